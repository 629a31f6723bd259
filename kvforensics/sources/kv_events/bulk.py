"""KV-cache event files read in bulk: DuckDB parses, checks and cuts the batches into block rows column-wise,
the chains are followed a depth at a time (:mod:`kvforensics.sources.kv_events.chains`), and the rows are
the ones the Python reference (:mod:`kvforensics.sources.kv_events.reference`) gives, line for line.

The bulk reader takes a line only when its text leaves nothing to judge: it parses in DuckDB, holds no
backslash (no escape can hide a key or a character), nothing DuckDB's JSON reader accepts that Python's
refuses (a trailing comma, ``nan``/``inf`` literals, a number of hundreds of digits), no key it reads twice
(Python keeps the last, DuckDB the first), a batch in array form or an object whose keys ``columns`` names
(each at most one array index, last), a timestamp that is a number, a rank and a sequence number that are
integers, and events that all load: known tags with their arity, hashes as integers, hex or base64, token
ids as non-negative integers, the optional fields of the right types. Every other line, whatever is wrong
or unusual in it, is read by the reference, which loads it or quarantines it with its reason; its rows
join the bulk rows before the chains are followed, so a chain runs through both.

A file goes to the reference whole when DuckDB cannot number its lines as the reference does (a CR or
0x01 byte, a line over 2 MiB, a stream that does not read to its end, bytes that are not UTF-8), when a
key ``columns`` names is one the bulk reader does not follow, and when it is small
(``BULK_MIN_LINES``: DuckDB's fixed cost per file is more than the reference's). The load notes say which
reader read the file, and how many lines of it the reference read.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.core.db import run_script, sql
from kvforensics.sources.common.bulk_lines import CheckedLines, numbered_lines
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import QuarantineRows
from kvforensics.sources.kv_events.chains import Chains, Fingerprints, follow
from kvforensics.sources.kv_events.reference import FIELDS, TYPES, LineReader, Rows, count, finish

BULK_MIN_LINES = 2_000  # smaller files are read by the reference
READER = "duckdb-bulk"
# what DuckDB's JSON reader accepts and Python's does not, or Python refuses for its size (ints over 4300 digits)
LENIENT = r",\s*[\]}]|[\[:,]\s*[-+]?(?i:nan|inf)|[0-9]{400}"
INT = "0|-?[1-9][0-9]*"  # an integer as DuckDB writes a JSON number that is one (never -0)
# a block hash (JSON text {h}) as the reference's canonical_hash writes it: an integer's digits, hex in lower case,
# base64 as the hex of its bytes (strictly padded); NULL for a "0x" string and anything else (left to the reference)
CANONICAL = """CASE WHEN regexp_full_match({h}, '0|-?[1-9][0-9]*') THEN {h}
    WHEN {h}[1] <> '"' OR lower({h}[2:3]) = '0x' THEN NULL
    WHEN regexp_full_match({h}, '"([0-9a-fA-F][0-9a-fA-F])+"') THEN lower({h}[2:-2])
    WHEN length({h}) > 2 AND regexp_full_match({h}, '"([A-Za-z0-9+/]{{4}})*([A-Za-z0-9+/]{{2}}==|[A-Za-z0-9+/]{{3}}=)?"')
        THEN lower(hex(from_base64({h}[2:-2]))) END"""
STORED_MAP = {
    "type": "JSON",
    **{name: "JSON" for name in FIELDS["BlockStored"]},
    "metadata": "JSON",
    "cache_salt": "JSON",
}
# an event map's fields as text (JSON null as NULL)
MAP_TYPE = "STRUCT(" + ", ".join(f'"{name}" VARCHAR' for name in STORED_MAP) + ")"
_TS_MIN, _TS_MAX = -62_135_596_800, 253_402_300_799  # 0001-01-01 and 9999-12-31 23:59:59 in epoch seconds


def read_bulk(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    key: bytes,
    chains: Chains,
    min_lines: int = BULK_MIN_LINES,
    checked: Future[CheckedLines | str] | None = None,
) -> FileLoad | str:
    """Load one KV-event file in bulk, or say why the reference must read it whole. *checked*: the check of the
    file's lines begun before (:class:`~kvforensics.sources.common.bulk_lines.LineChecks`)."""
    batch = _batch_reads(source)
    if isinstance(batch, str):
        return batch
    lines = numbered_lines(con, path, min_lines, checked)
    if isinstance(lines, str):
        return lines
    load = FileLoad(file=path, reader=READER)
    reader = LineReader(source, path, key)
    quarantine = QuarantineRows(con, source, path)
    fallback = 0
    for chunk in lines.chunks():
        con.register("kv_bulk_lines", chunk)
        try:
            fallback += _load_chunk(con, source, path, key, chains, batch, load, reader, quarantine)
        finally:
            con.unregister("kv_bulk_lines")
            for table in ("kv_bulk_events", "kv_bulk_blocks"):
                con.execute(f"DROP TABLE IF EXISTS {table}").fetchall()
    finish(load, quarantine, None, reader)
    load.notes.insert(
        0,
        "read in bulk by DuckDB"
        + (f"; {fallback:,} line(s) outside its shapes read by the Python reference" if fallback else ""),
    )
    return load


def _load_chunk(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    key: bytes,
    chains: Chains,
    batch: dict[str, Any],
    load: FileLoad,
    reader: LineReader,
    quarantine: QuarantineRows,
) -> int:
    """One chunk of lines (``kv_bulk_lines``) loaded: how many of them the reference read."""
    text = sql("kv_events_bulk").replace("{event_checks}", sql("kv_events_bulk_event"))
    for name, value in {
        **batch["sql"],
        "canonical_h": CANONICAL.format(h="h"),
        "map_type": MAP_TYPE,
        "canonical_parent": CANONICAL.format(h="parent_text"),
        "fingerprint": Fingerprints.expression("'kv-block:' || ids"),
    }.items():
        text = text.replace("{" + name + "}", value)
    run_script(
        con,
        "kv_events_bulk",
        {
            **batch["params"],
            **Fingerprints(key).params,
            "lenient": LENIENT,
            "map": json.dumps(STORED_MAP),
            "instance": reader.default_instance,
            "offset_us": round(source.clock_offset_s * 1_000_000),
            "ts_min": _TS_MIN,
            "ts_max": _TS_MAX,
        },
        text=text,
    )
    for tag, shape, events in con.execute("SELECT tag, shape, count(*) FROM kv_bulk_events GROUP BY ALL").fetchall():
        reader.shapes[(tag, shape)] = reader.shapes.get((tag, shape), 0) + events
    read, sequenced = con.execute("SELECT count(*), count(msg_seq) FILTER (seq = 0) FROM kv_bulk_events").fetchall()[0]
    load.records_read += read
    load.loaded += read
    reader.sequenced += sequenced
    # the lines the bulk reader left: read by the reference, their blocks added to the bulk ones
    rows = Rows()
    fallback = 0
    for line, raw in con.execute(
        "SELECT line, raw FROM kv_bulk_lines WHERE raw IS NOT NULL AND line NOT IN "
        "(SELECT line FROM kv_bulk_events WHERE seq = 0) ORDER BY line"
    ).fetchall():
        got = reader.read(line, raw.encode("utf-8"))
        if got is None:
            continue
        fallback += 1
        count(load, got)
        for reason, shown in got.refused:
            quarantine.add(line, reason, shown)
        if got.message is not None:
            rows.messages.append((*got.message, line))
            _add_blocks(rows.data, got.message, got.events, line)
    _insert_fallback(con, rows)
    con.register("kv_bulk_followed", follow(con, chains, "kv_bulk_blocks", key))
    try:
        run_script(con, "kv_events_bulk_rows", {"s": source.name, "f": str(path), "before": chains.messages})
    finally:
        con.unregister("kv_bulk_followed")
    chains.messages += con.execute("SELECT count(*) FROM kv_bulk_events WHERE seq = 0").fetchall()[0][0]
    return fallback


def _add_blocks(rows: list[tuple], message: tuple, events: list[tuple[int, str, list[Any]]], line: int) -> None:
    """The blocks of a line the reference read, as rows of ``kv_bulk_blocks`` (chains not yet followed)."""
    instance, dp_rank, msg_seq, ts = message[:4]
    for seq, kind, blocks in events:
        if kind == "cleared":
            rows.append(
                (line, seq, 0, kind, instance, dp_rank, ts, msg_seq, None, None, None, None, None, None, None, None)
            )
        elif kind == "removed":
            rows.extend(
                (line, seq, i, kind, instance, dp_rank, ts, msg_seq, h, None, None, None, None, None, medium, group)
                for i, (h, medium, group) in enumerate(blocks)
            )
        else:
            rows.extend(
                (
                    line,
                    seq,
                    i,
                    kind,
                    instance,
                    dp_rank,
                    ts,
                    msg_seq,
                    h,
                    parent,
                    num_tokens,
                    fp,
                    salt,
                    lora,
                    medium,
                    group,
                )
                for i, (h, parent, num_tokens, fp, salt, lora, medium, group) in enumerate(blocks)
            )


_BLOCK_COLUMNS = (
    ("line", pa.int64()),
    ("seq", pa.int32()),
    ("i", pa.int64()),
    ("kind", pa.string()),
    ("instance", pa.string()),
    ("dp_rank", pa.int32()),
    ("ts", TYPES["ts"]),
    ("msg_seq", pa.int64()),
    ("block_hash", pa.string()),
    ("parent", pa.string()),
    ("num_tokens", pa.int64()),
    ("block_fp", pa.int64()),
    ("own_salt", pa.string()),
    ("lora", pa.string()),
    ("medium", pa.string()),
    ("kv_group", pa.int32()),
)
_MESSAGE_COLUMNS = (
    ("instance", pa.string()),
    ("dp_rank", pa.int32()),
    ("msg_seq", pa.int64()),
    ("ts", TYPES["ts"]),
    ("events", pa.int64()),
    ("loaded", pa.int64()),
    ("line", pa.int64()),
)


def _insert_fallback(con: duckdb.DuckDBPyConnection, rows: Rows) -> None:
    """The reference's blocks and messages of the lines it read, beside the bulk reader's."""
    for table, data, columns in (
        ("kv_bulk_blocks", rows.data, _BLOCK_COLUMNS),
        ("kv_bulk_events", rows.messages, _MESSAGE_COLUMNS),
    ):
        if not data:
            continue
        arrow = pa.Table.from_struct_array(pa.array(data, type=pa.struct(list(columns))))
        con.register("kv_bulk_fallback", arrow)
        try:
            if table == "kv_bulk_blocks":
                con.execute("INSERT INTO kv_bulk_blocks BY NAME SELECT * FROM kv_bulk_fallback").fetchall()
            else:
                con.execute(
                    "INSERT INTO kv_bulk_events BY NAME SELECT *, 0 AS seq, true AS plain, "
                    "'fallback' AS kind FROM kv_bulk_fallback"
                ).fetchall()
        finally:
            con.unregister("kv_bulk_fallback")


def bulk_refusal(source: Source) -> str | None:
    """Why no file of *source* can be read in bulk (its ``columns`` name a key the bulk reader does not follow),
    or None."""
    found = _batch_reads(source)
    return found if isinstance(found, str) else None


def _batch_reads(source: Source) -> dict[str, Any] | str:
    """How the lines' batches are read, from the source's ``columns``: the JSON paths of the scalar parts of an
    object batch (one ``json_extract``), where its events are (``from_json`` structures that read them as lists of
    field lists, or as texts), and the keys no line read in bulk may hold twice; or why the bulk reader cannot
    follow the keys. Every key a parameter, none written into the SQL."""
    mapped = source.columns
    parts = {"events": source.column("events"), "ts": source.column("ts"), "seq": source.column("seq")}
    if "instance" in mapped:
        parts["instance"] = source.column("instance")
    if "dp_rank" in mapped:
        parts["dp_rank"] = source.column("dp_rank")
    else:  # vLLM's key, else SGLang's
        parts["dpr"], parts["attn"] = "data_parallel_rank", "attn_dp_rank"
    keys: set[str] = set()
    arrays: set[tuple[str, ...]] = set()  # the keys of the arrays a key indexes
    paths: list[str] = []
    events: tuple[list[str], int | None] = ([], None)
    for part, name in parts.items():
        steps = name.split(".")
        index = int(steps[-1]) if len(steps) > 1 and steps[-1].isascii() and steps[-1].isdigit() else None
        objects = steps[:-1] if index is not None else steps
        if any(not s or '"' in s or "\\" in s or (s.isascii() and s.isdigit()) for s in objects):
            return f"key '{name}' (columns.{part}) is one the bulk reader does not follow"
        keys.update(objects)
        if index is not None:
            arrays.add(tuple(objects))
        if part == "events":
            events = (objects, index)
        else:
            paths.append("$" + "".join(f'."{s}"' for s in objects) + ("" if index is None else f"[{index}]"))
    at = {part: i + 1 for i, part in enumerate(p for p in parts if p != "events")}
    params: dict[str, Any] = {"paths": paths}
    params.update({f"k{i}": k for i, k in enumerate(sorted(keys))})
    # an array a scalar's key indexes must be one (a JSON path cannot index an object, the reference's key can);
    # the events' array is one when the events are read
    containers = ["$" + "".join(f'."{s}"' for s in a) for a in sorted(arrays) if list(a) != events[0]]
    params.update({f"c{i}": c for i, c in enumerate(containers)})
    objects, index = events
    params.update({f"e{i}": step for i, step in enumerate(objects)})
    access = "{}"
    for i in range(len(objects)):
        access = f"struct_extract({access}, $e{i})"
    access = access if index is None else f"{access}[{index + 1}]"
    for kind, leaf in (("fields", [["JSON"]]), ("texts", ["JSON"])):
        structure: Any = leaf if index is None else [leaf]
        for step in reversed(objects):
            structure = {step: structure}
        params[f"events_{kind}"] = json.dumps(structure)

    def scalar(part: str) -> str:
        return f"scalars[{at[part]}]" if part in at else "NULL"

    return {
        "params": params,
        "sql": {
            "once": " AND ".join(
                f"strpos(substr(raw, strpos(raw, '\"' || $k{i} || '\"') + 1), '\"' || $k{i} || '\"') = 0"
                for i in range(len(keys))
            )
            or "true",
            "containers": " AND ".join(f"json_type(raw, $c{i}) = 'ARRAY'" for i in range(len(containers))) or "true",
            "array_ok": "false" if "instance" in mapped or "seq" in mapped else "true",
            "seq_mapped": "true" if "seq" in mapped else "false",
            "instance_mapped": "true" if "instance" in mapped else "false",
            "ts": scalar("ts"),
            "seq": scalar("seq"),
            "instance": scalar("instance"),
            "rank": scalar("dp_rank")
            if "dp_rank" in mapped
            else f"CASE WHEN {scalar('dpr')} IS NOT NULL THEN {scalar('dpr')} ELSE {scalar('attn')} END",
            "events_fields": access.format("from_json(raw, $events_fields)") + "::VARCHAR[][]",
            "events_texts": access.format("from_json(raw, $events_texts)") + "::VARCHAR[]",
        },
    }
