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
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import duckdb
import pyarrow as pa

from kvforensics.config import CANONICAL_REQUEST_FIELDS, Source
from kvforensics.db import one, run_script
from kvforensics.errors import InputError
from kvforensics.loaders import sglang_requests
from kvforensics.loaders.textio import CHUNK, LineStream, decode_line, open_binary, printable_raw

BATCH = 100_000
# Stage JSONL and Parquet with DuckDB's own readers when the file allows it (the Python readers
# remain the fallback for what DuckDB refuses: non-UTF-8 bytes, truncated streams, CR line ends).
FAST_STAGING = True

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


@dataclass
class FileLoad:
    """What happened to one input file."""

    file: Path
    records_read: int = 0
    loaded: int = 0
    quarantined: int = 0
    duplicates: int = 0
    notes: list[str] = field(default_factory=list)


def _staging_schema() -> pa.Schema:
    return pa.schema([("line", pa.int64()), ("raw", pa.string()), ("problem", pa.string())]
                     + [(c, pa.string()) for c in FIELD_COLUMNS])


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
    """Canonical field -> source column: the mapping, else the canonical name, else a known alias."""
    chosen: dict[str, str | None] = {}
    for canonical in CANONICAL_REQUEST_FIELDS:
        names = _candidate_names(source, canonical)
        hit = next((n for n in names if n in present), None)
        if hit is None and canonical in source.columns:
            hit = source.columns[canonical]
        chosen[canonical] = hit
    return chosen


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

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con
        self.schema = _staging_schema()
        con.execute("CREATE OR REPLACE TEMP TABLE staging_requests (line BIGINT, raw VARCHAR, problem VARCHAR, "
                    + ", ".join(f"{c} VARCHAR" for c in FIELD_COLUMNS) + ")")

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


def _stage_jsonl(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
                 tick: Callable[[int], None]) -> Mapping[str, str]:
    if sglang_requests.recognises(path):
        load.notes.append("recognised as SGLang --log-requests JSON; read as format = \"sglang_requests\"")
        return _stage_sglang_requests(con, source, path, load, tick)
    keys = _sample_json_keys(path)
    chosen = _choose_columns(source, keys)
    if FAST_STAGING and _stage_jsonl_in_duckdb(con, source, path, chosen, load, tick):
        _finish_jsonl(con, source, chosen, keys, load)
        return {}
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
    stager.add({"line": lines, "raw": raws, "problem": problems})
    tick(len(lines))
    if blank:
        load.notes.append(f"{blank} blank line(s) skipped")
    if stream.stopped:
        load.notes.append(stream.stopped)
    # Extract every field from the JSON in SQL; paths are parameters, never spliced into the query.
    con.execute("ALTER TABLE staging_requests RENAME TO python_lines").fetchall()
    _extract_json_fields(con, source, chosen, "SELECT line, raw, problem FROM python_lines", {})
    con.execute("DROP TABLE python_lines").fetchall()
    _finish_jsonl(con, source, chosen, keys, load)
    return {}


def _field_expressions(source: Source, chosen: Mapping[str, str | None]
                       ) -> tuple[list[str], list[str], dict[str, str]]:
    """JSON paths, the wrong-type checks and the value of each canonical field, over the lists
    ``t`` (json_type) and ``v`` (json_extract_string) of one parse of the record."""
    paths: list[str] = []
    wrong_type: list[str] = []
    values: dict[str, str] = {}
    for canonical in CANONICAL_REQUEST_FIELDS:
        col = chosen[canonical]
        if col is None:
            continue
        first = len(paths) + 1
        paths.extend(_json_paths(col))
        numbers = range(first, len(paths) + 1)
        types = "coalesce(" + ", ".join(f"t[{i}]" for i in numbers) + ")"
        wrong_type.append(f"WHEN {types} IN ('OBJECT', 'ARRAY', 'BOOLEAN') "
                          f"THEN '{canonical} must be a string or a number, not a JSON ' || lower({types})")
        expr = "coalesce(" + ", ".join(f"v[{i}]" for i in numbers) + ")"
        if col in SECONDS_ALIASES and canonical not in source.columns:
            expr = f"coalesce(CAST(round(TRY_CAST({expr} AS DOUBLE) * 1000, 3) AS VARCHAR), {expr})"
        values[canonical] = expr
    return paths, wrong_type, values


def _extract_json_fields(con: duckdb.DuckDBPyConnection, source: Source, chosen: Mapping[str, str | None],
                         lines_sql: str, params: dict[str, Any]) -> None:
    """``staging_requests`` from a relation of ``line, raw, problem``: each record parsed once for all
    fields (json_type / json_extract_string over the list of paths); blank lines dropped."""
    paths, wrong_type, values = _field_expressions(source, chosen)
    fields = ", ".join(f"CASE WHEN problem IS NULL THEN {values[c]} END AS {c}_raw" if c in values
                       else f"CAST(NULL AS VARCHAR) AS {c}_raw" for c in CANONICAL_REQUEST_FIELDS)
    type_check = f"CASE {' '.join(wrong_type)} END" if wrong_type else "CAST(NULL AS VARCHAR)"
    query = f"""
        CREATE OR REPLACE TEMP TABLE staging_requests AS
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
        SELECT line, raw, problem, {fields} FROM judged ORDER BY line"""
    con.execute(query, {**params, "paths": paths or ["$.__none__"]}).fetchall()


def _lines_are_plain(path: Path) -> bool:
    """True when no byte of the (decompressed) file is a CR or the 0x01 that DuckDB's line reader
    uses as its delimiter: either would make DuckDB split or cut a physical line (shifting line
    numbers, or silently dropping the text after the 0x01). The whole stream is scanned, at memchr
    speed; a file that fails the scan goes to the Python reader, which keeps every byte."""
    with open_binary(path) as fh:
        while chunk := fh.read(CHUNK):
            if b"\r" in chunk or b"\x01" in chunk:
                return False
    return True


def _stage_jsonl_in_duckdb(con: duckdb.DuckDBPyConnection, source: Source, path: Path,
                           chosen: Mapping[str, str | None], load: FileLoad, tick: Callable[[int], None]) -> bool:
    """Stage a JSONL file with DuckDB's own reader: every physical line a row (a delimiter valid JSON
    cannot contain unescaped, no quoting), numbered WITH ORDINALITY, each record parsed once for all
    fields. Returns False (and stages nothing) when DuckDB cannot read the file as clean UTF-8 text
    (non-UTF-8 bytes, a truncated stream, a CR or 0x01 byte that would split or cut a line): the Python
    reader then takes the file, line by line, and quarantines what it must."""
    try:
        if not _lines_are_plain(path):
            return False
    except Exception:  # noqa: BLE001 - any read failure (truncated gzip/zstd, I/O): the Python reader says why
        return False
    lines = ("SELECT ordinality AS line, raw, CAST(NULL AS VARCHAR) AS problem FROM read_csv($file, "
             "columns = {'raw': 'VARCHAR'}, header = false, delim = chr(1), quote = '', escape = '', "
             "auto_detect = false, strict_mode = false) WITH ORDINALITY")
    try:
        _extract_json_fields(con, source, chosen, lines, {"file": str(path)})
        total = one(con, "SELECT count(*) FROM read_csv($file, columns = {'raw': 'VARCHAR'}, header = false, "
                         "delim = chr(1), quote = '', escape = '', auto_detect = false, strict_mode = false)",
                    {"file": str(path)})[0]
    except duckdb.Error:
        con.execute("DROP TABLE IF EXISTS staging_requests").fetchall()
        return False
    staged = one(con, "SELECT count(*) FROM staging_requests")[0]
    tick(staged)
    if total > staged:
        load.notes.append(f"{total - staged} blank line(s) skipped")
    return True


def _finish_jsonl(con: duckdb.DuckDBPyConnection, source: Source, chosen: Mapping[str, str | None],
                  keys: set[str], load: FileLoad) -> None:
    load.notes.extend(_mapping_notes(source, chosen))
    if chosen["status"] is None:
        finish_reason = next((k for k in FINISH_REASON_KEYS if k in keys), None)
        if finish_reason is not None:
            _derive_status(con, finish_reason)
            load.notes.append(f"status derived from {finish_reason} (the engine's view: abort -> its status_code, "
                              "or 500 without one; otherwise 200), as the records have no status column")


def _derive_status(con: duckdb.DuckDBPyConnection, finish_reason: str) -> None:
    base = _json_path(finish_reason)
    con.execute("""UPDATE staging_requests SET status_raw = CASE
                     WHEN json_type(raw, $fr) = 'OBJECT' THEN
                         CASE WHEN lower(json_extract_string(raw, $type)) = 'abort'
                              THEN coalesce(json_extract_string(raw, $code), '500') ELSE '200' END
                     WHEN json_type(raw, $fr) = 'VARCHAR' THEN
                         CASE WHEN lower(json_extract_string(raw, $fr)) LIKE '%abort%' THEN '500' ELSE '200' END
                   END
                   WHERE problem IS NULL""",
                {"fr": base, "type": base + '."type"', "code": base + '."status_code"'})


def _mapping_notes(source: Source, chosen: dict[str, str | None]) -> list[str]:
    notes = []
    recognised = {c: col for c, col in chosen.items()
                  if col is not None and c not in source.columns and col != c}
    if recognised:
        notes.append("columns recognised without a mapping: "
                     + ", ".join(f"{c} <- {col}" for c, col in sorted(recognised.items())))
    return notes


def _require_header(source: Source, path: Path, header: Iterable[str], chosen: dict[str, str | None]) -> None:
    have = set(header)
    from kvforensics.config import REQUIRED_REQUEST_FIELDS

    for canonical in REQUIRED_REQUEST_FIELDS:
        col = chosen.get(canonical)
        if col is None or col not in have:
            hint = f"mapped to column '{col}'" if col else "no column of that name"
            raise InputError(
                f"required field '{canonical}' is missing ({hint}); the file has columns "
                f"{sorted(have)}. Map it in the incident file: columns = {{ {canonical} = \"<column>\" }}",
                location=f"source '{source.name}': {path}")
    for canonical, col in source.columns.items():
        if col not in have:
            raise InputError(f"columns maps '{canonical}' to '{col}', which the file does not have; "
                             f"it has {sorted(have)}", location=f"source '{source.name}': {path}")


def _stage_csv(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
               tick: Callable[[int], None]) -> Mapping[str, str]:
    stager = _Stager(con)
    stream = LineStream(path)
    with open_binary(path) as fh:
        text = io.TextIOWrapper(fh, encoding="utf-8", errors="surrogateescape", newline="")
        reader = csv.reader(text)
        try:
            header = next(reader)
        except StopIteration:
            load.notes.append("empty file")
            return {}
        except (EOFError, OSError, csv.Error) as e:
            load.notes.append(f"input ends early before the header ({type(e).__name__}: {e})")
            return {}
        header = [h.strip() for h in header]
        chosen = _choose_columns(source, set(header))
        _require_header(source, path, header, chosen)
        index = {c: header.index(col) for c, col in chosen.items() if col is not None and col in header}
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
        except (EOFError, OSError, csv.Error) as e:
            load.notes.append(f"input ends early after line {last_line} ({type(e).__name__}: {e}); "
                              f"later records, if any, are lost")
        stager.add(cols)
        tick(len(cols["line"]))
    del stream
    load.notes.extend(_mapping_notes(source, chosen))
    return {}


def _stage_parquet(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
                   tick: Callable[[int], None]) -> Mapping[str, str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError variants
        raise InputError(f"not a readable Parquet file ({e})", location=f"source '{source.name}': {path}") from None
    header = pf.schema_arrow.names
    chosen = _choose_columns(source, set(header))
    _require_header(source, path, header, chosen)
    wanted = {c: col for c, col in chosen.items() if col is not None and col in header}
    if FAST_STAGING and _stage_parquet_in_duckdb(con, path, pf.schema_arrow, wanted, tick):
        load.notes.extend(_mapping_notes(source, chosen))
        return {}
    stager = _Stager(con)
    offset = 0
    for batch in pf.iter_batches(batch_size=BATCH, columns=sorted(set(wanted.values()))):
        n = batch.num_rows
        cols: dict[str, list] = {"line": list(range(offset + 1, offset + n + 1)), "raw": [None] * n,
                                 "problem": [None] * n}
        for c, col in wanted.items():
            arr = batch.column(col)
            if pa.types.is_timestamp(arr.type):
                values = [None if v is None else v.isoformat() for v in arr.to_pylist()]
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
    return {}


def _quote_identifier(name: str) -> str:
    """A column name as a SQL identifier (the name exists in the file's schema; quotes are doubled)."""
    return '"' + name.replace('"', '""') + '"'


def _stage_parquet_in_duckdb(con: duckdb.DuckDBPyConnection, path: Path, schema: pa.Schema,
                             wanted: Mapping[str, str], tick: Callable[[int], None]) -> bool:
    """Stage a Parquet file in one DuckDB scan: values as text (timestamps as ISO-8601, with 'Z' when
    the column carries a zone), the line being the row number, the raw record as JSON."""
    exprs = []
    for canonical in CANONICAL_REQUEST_FIELDS:
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
        else:
            value = f"CAST({ident} AS VARCHAR)"
        exprs.append(f"{value} AS {canonical}_raw")
    raw_fields = ", ".join(f"'{c}': {_quote_identifier(col)}" for c, col in wanted.items())
    query = f"""CREATE OR REPLACE TEMP TABLE staging_requests AS
                SELECT file_row_number + 1 AS line, left(CAST(to_json({{{raw_fields}}}) AS VARCHAR), 2000) AS raw,
                       CAST(NULL AS VARCHAR) AS problem, {', '.join(exprs)}
                FROM read_parquet($file, file_row_number = true)"""
    try:
        con.execute(query, {"file": str(path)}).fetchall()
    except duckdb.Error:
        con.execute("DROP TABLE IF EXISTS staging_requests").fetchall()
        return False
    tick(one(con, "SELECT count(*) FROM staging_requests")[0])
    return True


def _stage_sglang_requests(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad,
                           tick: Callable[[int], None]) -> Mapping[str, str]:
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
    return sglang_requests.reason_rewrites(source)


StagerFn = Callable[[duckdb.DuckDBPyConnection, Source, Path, FileLoad, Callable[[int], None]], Mapping[str, str]]
# format -> stager; a stager returns rewrites of the typing step's reasons for its format
STAGERS: dict[str, StagerFn] = {"jsonl": _stage_jsonl, "csv": _stage_csv, "parquet": _stage_parquet,
                                sglang_requests.FORMAT: _stage_sglang_requests}


def load_requests_file(con: duckdb.DuckDBPyConnection, source: Source, path: Path, *,
                       tick: Callable[[int], None] = lambda n: None) -> FileLoad:
    """Stage, type, validate and load one requests file; quarantine what cannot be loaded."""
    load = FileLoad(file=path)
    rewrites = STAGERS[source.format](con, source, path, load, tick)
    run_script(con, "requests_typed", {"tz": source.timezone, "offset_s": source.clock_offset_s})
    for before, after in rewrites.items():
        con.execute("UPDATE typed_requests SET reason = $after WHERE reason = $before",
                    {"before": before, "after": after})
    _explain_missing(con, source)
    load.records_read = one(con, "SELECT count(*) FROM typed_requests")[0]
    naive = one(con, "SELECT count(*) FROM typed_requests WHERE reason IS NULL AND ts_naive")[0]
    if naive:
        load.notes.append(f"{naive} timestamp(s) without offset read as {source.timezone}")
    params = {"source": source.name, "file": str(path)}
    run_script(con, "requests_merge", params)
    load.loaded, load.duplicates, load.quarantined = one(
        con, "SELECT count(*) FILTER (WHERE outcome = 'loaded'), count(*) FILTER (WHERE outcome = 'duplicate'), "
        "count(*) FILTER (WHERE outcome = 'quarantined') FROM merged_requests")
    return load


def _explain_missing(con: duckdb.DuckDBPyConnection, source: Source) -> None:
    """Name the source column in 'missing required field' reasons, so the fix is obvious."""
    for canonical in CANONICAL_REQUEST_FIELDS:
        col = source.columns.get(canonical)
        if col:
            con.execute("UPDATE typed_requests SET reason = reason || ' (column ' || $col || ')' "
                        "WHERE reason = 'missing required field ''' || $f || ''''", {"col": col, "f": canonical})
