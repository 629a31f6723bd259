"""Typing one staged file into ``kvf_batch.typed_all``: the source's mapping applied, every field
typed and validated by ``sql/requests_typed.sql``, and the reasons a record is refused made to name
the source's own column.

Files are typed side by side, each on its own cursor of the connection, into one table of an
attached in-memory database (``kvf_batch``) that every cursor sees. A DuckDB reader that cannot
stand for a file (it fails on it, numbers its lines wrongly, or refuses a record it cannot say why)
hands the file to the next reader, down to the Python readers.
"""

from __future__ import annotations

import functools
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Mapping
from zoneinfo import ZoneInfo

import duckdb

from kvforensics.config import Source
from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS
from kvforensics.core.db import one, parameters_used, run_script, sql
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.requests import presets
from kvforensics.sources.requests.mapping import NUMBER, TIMESTAMP, bind_literal, read_as
from kvforensics.sources.requests.readers import STAGERS
from kvforensics.sources.requests.staging import Staged, expression_refs

TYPED_ALL = """CREATE OR REPLACE TABLE kvf_batch.typed_all (
    file_no INTEGER, line BIGINT, reason VARCHAR, raw VARCHAR, request_id VARCHAR, ts TIMESTAMPTZ,
    ts_naive BOOLEAN, ts_dst VARCHAR, account_id VARCHAR, model VARCHAR, status INTEGER, prompt_tokens BIGINT,
    completion_tokens BIGINT, cached_tokens BIGINT, ttft_ms DOUBLE, latency_ms DOUBLE,
    prefill_instance VARCHAR, decode_instance VARCHAR, cache_salt VARCHAR, id_hash UBIGINT)"""
MISSING = "UPDATE kvf_batch.typed_all SET reason = reason || ' (column ' || $col || ')' WHERE file_no = $n AND reason = $missing"
MISSING_FROM_EXPRESSION = (
    "UPDATE kvf_batch.typed_all SET reason = reason || ' (columns.' || $field || ' = ' || $expr "
    "|| ' gave NULL)' WHERE file_no = $n AND reason = $missing"
)


def new_batch(con: duckdb.DuckDBPyConnection) -> None:
    """The batch tables live in an attached in-memory database (spilled like any other under the
    memory limit), which every cursor of the connection sees, so files can be typed concurrently."""
    con.execute("ATTACH IF NOT EXISTS ':memory:' AS kvf_batch").fetchall()
    con.execute(TYPED_ALL).fetchall()
    con.execute("CREATE OR REPLACE TABLE kvf_batch.load_files (file_no INTEGER, file VARCHAR)").fetchall()


def type_file_on_cursor(
    con: duckdb.DuckDBPyConnection, source: Source, path: Path, file_no: int, tick: Callable[[int], None]
) -> tuple[FileLoad, bool]:
    cur = con.cursor()
    try:
        cur.execute("SET TimeZone = 'UTC'").fetchall()
        return _type_file(cur, source, path, file_no, tick)
    finally:
        cur.close()


def _type_file(
    con: duckdb.DuckDBPyConnection, source: Source, path: Path, file_no: int, tick: Callable[[int], None]
) -> tuple[FileLoad, bool]:
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
        except (duckdb.InvalidInputException, duckdb.IOException, duckdb.NotImplementedException, UnicodeDecodeError):
            if not fast:
                raise
        con.execute("DELETE FROM kvf_batch.typed_all WHERE file_no = $n", n).fetchall()
        if staged.retry is not None:
            staged = staged.retry()
        else:
            load = FileLoad(file=path)
            staged = STAGERS[source.format](con, source, path, load, tick, False)
    load.reader = staged.reader
    load.format = load.format or source.format
    load.records_read = one(con, "SELECT count(*) FROM kvf_batch.typed_all WHERE file_no = $n", n)[0]
    if not staged.ticked:
        tick(load.records_read)
    if staged.lines is not None and staged.lines > load.records_read:
        load.notes.append(f"{staged.lines - load.records_read} blank line(s) skipped")
    load.notes.extend(_dst_notes(con, source, file_no))
    if source.preset:
        load.notes.append(presets.describe(source.preset))
    return load, fast


def _type_staged(con: duckdb.DuckDBPyConnection, source: Source, staged: Staged, file_no: int) -> None:
    relation, mapping_params = mapped_relation(source, staged)
    text = sql("requests_typed").replace("{staging}", relation)
    params = {
        **staged.params,
        **mapping_params,
        "file_no": file_no,
        "tz": source.timezone,
        "offset_s": source.clock_offset_s,
        "ambiguous": source.ambiguous,
        "dst_days": dst_days(source.timezone),
    }
    run_script(con, "requests_typed", params, text=text)
    n = {"n": file_no}
    for before, after in staged.rewrites.items():
        con.execute(
            "UPDATE kvf_batch.typed_all SET reason = $after WHERE file_no = $n AND reason = $before",
            {**n, "before": before, "after": after},
        ).fetchall()
    _explain_missing(con, source, file_no)
    if (
        staged.raw_relation is not None
        and one(con, "SELECT count(*) FROM kvf_batch.typed_all WHERE file_no = $n AND reason IS NOT NULL", n)[0]
    ):
        query = (
            f"UPDATE kvf_batch.typed_all SET raw = left(r.raw, 2000) FROM {staged.raw_relation} r "
            "WHERE kvf_batch.typed_all.file_no = $n AND kvf_batch.typed_all.reason IS NOT NULL AND kvf_batch.typed_all.line = r.line"
        )
        con.execute(query, parameters_for(query, {**staged.params, **n})).fetchall()


def mapped_relation(source: Source, staged: Staged) -> tuple[str, dict[str, Any]]:
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
        return (
            f"CASE WHEN list_contains({tokens}, trim(CAST({value} AS VARCHAR))) THEN NULL ELSE {value} END"
            if tokens
            else value
        )

    refs = expression_refs(source)
    keys = [*CANONICAL_REQUEST_FIELDS, *(f"x{i}" for i in range(len(refs)))]
    inner, cell_problems = [], []
    for key in keys:
        value = nulled(f"{key}_raw")
        if key in staged.cells:
            cell_problems.append(
                f"WHEN {value} IS NOT NULL AND NOT json_valid({value}) "
                f"THEN {param(f'{_field_label(key, refs)}: the cell holds no JSON: ')} "
                f"|| left(CAST({value} AS VARCHAR), 40)"
            )
            value = nulled(
                f"CASE WHEN json_valid({value}) THEN json_extract_string({value}, {param(staged.cells[key])}) END"
            )
        inner.append(f"{value} AS {key}_v")
    problem = f"coalesce(problem, CASE {' '.join(cell_problems)} END)" if cell_problems else "problem"
    computed, fields, read_problems = [], [], []
    for canonical in CANONICAL_REQUEST_FIELDS:
        expression = source.expressions.get(canonical)
        if expression is not None:
            slots = [f"x{refs.index(ref)}_v" for ref in expression.refs]
            computed.append(
                "CAST(("
                + expression.sql(
                    lambda i, kind, slots=slots: read_as(slots[i], kind), functools.partial(bind_literal, params)
                )
                + f") AS VARCHAR) AS {canonical}_e"
            )
            # a value that does not convert matters where the expression then gives nothing (not in
            # a CASE branch not taken, or beside a coalesce fallback that gave a value)
            for i, kind in expression.uses:
                if kind in (NUMBER, TIMESTAMP):
                    what = f"columns.{canonical}: {expression.refs[i]} is not a {kind}: '"
                    read_problems.append(
                        f"WHEN {canonical}_e IS NULL AND {slots[i]} IS NOT NULL AND "
                        f"{read_as(slots[i], kind)} IS NULL "
                        f"THEN {param(what)} || left({slots[i]}, 40) || {param(chr(39))}"
                    )
        else:
            computed.append(f"{canonical}_v AS {canonical}_e")
        value = f"{canonical}_e"
        if canonical in source.values:
            table = source.values[canonical]
            text = f"CAST({value} AS VARCHAR)"
            value = (
                f"coalesce(list_extract({param(list(table.values()))}, "
                f"list_position({param(list(table))}, trim({text}))), {text})"
            )
        fields.append(f"{value} AS {canonical}_raw")
    problem_out = f"coalesce(problem, CASE {' '.join(read_problems)} END)" if read_problems else "problem"
    refs_v = "".join(f", x{i}_v" for i in range(len(refs)))
    relation = (
        f"(SELECT line, raw, {problem_out} AS problem, {', '.join(fields)} FROM "
        f"(SELECT line, raw, problem{refs_v}, {', '.join(computed)} FROM "
        f"(SELECT line, raw, {problem} AS problem, {', '.join(inner)} FROM {staged.relation})))"
    )
    return relation, params


def _field_label(key: str, refs: list[str]) -> str:
    """How a staged key is named in a reason: the canonical field, or the column an expression reads."""
    return key if key in CANONICAL_REQUEST_FIELDS else refs[int(key[1:])]


def _explain_missing(con: duckdb.DuckDBPyConnection, source: Source, file_no: int) -> None:
    """Name the source column (or the expression) in 'missing required field' reasons, so the fix is obvious."""
    for canonical in CANONICAL_REQUEST_FIELDS:
        col = source.columns.get(canonical)
        missing = f"missing required field '{canonical}'"
        if canonical in source.expressions:
            con.execute(
                MISSING_FROM_EXPRESSION,
                {"field": canonical, "expr": source.expressions[canonical].text, "n": file_no, "missing": missing},
            ).fetchall()
        elif col:
            con.execute(MISSING, {"col": col, "n": file_no, "missing": missing}).fetchall()


def _reader_kept(con: duckdb.DuckDBPyConnection, staged: Staged, file_no: int) -> bool:
    """Whether the file's records as staged stand: one per physical line where the reader must
    number them exactly, none refused where the reader cannot tell why."""
    if not staged.exact_lines and not staged.clean_only:
        return True
    records, refused = one(
        con, "SELECT count(*), count(reason) FROM kvf_batch.typed_all WHERE file_no = $n", {"n": file_no}
    )
    return (not staged.exact_lines or records == staged.lines) and (not staged.clean_only or refused == 0)


def _dst_notes(con: duckdb.DuckDBPyConnection, source: Source, file_no: int) -> list[str]:
    """What the source's ``ambiguous`` setting did to local times a daylight-saving change makes
    ambiguous (the repeated hour) or nonexistent (the skipped hour)."""
    rows = con.execute(
        "SELECT ts_dst, reason IS NULL, count(*), min(line) FROM kvf_batch.typed_all "
        "WHERE file_no = $n AND ts_dst IS NOT NULL GROUP BY ALL ORDER BY ALL",
        {"n": file_no},
    ).fetchall()
    notes = []
    for kind, kept, count, line in rows:
        what = f"{count} local time(s) {kind} in {source.timezone} (first at line {line})"
        if not kept:
            notes.append(f"{what}: quarantined (ambiguous = \"{source.ambiguous}\")")
        elif source.ambiguous != "reject":
            notes.append(
                f"{what}: read as the {source.ambiguous} of the two UTC instants they may mean "
                f"(ambiguous = \"{source.ambiguous}\")"
            )
    return notes


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


def parameters_for(query: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a query uses (DuckDB refuses unused named parameters)."""
    names = parameters_used(query)
    return {k: v for k, v in params.items() if k in names}
