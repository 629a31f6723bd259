"""``kvforensics watch``: every source of an incident file followed as it grows, the rules run on what is new,
alerts raised the moment the evidence supports them.

A poll takes what every file gained (:mod:`kvforensics.watch.follow`) and loads it: requests through the batch
loaders, merged in one transaction with their files' offsets (:mod:`kvforensics.watch.intake`); engine logs
increment by increment after the lines of the start-up in force (:mod:`kvforensics.watch.engine_logs`), their
start-ups placed in ``capacity`` as the ingest places them, and the audit's verdicts on them written to
``exposure_windows`` and ``prefix_windows``; KV events, and content when a prefix_reuse rule may read it.
Then it raises what is new: an exposed start-up, an affected response (the rules on the new requests,
:mod:`kvforensics.watch.detection`), a gap in the evidence (a source silent for longer than ``silence``, a
KV-event sequence gap, a source whose quarantined share is over its limit).

When watch stops (SIGINT, SIGTERM, ``--once``), it settles the folder as a batch run would leave it: the sources
a batch run reads whole (engine logs, KV events, changes, content) are ingested whole, every input is hashed
into the evidence set, the load report lists each request file with what its records became, and ``detect``
runs on everything. ``kvforensics scope`` and ``report`` on the folder then give the batch run's answer; a
response the settled answer holds but no poll alerted is alerted then.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

import duckdb
import pandas as pd

from kvforensics.audit.exposure import write_exposure_windows
from kvforensics.audit.isolation import write_prefix_windows
from kvforensics.config import Incident, Source
from kvforensics.core.db import one, run_script
from kvforensics.core.errors import InputError
from kvforensics.core.escaping import visible_controls
from kvforensics.core.timestamps import iso
from kvforensics.evidence.evidence_set import current_inputs, record
from kvforensics.investigation import Investigation
from kvforensics.stages.detect import detect
from kvforensics.stages.ingest import ingest, place_startups, restore_gateway_values
from kvforensics.watch import state as watch_state
from kvforensics.watch.alerts import AlertLog, alert
from kvforensics.watch.detection import LiveDetection, affected_after_detect
from kvforensics.watch.engine_logs import EngineLogs, EngineRead
from kvforensics.watch.follow import Follower, Poll
from kvforensics.watch.intake import PIECES, Counts, SideSources, load_requests

MIN_SHARE_RECORDS = 100  # a quarantine share is judged once a source has read this many records
WAL_CHECKPOINT = "1GB"  # DuckDB's write-ahead log is checkpointed into the database at this size
PLACE_EVERY_S = 30.0  # how far the start-ups' logs go is put into capacity at least this often
# the tables of the sources a batch run re-reads whole, emptied when watch starts and read again as they grow
_REREAD_TABLES = (
    "capacity",
    "engine_events",
    "prefill_batches",
    "changes",
    "content_fingerprints",
    "content_stats",
    "request_blocks",
    "kv_events",
    "kv_event_messages",
    "kv_event_gaps",
    "exposure_windows",
    "prefix_windows",
)


@dataclass(frozen=True)
class WatchOptions:
    interval: float = 5.0  # seconds between polls
    silence: float = 600.0  # a source that has not grown for this many seconds is an evidence gap
    alert_command: str | None = None  # run per batch of alerts, the JSON lines on its standard input
    memory_limit: str | None = None
    status: bool = True  # status lines on stderr
    stdout: TextIO | None = None  # where alerts are printed (None: sys.stdout)


@dataclass
class StopSummary:
    requests: int
    alerts: int
    alerted_not_in_answer: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Watch:
    """One incident followed into one output folder (held locked while watch runs)."""

    def __init__(self, incident: Incident, out_dir: Path, options: WatchOptions | None = None) -> None:
        self.options = options or WatchOptions()
        self.inv = Investigation.open(
            incident, out_dir, progress=False, pdf=False, memory_limit=self.options.memory_limit
        )
        try:
            self._start()
        except BaseException:
            self.inv.close()
            raise

    @property
    def incident(self) -> Incident:
        return self.inv.incident

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        return self.inv.con

    def _start(self) -> None:
        con, out = self.con, self.inv.out_dir
        if not watch_state.exists(con) and one(con, "SELECT count(*) FROM load_report")[0]:
            raise InputError(
                f"{out} holds the evidence of a batch run, which watch does not continue: watch into a new --out folder"
            )
        watch_state.create(con)
        # a checkpoint rewrites the table's last row group, which every poll appends to: taken when the log of
        # changes is large, not every few polls (it was half the cost of a poll of 50,000 requests at 2M)
        con.execute(f"SET wal_autocheckpoint = '{WAL_CHECKPOINT}'").fetchall()
        self.root = out / PIECES
        shutil.rmtree(self.root, ignore_errors=True)
        restore_gateway_values(con)
        names = [s.name for s in self.incident.sources if s.kind != "requests"]
        for table in _REREAD_TABLES:
            con.execute(f"DELETE FROM {table}").fetchall()
        con.execute("DELETE FROM quarantine WHERE list_contains($n, source)", {"n": names}).fetchall()
        self.live_content = bool(
            (self.incident.mechanisms and "prefix_reuse" in self.incident.mechanisms)
            or self.incident.sources_of("kv_events")
            or self.incident.prefix_block_size
            or self.incident.prefix_word_blocks
            or self.incident.prefix_isolation is not None
        )
        restored = watch_state.load(con)
        watch_state.undo_provisional(con, restored)
        self.followers: dict[str, Follower] = {}
        for s in self.incident.sources:
            read = s.kind in ("requests", "engine_log", "kv_events") or (s.kind == "content" and self.live_content)
            self.followers[s.name] = Follower(
                s.name,
                s.format,
                [f for f in restored if f.source == s.name] if s.kind == "requests" else None,
                keep_first_line=s.kind == "requests" or s.format == "csv",
                read=read,
            )
        self.counts = {s.name: Counts() for s in self.incident.sources}
        for f in restored:
            if f.source in self.counts:
                self.counts[f.source].read += f.records_read
                self.counts[f.source].quarantined += f.quarantined
        self.engines = EngineLogs(con, self.incident, self.root)
        self.sides = SideSources(con, self.incident, self.root)
        self.detection = LiveDetection(con, self.incident)
        self.alerts = AlertLog.open(
            out, self.options.alert_command, stdout=self.options.stdout or sys.stdout, warn=self._say
        )
        self.placed_at = 0.0
        self.problems: list[str] = []
        self.first_poll = True

    def _say(self, message: str) -> None:
        if self.options.status:
            print(visible_controls(message), file=sys.stderr, flush=True)

    def _problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)
            self._say(f"warning: {message}")

    # --- one poll -------------------------------------------------------------------------------------
    def poll(self, *, final: bool = False) -> list[dict[str, Any]]:
        """Read what every source gained, load it, judge it; the alerts raised."""
        looked = time.time()  # when the files were looked at: how long a source has been silent is counted to it
        polls: dict[str, tuple[Source, Poll]] = {}
        for source, files in self.incident.source_files():
            found = self.followers[source.name].poll(files, final=final)
            for problem in found.problems:
                self._problem(f"source '{source.name}': {problem}")
            polls[source.name] = (source, found)
        self._renamed(polls)
        engine = EngineRead()
        kv_loaded = False

        def requests() -> None:
            for source, found in polls.values():
                if source.kind == "requests" and found.increments:
                    load_requests(
                        self.con,
                        source,
                        found.increments,
                        self.root,
                        self.incident.model_aliases,
                        self.counts[source.name],
                    )

        # the engine logs are parsed while the requests load; then stored (the year of a vLLM log is the
        # first request's when nothing sets it: the first poll loads the requests first)
        jobs = [
            (source, inc) for source, found in polls.values() if source.kind == "engine_log" for inc in found.increments
        ]
        if self.first_poll:
            requests()
            self.engines.read(jobs, self.counts, engine)
        else:
            self.engines.read(jobs, self.counts, engine, meanwhile=requests)
        for source, found in polls.values():
            increments = found.increments
            counts = self.counts[source.name]
            if source.kind == "kv_events" and increments:
                self.sides.kv_events(source, increments, counts)
                kv_loaded = True
            elif source.kind == "content" and increments:
                self.sides.content(source, increments, counts)
            elif source.kind == "changes":
                for changed in found.changed:
                    self.sides.changes(source, Path(changed.path))
        raised = self._startups(engine)
        everything = self.first_poll or engine.startups_changed
        self.first_poll = False
        affected = self.detection.judge(engine.request_ids, self._alerted_requests(), everything=everything)
        raised += [_affected_alert(r) for r in affected.itertuples(index=False)]
        raised += self._gaps(kv_loaded, looked)
        self._save_states()
        return self.alerts.raise_new(raised)

    def _renamed(self, polls: dict[str, tuple[Source, Poll]]) -> None:
        """Rows read from a file under the name it had are moved to its new name (rotation), with its state."""
        for source, found in polls.values():
            for state, old in found.renamed:
                if source.kind == "engine_log":
                    self.engines.rename(old, state.path)
                if source.kind != "requests":
                    continue
                params = {"s": source.name, "old": old, "new": state.path}
                self.con.begin()
                try:
                    for table, column in (
                        ("requests", "source_file"),
                        ("quarantine", "file"),
                        ("request_conflicts", "source_file"),
                    ):
                        self.con.execute(
                            f"UPDATE {table} SET {column} = $new WHERE source = $s AND {column} = $old", params
                        ).fetchall()
                    watch_state.save(self.con, [state])
                    self.con.commit()
                except BaseException:
                    self.con.rollback()
                    raise

    def _save_states(self) -> None:
        for source in self.incident.sources_of("requests"):
            watch_state.save(self.con, self.followers[source.name].files.values())

    def _startups(self, engine: EngineRead) -> list[dict[str, Any]]:
        """Capacity and the exposure windows again when the start-ups changed (or gateway instance names appeared);
        an alert per exposed start-up."""
        now = time.monotonic()
        new_names = self._new_gateway_names()
        if not (
            engine.startups_changed or new_names or (engine.lives_changed and now - self.placed_at > PLACE_EVERY_S)
        ):
            if one(self.con, "SELECT count(*) FROM instance_names WHERE engine_instance <> gateway_name")[0]:
                run_script(self.con, "instance_rename")  # the new requests' gateway names, as ingest renames them
            return []
        before = self._placement()
        placed = place_startups(self.con, self.incident, self.engines.startups())
        for w in placed.warnings:
            if "no engine start-up found" not in w:
                self._problem(w)
        write_prefix_windows(self.con, self.incident)
        write_exposure_windows(self.con)
        self.placed_at = now
        engine.startups_changed = self._placement() != before  # then every request is judged again
        return exposed_startups(self.con)

    def _placement(self) -> list[tuple]:
        """What the rules read of the start-ups and the gateway's instance names."""
        return self.con.execute(
            "SELECT 'c', instance, role, model, valid_from, valid_to, kv_pool_tokens, context_length, NULL FROM capacity "
            "UNION ALL SELECT 'n', gateway_name, engine_instance, NULL, NULL, NULL, NULL, NULL, NULL FROM instance_names "
            "ORDER BY ALL"
        ).fetchall()

    def _new_gateway_names(self) -> bool:
        """Whether the requests loaded since the last judgement name an instance the matching has not seen."""
        return bool(
            one(
                self.con,
                """
            SELECT count(*) FROM (SELECT prefill_instance AS n FROM requests WHERE rowid > $w
                                  UNION SELECT decode_instance FROM requests WHERE rowid > $w) names
            WHERE n IS NOT NULL AND n NOT IN (SELECT gateway_name FROM instance_names)
              AND n NOT IN (SELECT engine_instance FROM instance_names WHERE engine_instance IS NOT NULL)""",
                {"w": self.detection.watermark},
            )[0]
        )

    def _alerted_requests(self) -> set[str]:
        prefix = "affected_response:"
        return {a[len(prefix) :] for a in self.alerts.raised if a.startswith(prefix)}

    def _gaps(self, kv_loaded: bool, now: float) -> list[dict[str, Any]]:
        """Evidence gaps: silent sources (at *now*, when the files were looked at), KV-event sequence gaps,
        quarantine shares over their limit."""
        out = []
        for source in self.incident.sources:
            since = self.followers[source.name].grew_at
            if now - since > self.options.silence:
                out.append(
                    alert(
                        "evidence_gap",
                        f"silent_source:{source.name}:{iso(_utc(since))}",
                        gap="silent_source",
                        source=source.name,
                        kind_of_source=source.kind,
                        silent_since=_utc(since),
                        silent_s=round(now - since, 1),
                    )
                )
            c = self.counts[source.name]
            limit = self.incident.max_quarantine_fractions()[source.kind]
            if c.read >= MIN_SHARE_RECORDS and c.quarantined > limit * c.read:
                out.append(
                    alert(
                        "evidence_gap",
                        f"quarantine_share:{source.name}",
                        gap="quarantine_share",
                        source=source.name,
                        kind_of_source=source.kind,
                        records_read=c.read,
                        quarantined=c.quarantined,
                        share=round(c.quarantined / c.read, 4),
                        max_share=limit,
                    )
                )
        if kv_loaded:
            run_script(self.con, "kv_event_gaps")
            for inst, rank, file, before, after, missing, t0, t1, kind in self.con.execute(
                "SELECT instance, dp_rank, source_file, seq_before, seq_after, missing, from_ts, to_ts, kind "
                "FROM kv_event_gaps WHERE kind = 'gap' OR missing > 0 ORDER BY to_ts"
            ).fetchall():
                out.append(
                    alert(
                        "evidence_gap",
                        f"kv_event_sequence:{inst}:{rank}:{before}:{after}:{file}",
                        gap="kv_event_sequence",
                        instance=inst,
                        dp_rank=rank,
                        seq_before=before,
                        seq_after=after,
                        missing=missing,
                        sequence_break=kind,
                        from_ts=t0,
                        to_ts=t1,
                        file=file,
                    )
                )
        return out

    # --- stopping ---------------------------------------------------------------------------------------
    def stop(self) -> StopSummary:
        """A last poll (a last line without its newline read too), then the folder settled as a batch run
        leaves it; the summary of the run."""
        try:
            self.poll(final=True)
            live = self._alerted_requests()
            self._settle()
            final = affected_after_detect(self.con, self.incident)
            self.alerts.raise_new(
                [_affected_alert(r) for r in final.itertuples(index=False)] + exposed_startups(self.con)
            )
            answer = set(final["request_id"])
            requests = one(self.con, "SELECT count(*) FROM requests")[0]
            self.con.execute("CHECKPOINT").fetchall()
            return StopSummary(
                requests=requests,
                alerts=len(self.alerts.raised),
                alerted_not_in_answer=sorted(live - answer),
                problems=list(self.problems),
            )
        finally:
            self.close()

    def close(self) -> None:
        for f in self.followers.values():
            f.close()
        try:
            self.detection.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.inv.close()

    def _settle(self) -> None:
        con, incident = self.con, self.incident
        others = []
        for source, files in incident.source_files():
            if source.kind != "requests" and files:
                others.append(source)
            elif source.kind != "requests":
                self._problem(f"source '{source.name}': no file matches path '{source.path}'; it is left out")
        names = [s.name for s in incident.sources if s.kind != "requests"]
        con.execute("DELETE FROM quarantine WHERE list_contains($n, source)", {"n": names}).fetchall()
        con.execute("DELETE FROM load_report").fetchall()
        inputs = current_inputs(incident)
        result = ingest(con, replace(incident, sources=tuple(others)), digests=inputs.digests)
        for w in result.warnings:
            self._problem(w)
        write_prefix_windows(con, incident)
        write_exposure_windows(con)
        self._request_load_report(inputs.digests)
        record(con, inputs)
        detect(con, overrides=incident.rule_parameters, mechanisms=incident.mechanisms)

    def _request_load_report(self, digests: dict[str, tuple[str, int]] | Any) -> None:
        """One load_report row per request file, as a batch ingest writes it: its SHA-256 and size now, what its
        records became over all its increments."""
        rows = []
        for source in self.incident.sources_of("requests"):
            for s in sorted(self.followers[source.name].files.values(), key=lambda f: f.path):
                sha, size = digests.get(str(Path(s.path).resolve()), ("", s.size))
                notes = watch_state.merged_notes(s.notes)
                if s.records_read == 0 and not notes:
                    notes = ["empty file"]
                if s.gone:
                    notes.append("left the source's path while watch followed it (its records are loaded)")
                if s.broken:
                    notes.append(s.broken)
                rows.append(
                    (
                        source.name,
                        source.kind,
                        s.path,
                        sha,
                        size,
                        s.records_read,
                        s.loaded,
                        s.quarantined,
                        s.duplicates,
                        "; ".join(notes) or None,
                    )
                )
        self.con.executemany("INSERT INTO load_report VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    # --- the loop -----------------------------------------------------------------------------------------
    def run(
        self,
        stop: threading.Event | None = None,
        *,
        once: bool = False,
        on_poll: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> StopSummary:
        """Poll every ``interval`` seconds until *stop* is set (SIGINT and SIGTERM set it when this runs in the
        main thread) or, with *once*, after one poll; then stop and settle."""
        stop = stop or threading.Event()
        restore = _on_signals(stop)
        try:
            while True:
                began = time.monotonic()
                raised = self.poll()
                if on_poll is not None:
                    on_poll(raised)
                if once or stop.wait(max(0.0, self.options.interval - (time.monotonic() - began))):
                    break
        except BaseException:
            self.close()
            raise
        finally:
            restore()
        return self.stop()


def _on_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT and SIGTERM set *stop* (the main thread only); a second one interrupts at once. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, _frame: Any) -> None:
        stop.set()
        for s, h in before.items():  # the next signal acts as it did before watch
            signal.signal(s, h)

    def restore() -> None:
        for s, h in before.items():
            signal.signal(s, h)

    for s in before:
        signal.signal(s, handler)
    return restore


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def _affected_alert(row: Any) -> dict[str, Any]:
    ts = row.ts.to_pydatetime() if isinstance(row.ts, pd.Timestamp) else row.ts
    return alert(
        "affected_response",
        str(row.request_id),
        request_id=row.request_id,
        account_id=row.account_id,
        model=row.model,
        instance=None if pd.isna(row.instance) else row.instance,
        ts=ts,
        confidence=row.confidence,
        rules=row.rules.split(" "),
    )


def exposed_startups(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """An alert per start-up the audit finds exposed: audit check 1 (a pool below the context in a role where a
    prompt beyond the pool reads pages it did not write) and check 6 (a path across tenants in the prefix cache:
    a store whose keys drop the salt, no salt on a multi-tenant deployment ...; a path the evidence leaves
    undetermined is the audit's and the report's, not an alert)."""
    out = []
    for inst, role, model, engine, version, start, pool, context, sentence, file, line in con.execute(
        "SELECT instance, role, model, engine, engine_version, valid_from, kv_pool_tokens, context_length, "
        "sentence, source_file, source_line FROM exposure_windows ORDER BY valid_from NULLS LAST, instance"
    ).fetchall():
        out.append(
            alert(
                "exposed_startup",
                f"pool_vs_context:{inst}:{file}:{line}",
                instance=inst,
                role=role,
                model=model,
                engine=engine,
                engine_version=version,
                start=start,
                check="pool_vs_context",
                kv_pool_tokens=pool,
                context_length=context,
                verdict=sentence,
                file=file,
                line=line,
            )
        )
    for inst, model, engine, version, start, path, status, sentence, file, line in con.execute(
        "SELECT instance, model, engine, engine_version, valid_from, path, status, sentence, startup_file, "
        "startup_line FROM prefix_windows WHERE path <> 'isolated' AND status = 'fail' "
        "ORDER BY valid_from NULLS LAST, instance"
    ).fetchall():
        out.append(
            alert(
                "exposed_startup",
                f"prefix_cache:{path}:{inst}:{file}:{line}",
                instance=inst,
                model=model,
                engine=engine,
                engine_version=version,
                start=start,
                check="prefix_cache",
                path=path,
                status=status,
                verdict=sentence,
                file=file,
                line=line,
            )
        )
    return out
