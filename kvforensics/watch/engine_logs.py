"""Engine logs as they grow: start-ups, per-request events and prefill batches of each increment.

An engine parser reads a log from a start-up's first line on: a per-request line means little without the
start-up it belongs to. So each increment is parsed after a *prelude*: the lines of the start-up in force
(its first line up to the last line a field of it came from: server arguments, KV pool, context length,
role, version). The parse of prelude and increment gives that start-up again, now with how far its log goes
(last line, last time, its shutdown), any start-up the increment begins, and the increment's own events,
prefill batches and quarantined lines, which go to the evidence tables with the file's line numbers. What the
prelude's lines give again is dropped. A start-up's fields stay as first read whole; a later parse only adds
what the earlier one lacked (a KV pool logged after the server arguments) and how far its log goes.

This is what ``watch`` knows while it runs; when it stops, the engine logs are read again whole by the batch
ingest (they are small), so the evidence is a batch run's to the byte.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from kvforensics.config import Incident, Source
from kvforensics.core.db import one
from kvforensics.sources.common.textio import printable_raw
from kvforensics.sources.engine_logs.columnar import EvidenceSink, parse_engine_file_columnar
from kvforensics.sources.engine_logs.contract import EngineFileParse, EngineLogParse, StartupRecord
from kvforensics.sources.engine_logs.parse import parse_engine_file
from kvforensics.watch.follow import Follower, Increment
from kvforensics.watch.intake import Counts, Pieces

COLUMNAR_LINES = 2_000  # a piece of this many lines or more is read column-wise
PARSERS = 2  # increments parsed at once
PRELUDE_LINES = 20_000  # at most this many lines of a start-up are kept to parse the next increment after
# how far a start-up's log goes: taken from the latest parse; every other field as first read
_LIFE = ("last_line", "last_ts", "shutdown_line", "shutdown_ts", "shutdown_reason")


@dataclass
class EngineFile:
    """One followed engine log: its start-ups so far (by first line) and the prelude of the next increment."""

    source: Source
    path: Path
    year: int | None
    prelude: list[tuple[int, bytes]] = field(default_factory=list)  # (line number, its bytes)
    startups: dict[int, StartupRecord] = field(default_factory=dict)


@dataclass
class EngineRead:
    """What the increments of a poll brought: request ids of new engine events, and whether start-ups changed."""

    request_ids: set[str] = field(default_factory=set)
    startups_changed: bool = False  # a start-up began, or one's fields or shutdown changed
    lives_changed: bool = False  # only how far a start-up's log goes (its last line and time)


class EngineLogs:
    """Every followed engine log of an investigation."""

    def __init__(self, con: duckdb.DuckDBPyConnection, incident: Incident, root: Path) -> None:
        self.con, self.incident, self.root = con, incident, root
        self.files: dict[str, EngineFile] = {}

    def startups(self) -> list[tuple[Source, Path, StartupRecord]]:
        """Every start-up read so far, with its source and file, as the ingest places them."""
        return [(f.source, f.path, s) for f in self.files.values() for s in f.startups.values()]

    def rename(self, old: str, new: str) -> None:
        """A followed log renamed (rotated): its start-ups and prelude go with it, under its new name."""
        f = self.files.pop(old, None)
        if f is not None:
            f.path = Path(new)
            self.files[new] = f

    def read(
        self,
        jobs: list[tuple[Source, Increment]],
        counts: dict[str, Counts],
        out: EngineRead,
        meanwhile: Callable[[], None] = lambda: None,
    ) -> None:
        """Parse the increments (side by side, in threads, while *meanwhile* runs: the parse is mostly Arrow and
        DuckDB work), then store them in order. Several increments of one file (a last line read as watch
        stops) are parsed one after the other, each after the prelude the one before it leaves."""
        pieces = Pieces(self.root / "engine")
        for source, inc in jobs:
            self._file(source, inc.path)  # here, not in a thread: a vLLM log's year may be read from the evidence
        try:
            files = [str(inc.path) for _, inc in jobs]
            if len(set(files)) < len(files):
                meanwhile()
                for source, inc in jobs:
                    self._store(self._parse(source, inc, pieces), counts[source.name], out)
                return
            with ThreadPoolExecutor(
                max_workers=min(PARSERS, max(1, len(jobs))), thread_name_prefix="kvf-watch-engine"
            ) as pool:
                futures = [pool.submit(self._parse, source, inc, pieces) for source, inc in jobs]
                meanwhile()
                for (source, _), future in zip(jobs, futures, strict=True):
                    self._store(future.result(), counts[source.name], out)
        finally:
            pieces.remove()

    def _file(self, source: Source, path: Path) -> EngineFile:
        f = self.files.get(str(path))
        if f is None or f.source.name != source.name:
            year = source.year or self.incident.year
            if year is None and source.format in ("vllm", "auto"):  # vLLM stamps carry no year
                first = one(self.con, "SELECT min(ts) FROM requests")[0]
                year = first.year if first is not None else datetime.now(timezone.utc).year
            f = EngineFile(source, path, year)
            self.files[str(path)] = f
        return f

    def _parse(self, source: Source, inc: Increment, pieces: Pieces) -> _Parsed:
        f = self._file(source, inc.path)
        prelude = f.prelude
        piece = pieces.write(inc, b"".join(raw + b"\n" for _, raw in prelude))
        # a small piece through the parser alone: the column-wise reader pays for its set-up on every piece
        parse = parse_engine_file_columnar if inc.lines >= COLUMNAR_LINES else parse_engine_file
        parsed = parse(
            piece,
            fmt=source.format,
            instance=lambda labels: source.instance_for(f.path, labels),
            tz=source.tz,
            year=f.year,
            clock_offset_s=source.clock_offset_s,
            envelope=source.envelope,
        )
        return _Parsed(f, inc, prelude, parsed)

    def _store(self, job: _Parsed, counts: Counts, out: EngineRead) -> None:
        f, inc, prelude, parsed = job.file, job.increment, job.prelude, job.parsed
        lead = len(prelude)

        def line_of(n: int | None) -> int | None:
            """A line of the piece as the followed file numbers it."""
            if n is None:
                return None
            return prelude[n - 1][0] if n <= lead else inc.first_line + n - lead - 1

        events, batches = (_own_rows(t, lead, inc.first_line) for t in (parsed.event_table(), parsed.batch_table()))
        EvidenceSink(f.source.name, str(f.path)).store(
            self.con,
            EngineFileParse(
                envelope=parsed.envelope, instances={"": EngineLogParse(event_tables=[events], batch_tables=[batches])}
            ),
        )
        out.request_ids.update(r for r in events.column("request_id").to_pylist() if r is not None)
        quarantined = [q for q in parsed.all_quarantined() if q.line > lead]
        if quarantined:
            self.con.executemany(
                "INSERT INTO quarantine VALUES (?, ?, ?, ?, ?)",
                [(f.source.name, str(f.path), line_of(q.line), q.reason, printable_raw(q.raw)) for q in quarantined],
            )
        counts.read += inc.lines
        counts.quarantined += len(quarantined)
        for s in parsed.startups:
            s = _renumbered(s, line_of)
            old = f.startups.get(s.line)
            merged = s if old is None else _merged(old, s)
            if merged == old:
                continue
            f.startups[s.line] = merged
            if (
                old is None
                or merged.shutdown_line != old.shutdown_line
                or any(getattr(merged, k.name) != getattr(old, k.name) for k in fields(merged) if k.name not in _LIFE)
            ):
                out.startups_changed = True
            else:
                out.lives_changed = True
        f.prelude = _prelude(f, prelude, inc)
        Follower.commit(inc)


@dataclass(frozen=True)
class _Parsed:
    file: EngineFile
    increment: Increment
    prelude: list[tuple[int, bytes]]
    parsed: EngineFileParse


def _own_rows(table: pa.Table, lead: int, first_line: int) -> pa.Table:
    """The rows of the increment's own lines (not the prelude's), numbered as in the followed file."""
    line = table.column("line")
    own = table.filter(pc.greater(line, lead))
    i = own.schema.get_field_index("line")
    return own.set_column(i, "line", pc.add(own.column("line"), first_line - lead - 1))


def _renumbered(s: StartupRecord, line_of) -> StartupRecord:
    return replace(
        s,
        line=line_of(s.line),
        pool_source_line=line_of(s.pool_source_line),
        last_line=line_of(s.last_line),
        shutdown_line=line_of(s.shutdown_line),
        evidence={k: line_of(v) for k, v in s.evidence.items()},
    )


def _merged(old: StartupRecord, new: StartupRecord) -> StartupRecord:
    """*old* as first read, with what it lacked from *new* and how far its log goes now."""
    filled: dict[str, Any] = {
        k.name: getattr(new, k.name) for k in fields(old) if getattr(old, k.name) is None and k.name not in _LIFE
    }
    life = {k: getattr(new, k) for k in _LIFE if getattr(new, k) is not None}
    return replace(old, **filled, **life, flags={**new.flags, **old.flags}, evidence={**new.evidence, **old.evidence})


def _prelude(f: EngineFile, prelude: list[tuple[int, bytes]], inc: Increment) -> list[tuple[int, bytes]]:
    """The lines of the start-ups in force, one per instance of the file (its last): from each one's first line
    to the last line a field of it came from, of those read (the prelude and the increment)."""
    last: dict[str, StartupRecord] = {}
    for s in f.startups.values():
        if s.instance not in last or s.line > last[s.instance].line:
            last[s.instance] = s
    spans = [(s.line, max([s.line, s.pool_source_line or 0, *s.evidence.values()])) for s in last.values()]
    if not spans:
        return []
    lines = dict(prelude)
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if hi >= inc.first_line and lo < inc.first_line + inc.lines:
        for i, raw in enumerate(inc.data.split(b"\n")[: inc.lines]):
            n = inc.first_line + i
            if lo <= n <= hi:
                lines[n] = raw
    kept = sorted((n, raw) for n, raw in lines.items() if any(a <= n <= b for a, b in spans))
    return kept[:PRELUDE_LINES]
