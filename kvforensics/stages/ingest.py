"""Ingest: every input of the incident file into the evidence database, nothing lost.

For every file: its SHA-256, records read, loaded, quarantined and duplicates go to ``load_report``;
every refused record goes to ``quarantine`` with file, line and reason. Request files already
loaded (same source, same SHA-256) are skipped, so re-running ingest is idempotent (a run killed
half-way resumes) and, with ``--append``, adding a new day's files loads only what is new (any other
change to the inputs rebuilds the evidence: kvforensics/evidence/evidence_set.py). Engine logs, changes and
content are small and re-read whole.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import duckdb
import pyarrow as pa

from kvforensics.config import Incident, Source
from kvforensics.core.db import memory_set_aside, one, run_script
from kvforensics.core.errors import InputError, StrictModeError
from kvforensics.core.fingerprint import key_for
from kvforensics.stages.instances import (
    PlacedStartup,
    lifetimes,
    match_instance_names,
    role_carried_over,
    roles_carried_over,
)
from kvforensics.sources.changes.load import load_changes
from kvforensics.sources.content.load import load_content
from kvforensics.sources.kv_events.load import Chains, load_kv_events
from kvforensics.sources.content.prefix_blocks import block_size
from kvforensics.sources.requests.load import FileLoad, load_requests_files
from kvforensics.sources.common.textio import file_digest, printable_raw


@dataclass(frozen=True)
class InputFile:
    source: str
    kind: str
    file: str
    sha256: str
    bytes: int
    records_read: int
    loaded: int
    quarantined: int
    duplicates: int
    notes: tuple[str, ...]


@dataclass
class IngestResult:
    files: list[InputFile] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def records_read(self) -> int:
        return sum(f.records_read for f in self.files)

    @property
    def quarantined(self) -> int:
        return sum(f.quarantined for f in self.files)


Tick = Callable[[int], None]


def ingest(con: duckdb.DuckDBPyConnection, incident: Incident, *, strict: bool = False,
           tick: Tick = lambda n: None, on_file: Callable[[str], None] = lambda name: None,
           digests: Mapping[str, tuple[str, int]] | None = None) -> IngestResult:
    """Load every source of the incident into ``con``. *digests*: (SHA-256, bytes) of input files by
    absolute path, already taken (kvforensics.evidence.evidence_set), so that they are not hashed again."""
    result = IngestResult()
    plan = incident.source_files()  # a file two sources name is refused before anything is read
    for source, files in plan:
        if not files:
            raise InputError(f"no file matches path '{source.path}' (looked in {source.base_dir}); "
                             f"check the path, which is relative to the incident file",
                             location=f"source '{source.name}'")
        if source.timezone != "UTC" or source.clock_offset_s:
            result.assumptions.append(
                f"source '{source.name}': timestamps without an offset read as {source.timezone}"
                + (f", clock offset {source.clock_offset_s:+g} s applied" if source.clock_offset_s else ""))
    # Requests first: engine model names are matched against the gateway's model ids.
    restore_gateway_values(con)
    for source, files in plan:
        if source.kind == "requests":
            result.files.extend(_ingest_requests_files(con, source, files, tick, on_file, incident.model_aliases,
                                                       digests or {}))
    con.execute("DELETE FROM capacity").fetchall()
    con.execute("DELETE FROM engine_events").fetchall()
    con.execute("DELETE FROM prefill_batches").fetchall()
    con.execute("DELETE FROM changes").fetchall()
    con.execute("DELETE FROM content_fingerprints").fetchall()
    con.execute("DELETE FROM content_stats").fetchall()
    con.execute("DELETE FROM request_blocks").fetchall()
    con.execute("DELETE FROM kv_events").fetchall()
    con.execute("DELETE FROM kv_event_messages").fetchall()
    chains = Chains()  # KV-event chains continue across files
    startups: list[tuple[Source, Path, Any]] = []
    engine_logs = [(source, path) for source, files in plan if source.kind == "engine_log" for path in files]
    reader = _EngineLogReader(con, incident, engine_logs, digests)
    with memory_set_aside(con, reader.memory_held), reader:
        # content last: its prompts are cut into blocks of the size the KV events and start-ups show
        for source, files in [p for p in plan if p[0].kind not in ("requests", "content")]:
            for path in files:
                on_file(f"{source.name}: {path.name}")
                if source.kind == "engine_log":
                    record, parsed = reader.next_file(source, path)
                    startups.extend((source, path, s) for s in parsed.startups)
                    result.assumptions.extend(f"{source.name}: {path.name}: {n}" for n in parsed.all_notes())
                    result.warnings.extend(f"{source.name}: {path.name}: {w}" for w in parsed.warnings)
                    result.files.append(record)
                    continue
                _forget_file(con, source, path)
                if source.kind == "changes":
                    record = _record(con, source, path, _digest(path, digests), load_changes(con, source, path))
                elif source.kind == "kv_events":
                    record = _record(con, source, path, _digest(path, digests),
                                     load_kv_events(con, source, path, key_for(incident.id), chains))
                result.files.append(record)
    _find_kv_event_gaps(con, result)
    _build_capacity(con, incident, startups, result)
    size = block_size(con, incident.prefix_block_size)
    for source, files in [p for p in plan if p[0].kind == "content"]:
        for path in files:
            on_file(f"{source.name}: {path.name}")
            _forget_file(con, source, path)
            result.files.append(_record(con, source, path, _digest(path, digests),
                                        load_content(con, source, path, key_for(incident.id), size,
                                                     incident.prefix_word_blocks, incident.winnow_window)))
    _match_instance_names(con, incident, result)
    _fill_cached_tokens(con, result)
    _check_models(con, result)
    _write_account_patterns(con, incident)
    con.execute("DELETE FROM ingest_notes").fetchall()
    for kind, notes in (("warning", result.warnings), ("assumption", result.assumptions)):
        for note in notes:
            con.execute("INSERT INTO ingest_notes VALUES ($k, $n)", {"k": kind, "n": note}).fetchall()
    if strict:
        _enforce_strict(con, result)
    return result


def restore_gateway_values(con: duckdb.DuckDBPyConnection) -> None:
    """Records loaded before get the gateway's own values back (its instance names, its cached_tokens where the
    engines filled them in), so that re-delivered ones compare equal with them: before request files are merged."""
    if one(con, "SELECT count(*) FROM instance_names WHERE engine_instance <> gateway_name")[0]:
        run_script(con, "instance_restore")
    # cached_tokens the engines filled in (sql/cached_tokens.sql) go back to the gateway's own value
    con.execute("UPDATE requests SET cached_tokens = NULL, cached_tokens_source = NULL "
                "WHERE cached_tokens_source IN ('engine_request', 'engine_batch')").fetchall()


def place_startups(con: duckdb.DuckDBPyConnection, incident: Incident,
                   startups: list[tuple[Source, Path, Any]]) -> IngestResult:
    """``capacity`` rebuilt from *startups* ((source, file, StartupRecord)) and the gateway's instance names
    matched to the engine instances: what the ingest derives from the engine logs, for a caller that reads them
    itself, increment by increment (``kvforensics watch``). Its warnings and assumptions are in the result."""
    result = IngestResult()
    restore_gateway_values(con)
    con.execute("DELETE FROM capacity").fetchall()
    _build_capacity(con, incident, startups, result)
    _match_instance_names(con, incident, result)
    return result


def _digest(path: Path, known: Mapping[str, tuple[str, int]] | None) -> tuple[str, int]:
    return (known or {}).get(str(path.resolve())) or file_digest(path)


def _forget_file(con: duckdb.DuckDBPyConnection, source: Source, path: Path) -> None:
    params = {"s": source.name, "f": str(path)}
    con.execute("DELETE FROM load_report WHERE source = $s AND file = $f", params).fetchall()
    con.execute("DELETE FROM quarantine WHERE source = $s AND file = $f", params).fetchall()


def _record(con: duckdb.DuckDBPyConnection, source: Source, path: Path, digest: tuple[str, int],
            load: FileLoad) -> InputFile:
    rec = InputFile(source=source.name, kind=source.kind, file=str(path), sha256=digest[0], bytes=digest[1],
                    records_read=load.records_read, loaded=load.loaded, quarantined=load.quarantined,
                    duplicates=load.duplicates, notes=tuple(load.notes))
    con.execute("INSERT INTO load_report VALUES ($source, $kind, $file, $sha, $bytes, $read, $loaded, $q, $d, $notes)",
                {"source": rec.source, "kind": rec.kind, "file": rec.file, "sha": rec.sha256, "bytes": rec.bytes,
                 "read": rec.records_read, "loaded": rec.loaded, "q": rec.quarantined, "d": rec.duplicates,
                 "notes": "; ".join(rec.notes) or None}).fetchall()
    return rec


def _ingest_requests_files(con: duckdb.DuckDBPyConnection, source: Source, files: list[Path], tick: Tick,
                           on_file: Callable[[str], None], aliases: Mapping[str, str],
                           known: Mapping[str, tuple[str, int]]) -> list[InputFile]:
    """Load the source's files that are new (by SHA-256; a file loaded before is reported, not read
    again), each file's load report written in the same transaction as its records."""
    records: dict[Path, InputFile] = {}
    digests: dict[Path, tuple[str, int]] = {}
    todo: list[Path] = []
    for path in files:
        digest = known.get(str(path.resolve())) or file_digest(path)
        seen = con.execute("SELECT records_read, loaded, quarantined, duplicates, notes FROM load_report "
                           "WHERE source = $s AND sha256 = $h", {"s": source.name, "h": digest[0]}).fetchall()
        if seen:
            r = seen[0]
            records[path] = InputFile(source=source.name, kind=source.kind, file=str(path), sha256=digest[0],
                                      bytes=digest[1], records_read=r[0], loaded=r[1], quarantined=r[2],
                                      duplicates=r[3],
                                      notes=tuple(filter(None, [r[4], "already loaded (same SHA-256): not read again"])))
        elif digest[1] == 0:
            records[path] = _record(con, source, path, digest, FileLoad(file=path, notes=["empty file"]))
        else:
            digests[path] = digest
            todo.append(path)

    def merged(load: FileLoad) -> None:
        if load.records_read == 0 and not load.notes:
            load.notes.append("empty file")
        records[load.file] = _record(con, source, load.file, digests[load.file], load)

    load_requests_files(con, source, todo, tick=tick, on_file=lambda p: on_file(f"{source.name}: {p.name}"),
                        on_merged=merged, model_aliases=aliases)
    return [records[path] for path in files]


class _EngineLogReader:
    """Engine log files read side by side: up to one per core (at most four) is parsed at a time, in a
    thread of its own on its own DuckDB cursor, inserting the lines it reads column-wise as it goes
    (sources/engine_logs/columnar.py); :meth:`next_file` then stores the rest of each file in the incident
    file's order (events the parser read, quarantined lines, its load report). A file that fails
    raises when its turn comes; leaving the ``with`` block waits for every parse under way."""

    def __init__(self, con: duckdb.DuckDBPyConnection, incident: Incident, files: list[tuple[Source, Path]],
                 digests: Mapping[str, tuple[str, int]] | None) -> None:
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

    def __enter__(self) -> _EngineLogReader:
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
            _forget_file(self.con, source, path)
            cursor = self.con.cursor()
            digest = self.digests.get(str(path.resolve()))
            future = self.pool.submit(_parse_engine_log, cursor, source, path, year, digest)
            self.running[(source.name, path)] = (future, cursor, year, derived)

    def next_file(self, source: Source, path: Path):
        """The load report and parse of *path* (the next file of the plan), stored."""
        future, cursor, year, derived = self.running.pop((source.name, path))
        try:
            digest, parsed = future.result()
        finally:
            cursor.close()
            self._fill()
        if derived and any("carry no year" in n for n in parsed.all_notes()):
            parsed.notes.append(f"the year {year} was taken from the first gateway request (or the file's "
                                f"modification time); set [settings] year or the source's year to override")
        return _store_engine_log(self.con, source, path, digest, parsed), parsed


def _parse_engine_log(con: duckdb.DuckDBPyConnection, source: Source, path: Path, year: int | None,
                      digest: tuple[str, int] | None):
    """One engine log file, which may hold several instances (an export of interleaved pods): its
    SHA-256, and its parse, the lines read column-wise already inserted into ``con``'s tables."""
    from kvforensics.sources.engine_logs.columnar import EvidenceSink, parse_engine_file_columnar

    digest = digest or file_digest(path)
    parsed = parse_engine_file_columnar(
        path, fmt=source.format, instance=lambda labels: source.instance_for(path, labels), tz=source.tz,
        year=year, clock_offset_s=source.clock_offset_s, envelope=source.envelope, con=con,
        sink=EvidenceSink(source.name, str(path)))
    return digest, parsed


def _store_engine_log(con: duckdb.DuckDBPyConnection, source: Source, path: Path, digest: tuple[str, int],
                      parsed) -> InputFile:
    """The rest of a parsed engine log: the parser's events and prefill batches, quarantined lines, and
    one load report for the file's physical lines."""
    from kvforensics.sources.engine_logs.columnar import EvidenceSink

    EvidenceSink(source.name, str(path)).store(con, parsed)  # the column-wise rows are in already
    quarantined = parsed.all_quarantined()
    for q in quarantined:
        con.execute("INSERT INTO quarantine VALUES ($s, $f, $l, $r, $raw)",
                    {"s": source.name, "f": str(path), "l": q.line, "r": q.reason,
                     "raw": printable_raw(q.raw)}).fetchall()
    notes = parsed.all_notes()
    if not parsed.startups:
        notes.append("no engine start-up found: this file gives no KV pool size")
    load = FileLoad(file=path, records_read=parsed.lines_read, loaded=parsed.lines_read - len(quarantined),
                    quarantined=len(quarantined), notes=notes)
    return _record(con, source, path, digest, load)


def _year_for_yearless_stamps(con: duckdb.DuckDBPyConnection, path: Path) -> int:
    """vLLM stamps carry no year: the first request's year, else the file's modification year."""
    first = one(con, "SELECT min(ts) FROM requests")[0]
    if first is not None:
        return int(first.year)
    return datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc).year


def resolve_model(engine_model: str | None, source: Source, aliases: dict[str, str],
                  gateway_models: list[str]) -> tuple[str | None, str]:
    """The gateway model id an engine serves, and how we know."""
    if source.model:
        return source.model, "source model setting"
    if engine_model is None:
        return None, "engine log names no model"
    if engine_model in aliases:
        return aliases[engine_model], "alias"
    lowered = {k.lower(): v for k, v in aliases.items()}
    if engine_model.lower() in lowered:
        return lowered[engine_model.lower()], "alias"
    for g in gateway_models:
        if g.lower() == engine_model.lower():
            return g, "same name"
    suffix_hits = [g for g in gateway_models if g.lower().endswith("/" + engine_model.lower())]
    if len(suffix_hits) == 1:
        return suffix_hits[0], "name suffix"
    return engine_model, "unmatched"


def _build_capacity(con: duckdb.DuckDBPyConnection, incident: Incident, startups: list, result: IngestResult) -> None:
    """One capacity row per start-up, in force from its first line until it ended (kvforensics/stages/instances.py)."""
    gateway_models = [r[0] for r in con.execute("SELECT DISTINCT model FROM requests ORDER BY 1").fetchall()]
    items = sorted(startups, key=lambda it: (it[2].instance, it[2].ts is None,
                                             it[2].ts or datetime.min.replace(tzinfo=timezone.utc),
                                             str(it[1]), it[2].line))
    models = []
    for source, path, s in items:
        model, how = resolve_model(s.model, source, dict(incident.model_aliases), gateway_models)
        models.append(model)
        if how == "unmatched":
            result.warnings.append(
                f"engine instance '{s.instance}' serves '{s.model}', which matches no gateway model id; "
                f"add it to [models] aliases in the incident file")
        if s.ts is None:
            result.warnings.append(f"engine instance '{s.instance}': start-up at {path.name}:{s.line} has no "
                                   f"timestamp; its pool cannot be placed in time")
    placed = [PlacedStartup(instance=s.instance, role=s.role, model=model, ts=s.ts, file=str(path), line=s.line,
                            last_ts=s.last_ts, last_line=s.last_line, shutdown_ts=s.shutdown_ts,
                            shutdown_line=s.shutdown_line)
              for (_source, path, s), model in zip(items, models, strict=True)]
    ends = lifetimes(placed, incident.instances.handover_s)
    carried = roles_carried_over(placed)
    rows = []
    for (source, path, s), model, end, prev in zip(items, models, ends, carried, strict=True):
        role, flags = s.role, dict(s.flags)
        if prev is not None:  # a restart that logged no server_args keeps its role, as the audit says
            _, prev_path, prev_rec = items[prev]
            role = prev_rec.role
            flags["role_source"] = role_carried_over(prev_path.name, prev_rec.line)
            if s.model is None and models[prev] is not None:
                model, flags["model_source"] = models[prev], flags["role_source"]
        if end.end_reason == "log_end":
            result.assumptions.append(
                f"engine instance '{s.instance}': its log ends at {path.name}:{end.end_line} and "
                f"'{end.successor}' took over ({model}, {s.role}): retired from {end.valid_to:%Y-%m-%d %H:%M:%S}Z")
        rows.append({
            "instance": s.instance, "role": role, "model": model, "engine_model": s.model,
            "valid_from": s.ts, "valid_to": end.valid_to, "kv_pool_tokens": s.kv_pool_tokens,
            "context_length": s.context_length, "page_size": s.page_size, "engine": s.engine,
            "engine_version": s.engine_version, "version_source": s.version_source,
            "tp_size": s.tp_size, "dp_size": s.dp_size, "flags": json.dumps(flags, sort_keys=True),
            "startup_refused": str(flags.get("startup_refused", "")).lower() == "true",
            "source": source.name, "source_file": str(path), "source_line": s.line,
            "pool_source_line": s.pool_source_line, "end_reason": end.end_reason, "end_ts": end.end_ts,
            "end_file": end.end_file, "end_line": end.end_line, "successor": end.successor,
            "last_ts": s.last_ts, "last_line": s.last_line,
        })
    if not rows:
        result.warnings.append("no engine start-up found in any engine log: KV pool sizes are unknown, "
                               "so the pool rule cannot judge any request")
        return
    ts_type = pa.timestamp("us", tz="UTC")
    table = pa.table({
        k: (pa.array([r[k] for r in rows], type=ts_type) if k in ("valid_from", "valid_to", "end_ts", "last_ts")
            else pa.array([r[k] for r in rows], type=pa.int64()) if k in (
                "kv_pool_tokens", "context_length", "page_size", "source_line", "pool_source_line", "end_line",
                "last_line")
            else pa.array([r[k] for r in rows], type=pa.string()) if k in ("end_reason", "end_file", "successor")
            else pa.array([r[k] for r in rows], type=pa.int32()) if k in ("tp_size", "dp_size")
            else pa.array([r[k] for r in rows]))
        for k in rows[0]
    })
    con.register("capacity_batch", table)
    cols = ", ".join(rows[0])
    con.execute(f"INSERT INTO capacity ({cols}) SELECT {cols} FROM capacity_batch").fetchall()
    con.unregister("capacity_batch")
    missing_pool = [r["instance"] for r in rows if r["kv_pool_tokens"] is None]
    for inst in sorted(set(missing_pool)):
        result.warnings.append(f"engine instance '{inst}': a start-up logs no KV pool size")


def _find_kv_event_gaps(con: duckdb.DuckDBPyConnection, result: IngestResult) -> None:
    """Breaks in the KV-event publishers' sequence numbers (sql/kv_event_gaps.sql): lost messages are a
    warning per instance and rank, restarts an assumption."""
    run_script(con, "kv_event_gaps")
    for instance, rank, kind, breaks, missing, first, last in con.execute("""
            SELECT instance, dp_rank, kind, count(*), sum(missing), min(from_ts), max(to_ts) FROM kv_event_gaps
            WHERE kind = 'gap' OR missing > 0 GROUP BY ALL ORDER BY instance, dp_rank NULLS FIRST, kind""").fetchall():
        where = f"KV events of instance '{instance}'" + ("" if rank is None else f" (dp rank {rank})")
        what = "sequence gap(s)" if kind == "gap" else "restart(s) whose new sequence does not start at 0"
        result.warnings.append(
            f"{where}: {missing:,} message(s) lost in {breaks:,} {what}, from {_utc(first)} to {_utc(last)} "
            "(table kv_event_gaps); recover them from the publisher's replay buffer or the subscriber's other copy")
    for instance, rank, restarts in con.execute("""
            SELECT instance, dp_rank, count(*) FROM kv_event_gaps WHERE kind = 'restart'
            GROUP BY ALL ORDER BY instance, dp_rank NULLS FIRST""").fetchall():
        result.assumptions.append(
            f"KV events of instance '{instance}'" + ("" if rank is None else f" (dp rank {rank})")
            + f": the publisher's sequence started again {restarts:,} time(s) (an engine restart; table kv_event_gaps)")


def _utc(ts: datetime | None) -> str:
    return "?" if ts is None else ts.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _match_instance_names(con: duckdb.DuckDBPyConnection, incident: Incident, result: IngestResult) -> None:
    """Requests name the engine instance their gateway instance name matches ([instances], see
    kvforensics/stages/instances.py); how each name matched goes to ``instance_names``. Names no engine log
    knows are a warning with the config to add."""
    counts = dict(con.execute("""
        SELECT name, count(*) FROM (
            SELECT prefill_instance AS name FROM requests WHERE prefill_instance IS NOT NULL
            UNION ALL
            SELECT decode_instance AS name FROM requests WHERE decode_instance IS NOT NULL) n
        GROUP BY 1""").fetchall())
    engines = [r[0] for r in con.execute("SELECT DISTINCT instance FROM capacity").fetchall()]
    matches = match_instance_names(counts, engines, incident.instances, where=f"{incident.path}: [instances]")
    con.execute("DELETE FROM instance_names").fetchall()
    if matches:
        con.register("instance_names_batch", pa.table({
            "gateway_name": [m.gateway_name for m in matches],
            "engine_instance": pa.array([m.engine_instance for m in matches], type=pa.string()),
            "matched_by": [m.matched_by for m in matches],
            "candidates": pa.array([", ".join(m.candidates) or None for m in matches], type=pa.string()),
            "requests": pa.array([counts[m.gateway_name] for m in matches], type=pa.int64()),
        }))
        con.execute("INSERT INTO instance_names SELECT * FROM instance_names_batch").fetchall()
        con.unregister("instance_names_batch")
    renamed: dict[str, list] = {}
    for m in matches:
        if m.engine_instance is not None and m.engine_instance != m.gateway_name:
            renamed.setdefault(m.matched_by, []).append(m)
    if renamed:
        run_script(con, "instance_rename")
    for how, ms in sorted(renamed.items()):
        examples = ", ".join(f"'{m.gateway_name}' -> '{m.engine_instance}'" for m in ms[:3])
        result.assumptions.append(
            f"{len(ms)} gateway instance name(s) matched to engine instances by {how} ({examples}"
            f"{', ...' if len(ms) > 3 else ''}); the gateway's names are in table instance_names")
    known = set(engines)
    unknown = [m for m in matches if m.engine_instance is None or m.engine_instance not in known]
    if unknown:
        n = sum(counts[m.gateway_name] for m in unknown)
        examples = ", ".join(f"'{m.gateway_name}'" + (f" (fits {', '.join(m.candidates)})" if m.candidates else "")
                             for m in unknown[:3])
        example = unknown[0].gateway_name
        result.warnings.append(
            f"{n} request(s) name {len(unknown)} instance(s) no engine log knows ({examples}"
            f"{', ...' if len(unknown) > 3 else ''}): the pool rule cannot judge them by instance; "
            f"add [instances] map = {{ \"{example}\" = \"<engine instance>\" }} or "
            f"match = \"<regex with a (?P<instance>...) group>\" to the incident file, or the missing engine logs")


def _fill_cached_tokens(con: duckdb.DuckDBPyConnection, result: IngestResult) -> None:
    """requests.cached_tokens the gateway lacks, from the engines (sql/cached_tokens.sql); where gateway and
    engine both count a request's cached tokens and differ, a warning with the counts."""
    run_script(con, "cached_tokens")
    filled = con.execute("SELECT cached_tokens_source, count(*) FROM requests WHERE cached_tokens_source LIKE 'engine%' "
                         "GROUP BY 1 ORDER BY 1").fetchall()
    for how, n in filled:
        what = ("the engine's per-request count (ReqTimeStats cached_input_len)" if how == "engine_request"
                else "a prefill batch of that request alone (#new-seq: 1, #cached-token)")
        result.assumptions.append(f"{n} request(s) without cached_tokens from the gateway took it from {what}; "
                                  f"requests.cached_tokens_source = '{how}'")
    compared, differ, example = one(con, """
        SELECT count(*), count(*) FILTER (WHERE engine_cached <> gateway_cached),
               min(request_id) FILTER (WHERE engine_cached <> gateway_cached)
        FROM engine_cached_tokens WHERE gateway_cached IS NOT NULL""")
    if differ:
        result.warnings.append(
            f"cached_tokens: the gateway and the engine's own count (ReqTimeStats cached_input_len) differ for "
            f"{differ:,} of {compared:,} request(s) both count (e.g. '{example}'): the two sources contradict each "
            "other; check which engine the gateway's number comes from (table engine_cached_tokens)")


def _check_models(con: duckdb.DuckDBPyConnection, result: IngestResult) -> None:
    rows = con.execute("""SELECT r.model, count(*) FROM requests r
                          WHERE NOT EXISTS (SELECT 1 FROM capacity c WHERE c.model = r.model)
                          GROUP BY 1 ORDER BY 1""").fetchall()
    for model, n in rows:
        result.warnings.append(f"unknown model '{model}': no engine log covers it, so the pool rule cannot "
                               f"judge its {n} request(s)")


def _write_account_patterns(con: duckdb.DuckDBPyConnection, incident: Incident) -> None:
    con.execute("CREATE OR REPLACE TABLE account_patterns (pattern VARCHAR, account_class VARCHAR, priority INTEGER)"
                ).fetchall()
    for p in incident.scope.reporter_accounts:
        con.execute("INSERT INTO account_patterns VALUES ($p, 'reporter', 1)", {"p": p}).fetchall()
    for p in incident.scope.internal_accounts:
        con.execute("INSERT INTO account_patterns VALUES ($p, 'internal', 2)", {"p": p}).fetchall()
    # [prefix_cache] shared_namespaces: cache salts every tenant shares (their blocks are nobody's data)
    con.execute("DELETE FROM prefix_shared_namespaces").fetchall()
    for p in incident.prefix_shared_namespaces:
        con.execute("INSERT INTO prefix_shared_namespaces VALUES ($p)", {"p": p}).fetchall()


def _enforce_strict(con: duckdb.DuckDBPyConnection, result: IngestResult) -> None:
    rows = con.execute("SELECT file, line, reason FROM quarantine ORDER BY file, line LIMIT 1").fetchall()
    if rows:
        f, line, reason = rows[0]
        raise StrictModeError(f"{reason} (--strict stops at the first record that would be quarantined)",
                              location=f"{f}:{line}")
    stopped = [f for f in result.files if any("ends early" in n for n in f.notes)]
    if stopped:
        raise StrictModeError(next(n for n in stopped[0].notes if "ends early" in n), location=stopped[0].file)


def requests_loaded(con: duckdb.DuckDBPyConnection) -> int:
    return one(con, "SELECT count(*) FROM requests")[0]
