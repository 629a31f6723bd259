"""Gateway request logs (JSONL, CSV, Parquet) into the canonical ``requests`` table.

Each file is streamed into a staging table of text fields (one row per record, with its line
number and the raw record), then typed and validated in SQL (``sql/requests_typed.sql``). Good rows
go to ``requests``; every other record goes to ``quarantine`` with the reason it was refused.
Column names are mapped by the incident file; OpenTelemetry GenAI and SGLang ``meta_info`` names
are recognised without a mapping (SGLang's seconds-valued latencies are converted to milliseconds,
and without a status column the status is derived from ``finish_reason``). SGLang's own
``--log-requests`` output is read by ``loaders/sglang_requests.py`` into the same staging table, also
when it is given as ``jsonl`` (recognised by its ``"event": "request.*"`` records).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import sys
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping
from zoneinfo import ZoneInfo

import duckdb
import pyarrow as pa
import zstandard

from kvforensics import presets
from kvforensics.config import CANONICAL_REQUEST_FIELDS, REQUIRED_REQUEST_FIELDS, Source
from kvforensics.db import one, parameters_used, run_script, sql
from kvforensics.errors import ConfigError, InputError
from kvforensics.loaders import otlp, sglang_requests
from kvforensics.loaders.mapping import NUMBER, TIMESTAMP, bind_literal, json_path, read_as
from kvforensics.loaders.textio import (
    CHUNK,
    INCOMPLETE_RECORD,
    LineStream,
    Recovering,
    decode_line,
    open_binary,
    printable_raw,
)

BATCH = 100_000
# Stage JSONL and Parquet with DuckDB's own readers when the file allows it (the Python readers
# remain the fallback for what DuckDB refuses: non-UTF-8 bytes, truncated streams, CR line ends).
FAST_STAGING = True
# For JSONL whose mapped columns are top-level keys, DuckDB's NDJSON reader is tried first (one parse
# per record), in these ways, in order: "text" reads every column as text (the cheapest; kept only for
# a file whose every record it can load unambiguously), "json" reads them as JSON values (their types
# kept). A file neither can number exactly falls back to the line reader.
JSON_READERS: tuple[str, ...] = ("text", "json")

# Names other systems use for the canonical fields, tried (in order) when the incident file does not
# map a field and the canonical name is absent: OpenTelemetry GenAI semantic conventions, SGLang's
# --log-requests JSON (`out.meta_info`), common OpenAI-style exports.
KNOWN_ALIASES: dict[str, tuple[str, ...]] = {
    "request_id": ("gen_ai.response.id", "rid", "id", "out.meta_info.id", "meta_info.id", "requestId"),
    "ts": ("timestamp", "time", "start_time", "received_at", "created_at", "@timestamp",
           "request_received_ts", "meta_info.request_received_ts", "out.meta_info.request_received_ts"),
    "account_id": ("account", "customer_id", "tenant_id", "user", "enduser.id"),
    "model": ("gen_ai.request.model", "gen_ai.response.model", "model_name", "model_id"),
    "status": ("http.response.status_code", "status_code", "http_status"),
    "prompt_tokens": ("gen_ai.usage.input_tokens", "usage.prompt_tokens", "out.meta_info.prompt_tokens",
                      "meta_info.prompt_tokens", "input_tokens"),
    "completion_tokens": ("gen_ai.usage.output_tokens", "usage.completion_tokens",
                          "out.meta_info.completion_tokens", "meta_info.completion_tokens", "output_tokens"),
    "cached_tokens": ("gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_read_input_tokens",
                      "usage.prompt_tokens_details.cached_tokens", "out.meta_info.cached_tokens",
                      "meta_info.cached_tokens"),
    "ttft_ms": ("time_to_first_token_ms", "ttft", "first_token_latency", "meta_info.first_token_latency",
                "out.meta_info.first_token_latency"),
    "latency_ms": ("duration_ms", "e2e_latency_ms", "elapsed_ms", "e2e_latency", "meta_info.e2e_latency",
                   "out.meta_info.e2e_latency"),
    "prefill_instance": ("prefill_node", "prefill_host"),
    "decode_instance": ("decode_node", "decode_host"),
}
# Aliases whose values are seconds (SGLang meta_info); the canonical fields are milliseconds.
SECONDS_ALIASES = frozenset(f"{prefix}{name}" for prefix in ("", "meta_info.", "out.meta_info.")
                            for name in ("e2e_latency", "first_token_latency"))
# Where an SGLang-shaped record keeps its finish reason, from which a status is derived when the
# record has no status column (the engine's view: abort -> its status_code or 500, otherwise 200).
FINISH_REASON_KEYS = ("finish_reason", "meta_info.finish_reason", "out.meta_info.finish_reason")
FIELD_COLUMNS = [f"{f}_raw" for f in CANONICAL_REQUEST_FIELDS]
CR_ONLY = "old Mac line ends (CR only): read as lines split at each CR"


@dataclass
class FileLoad:
    """What happened to one input file."""

    file: Path
    records_read: int = 0
    loaded: int = 0
    quarantined: int = 0
    duplicates: int = 0
    notes: list[str] = field(default_factory=list)
    reader: str = ""  # duckdb-json / duckdb-lines / duckdb-parquet (DuckDB's readers) or python


def _staging_schema(keys: Iterable[str] = CANONICAL_REQUEST_FIELDS) -> pa.Schema:
    return pa.schema([("line", pa.int64()), ("raw", pa.string()), ("problem", pa.string())]
                     + [(f"{k}_raw", pa.string()) for k in keys])


def _expression_refs(source: Source) -> list[str]:
    """The source names the source's `columns` expressions read, once each: ref i is staged as the
    text column ``x<i>_raw`` (beside the canonical fields' ``<field>_raw``)."""
    return list(dict.fromkeys(ref for e in source.expressions.values() for ref in e.refs))


def _ref_field(source: Source, ref: str) -> str:
    """The first canonical field whose expression reads ``ref`` (to name the key in an error)."""
    return next(c for c, e in source.expressions.items() if ref in e.refs)


def _json_paths(name: str) -> list[str]:
    """JSON paths for a column name: a literal key first, then the dotted name as a nested path."""
    quoted = '$."' + name.replace('"', '\\"') + '"'
    if "." not in name:
        return [quoted]
    return [quoted, "$." + ".".join('"' + p.replace('"', '\\"') + '"' for p in name.split("."))]


def _candidate_names(source: Source, canonical: str) -> list[str]:
    if canonical in source.columns:
        return [source.columns[canonical]]
    return [canonical, *KNOWN_ALIASES.get(canonical, ())]


def _choose_columns(source: Source, present: set[str]) -> dict[str, str | None]:
    """Canonical field -> source column: the mapping, else the canonical name, else a known alias;
    a field given by an expression is None, and each column the expressions read follows as ``x<i>``."""
    chosen: dict[str, str | None] = {}
    for canonical in CANONICAL_REQUEST_FIELDS:
        if canonical in source.expressions:
            chosen[canonical] = None
            continue
        names = _candidate_names(source, canonical)
        hit = next((n for n in names if n in present), None)
        if hit is None and canonical in source.columns:
            hit = source.columns[canonical]
        chosen[canonical] = hit
    for i, ref in enumerate(_expression_refs(source)):
        chosen[f"x{i}"] = ref
    return chosen


def _unknown_column(source: Source, path: Path, ref: str, have: Iterable[str]) -> ConfigError:
    names = sorted(have)
    shown = ", ".join(names[:30]) + (f" ... ({len(names)} in all)" if len(names) > 30 else "")
    where = f"{source.incident_file}: source '{source.name}'" if source.incident_file else f"source '{source.name}'"
    return ConfigError(f"columns.{_ref_field(source, ref)}: column {ref!r} is not in {path.name} "
                       f"(it has: {shown or 'no columns'})", location=where)


def _cell_column(name: str, header: Iterable[str]) -> tuple[str, str | None] | None:
    """Where a name is in a table's header: the column itself, or the longest dotted prefix that is
    a column with the rest as a JSON path into its cells; None when neither."""
    have = set(header)
    if name in have:
        return name, None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        column = ".".join(parts[:cut])
        if column in have:
            return column, json_path(".".join(parts[cut:]))
    return None


def _split_cells(source: Source, path: Path, chosen: Mapping[str, str | None], header: list[str]
                 ) -> tuple[dict[str, str | None], dict[str, str]]:
    """The columns a CSV/Parquet stager reads (a path's column) and the JSON paths into their cells,
    per staged key; a column an expression reads that the file lacks is a ConfigError."""
    columns: dict[str, str | None] = {}
    cells: dict[str, str] = {}
    for key, name in chosen.items():
        found = None if name is None else _cell_column(name, header)
        if found is None:
            if name is not None and key not in CANONICAL_REQUEST_FIELDS:
                raise _unknown_column(source, path, name, header)
            columns[key] = name
            continue
        columns[key], cell = found
        if cell is not None:
            cells[key] = cell
    return columns, cells


def _json_keys(obj: object, prefix: str = "", depth: int = 0) -> Iterator[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{prefix}{k}"
            yield key
            if depth < 3:
                yield from _json_keys(v, key + ".", depth + 1)


def _sample_json_keys(path: Path, limit: int = 2000) -> set[str]:
    keys: set[str] = set()
    stream = LineStream(path)
    for n, raw in stream:
        if n > limit:
            break
        try:
            keys.update(_json_keys(json.loads(raw)))
        except (ValueError, UnicodeDecodeError):
            continue
    return keys


class _Stager:
    """Appends batches of staged records to the ``staging_requests`` temp table."""

    def __init__(self, con: duckdb.DuckDBPyConnection, keys: Iterable[str] = CANONICAL_REQUEST_FIELDS) -> None:
        self.con = con
        self.schema = _staging_schema(keys)
        con.execute("CREATE OR REPLACE TEMP TABLE staging_requests (line BIGINT, raw VARCHAR, problem VARCHAR"
                    + "".join(f", {c} VARCHAR" for c in self.schema.names[3:]) + ")")

    def add(self, columns: dict[str, list]) -> None:
        n = len(columns["line"])
        if n == 0:
            return
        arrays = [pa.array(columns.get(f.name, [None] * n), type=f.type) for f in self.schema]
        batch = pa.Table.from_arrays(arrays, schema=self.schema)
        self.con.register("staging_batch", batch)
        self.con.execute("INSERT INTO staging_requests SELECT * FROM staging_batch")
        self.con.unregister("staging_batch")


def _json_path(name: str) -> str:
    return "$." + ".".join('"' + p.replace('"', '\\"') + '"' for p in name.split("."))


@dataclass
class Staged:
    """One file's staged records, as SQL the typing step reads from.

    ``relation`` yields ``line, raw, problem, <field>_raw ...``: the ``staging_requests`` temp table the
    Python readers filled, or a DuckDB reader query (with ``params``) that is read, parsed and typed
    in one streaming pass. ``raw_relation`` (``line, raw``), when set, gives the raw text the relation
    leaves out (Parquet builds it only for the records that are refused). ``rewrites`` map the typing
    step's reasons to the format's own words; ``lines`` is the file's physical line count when the
    reader knows it (to report blank lines); ``ticked`` says the reader already reported progress."""

    relation: str
    params: dict[str, Any] = field(default_factory=dict)
    raw_relation: str | None = None
    rewrites: Mapping[str, str] = field(default_factory=dict)
    lines: int | None = None
    ticked: bool = True
    # the relation must yield exactly ``lines`` records (one per physical line), else ``retry`` stages
    # the file another way; ``retry`` is also taken when the reader raises on the file
    exact_lines: bool = False
    # kept only when it refuses no record (it cannot tell every refusal's reason or raw text)
    clean_only: bool = False
    retry: Callable[[], Staged] | None = None
    reader: str = "python"  # which reader staged the file, for the load's record
    # staged key -> JSON path into the staged text (a path into JSON held in a CSV/Parquet cell)
    cells: Mapping[str, str] = field(default_factory=dict)


def _python_staged(rewrites: Mapping[str, str] | None = None) -> Staged:
    return Staged("staging_requests", rewrites=rewrites or {})


def _stage_jsonl(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
                 tick: Callable[[int], None], fast: bool = True) -> Staged:
    if sglang_requests.recognises(path):
        load.notes.append("recognised as SGLang --log-requests JSON; read as format = \"sglang_requests\"")
        return _stage_sglang_requests(con, source, path, load, tick, fast)
    if otlp.recognises(path):
        load.notes.append("recognised as an OpenTelemetry OTLP/JSON trace export; read as format = \"otlp_json\" "
                          "(the otlp mapping, with the source's own columns over it)")
        if source.preset not in (None, "otlp"):
            load.notes.append(f"the columns of preset '{source.preset}' apply over the otlp mapping: "
                              "for these files use preset = \"otlp\"")
        return otlp.stage(con, source, path, load, tick, fast)
    keys = _sample_json_keys(path)
    chosen = _choose_columns(source, keys)
    top_level = {k.split(".")[0] for k in keys}
    for ref in _expression_refs(source):
        if keys and ref not in keys and ref.split(".")[0] not in top_level:
            raise _unknown_column(source, path, ref, top_level)
    finish_reason = None
    if chosen["status"] is None and "status" not in source.expressions:
        finish_reason = next((k for k in FINISH_REASON_KEYS if k in keys), None)
    load.notes.extend(_mapping_notes(source, chosen))
    if finish_reason is not None:
        load.notes.append(f"status derived from {finish_reason} (the engine's view: abort -> its status_code, "
                          "or 500 without one; otherwise 200), as the records have no status column")
    if fast and FAST_STAGING:
        staged = _stage_jsonl_in_duckdb(source, path, chosen, finish_reason)
        if staged is not None:
            return staged
    stager = _Stager(con)
    stream = LineStream(path)
    lines: list[int] = []
    raws: list[str] = []
    problems: list[str | None] = []
    blank = 0
    for n, raw in stream:
        if not raw.strip():
            blank += 1
            continue
        text = decode_line(raw)
        lines.append(n)
        if text is None:
            raws.append(printable_raw(raw))
            problems.append("not UTF-8")
        else:
            raws.append(text)
            problems.append(None)
        if len(lines) >= BATCH:
            stager.add({"line": lines, "raw": raws, "problem": problems})
            tick(len(lines))
            lines, raws, problems = [], [], []
    if stream.partial is not None:
        lines.append(stream.partial[0])
        raws.append(printable_raw(stream.partial[1]))
        problems.append(INCOMPLETE_RECORD)
    stager.add({"line": lines, "raw": raws, "problem": problems})
    tick(len(lines))
    if blank:
        load.notes.append(f"{blank} blank line(s) skipped")
    if stream.stopped:
        load.notes.append(stream.stopped)
    if stream.cr_only:
        load.notes.append(CR_ONLY)
    # Extract every field from the JSON in SQL; paths are parameters, never spliced into the query.
    con.execute("ALTER TABLE staging_requests RENAME TO python_lines").fetchall()
    relation, params = _json_fields_relation(source, chosen, "SELECT line, raw, problem FROM python_lines",
                                             finish_reason)
    con.execute(f"CREATE OR REPLACE TEMP TABLE staging_requests AS {relation}", params).fetchall()
    con.execute("DROP TABLE python_lines").fetchall()
    return _python_staged()


def _in_milliseconds(source: Source, canonical: str, column: str, expr: str) -> str:
    """A duration the record gives in seconds under a known name (SGLang's ``e2e_latency``), in
    milliseconds as text; an explicit mapping in the incident file is taken as milliseconds."""
    if column in SECONDS_ALIASES and canonical in CANONICAL_REQUEST_FIELDS and canonical not in source.columns:
        return f"coalesce(CAST(round(TRY_CAST({expr} AS DOUBLE) * 1000, 3) AS VARCHAR), {expr})"
    return expr


def _field_expressions(source: Source, chosen: Mapping[str, str | None]
                       ) -> tuple[list[str], list[str], dict[str, str]]:
    """JSON paths, the wrong-type checks and the value of each canonical field, over the lists
    ``t`` (json_type) and ``v`` (json_extract_string) of one parse of the record."""
    paths: list[str] = []
    wrong_type: list[str] = []
    values: dict[str, str] = {}
    for canonical, col in chosen.items():
        if col is None:
            continue
        first = len(paths) + 1
        paths.extend(_json_paths(col))
        numbers = range(first, len(paths) + 1)
        types = "coalesce(" + ", ".join(f"t[{i}]" for i in numbers) + ")"
        wrong_type.append(f"WHEN {types} IN ('OBJECT', 'ARRAY', 'BOOLEAN') "
                          f"THEN {_wrong_type_reason(canonical)} || lower({types})")
        expr = "coalesce(" + ", ".join(f"v[{i}]" for i in numbers) + ")"
        expr = _in_milliseconds(source, canonical, col, expr)
        values[canonical] = expr
    return paths, wrong_type, values


# The status an SGLang-shaped record implies when it has no status column: abort -> its status_code
# (or 500), anything else 200. $fr, $fr_type, $fr_code are JSON paths (parameters).
_STATUS_FROM_FINISH_REASON = """CASE
    WHEN json_type(raw, $fr) = 'OBJECT' THEN
        CASE WHEN lower(json_extract_string(raw, $fr_type)) = 'abort'
             THEN coalesce(json_extract_string(raw, $fr_code), '500') ELSE '200' END
    WHEN json_type(raw, $fr) = 'VARCHAR' THEN
        CASE WHEN lower(json_extract_string(raw, $fr)) LIKE '%abort%' THEN '500' ELSE '200' END
END"""


def _wrong_type_reason(key: str) -> str:
    """SQL text of the reason a staged value is refused for its JSON type (the type follows)."""
    what = key if key in CANONICAL_REQUEST_FIELDS else "a column an expression reads"
    return f"'{what} must be a string or a number, not a JSON '"


def _json_fields_relation(source: Source, chosen: Mapping[str, str | None], lines_sql: str,
                          finish_reason: str | None) -> tuple[str, dict[str, Any]]:
    """The staged relation over a relation of ``line, raw, problem``: each record parsed once for all
    fields (json_type / json_extract_string over the list of paths); blank lines dropped. Returns the
    query and its parameters (the JSON paths: never spliced into the text)."""
    paths, wrong_type, values = _field_expressions(source, chosen)
    params: dict[str, Any] = {"paths": paths or ["$.__none__"]}
    if finish_reason is not None and "status" not in values:
        base = _json_path(finish_reason)
        values["status"] = _STATUS_FROM_FINISH_REASON
        params.update(fr=base, fr_type=base + '."type"', fr_code=base + '."status_code"')
    fields = ", ".join(f"CASE WHEN problem IS NULL THEN {values[c]} END AS {c}_raw" if c in values
                       else f"CAST(NULL AS VARCHAR) AS {c}_raw" for c in chosen)
    type_check = f"CASE {' '.join(wrong_type)} END" if wrong_type else "CAST(NULL AS VARCHAR)"
    query = f"""
        WITH lines AS ({lines_sql}),
        checked AS (
            SELECT line, raw,
                   coalesce(problem, CASE WHEN NOT json_valid(raw) THEN 'malformed JSON'
                                          WHEN json_type(raw) <> 'OBJECT' THEN 'not a JSON object' END) AS first_problem
            FROM lines WHERE raw IS NOT NULL AND trim(raw) <> ''
        ), parsed AS (
            SELECT line, raw, first_problem,
                   CASE WHEN first_problem IS NULL THEN json_type(raw, $paths) END AS t,
                   CASE WHEN first_problem IS NULL THEN json_extract_string(raw, $paths) END AS v
            FROM checked
        ), judged AS (
            SELECT line, raw, t, v, coalesce(first_problem, {type_check}) AS problem FROM parsed
        )
        SELECT line, raw, problem, {fields} FROM judged"""
    return query, params


def _plain_line_count(path: Path) -> int | None:
    """The number of physical lines of the (decompressed) file, or None when a byte in it is a CR or
    the 0x01 that DuckDB's line reader uses as its delimiter: either would make DuckDB split or cut
    a physical line (shifting line numbers, or silently dropping the text after the 0x01). The whole
    stream is scanned at memchr speed; a file that fails goes to the Python reader, which keeps
    every byte. A last line without a newline counts, as it does for the Python reader."""
    count = 0
    last = b"\n"
    with open_binary(path, fast_gzip=True) as fh:
        while chunk := fh.read(CHUNK):
            if b"\r" in chunk or b"\x01" in chunk:
                return None
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _stage_jsonl_in_duckdb(source: Source, path: Path, chosen: Mapping[str, str | None],
                           finish_reason: str | None) -> Staged | None:
    """Stage a JSONL file with DuckDB's own readers. None when DuckDB cannot read the file as clean
    text (a CR or 0x01 byte, a truncated or unreadable stream): the Python reader then takes the
    file, line by line, and quarantines what it must.

    First choice, when every mapped column is a top-level key: ``read_json`` with those keys as JSON
    columns, numbered WITH ORDINALITY: one parse per record by DuckDB's NDJSON reader, and the line
    numbers are right exactly when the reader yields one record per physical line. A file with a
    blank or malformed line fails that check (or makes the reader raise) and is staged again by the
    second choice: every physical line a row of ``read_csv`` (a delimiter valid JSON cannot contain
    unescaped, no quoting), each record parsed for all fields with the JSON functions. Bytes that
    are not UTF-8 make either reader fail; the loader then hands the file to the Python reader."""
    try:
        lines = _plain_line_count(path)
    except Exception:  # noqa: BLE001 - any read failure (truncated gzip/zstd, I/O): the Python reader says why
        return None
    if lines is None:
        return None
    reader = ("SELECT ordinality AS line, raw, CAST(NULL AS VARCHAR) AS problem FROM read_csv($file, "
              "columns = {'raw': 'VARCHAR'}, header = false, delim = chr(1), quote = '', escape = '', "
              "auto_detect = false, strict_mode = false) WITH ORDINALITY")
    relation, params = _json_fields_relation(source, chosen, reader, finish_reason)

    def by_lines() -> Staged:
        return Staged(f"({relation})", {**params, "file": str(path)}, lines=lines, ticked=False, reader="duckdb-lines")

    keys = [c for c in dict.fromkeys(chosen.values()) if c is not None]
    if finish_reason is not None or any("." in k for k in keys) or not keys:
        return by_lines()

    raw_lines = f"(SELECT line, raw FROM ({reader}))"

    def as_json(then: Callable[[], Staged]) -> Staged:
        return Staged(_json_columns_relation(source, chosen, keys), {"file": str(path), "columns": dict.fromkeys(keys, "JSON")},
                      raw_relation=raw_lines, lines=lines, ticked=False, exact_lines=True, retry=then, reader="duckdb-json")

    def as_text(then: Callable[[], Staged]) -> Staged:
        return Staged(_json_text_relation(source, chosen, keys), {"file": str(path), "columns": dict.fromkeys(keys, "VARCHAR")},
                      raw_relation=raw_lines, lines=lines, ticked=False, exact_lines=True, clean_only=True, retry=then,
                      reader="duckdb-json-text")

    staged: Callable[[], Staged] = by_lines
    for way in reversed(JSON_READERS):
        staged = functools.partial({"text": as_text, "json": as_json}[way], staged)
    return staged()


# A value DuckDB's NDJSON reader hands over as text may have been something else: an object, array or
# boolean (serialised), or a number it printed in exponent form (where the JSON reader keeps the
# digits). That matters only for the fields kept as text: in a number or timestamp field such a text
# fails the typing, and a refused record gives the file up anyway. The range test picks texts that
# start like a number ('-', '.', '/' or a digit) before the regular expression runs.
_TEXT_FIELDS = ("request_id", "account_id", "model", "prefill_instance", "decode_instance")
_NUMBER_FIELDS = ("status", "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "latency_ms")
_AMBIGUOUS_TEXT = ("starts_with({k}, '{{') OR starts_with({k}, '[') OR {k} IN ('true', 'false') "
                   "OR ({k} >= '-' AND {k} < ':' AND regexp_full_match({k}, '-?[0-9][0-9.]*[eE][-+]?[0-9]+'))")


def _positional_names(keys: list[str]) -> list[str]:
    """Names of the mapped keys' columns in ``read_json``'s output (renamed by position)."""
    return [f"k{i}" for i in range(len(keys))]


def _keyed_fields(chosen: Mapping[str, str | None], keys: list[str]) -> Iterator[tuple[str, str | None, str | None]]:
    """Every canonical field with its mapped key and that key's positional column (None, None when unmapped)."""
    names = _positional_names(keys)
    for canonical, col in chosen.items():
        yield canonical, col, None if col is None else names[keys.index(col)]


def _json_text_relation(source: Source, chosen: Mapping[str, str | None], keys: list[str]) -> str:
    """The staged relation over ``read_json`` with the mapped keys as text columns ($columns, a
    parameter): DuckDB unescapes strings and prints numbers itself, the cheapest way to stage. It
    cannot see a value's JSON type, so a record holding a value whose text is ambiguous (see
    ``_AMBIGUOUS_TEXT``) is refused, and a file with any refused record is staged again by the JSON
    reader, which names every reason exactly."""
    names = _positional_names(keys)
    text_keys = dict.fromkeys(k for canonical, _, k in _keyed_fields(chosen, keys)
                              if (canonical in _TEXT_FIELDS or canonical not in CANONICAL_REQUEST_FIELDS) and k)
    ambiguous = " OR ".join(f"({_AMBIGUOUS_TEXT.format(k=k)})" for k in text_keys) or "false"
    fields = [f"{_in_milliseconds(source, canonical, col, k)} AS {canonical}_raw" if k is not None
              else f"CAST(NULL AS VARCHAR) AS {canonical}_raw" for canonical, col, k in _keyed_fields(chosen, keys)]
    return (f"(SELECT line, CAST(NULL AS VARCHAR) AS raw, "
            f"CASE WHEN coalesce({ambiguous}, false) THEN 'value of ambiguous JSON type' END AS problem, "
            f"{', '.join(fields)} FROM read_json($file, format = 'newline_delimited', columns = $columns) "
            f"WITH ORDINALITY AS j({', '.join(names)}, line))")


def _json_columns_relation(source: Source, chosen: Mapping[str, str | None], keys: list[str]) -> str:
    """The staged relation over ``read_json`` with the mapped keys as JSON columns ($columns, a
    parameter: no key is spliced into the query; the columns are renamed by position)."""
    names = _positional_names(keys)
    wrong_type = []
    fields = []
    for canonical, col, k in _keyed_fields(chosen, keys):
        if col is None or k is None:  # both or neither (the check tells the type checker)
            fields.append(f"CAST(NULL AS VARCHAR) AS {canonical}_raw")
            continue
        # k is the value as serialised JSON, so its first character tells its type: only strings
        # need unescaping, numbers are their own text (json_extract_string would return the same)
        for first, kind in (("{", "object"), ("[", "array"), ("t", "boolean"), ("f", "boolean")):
            wrong_type.append(f"WHEN starts_with({k}, '{first}') "
                              f"THEN {_wrong_type_reason(canonical)} || '{kind}'")
        expr = f"CASE WHEN starts_with({k}, '\"') THEN json_extract_string({k}, '$') ELSE CAST({k} AS VARCHAR) END"
        expr = _in_milliseconds(source, canonical, col, expr)
        fields.append(f"CASE WHEN problem IS NULL THEN {expr} END AS {canonical}_raw")
    problem = f"CASE {' '.join(wrong_type)} END"
    return (f"(SELECT line, CAST(NULL AS VARCHAR) AS raw, problem, {', '.join(fields)} FROM "
            f"(SELECT *, {problem} AS problem FROM read_json($file, format = 'newline_delimited', "
            f"columns = $columns) WITH ORDINALITY AS j({', '.join(names)}, line)))")


def _mapping_notes(source: Source, chosen: dict[str, str | None]) -> list[str]:
    notes = []
    recognised = {c: col for c, col in chosen.items()
                  if col is not None and c in CANONICAL_REQUEST_FIELDS and c not in source.columns and col != c}
    if recognised:
        notes.append("columns recognised without a mapping: "
                     + ", ".join(f"{c} <- {col}" for c, col in sorted(recognised.items())))
    return notes


def _require_header(source: Source, path: Path, header: Iterable[str], chosen: dict[str, str | None]) -> None:
    have = set(header)
    for canonical in REQUIRED_REQUEST_FIELDS:
        col = chosen.get(canonical)
        if canonical in source.expressions:
            continue
        if col is None or _cell_column(col, have) is None:
            hint = f"mapped to column '{col}'" if col else "no column of that name"
            raise InputError(
                f"required field '{canonical}' is missing ({hint}); the file has columns "
                f"{sorted(have)}. Map it in the incident file: columns = {{ {canonical} = \"<column>\" }}",
                location=f"source '{source.name}': {path}")
    for canonical, col in source.columns.items():
        if canonical not in source.expressions and _cell_column(col, have) is None:
            raise InputError(f"columns maps '{canonical}' to '{col}', which the file does not have; "
                             f"it has {sorted(have)}", location=f"source '{source.name}': {path}")


def _stage_csv(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
               tick: Callable[[int], None], fast: bool = True) -> Staged:
    stager = _Stager(con)
    csv.field_size_limit(sys.maxsize)  # a cell of any length (the default stops the file at 128 KiB)
    # every byte of a truncated gzip/zstd file is read (gzip's own reader drops what it decompressed
    # last); the incomplete last line, its tail, is quarantined below
    with Recovering(path) as raw, io.BufferedReader(raw, CHUNK) as fh:
        text = io.TextIOWrapper(fh, encoding="utf-8", errors="surrogateescape", newline="")
        reader = csv.reader(text)
        try:
            header = next(reader)
        except StopIteration:
            load.notes.append("empty file")
            return _python_staged()
        except (EOFError, OSError, csv.Error) as e:
            load.notes.append(f"input ends early before the header ({type(e).__name__}: {e})")
            return _python_staged()
        header = [h.strip() for h in header]
        chosen = _choose_columns(source, set(header))
        _require_header(source, path, header, chosen)
        columns, cells = _split_cells(source, path, chosen, header)
        stager = _Stager(con, columns)
        index = {c: header.index(col) for c, col in columns.items() if col is not None and col in header}
        cols: dict[str, list] = {"line": [], "raw": [], "problem": [], **{f"{c}_raw": [] for c in index}}
        last_line = 1
        try:
            for row in reader:
                start = last_line + 1
                last_line = reader.line_num
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                joined = ",".join(row)
                problem = None
                try:
                    joined.encode("utf-8")
                except UnicodeEncodeError:
                    problem = "not UTF-8"
                    joined = joined.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                if problem is None and len(row) != len(header):
                    problem = f"expected {len(header)} fields, found {len(row)}"
                cols["line"].append(start)
                cols["raw"].append(printable_raw(joined, 2000))
                cols["problem"].append(problem)
                for c, i in index.items():
                    value = row[i].strip() if i < len(row) and problem is None else None
                    cols[f"{c}_raw"].append(value if value != "" else None)
                if len(cols["line"]) >= BATCH:
                    stager.add(cols)
                    tick(len(cols["line"]))
                    cols = {k: [] for k in cols}
        except (EOFError, OSError, csv.Error, zlib.error, zstandard.ZstdError) as e:
            load.notes.append(f"input ends early after line {last_line} ({type(e).__name__}: {e}); "
                              f"later records, if any, are lost")
            if not isinstance(e, csv.Error) and raw.tail:
                cols["line"].append(last_line + 1)
                cols["raw"].append(printable_raw(raw.tail))
                cols["problem"].append(INCOMPLETE_RECORD)
                for c in index:
                    cols[f"{c}_raw"].append(None)
        stager.add(cols)
        tick(len(cols["line"]))
    load.notes.extend(_mapping_notes(source, chosen))
    return replace(_python_staged(), cells=cells)


def _stage_parquet(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
                   tick: Callable[[int], None], fast: bool = True) -> Staged:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError variants
        raise InputError(f"not a readable Parquet file ({e})", location=f"source '{source.name}': {path}") from None
    header = pf.schema_arrow.names
    chosen = _choose_columns(source, set(header))
    _require_header(source, path, header, chosen)
    columns, cells = _split_cells(source, path, chosen, header)
    wanted = {c: col for c, col in columns.items() if col is not None and col in header}
    if fast and FAST_STAGING:
        load.notes.extend(_mapping_notes(source, chosen))
        return _stage_parquet_in_duckdb(path, pf.schema_arrow, wanted, list(columns), cells)
    stager = _Stager(con, columns)
    offset = 0
    for batch in pf.iter_batches(batch_size=BATCH, columns=sorted(set(wanted.values()))):
        n = batch.num_rows
        cols: dict[str, list] = {"line": list(range(offset + 1, offset + n + 1)), "raw": [None] * n,
                                 "problem": [None] * n}
        for c, col in wanted.items():
            arr = batch.column(col)
            if pa.types.is_timestamp(arr.type):
                values = [None if v is None else v.isoformat() for v in arr.to_pylist()]
            elif c in cells and (pa.types.is_struct(arr.type) or pa.types.is_map(arr.type)
                                 or pa.types.is_list(arr.type)):
                values = [None if v is None else json.dumps(v, default=str) for v in arr.to_pylist()]
            else:
                values = [None if v is None else str(v) for v in arr.to_pylist()]
            cols[f"{c}_raw"] = values
        table = pa.table({k: v for k, v in cols.items() if k.endswith("_raw")})
        raws = [printable_raw(json.dumps(r, default=str)) for r in table.to_pylist()]
        cols["raw"] = raws
        stager.add(cols)
        tick(n)
        offset += n
    load.notes.extend(_mapping_notes(source, chosen))
    return replace(_python_staged(), cells=cells)


def _quote_identifier(name: str) -> str:
    """A column name as a SQL identifier (the name exists in the file's schema; quotes are doubled)."""
    return '"' + name.replace('"', '""') + '"'


def _stage_parquet_in_duckdb(path: Path, schema: pa.Schema, wanted: Mapping[str, str], keys: list[str],
                             cells: Mapping[str, str]) -> Staged:
    """Stage a Parquet file as one DuckDB scan: values as text (timestamps as ISO-8601, with 'Z' when
    the column carries a zone; a nested column a path reads into as JSON), the line being the row
    number. The raw record (the mapped columns as JSON) is built only for the records the typing
    step refuses."""
    exprs = []
    for canonical in keys:
        col = wanted.get(canonical)
        if col is None:
            exprs.append(f"CAST(NULL AS VARCHAR) AS {canonical}_raw")
            continue
        ident = _quote_identifier(col)
        kind = schema.field(col).type
        if pa.types.is_timestamp(kind) and kind.tz is not None:
            value = f"strftime(timezone('UTC', {ident}), '%Y-%m-%dT%H:%M:%S.%fZ')"
        elif pa.types.is_timestamp(kind):
            value = f"strftime({ident}, '%Y-%m-%dT%H:%M:%S.%f')"
        elif canonical in cells and pa.types.is_nested(kind):
            value = f"CAST(to_json({ident}) AS VARCHAR)"
        elif canonical in _NUMBER_FIELDS and (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            # kept a number: the typing casts it to DOUBLE (exactly, as the Python reader does; the
            # text of a float32 would be its shortest float32 spelling, which reads back as another
            # double) and prints it for a refusal as CAST AS VARCHAR would have
            value = ident
        else:
            value = f"CAST({ident} AS VARCHAR)"
        exprs.append(f"{value} AS {canonical}_raw")
    raw_fields = ", ".join(f"'{c}': {_quote_identifier(col)}" for c, col in wanted.items())
    relation = (f"(SELECT file_row_number + 1 AS line, CAST(NULL AS VARCHAR) AS raw, CAST(NULL AS VARCHAR) AS problem, "
                f"{', '.join(exprs)} FROM read_parquet($file, file_row_number = true))")
    raw = (f"(SELECT file_row_number + 1 AS line, CAST(to_json({{{raw_fields}}}) AS VARCHAR) AS raw "
           f"FROM read_parquet($file, file_row_number = true))")
    return Staged(relation, {"file": str(path)}, raw_relation=raw, ticked=False, reader="duckdb-parquet",
                  cells=cells)


def _stage_sglang_requests(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
                           tick: Callable[[int], None], fast: bool = True) -> Staged:
    """SGLang --log-requests output (text or JSON): one staged record per request."""
    stager = _Stager(con)
    reader = sglang_requests.RequestLogReader(source, path)
    cols: dict[str, list] = {"line": [], "raw": [], "problem": [], **{c: [] for c in FIELD_COLUMNS}}
    for record in reader:
        cols["line"].append(record.line)
        cols["raw"].append(record.raw)
        cols["problem"].append(record.problem)
        for canonical in CANONICAL_REQUEST_FIELDS:
            cols[f"{canonical}_raw"].append(record.values.get(canonical))
        if len(cols["line"]) >= BATCH:
            stager.add(cols)
            tick(len(cols["line"]))
            cols = {k: [] for k in cols}
    stager.add(cols)
    tick(len(cols["line"]))
    load.notes.extend(reader.notes)
    return _python_staged(sglang_requests.reason_rewrites(source))


StagerFn = Callable[[duckdb.DuckDBPyConnection, Source, Path, FileLoad, Callable[[int], None], bool], Staged]
# format -> stager
STAGERS: dict[str, StagerFn] = {"jsonl": _stage_jsonl, "csv": _stage_csv, "parquet": _stage_parquet,
                                sglang_requests.FORMAT: _stage_sglang_requests, otlp.FORMAT: otlp.stage}


# Records typed before their duplicates are resolved and they are written to `requests`: a batch of
# files is merged at once (one pass over `requests` per batch, not per file), and a batch is closed
# once it holds this many records. None: as many as fit in half of DuckDB's memory limit (a
# typed record takes ~200 bytes in memory; a batch that spills to disk costs more to merge than the
# extra passes over `requests` that smaller batches take), within BATCH_ROWS_RANGE.
MERGE_ROWS: int | None = None
BATCH_ROWS_RANGE = (500_000, 20_000_000)
TYPED_RECORD_BYTES = 200
# Keep the last batch's temp tables (typed_all, repeated, ...) after a load, to inspect them.
KEEP_BATCH_TABLES = False

TYPED_ALL = """CREATE OR REPLACE TABLE kvf_batch.typed_all (
    file_no INTEGER, line BIGINT, reason VARCHAR, raw VARCHAR, request_id VARCHAR, ts TIMESTAMPTZ,
    ts_naive BOOLEAN, ts_dst VARCHAR, account_id VARCHAR, model VARCHAR, status INTEGER, prompt_tokens BIGINT,
    completion_tokens BIGINT, cached_tokens BIGINT, ttft_ms DOUBLE, latency_ms DOUBLE,
    prefill_instance VARCHAR, decode_instance VARCHAR, id_hash UBIGINT)"""
CONFLICT = "duplicate request_id with conflicting values%"
MISSING = "UPDATE kvf_batch.typed_all SET reason = reason || ' (column ' || $col || ')' WHERE file_no = $n AND reason = $missing"
MISSING_FROM_EXPRESSION = ("UPDATE kvf_batch.typed_all SET reason = reason || ' (columns.' || $field || ' = ' || $expr "
                           "|| ' gave NULL)' WHERE file_no = $n AND reason = $missing")


def load_requests_file(con: duckdb.DuckDBPyConnection, source: Source, path: Path, *,
                       tick: Callable[[int], None] = lambda n: None) -> FileLoad:
    """Stage, type, validate and load one requests file; quarantine what cannot be loaded."""
    (load,) = load_requests_files(con, source, [path], tick=tick)
    return load


def load_requests_files(con: duckdb.DuckDBPyConnection, source: Source, paths: Iterable[Path], *,
                        tick: Callable[[int], None] = lambda n: None,
                        on_file: Callable[[Path], None] = lambda path: None,
                        on_merged: Callable[[FileLoad], None] = lambda load: None,
                        model_aliases: Mapping[str, str] | None = None) -> list[FileLoad]:
    """Load the files of one source, in order: each file is read and typed (one streaming pass where
    DuckDB can read it), then a batch of files is merged into ``requests`` at once: duplicates
    resolved against everything loaded before, conflicts and refused records quarantined.
    ``on_merged`` is called for every file of a batch inside the batch's transaction (the ingest
    records its load report there), so a batch lands whole or not at all. ``model_aliases`` (the
    incident's ``[models] aliases``: engine model name -> gateway model id) rename the models of
    request logs written by an engine, which name models the engine's way."""
    loads: list[FileLoad] = []
    batch: list[tuple[int, FileLoad, Path, bool]] = []
    rows = 0
    pending = iter(paths)
    workers = _typing_workers(con)
    # files being typed, in load order; a new one starts as soon as one is done (no lockstep rounds)
    in_flight: deque[tuple[int, Path, Future[tuple[FileLoad, bool]]]] = deque()
    numbered = 0  # files of the current batch handed to the typing cursors
    batch_rows = MERGE_ROWS or _batch_rows(con)
    _new_batch(con)

    def finish() -> None:
        nonlocal rows
        file_no, path, future = in_flight.popleft()
        load, fast = future.result()
        if model_aliases and source.format in (sglang_requests.FORMAT, otlp.FORMAT):
            _apply_model_aliases(con, file_no, model_aliases, load)
        con.execute("INSERT INTO kvf_batch.load_files VALUES ($n, $f)", {"n": file_no, "f": str(path)}).fetchall()
        batch.append((file_no, load, path, fast))
        loads.append(load)
        rows += load.records_read

    with ThreadPoolExecutor(max_workers=workers) as pool:
        while True:
            while len(in_flight) < workers and (path := next(pending, None)) is not None:
                on_file(path)
                in_flight.append((numbered, path, pool.submit(_type_file_on_cursor, con, source, path, numbered, tick)))
                numbered += 1
            if not in_flight:
                break
            finish()
            if rows >= batch_rows:
                while in_flight:  # files already being typed belong to this batch
                    finish()
                _merge_batch(con, source, batch, on_merged)
                batch, rows, numbered = [], 0, 0
                _new_batch(con)
    if batch:
        _merge_batch(con, source, batch, on_merged)
    if not KEEP_BATCH_TABLES:
        for name in ("kvf_batch.typed_all", "kvf_batch.load_files", "repeated_ids", "repeated", "merge_counts"):
            con.execute(f"DROP TABLE IF EXISTS {name}").fetchall()
    return loads


def _apply_model_aliases(con: duckdb.DuckDBPyConnection, file_no: int, aliases: Mapping[str, str],
                         load: FileLoad) -> None:
    """Engine model names -> gateway model ids (exact name first, else case-insensitive), before the
    merge, so the records compare with the gateway's own and match the capacity of their model."""
    exact = list(aliases.items())
    lowered = {k.lower(): v for k, v in reversed(exact)}
    con.execute("CREATE OR REPLACE TEMP TABLE alias_map (engine VARCHAR, gateway VARCHAR, exact BOOLEAN)").fetchall()
    con.executemany("INSERT INTO alias_map VALUES (?, ?, ?)",
                    [(k, v, True) for k, v in exact] + [(k, v, False) for k, v in lowered.items()])
    renamed = con.execute("""
        UPDATE kvf_batch.typed_all AS t SET model = m.gateway
        FROM (SELECT DISTINCT ON (t2.model) t2.model AS engine, a.gateway
              FROM (SELECT DISTINCT model FROM kvf_batch.typed_all WHERE file_no = $n) t2
              JOIN alias_map a ON (a.exact AND a.engine = t2.model) OR (NOT a.exact AND a.engine = lower(t2.model))
              ORDER BY t2.model, a.exact DESC) m
        WHERE t.file_no = $n AND t.model = m.engine AND t.model <> m.gateway""", {"n": file_no}).fetchall()
    con.execute("DROP TABLE alias_map").fetchall()
    if renamed and renamed[0][0]:
        load.notes.append(f"{renamed[0][0]} record(s) named the model the engine's way; renamed to the gateway's "
                          "model id through [models] aliases")


_SIZE_UNITS = {"bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _batch_rows(con: duckdb.DuckDBPyConnection) -> int:
    """Records per merged batch under the connection's memory limit (see MERGE_ROWS)."""
    setting = str(one(con, "SELECT current_setting('memory_limit')")[0]).strip()
    number, _, unit = setting.partition(" ")
    try:
        limit = float(number) * _SIZE_UNITS[unit.strip().lower() or "bytes"]
    except (ValueError, KeyError):  # an unexpected spelling: the largest batch, as before
        return BATCH_ROWS_RANGE[1]
    low, high = BATCH_ROWS_RANGE
    return int(min(max(limit / 2 / TYPED_RECORD_BYTES, low), high))


def _typing_workers(con: duckdb.DuckDBPyConnection) -> int:
    """Files typed at once: DuckDB reads a gzip stream (and a small file) on one thread, so files
    are read side by side, one per DuckDB thread (at most 4)."""
    threads = one(con, "SELECT current_setting('threads')")[0]
    return max(1, min(int(threads), 4))


def _new_batch(con: duckdb.DuckDBPyConnection) -> None:
    """The batch tables live in an attached in-memory database (spilled like any other under the
    memory limit), which every cursor of the connection sees, so files can be typed concurrently."""
    con.execute("ATTACH IF NOT EXISTS ':memory:' AS kvf_batch").fetchall()
    con.execute(TYPED_ALL).fetchall()
    con.execute("CREATE OR REPLACE TABLE kvf_batch.load_files (file_no INTEGER, file VARCHAR)").fetchall()


def _type_file_on_cursor(con: duckdb.DuckDBPyConnection, source: Source, path: Path, file_no: int,
                         tick: Callable[[int], None]) -> tuple[FileLoad, bool]:
    cur = con.cursor()
    try:
        cur.execute("SET TimeZone = 'UTC'").fetchall()
        return _type_file(cur, source, path, file_no, tick)
    finally:
        cur.close()


def _type_file(con: duckdb.DuckDBPyConnection, source: Source, path: Path, file_no: int,
               tick: Callable[[int], None]) -> tuple[FileLoad, bool]:
    """Stage and type one file into ``typed_all``; a DuckDB reader that fails on the file (bytes
    that are not UTF-8, an unreadable Parquet page) hands it to the Python reader. Also returns
    whether the DuckDB reader was kept."""
    load = FileLoad(file=path)
    staged = STAGERS[source.format](con, source, path, load, tick, True)
    n = {"n": file_no}
    while True:
        fast = staged.relation != "staging_requests"
        try:
            _type_staged(con, source, staged, file_no)
            if _reader_kept(con, staged, file_no):
                break
        # what DuckDB's readers raise on bad input; UnicodeDecodeError when DuckDB's message about it
        # quotes the input cut inside a multi-byte character and Python cannot decode the message;
        # NotImplementedException when a line is longer than the line reader's buffer (tens of MB)
        except (duckdb.InvalidInputException, duckdb.IOException, duckdb.NotImplementedException,
                UnicodeDecodeError):
            if not fast:
                raise
        con.execute("DELETE FROM kvf_batch.typed_all WHERE file_no = $n", n).fetchall()
        if staged.retry is not None:
            staged = staged.retry()
        else:
            load = FileLoad(file=path)
            staged = STAGERS[source.format](con, source, path, load, tick, False)
    load.reader = staged.reader
    load.records_read = one(con, "SELECT count(*) FROM kvf_batch.typed_all WHERE file_no = $n", n)[0]
    if not staged.ticked:
        tick(load.records_read)
    if staged.lines is not None and staged.lines > load.records_read:
        load.notes.append(f"{staged.lines - load.records_read} blank line(s) skipped")
    load.notes.extend(_dst_notes(con, source, file_no))
    if source.preset:
        load.notes.append(presets.describe(source.preset))
    return load, fast


def _dst_notes(con: duckdb.DuckDBPyConnection, source: Source, file_no: int) -> list[str]:
    """What the source's ``ambiguous`` setting did to local times a daylight-saving change makes
    ambiguous (the repeated hour) or nonexistent (the skipped hour)."""
    rows = con.execute("SELECT ts_dst, reason IS NULL, count(*), min(line) FROM kvf_batch.typed_all "
                       "WHERE file_no = $n AND ts_dst IS NOT NULL GROUP BY ALL ORDER BY ALL",
                       {"n": file_no}).fetchall()
    notes = []
    for kind, kept, count, line in rows:
        what = f"{count} local time(s) {kind} in {source.timezone} (first at line {line})"
        if not kept:
            notes.append(f"{what}: quarantined (ambiguous = \"{source.ambiguous}\")")
        elif source.ambiguous != "reject":
            notes.append(f"{what}: read as the {source.ambiguous} of the two UTC instants they may mean "
                         f"(ambiguous = \"{source.ambiguous}\")")
    return notes


def _reader_kept(con: duckdb.DuckDBPyConnection, staged: Staged, file_no: int) -> bool:
    """Whether the file's records as staged stand: one per physical line where the reader must
    number them exactly, none refused where the reader cannot tell why."""
    if not staged.exact_lines and not staged.clean_only:
        return True
    records, refused = one(con, "SELECT count(*), count(reason) FROM kvf_batch.typed_all WHERE file_no = $n",
                           {"n": file_no})
    return (not staged.exact_lines or records == staged.lines) and (not staged.clean_only or refused == 0)


def _mapped_relation(source: Source, staged: Staged) -> tuple[str, dict[str, Any]]:
    """The staged relation with the source's mapping applied, as ``line, raw, problem, <field>_raw``:
    null tokens (a trimmed text equal to one is NULL), paths into JSON held in a cell, expressions
    (over the ``x<i>_raw`` columns they read) and value maps (a text in the map is replaced, any other
    passes unchanged). A value an expression cannot read as the number or timestamp it needs (where
    the expression then gives NULL), or a cell a path reads that holds no JSON, becomes the record's
    problem, so it is quarantined. Every text of the incident file is a parameter. The staged
    relation itself when there is nothing to apply."""
    if not (source.null_tokens or source.values or source.expressions or staged.cells):
        return staged.relation, {}
    params: dict[str, Any] = {}

    def param(value: Any) -> str:
        name = f"kvf_map{len(params)}"
        params[name] = value
        return f"${name}"

    tokens = param(list(source.null_tokens)) if source.null_tokens else None

    def nulled(value: str) -> str:
        return f"CASE WHEN list_contains({tokens}, trim(CAST({value} AS VARCHAR))) THEN NULL ELSE {value} END" \
            if tokens else value

    refs = _expression_refs(source)
    keys = [*CANONICAL_REQUEST_FIELDS, *(f"x{i}" for i in range(len(refs)))]
    inner, cell_problems = [], []
    for key in keys:
        value = nulled(f"{key}_raw")
        if key in staged.cells:
            cell_problems.append(f"WHEN {value} IS NOT NULL AND NOT json_valid({value}) "
                                 f"THEN {param(f'{_field_label(key, refs)}: the cell holds no JSON: ')} "
                                 f"|| left(CAST({value} AS VARCHAR), 40)")
            value = nulled(f"CASE WHEN json_valid({value}) THEN json_extract_string({value}, {param(staged.cells[key])}) END")
        inner.append(f"{value} AS {key}_v")
    problem = f"coalesce(problem, CASE {' '.join(cell_problems)} END)" if cell_problems else "problem"
    computed, fields, read_problems = [], [], []
    for canonical in CANONICAL_REQUEST_FIELDS:
        expression = source.expressions.get(canonical)
        if expression is not None:
            slots = [f"x{refs.index(ref)}_v" for ref in expression.refs]
            computed.append("CAST((" + expression.sql(lambda i, kind, slots=slots: read_as(slots[i], kind),
                                                       functools.partial(bind_literal, params))
                            + f") AS VARCHAR) AS {canonical}_e")
            # a value that does not convert matters where the expression then gives nothing (not in
            # a CASE branch not taken, or beside a coalesce fallback that gave a value)
            for i, kind in expression.uses:
                if kind in (NUMBER, TIMESTAMP):
                    what = f"columns.{canonical}: {expression.refs[i]} is not a {kind}: '"
                    read_problems.append(f"WHEN {canonical}_e IS NULL AND {slots[i]} IS NOT NULL AND "
                                         f"{read_as(slots[i], kind)} IS NULL "
                                         f"THEN {param(what)} || left({slots[i]}, 40) || {param(chr(39))}")
        else:
            computed.append(f"{canonical}_v AS {canonical}_e")
        value = f"{canonical}_e"
        if canonical in source.values:
            table = source.values[canonical]
            text = f"CAST({value} AS VARCHAR)"
            value = (f"coalesce(list_extract({param(list(table.values()))}, "
                     f"list_position({param(list(table))}, trim({text}))), {text})")
        fields.append(f"{value} AS {canonical}_raw")
    problem_out = f"coalesce(problem, CASE {' '.join(read_problems)} END)" if read_problems else "problem"
    refs_v = "".join(f", x{i}_v" for i in range(len(refs)))
    relation = (f"(SELECT line, raw, {problem_out} AS problem, {', '.join(fields)} FROM "
                f"(SELECT line, raw, problem{refs_v}, {', '.join(computed)} FROM "
                f"(SELECT line, raw, {problem} AS problem, {', '.join(inner)} FROM {staged.relation})))")
    return relation, params


def _field_label(key: str, refs: list[str]) -> str:
    """How a staged key is named in a reason: the canonical field, or the column an expression reads."""
    return key if key in CANONICAL_REQUEST_FIELDS else refs[int(key[1:])]


@functools.lru_cache(maxsize=32)
def dst_days(tz: str) -> list[date]:
    """The dates (1900-2300) within three days of a change of the zone's UTC offset, as a superset of
    the local times a change can make ambiguous or nonexistent (the typing checks only those); a
    sentinel date keeps the list non-empty (and typed) for a zone that never changes."""
    zone = ZoneInfo(tz)
    days = {date(1, 1, 1)}
    instant = datetime(1899, 12, 1, tzinfo=timezone.utc)
    before = instant.astimezone(zone).utcoffset()
    while instant.year < 2301:
        instant += timedelta(days=1)
        offset = instant.astimezone(zone).utcoffset()
        if offset != before:
            days.update(instant.date() + timedelta(days=k) for k in range(-3, 3))
        before = offset
    return sorted(days)


def _type_staged(con: duckdb.DuckDBPyConnection, source: Source, staged: Staged, file_no: int) -> None:
    relation, mapping_params = _mapped_relation(source, staged)
    text = sql("requests_typed").replace("{staging}", relation)
    params = {**staged.params, **mapping_params, "file_no": file_no, "tz": source.timezone,
              "offset_s": source.clock_offset_s, "ambiguous": source.ambiguous,
              "dst_days": dst_days(source.timezone)}
    run_script(con, "requests_typed", params, text=text)
    n = {"n": file_no}
    for before, after in staged.rewrites.items():
        con.execute("UPDATE kvf_batch.typed_all SET reason = $after WHERE file_no = $n AND reason = $before",
                    {**n, "before": before, "after": after}).fetchall()
    _explain_missing(con, source, file_no)
    if staged.raw_relation is not None and one(
            con, "SELECT count(*) FROM kvf_batch.typed_all WHERE file_no = $n AND reason IS NOT NULL", n)[0]:
        query = (f"UPDATE kvf_batch.typed_all SET raw = left(r.raw, 2000) FROM {staged.raw_relation} r "
                 "WHERE kvf_batch.typed_all.file_no = $n AND kvf_batch.typed_all.reason IS NOT NULL AND kvf_batch.typed_all.line = r.line")
        con.execute(query, _used(query, {**staged.params, **n})).fetchall()


def _merge_batch(con: duckdb.DuckDBPyConnection, source: Source, batch: list[tuple[int, FileLoad, Path, bool]],
                 on_merged: Callable[[FileLoad], None]) -> None:
    con.begin()
    try:
        run_script(con, "requests_merge", {"source": source.name})
        counts = {r[0]: r[1:] for r in con.execute(
            "SELECT file_no, records_read, loaded, quarantined, duplicates, naive FROM merge_counts").fetchall()}
        for file_no, load, _, _ in batch:
            read, loaded, quarantined, duplicates, naive = counts[file_no]
            if read != load.records_read:
                raise RuntimeError(f"{load.file}: {read} typed records, {load.records_read} counted")
            load.loaded, load.quarantined, load.duplicates = loaded, quarantined, duplicates
            if naive:
                load.notes.append(f"{naive} timestamp(s) without offset read as {source.timezone}")
        conflicted = {r[0] for r in con.execute(
            "SELECT DISTINCT file_no FROM repeated WHERE outcome = 'conflict'").fetchall()}
        for file_no, _, path, fast in batch:
            if file_no in conflicted:
                _fill_conflict_raw(con, source, path, fast)
        for _, load, _, _ in batch:
            on_merged(load)
        con.commit()
    except BaseException:
        con.rollback()
        raise


def _fill_conflict_raw(con: duckdb.DuckDBPyConnection, source: Source, path: Path, fast: bool) -> None:
    """The raw text of a file's conflicting duplicates, read again from the file (rare: the typing
    pass keeps raw text only for the records it refuses). A record is found by its line and, where
    a line may hold several records (the spans of one OTLP export), by its request id as typed;
    conflicts of one line that read the same are paired with its records one to one."""
    staged = STAGERS[source.format](con, source, path, FileLoad(file=path), lambda n: None, fast)
    if staged.raw_relation is not None:  # one record a line (JSONL, Parquet): the line tells it
        relation, params, same_record = staged.raw_relation, dict(staged.params), "r.line = c.line"
    else:
        mapped, params = _mapped_relation(source, staged)
        relation = f"(SELECT line, raw, trim(CAST(request_id_raw AS VARCHAR)) AS request_id FROM {mapped})"
        params = {**staged.params, **params}
        same_record = "r.line = c.line AND r.request_id = c.request_id"
    # the conflicts' reasons as requests_merge.sql words them; rows that read alike are numbered
    query = f"""UPDATE quarantine SET raw = m.raw FROM (
        SELECT q.rid, left(c.raw, 2000) AS raw
        FROM (SELECT rowid AS rid, line, reason, row_number() OVER (PARTITION BY line, reason ORDER BY rowid) AS nth
              FROM quarantine WHERE source = $source AND file = $path AND raw IS NULL AND reason LIKE $conflict) q
        JOIN (SELECT c.line, r.raw,
                     'duplicate request_id with conflicting values (kept the record at ' || c.kept_at || ')' AS reason,
                     row_number() OVER (PARTITION BY c.line, c.kept_at ORDER BY c.request_id, r.raw) AS nth
              FROM repeated c JOIN {relation} r ON {same_record}
              WHERE c.outcome = 'conflict' AND c.file = $path) c
          ON c.line = q.line AND c.reason = q.reason AND c.nth = q.nth) m
        WHERE quarantine.rowid = m.rid"""
    con.execute(query, _used(query, {**params, "source": source.name, "path": str(path),
                                     "conflict": CONFLICT})).fetchall()


def _used(query: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a query uses (DuckDB refuses unused named parameters)."""
    names = parameters_used(query)
    return {k: v for k, v in params.items() if k in names}


def _explain_missing(con: duckdb.DuckDBPyConnection, source: Source, file_no: int) -> None:
    """Name the source column (or the expression) in 'missing required field' reasons, so the fix is obvious."""
    for canonical in CANONICAL_REQUEST_FIELDS:
        col = source.columns.get(canonical)
        missing = f"missing required field '{canonical}'"
        if canonical in source.expressions:
            con.execute(MISSING_FROM_EXPRESSION, {"field": canonical, "expr": source.expressions[canonical].text,
                                                  "n": file_no, "missing": missing}).fetchall()
        elif col:
            con.execute(MISSING, {"col": col, "n": file_no, "missing": missing}).fetchall()
