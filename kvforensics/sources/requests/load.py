"""Gateway request logs (JSONL, CSV, Parquet) into the canonical ``requests`` table.

Each file is read by the reader of its format (``sources/requests/readers.py``) into a staged
relation of text fields (one row per record, with its line number and the raw record), then typed
and validated in SQL (``sources/requests/typed.py``, ``sql/requests_typed.sql``). A batch of typed
files is then merged here: good rows go to ``requests``; every other record goes to ``quarantine``
with the reason it was refused, duplicates are counted and conflicting duplicates quarantined.
Column names are mapped by the incident file; OpenTelemetry GenAI and SGLang ``meta_info`` names
are recognised without a mapping (SGLang's seconds-valued latencies are converted to milliseconds,
and without a status column the status is derived from ``finish_reason``). SGLang's own
``--log-requests`` output is read by ``sources/requests/sglang.py`` into the same staging table, also
when it is given as ``jsonl`` (recognised by its ``"event": "request.*"`` records).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Mapping

import duckdb

from kvforensics.config import Source
from kvforensics.core.db import one, run_script
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import cut_note, cut_short
from kvforensics.sources.requests import otlp
from kvforensics.sources.requests import sglang as sglang_requests
from kvforensics.sources.requests.readers import STAGERS
from kvforensics.sources.requests.typed import (
    dst_days,
    mapped_relation,
    new_batch,
    parameters_for,
    type_file_on_cursor,
)

__all__ = ["FileLoad", "dst_days", "load_requests_file", "load_requests_files"]

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
CONFLICT = "duplicate request_id with conflicting values%"


def load_requests_file(
    con: duckdb.DuckDBPyConnection, source: Source, path: Path, *, tick: Callable[[int], None] = lambda n: None
) -> FileLoad:
    """Stage, type, validate and load one requests file; quarantine what cannot be loaded."""
    (load,) = load_requests_files(con, source, [path], tick=tick)
    return load


def load_requests_files(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    paths: Iterable[Path],
    *,
    tick: Callable[[int], None] = lambda n: None,
    on_file: Callable[[Path], None] = lambda path: None,
    on_merged: Callable[[FileLoad], None] = lambda load: None,
    model_aliases: Mapping[str, str] | None = None,
    growing: bool = False,
) -> list[FileLoad]:
    """Load the files of one source, in order: each file is read and typed (one streaming pass where
    DuckDB can read it), then a batch of files is merged into ``requests`` at once: duplicates
    resolved against everything loaded before, conflicts and refused records quarantined.
    ``on_merged`` is called for every file of a batch inside the batch's transaction (the ingest
    records its load report there), so a batch lands whole or not at all. ``model_aliases`` (the
    incident's ``[models] aliases``: engine model name -> gateway model id) rename the models of
    request logs written by an engine, which name models the engine's way. ``growing``: the files are pieces of
    files still being written (``kvforensics watch``), whose last line may be one not yet finished: it is not
    taken for the mark of a file cut short."""
    loads: list[FileLoad] = []
    batch: list[tuple[int, FileLoad, Path, bool]] = []
    rows = 0
    pending = iter(paths)
    workers = _typing_workers(con)
    # files being typed, in load order; a new one starts as soon as one is done (no lockstep rounds)
    in_flight: deque[tuple[int, Path, Future[tuple[FileLoad, bool]]]] = deque()
    numbered = 0  # files of the current batch handed to the typing cursors
    batch_rows = MERGE_ROWS or _batch_rows(con)
    new_batch(con)

    def finish() -> None:
        nonlocal rows
        file_no, path, future = in_flight.popleft()
        load, fast = future.result()
        if model_aliases and load.format in (sglang_requests.FORMAT, otlp.FORMAT):  # as read, not as declared
            _apply_model_aliases(con, file_no, model_aliases, load)
        con.execute("INSERT INTO kvf_batch.load_files VALUES ($n, $f)", {"n": file_no, "f": str(path)}).fetchall()
        batch.append((file_no, load, path, fast))
        loads.append(load)
        rows += load.records_read

    with ThreadPoolExecutor(max_workers=workers) as pool:
        while True:
            while len(in_flight) < workers and (path := next(pending, None)) is not None:
                on_file(path)
                in_flight.append((numbered, path, pool.submit(type_file_on_cursor, con, source, path, numbered, tick)))
                numbered += 1
            if not in_flight:
                break
            finish()
            if rows >= batch_rows:
                while in_flight:  # files already being typed belong to this batch
                    finish()
                _merge_batch(con, source, batch, on_merged, growing)
                batch, rows, numbered = [], 0, 0
                new_batch(con)
    if batch:
        _merge_batch(con, source, batch, on_merged, growing)
    if not KEEP_BATCH_TABLES:
        for name in ("kvf_batch.typed_all", "kvf_batch.load_files", "repeated_ids", "repeated", "merge_counts"):
            con.execute(f"DROP TABLE IF EXISTS {name}").fetchall()
    return loads


def _apply_model_aliases(
    con: duckdb.DuckDBPyConnection, file_no: int, aliases: Mapping[str, str], load: FileLoad
) -> None:
    """Engine model names -> gateway model ids (exact name first, else case-insensitive), before the
    merge, so the records compare with the gateway's own and match the capacity of their model."""
    exact = list(aliases.items())
    lowered = {k.lower(): v for k, v in reversed(exact)}
    con.execute("CREATE OR REPLACE TEMP TABLE alias_map (engine VARCHAR, gateway VARCHAR, exact BOOLEAN)").fetchall()
    con.executemany(
        "INSERT INTO alias_map VALUES (?, ?, ?)",
        [(k, v, True) for k, v in exact] + [(k, v, False) for k, v in lowered.items()],
    )
    renamed = con.execute(
        """
        UPDATE kvf_batch.typed_all AS t SET model = m.gateway
        FROM (SELECT DISTINCT ON (t2.model) t2.model AS engine, a.gateway
              FROM (SELECT DISTINCT model FROM kvf_batch.typed_all WHERE file_no = $n) t2
              JOIN alias_map a ON (a.exact AND a.engine = t2.model) OR (NOT a.exact AND a.engine = lower(t2.model))
              ORDER BY t2.model, a.exact DESC) m
        WHERE t.file_no = $n AND t.model = m.engine AND t.model <> m.gateway""",
        {"n": file_no},
    ).fetchall()
    con.execute("DROP TABLE alias_map").fetchall()
    if renamed and renamed[0][0]:
        load.notes.append(
            f"{renamed[0][0]} record(s) named the model the engine's way; renamed to the gateway's "
            "model id through [models] aliases"
        )


_SIZE_UNITS = {
    "bytes": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


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


def _merge_batch(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    batch: list[tuple[int, FileLoad, Path, bool]],
    on_merged: Callable[[FileLoad], None],
    growing: bool = False,
) -> None:
    con.begin()
    try:
        run_script(con, "requests_merge", {"source": source.name})
        counts = {
            r[0]: r[1:]
            for r in con.execute(
                "SELECT file_no, records_read, loaded, quarantined, duplicates, naive FROM merge_counts"
            ).fetchall()
        }
        for file_no, load, _, _ in batch:
            read, loaded, quarantined, duplicates, naive = counts[file_no]
            if read != load.records_read:
                raise RuntimeError(f"{load.file}: {read} typed records, {load.records_read} counted")
            load.loaded, load.quarantined, load.duplicates = loaded, quarantined, duplicates
            if naive:
                load.notes.append(f"{naive} timestamp(s) without offset read as {source.timezone}")
        conflicted = {
            r[0] for r in con.execute("SELECT DISTINCT file_no FROM repeated WHERE outcome = 'conflict'").fetchall()
        }
        for file_no, _, path, fast in batch:
            if file_no in conflicted:
                _fill_conflict_raw(con, source, path, fast)
        for _, load, path, _ in batch:
            if not growing:
                _note_cut_last_record(con, source, path, load)
            on_merged(load)
        con.commit()
    except BaseException:
        con.rollback()
        raise


def _note_cut_last_record(con: duckdb.DuckDBPyConnection, source: Source, path: Path, load: FileLoad) -> None:
    """A JSONL file whose last record is malformed JSON that stops before the record does was cut there (a copy
    stopped mid-file, then compressed whole): its load says it ends early, as a stream that ends early does. The
    kept raw text (its first 2,000 characters) is judged only when it is the whole line."""
    if load.format not in ("", "jsonl") or any("ends early" in n for n in load.notes):
        return
    rows = con.execute(
        """SELECT line, raw FROM quarantine
           WHERE source = $s AND file = $f AND reason = 'malformed JSON' AND length(raw) < 2000
             AND line = (SELECT max(line) FROM (
                 SELECT max(line) AS line FROM quarantine WHERE source = $s AND file = $f
                 UNION ALL SELECT max(source_line) FROM requests WHERE source = $s AND source_file = $f))""",
        {"s": source.name, "f": str(path)},
    ).fetchall()
    if rows and rows[0][1] is not None and cut_short(rows[0][1]):
        load.notes.append(cut_note(rows[0][0]))


def _fill_conflict_raw(con: duckdb.DuckDBPyConnection, source: Source, path: Path, fast: bool) -> None:
    """The raw text of a file's conflicting duplicates, read again from the file (rare: the typing
    pass keeps raw text only for the records it refuses). A record is found by its line and, where
    a line may hold several records (the spans of one OTLP export), by its request id as typed;
    conflicts of one line that read the same are paired with its records one to one."""
    staged = STAGERS[source.format](con, source, path, FileLoad(file=path), lambda n: None, fast)
    if staged.raw_relation is not None:  # one record a line (JSONL, Parquet): the line tells it
        relation, params, same_record = staged.raw_relation, dict(staged.params), "r.line = c.line"
    else:
        mapped, params = mapped_relation(source, staged)
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
    con.execute(
        query, parameters_for(query, {**params, "source": source.name, "path": str(path), "conflict": CONFLICT})
    ).fetchall()
