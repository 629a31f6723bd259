"""What ingest calls for an engine_log source (``entry`` of ``kind.yml``): the files parsed side by side, each
stored in the incident file's order, its start-ups handed to ingest (they become ``capacity``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import duckdb

from kvforensics.config import Incident, Source
from kvforensics.core.db import memory_set_aside, one
from kvforensics.sources.common.load_report import FileLoad, IngestRun, InputFile, forget_file, record
from kvforensics.sources.common.textio import file_digest, printable_raw


@contextmanager
def reading(run: IngestRun, files: list[tuple[Source, Path]]) -> Iterator[None]:
    """The engine log files of the whole ingest parsed side by side while the kinds read file by file are loaded:
    the memory the parses hold outside DuckDB set aside from its limit until the last is stored."""
    reader = EngineLogReader(run.con, run.incident, files, run.digests)
    with memory_set_aside(run.con, reader.memory_held), reader:
        run.state[__name__] = reader
        yield


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    reader: EngineLogReader = run.state[__name__]
    out = []
    for path in files:
        run.on_file(f"{source.name}: {path.name}")
        report, parsed = reader.next_file(source, path)
        run.startups.extend((source, path, s) for s in parsed.startups)
        run.result.assumptions.extend(f"{source.name}: {path.name}: {n}" for n in parsed.all_notes())
        run.result.warnings.extend(f"{source.name}: {path.name}: {w}" for w in parsed.warnings)
        out.append(report)
    return out


class EngineLogReader:
    """Engine log files read side by side: up to one per core (at most four) is parsed at a time, in a
    thread of its own on its own DuckDB cursor, inserting the lines it reads column-wise as it goes
    (sources/engine_logs/columnar.py); :meth:`next_file` then stores the rest of each file in the incident
    file's order (events the parser read, quarantined lines, its load report). A file that fails
    raises when its turn comes; leaving the ``with`` block waits for every parse under way."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        incident: Incident,
        files: list[tuple[Source, Path]],
        digests: Mapping[str, tuple[str, int]] | None,
    ) -> None:
        self.con, self.incident, self.digests = con, incident, digests or {}
        self.todo = list(files)
        self.workers = max(1, min(4, os.cpu_count() or 1, len(files)))
        self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvf-engine-log")
        self.running: dict[tuple[str, Path], tuple[Future, duckdb.DuckDBPyConnection, int | None, bool]] = {}

    @property
    def memory_held(self) -> int:
        """Bytes the parses under way hold outside DuckDB's buffers, at most (set aside from its limit)."""
        from kvforensics.sources.engine_logs.columnar import HELD_PER_FILE

        return self.workers * HELD_PER_FILE if self.todo else 0

    def __enter__(self) -> EngineLogReader:
        self._fill()
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for _, cursor, _, _ in self.running.values():
            cursor.close()

    def _fill(self) -> None:
        while self.todo and len(self.running) < self.workers:
            source, path = self.todo.pop(0)
            year = source.year or self.incident.year
            derived = year is None and source.format in ("vllm", "auto")
            if derived:
                year = _year_for_yearless_stamps(self.con, path)
            forget_file(self.con, source, path)
            cursor = self.con.cursor()
            digest = self.digests.get(str(path.resolve()))
            future = self.pool.submit(parse_engine_log, cursor, source, path, year, digest)
            self.running[(source.name, path)] = (future, cursor, year, derived)

    def next_file(self, source: Source, path: Path) -> tuple[InputFile, Any]:
        """The load report and parse of *path* (the next file of the plan), stored."""
        future, cursor, year, derived = self.running.pop((source.name, path))
        try:
            digest, parsed = future.result()
        finally:
            cursor.close()
            self._fill()
        if derived and any("carry no year" in n for n in parsed.all_notes()):
            parsed.notes.append(
                f"the year {year} was taken from the first gateway request (or the file's "
                f"modification time); set [settings] year or the source's year to override"
            )
        return _store_engine_log(self.con, source, path, digest, parsed), parsed


def parse_engine_log(
    con: duckdb.DuckDBPyConnection, source: Source, path: Path, year: int | None, digest: tuple[str, int] | None
):
    """One engine log file, which may hold several instances (an export of interleaved pods): its
    SHA-256, and its parse, the lines read column-wise already inserted into ``con``'s tables."""
    from kvforensics.sources.engine_logs.columnar import EvidenceSink, parse_engine_file_columnar

    digest = digest or file_digest(path)
    parsed = parse_engine_file_columnar(
        path,
        fmt=source.format,
        instance=lambda labels: source.instance_for(path, labels),
        tz=source.tz,
        year=year,
        clock_offset_s=source.clock_offset_s,
        envelope=source.envelope,
        con=con,
        sink=EvidenceSink(source.name, str(path)),
    )
    return digest, parsed


def _store_engine_log(
    con: duckdb.DuckDBPyConnection, source: Source, path: Path, digest: tuple[str, int], parsed: Any
) -> InputFile:
    """The rest of a parsed engine log: the parser's events and prefill batches, quarantined lines, and
    one load report for the file's physical lines."""
    from kvforensics.sources.engine_logs.columnar import EvidenceSink

    EvidenceSink(source.name, str(path)).store(con, parsed)  # the column-wise rows are in already
    quarantined = parsed.all_quarantined()
    for q in quarantined:
        con.execute(
            "INSERT INTO quarantine VALUES ($s, $f, $l, $r, $raw)",
            {"s": source.name, "f": str(path), "l": q.line, "r": q.reason, "raw": printable_raw(q.raw)},
        ).fetchall()
    notes = parsed.all_notes()
    if not parsed.startups:
        notes.append("no engine start-up found: this file gives no KV pool size")
    load = FileLoad(
        file=path,
        records_read=parsed.lines_read,
        loaded=parsed.lines_read - len(quarantined),
        quarantined=len(quarantined),
        notes=notes,
    )
    return record(con, source, path, digest, load)


def _year_for_yearless_stamps(con: duckdb.DuckDBPyConnection, path: Path) -> int:
    """vLLM stamps carry no year: the first request's year, else the file's modification year."""
    first = one(con, "SELECT min(ts) FROM requests")[0]
    if first is not None:
        return int(first.year)
    return datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc).year
