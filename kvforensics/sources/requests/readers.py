"""The readers of request-log files, one per format: each stages a file for the typing step.

``STAGERS`` maps a source's ``format`` to its reader. JSONL and Parquet are read by DuckDB's own
readers where the file allows it (``FAST_STAGING``); the Python readers are the fallback for what
DuckDB refuses (bytes that are not UTF-8, CR line ends, truncated streams) and read CSV and SGLang's
``--log-requests`` output. A JSONL file that is SGLang's request log or an OTLP/JSON trace export
is recognised and read as that format.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import sys
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

import duckdb
import pyarrow as pa
import zstandard

from kvforensics.config import Source
from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS
from kvforensics.core.errors import ConfigError, InputError
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.textio import (
    CHUNK,
    INCOMPLETE_RECORD,
    LineStream,
    Recovering,
    decode_line,
    line_limit,
    printable_raw,
    scan_file,
)
from kvforensics.sources.engine_logs.contract import unreadable_reason
from kvforensics.sources.requests import otlp
from kvforensics.sources.requests import sglang as sglang_requests
from kvforensics.sources.requests.keys import (
    SAMPLE_RECORDS,
    late_needles,
    require_mapped_keys,
    sample_json_keys,
)
from kvforensics.sources.requests.staging import (
    BATCH,
    BLANK,
    FIELD_COLUMNS,
    FINISH_REASON_KEYS,
    Staged,
    Stager,
    choose_columns,
    in_milliseconds,
    json_fields_relation,
    mapping_notes,
    python_staged,
    require_header,
    split_cells,
    wrong_type_reason,
)

# Stage JSONL and Parquet with DuckDB's own readers when the file allows it (the Python readers
# remain the fallback for what DuckDB refuses: non-UTF-8 bytes, truncated streams, CR line ends).
FAST_STAGING = True
# For JSONL whose mapped columns are top-level keys, DuckDB's NDJSON reader is tried first (one parse
# per record), in these ways, in order: "text" reads every column as text (the cheapest; kept only for
# a file whose every record it can load unambiguously), "json" reads them as JSON values (their types
# kept). A file neither can number exactly falls back to the line reader.
JSON_READERS: tuple[str, ...] = ("text", "json")
CR_ONLY = "old Mac line ends (CR only): read as lines split at each CR"


def _stage_jsonl(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    tick: Callable[[int], None],
    fast: bool = True,
) -> Staged:
    if sglang_requests.recognises(path):
        load.notes.append("recognised as SGLang --log-requests JSON; read as format = \"sglang_requests\"")
        load.format = sglang_requests.FORMAT
        return _stage_sglang_requests(con, source, path, load, tick, fast)
    if otlp.recognises(path):
        if source.preset not in (None, "otlp"):  # its columns name another export's keys: no span has them
            raise ConfigError(
                f"{path.name} is an OpenTelemetry OTLP/JSON trace export, which preset "
                f"'{source.preset}' does not map: use preset = \"otlp\" for these files",
                location=f"{source.incident_file}: source '{source.name}'"
                if source.incident_file
                else f"source '{source.name}'",
            )
        load.format = otlp.FORMAT
        load.notes.append(
            "recognised as an OpenTelemetry OTLP/JSON trace export; read as format = \"otlp_json\" "
            "(the otlp mapping, with the source's own columns over it)"
        )
        return otlp.stage(con, source, path, load, tick, fast)
    keys, whole = sample_json_keys(path)
    chosen = choose_columns(source, keys)
    needles = {} if whole else late_needles(source, keys, chosen)
    lines, late = scan_file(path, needles) if needles or (fast and FAST_STAGING) else (None, [])
    if late:  # a name of a field the sample lacks is in the file: read every record's keys, in case it is a key
        keys, whole = sample_json_keys(path, None)
        chosen = choose_columns(source, keys)
        if mapped := [f for f in late if chosen.get(f) is not None]:
            load.notes.append(
                f"{', '.join(f'{f} <- {chosen[f]}' for f in mapped)}: first logged after the first "
                f"{SAMPLE_RECORDS:,} records (the keys of every record were read to map it)"
            )
    load.notes.extend(require_mapped_keys(source, path, keys, whole))
    finish_reason = None
    if chosen["status"] is None and "status" not in source.expressions:
        finish_reason = next((k for k in FINISH_REASON_KEYS if k in keys), None)
    load.notes.extend(mapping_notes(source, chosen))
    if finish_reason is not None:
        load.notes.append(
            f"status derived from {finish_reason} (the engine's view: abort -> its status_code, "
            "or 500 without one; otherwise 200), as the records have no status column"
        )
    if fast and FAST_STAGING:
        staged = _stage_jsonl_in_duckdb(source, path, chosen, finish_reason, lines)
        if staged is not None:
            return staged
    stager = Stager(con)
    stream = LineStream(path, max_line=line_limit(con))
    lines: list[int] = []
    raws: list[str] = []
    problems: list[str | None] = []
    blank = 0
    for n, raw in stream:
        if not raw.strip(BLANK):
            blank += 1
            continue
        text = decode_line(raw)
        lines.append(n)
        if text is None:
            raws.append(printable_raw(raw))
            problems.append(unreadable_reason(raw))
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
    relation, params = json_fields_relation(
        source, chosen, "SELECT line, raw, problem FROM python_lines", finish_reason
    )
    con.execute(f"CREATE OR REPLACE TEMP TABLE staging_requests AS {relation}", params).fetchall()
    con.execute("DROP TABLE python_lines").fetchall()
    return python_staged()


def _stage_jsonl_in_duckdb(
    source: Source, path: Path, chosen: Mapping[str, str | None], finish_reason: str | None, lines: int | None
) -> Staged | None:
    """Stage a JSONL file with DuckDB's own readers. None when DuckDB cannot read the file as clean
    text (a CR or 0x01 byte, a truncated or unreadable stream): the Python reader then takes the
    file, line by line, and quarantines what it must.

    First choice, when every mapped column is a top-level key: ``read_json`` with those keys as JSON
    columns, numbered WITH ORDINALITY: one parse per record by DuckDB's NDJSON reader, and the line
    numbers are right exactly when the reader yields one record per physical line. A file with a
    blank or malformed line fails that check (or makes the reader raise) and is staged again by the
    second choice: every physical line a row of ``read_csv`` (a delimiter valid JSON cannot contain
    unescaped, no quoting), each record parsed for all fields with the JSON functions. Bytes that
    are not UTF-8 make either reader fail; the loader then hands the file to the Python reader.
    *lines*: the file's physical lines, None when DuckDB cannot number them (see ``scan_file``)."""
    if lines is None:
        return None
    reader = (
        "SELECT ordinality AS line, raw, CAST(NULL AS VARCHAR) AS problem FROM read_csv($file, "
        "columns = {'raw': 'VARCHAR'}, header = false, delim = chr(1), quote = '', escape = '', "
        "auto_detect = false, strict_mode = false) WITH ORDINALITY"
    )
    relation, params = json_fields_relation(source, chosen, reader, finish_reason)

    def by_lines() -> Staged:
        return Staged(f"({relation})", {**params, "file": str(path)}, lines=lines, ticked=False, reader="duckdb-lines")

    keys = [c for c in dict.fromkeys(chosen.values()) if c is not None]
    if finish_reason is not None or any("." in k for k in keys) or not keys:
        return by_lines()

    raw_lines = f"(SELECT line, raw FROM ({reader}))"

    def as_json(then: Callable[[], Staged]) -> Staged:
        return Staged(
            _json_columns_relation(source, chosen, keys),
            {"file": str(path), "columns": dict.fromkeys(keys, "JSON")},
            raw_relation=raw_lines,
            lines=lines,
            ticked=False,
            exact_lines=True,
            retry=then,
            reader="duckdb-json",
        )

    def as_text(then: Callable[[], Staged]) -> Staged:
        return Staged(
            _json_text_relation(source, chosen, keys),
            {"file": str(path), "columns": dict.fromkeys(keys, "VARCHAR")},
            raw_relation=raw_lines,
            lines=lines,
            ticked=False,
            exact_lines=True,
            clean_only=True,
            retry=then,
            reader="duckdb-json-text",
        )

    staged: Callable[[], Staged] = by_lines
    for way in reversed(JSON_READERS):
        staged = functools.partial({"text": as_text, "json": as_json}[way], staged)
    return staged()


# A value DuckDB's NDJSON reader hands over as text may have been something else: an object, array or
# boolean (serialised), or a number it printed in exponent form (where the JSON reader keeps the
# digits). That matters only for the fields kept as text: in a number or timestamp field such a text
# fails the typing, and a refused record gives the file up anyway. The range test picks texts that
# start like a number ('-', '.', '/' or a digit) before the regular expression runs.
_TEXT_FIELDS = ("request_id", "account_id", "model", "prefill_instance", "decode_instance", "cache_salt")
_NUMBER_FIELDS = ("status", "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "latency_ms")
_AMBIGUOUS_TEXT = (
    "starts_with({k}, '{{') OR starts_with({k}, '[') OR {k} IN ('true', 'false') "
    "OR ({k} >= '-' AND {k} < ':' AND regexp_full_match({k}, '-?[0-9][0-9.]*[eE][-+]?[0-9]+'))"
)


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
    text_keys = dict.fromkeys(
        k
        for canonical, _, k in _keyed_fields(chosen, keys)
        if (canonical in _TEXT_FIELDS or canonical not in CANONICAL_REQUEST_FIELDS) and k
    )
    ambiguous = " OR ".join(f"({_AMBIGUOUS_TEXT.format(k=k)})" for k in text_keys) or "false"
    fields = [
        f"{in_milliseconds(source, canonical, col, k)} AS {canonical}_raw"
        if k is not None
        else f"CAST(NULL AS VARCHAR) AS {canonical}_raw"
        for canonical, col, k in _keyed_fields(chosen, keys)
    ]
    return (
        f"(SELECT line, CAST(NULL AS VARCHAR) AS raw, "
        f"CASE WHEN coalesce({ambiguous}, false) THEN 'value of ambiguous JSON type' END AS problem, "
        f"{', '.join(fields)} FROM read_json($file, format = 'newline_delimited', columns = $columns) "
        f"WITH ORDINALITY AS j({', '.join(names)}, line))"
    )


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
            wrong_type.append(f"WHEN starts_with({k}, '{first}') THEN {wrong_type_reason(canonical)} || '{kind}'")
        expr = f"CASE WHEN starts_with({k}, '\"') THEN json_extract_string({k}, '$') ELSE CAST({k} AS VARCHAR) END"
        expr = in_milliseconds(source, canonical, col, expr)
        fields.append(f"CASE WHEN problem IS NULL THEN {expr} END AS {canonical}_raw")
    problem = f"CASE {' '.join(wrong_type)} END"
    return (
        f"(SELECT line, CAST(NULL AS VARCHAR) AS raw, problem, {', '.join(fields)} FROM "
        f"(SELECT *, {problem} AS problem FROM read_json($file, format = 'newline_delimited', "
        f"columns = $columns) WITH ORDINALITY AS j({', '.join(names)}, line)))"
    )


def _stage_csv(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    tick: Callable[[int], None],
    fast: bool = True,
) -> Staged:
    stager = Stager(con)
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
            return python_staged()
        except (EOFError, OSError, csv.Error) as e:
            load.notes.append(f"input ends early before the header ({type(e).__name__}: {e})")
            return python_staged()
        header = [h.strip() for h in header]
        chosen = choose_columns(source, set(header))
        load.notes.extend(require_header(source, path, header, chosen))
        columns, cells = split_cells(source, path, chosen, header)
        stager = Stager(con, columns)
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
            load.notes.append(
                f"input ends early after line {last_line} ({type(e).__name__}: {e}); later records, if any, are lost"
            )
            if not isinstance(e, csv.Error) and raw.tail:
                cols["line"].append(last_line + 1)
                cols["raw"].append(printable_raw(raw.tail))
                cols["problem"].append(INCOMPLETE_RECORD)
                for c in index:
                    cols[f"{c}_raw"].append(None)
        stager.add(cols)
        tick(len(cols["line"]))
    load.notes.extend(mapping_notes(source, chosen))
    return replace(python_staged(), cells=cells)


def _stage_parquet(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    tick: Callable[[int], None],
    fast: bool = True,
) -> Staged:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError variants
        raise InputError(f"not a readable Parquet file ({e})", location=f"source '{source.name}': {path}") from None
    header = pf.schema_arrow.names
    chosen = choose_columns(source, set(header))
    load.notes.extend(require_header(source, path, header, chosen))
    columns, cells = split_cells(source, path, chosen, header)
    wanted = {c: col for c, col in columns.items() if col is not None and col in header}
    if fast and FAST_STAGING:
        load.notes.extend(mapping_notes(source, chosen))
        return _stage_parquet_in_duckdb(path, pf.schema_arrow, wanted, list(columns), cells)
    stager = Stager(con, columns)
    offset = 0
    for batch in pf.iter_batches(batch_size=BATCH, columns=sorted(set(wanted.values()))):
        n = batch.num_rows
        cols: dict[str, list] = {
            "line": list(range(offset + 1, offset + n + 1)),
            "raw": [None] * n,
            "problem": [None] * n,
        }
        for c, col in wanted.items():
            arr = batch.column(col)
            if pa.types.is_timestamp(arr.type):
                values = [None if v is None else v.isoformat() for v in arr.to_pylist()]
            elif c in cells and (
                pa.types.is_struct(arr.type) or pa.types.is_map(arr.type) or pa.types.is_list(arr.type)
            ):
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
    load.notes.extend(mapping_notes(source, chosen))
    return replace(python_staged(), cells=cells)


def _quote_identifier(name: str) -> str:
    """A column name as a SQL identifier (the name exists in the file's schema; quotes are doubled)."""
    return '"' + name.replace('"', '""') + '"'


def _stage_parquet_in_duckdb(
    path: Path, schema: pa.Schema, wanted: Mapping[str, str], keys: list[str], cells: Mapping[str, str]
) -> Staged:
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
    relation = (
        f"(SELECT file_row_number + 1 AS line, CAST(NULL AS VARCHAR) AS raw, CAST(NULL AS VARCHAR) AS problem, "
        f"{', '.join(exprs)} FROM read_parquet($file, file_row_number = true))"
    )
    raw = (
        f"(SELECT file_row_number + 1 AS line, CAST(to_json({{{raw_fields}}}) AS VARCHAR) AS raw "
        f"FROM read_parquet($file, file_row_number = true))"
    )
    return Staged(relation, {"file": str(path)}, raw_relation=raw, ticked=False, reader="duckdb-parquet", cells=cells)


def _stage_sglang_requests(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    tick: Callable[[int], None],
    fast: bool = True,
) -> Staged:
    """SGLang --log-requests output (text or JSON): one staged record per request."""
    stager = Stager(con)
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
    return python_staged(sglang_requests.reason_rewrites(source))


StagerFn = Callable[[duckdb.DuckDBPyConnection, Source, Path, FileLoad, Callable[[int], None], bool], Staged]
# format -> stager
STAGERS: dict[str, StagerFn] = {
    "jsonl": _stage_jsonl,
    "csv": _stage_csv,
    "parquet": _stage_parquet,
    sglang_requests.FORMAT: _stage_sglang_requests,
    otlp.FORMAT: otlp.stage,
}
