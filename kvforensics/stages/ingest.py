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
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

import duckdb
import pyarrow as pa

from kvforensics.config import Incident, Source
from kvforensics.core.db import one, run_script
from kvforensics.core.errors import InputError, StrictModeError
from kvforensics.sources import kinds_by_name, load_kinds
from kvforensics.sources.common.load_report import IngestResult, IngestRun, Tick
from kvforensics.stages.instances import (
    PlacedStartup,
    lifetimes,
    match_instance_names,
    role_carried_over,
    roles_carried_over,
)


def ingest(
    con: duckdb.DuckDBPyConnection,
    incident: Incident,
    *,
    strict: bool = False,
    tick: Tick = lambda n: None,
    on_file: Callable[[str], None] = lambda name: None,
    digests: Mapping[str, tuple[str, int]] | None = None,
) -> IngestResult:
    """Load every source of the incident into ``con``. *digests*: (SHA-256, bytes) of input files by
    absolute path, already taken (kvforensics.evidence.evidence_set), so that they are not hashed again."""
    result = IngestResult()
    plan = incident.source_files()  # a file two sources name is refused before anything is read
    for source, files in plan:
        if not files:
            raise InputError(
                f"no file matches path '{source.path}' (looked in {source.base_dir}); "
                f"check the path, which is relative to the incident file",
                location=f"source '{source.name}'",
            )
        if source.timezone != "UTC" or source.clock_offset_s:
            result.assumptions.append(
                f"source '{source.name}': timestamps without an offset read as {source.timezone}"
                + (f", clock offset {source.clock_offset_s:+g} s applied" if source.clock_offset_s else "")
            )
    run = IngestRun(con, incident, tick, on_file, digests or {}, result)
    kinds = load_kinds()
    planned = {k.name: [(s, f) for s, f in plan if s.kind == k.name] for k in kinds}
    with ExitStack() as begun:  # what a kind's entry begins before any source is read (its `begin`), ended last
        for kind in kinds:
            begin = getattr(kind.entry_module(), "begin", None)
            for source, files in planned[kind.name] if begin is not None else ():
                begun.enter_context(begin(run, source, files))
        _load_sources(run, kinds, planned, plan)
    _find_kv_event_gaps(con, result)
    _build_capacity(con, incident, run.startups, result)
    for kind in (k for k in kinds if k.ingest == "last"):
        for source, files in planned[kind.name]:
            result.files.extend(kind.entry_module().load(run, source, files))
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


def _load_sources(
    run: IngestRun,
    kinds: list[Any],
    planned: dict[str, list[tuple[Source, list[Path]]]],
    plan: list[tuple[Source, list[Path]]],
) -> None:
    """The kinds read first (requests), then those read file by file, in the incident's order (content last)."""
    con, result = run.con, run.result
    # Requests first: engine model names are matched against the gateway's model ids.
    restore_gateway_values(con)
    for kind in (k for k in kinds if k.ingest == "first"):
        for source, files in planned[kind.name]:
            result.files.extend(kind.entry_module().load(run, source, files))
    for kind in kinds:  # the kinds read whole again: their tables emptied first
        for table in kind.tables if kind.ingest != "first" else ():
            con.execute(f'DELETE FROM "{table}"').fetchall()  # a table name of a kind.yml, checked against schema.sql
    by_file = [k for k in kinds if k.ingest == "files"]
    with ExitStack() as stack:
        for kind in by_file:
            reading = getattr(kind.entry_module(), "reading", None)
            if reading is not None:
                stack.enter_context(reading(run, [(s, f) for s, files in planned[kind.name] for f in files]))
        # content last: its prompts are cut into blocks of the size the KV events and start-ups show
        for source, files in plan:
            kind = kinds_by_name()[source.kind]
            if kind in by_file:
                result.files.extend(kind.entry_module().load(run, source, files))


def restore_gateway_values(con: duckdb.DuckDBPyConnection) -> None:
    """Records loaded before get the gateway's own values back (its instance names, its cached_tokens where the
    engines filled them in), so that re-delivered ones compare equal with them: before request files are merged."""
    if one(con, "SELECT count(*) FROM instance_names WHERE engine_instance <> gateway_name")[0]:
        run_script(con, "instance_restore")
    # cached_tokens the engines filled in (sql/cached_tokens.sql) go back to the gateway's own value
    con.execute(
        "UPDATE requests SET cached_tokens = NULL, cached_tokens_source = NULL "
        "WHERE cached_tokens_source IN ('engine_request', 'engine_batch')"
    ).fetchall()


def place_startups(
    con: duckdb.DuckDBPyConnection, incident: Incident, startups: list[tuple[Source, Path, Any]]
) -> IngestResult:
    """``capacity`` rebuilt from *startups* ((source, file, StartupRecord)) and the gateway's instance names
    matched to the engine instances: what the ingest derives from the engine logs, for a caller that reads them
    itself, increment by increment (``kvforensics watch``). Its warnings and assumptions are in the result."""
    result = IngestResult()
    restore_gateway_values(con)
    con.execute("DELETE FROM capacity").fetchall()
    _build_capacity(con, incident, startups, result)
    _match_instance_names(con, incident, result)
    return result


def resolve_model(
    engine_model: str | None, source: Source, aliases: dict[str, str], gateway_models: list[str]
) -> tuple[str | None, str]:
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
    items = sorted(
        startups,
        key=lambda it: (
            it[2].instance,
            it[2].ts is None,
            it[2].ts or datetime.min.replace(tzinfo=timezone.utc),
            str(it[1]),
            it[2].line,
        ),
    )
    models = []
    for source, path, s in items:
        model, how = resolve_model(s.model, source, dict(incident.model_aliases), gateway_models)
        models.append(model)
        if how == "unmatched":
            result.warnings.append(
                f"engine instance '{s.instance}' serves '{s.model}', which matches no gateway model id; "
                f"add it to [models] aliases in the incident file"
            )
        if s.ts is None:
            result.warnings.append(
                f"engine instance '{s.instance}': start-up at {path.name}:{s.line} has no "
                f"timestamp; its pool cannot be placed in time"
            )
    placed = [
        PlacedStartup(
            instance=s.instance,
            role=s.role,
            model=model,
            ts=s.ts,
            file=str(path),
            line=s.line,
            last_ts=s.last_ts,
            last_line=s.last_line,
            shutdown_ts=s.shutdown_ts,
            shutdown_line=s.shutdown_line,
        )
        for (_source, path, s), model in zip(items, models, strict=True)
    ]
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
                f"'{end.successor}' took over ({model}, {s.role}): retired from {end.valid_to:%Y-%m-%d %H:%M:%S}Z"
            )
        rows.append(
            {
                "instance": s.instance,
                "role": role,
                "model": model,
                "engine_model": s.model,
                "valid_from": s.ts,
                "valid_to": end.valid_to,
                "kv_pool_tokens": s.kv_pool_tokens,
                "context_length": s.context_length,
                "page_size": s.page_size,
                "engine": s.engine,
                "engine_version": s.engine_version,
                "version_source": s.version_source,
                "tp_size": s.tp_size,
                "dp_size": s.dp_size,
                "flags": json.dumps(flags, sort_keys=True),
                "startup_refused": str(flags.get("startup_refused", "")).lower() == "true",
                "source": source.name,
                "source_file": str(path),
                "source_line": s.line,
                "pool_source_line": s.pool_source_line,
                "end_reason": end.end_reason,
                "end_ts": end.end_ts,
                "end_file": end.end_file,
                "end_line": end.end_line,
                "successor": end.successor,
                "last_ts": s.last_ts,
                "last_line": s.last_line,
            }
        )
    if not rows:
        result.warnings.append(
            "no engine start-up found in any engine log: KV pool sizes are unknown, "
            "so the pool rule cannot judge any request"
        )
        return
    ts_type = pa.timestamp("us", tz="UTC")
    table = pa.table(
        {
            k: (
                pa.array([r[k] for r in rows], type=ts_type)
                if k in ("valid_from", "valid_to", "end_ts", "last_ts")
                else pa.array([r[k] for r in rows], type=pa.int64())
                if k
                in (
                    "kv_pool_tokens",
                    "context_length",
                    "page_size",
                    "source_line",
                    "pool_source_line",
                    "end_line",
                    "last_line",
                )
                else pa.array([r[k] for r in rows], type=pa.string())
                if k in ("end_reason", "end_file", "successor")
                else pa.array([r[k] for r in rows], type=pa.int32())
                if k in ("tp_size", "dp_size")
                else pa.array([r[k] for r in rows])
            )
            for k in rows[0]
        }
    )
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
            "(table kv_event_gaps); recover them from the publisher's replay buffer or the subscriber's other copy"
        )
    for instance, rank, restarts in con.execute("""
            SELECT instance, dp_rank, count(*) FROM kv_event_gaps WHERE kind = 'restart'
            GROUP BY ALL ORDER BY instance, dp_rank NULLS FIRST""").fetchall():
        result.assumptions.append(
            f"KV events of instance '{instance}'"
            + ("" if rank is None else f" (dp rank {rank})")
            + f": the publisher's sequence started again {restarts:,} time(s) (an engine restart; table kv_event_gaps)"
        )


def _utc(ts: datetime | None) -> str:
    return "?" if ts is None else ts.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _match_instance_names(con: duckdb.DuckDBPyConnection, incident: Incident, result: IngestResult) -> None:
    """Requests name the engine instance their gateway instance name matches ([instances], see
    kvforensics/stages/instances.py); how each name matched goes to ``instance_names``. Names no engine log
    knows are a warning with the config to add."""
    counts = dict(
        con.execute("""
        SELECT name, count(*) FROM (
            SELECT prefill_instance AS name FROM requests WHERE prefill_instance IS NOT NULL
            UNION ALL
            SELECT decode_instance AS name FROM requests WHERE decode_instance IS NOT NULL) n
        GROUP BY 1""").fetchall()
    )
    engines = [r[0] for r in con.execute("SELECT DISTINCT instance FROM capacity").fetchall()]
    matches = match_instance_names(counts, engines, incident.instances, where=f"{incident.path}: [instances]")
    con.execute("DELETE FROM instance_names").fetchall()
    if matches:
        con.register(
            "instance_names_batch",
            pa.table(
                {
                    "gateway_name": [m.gateway_name for m in matches],
                    "engine_instance": pa.array([m.engine_instance for m in matches], type=pa.string()),
                    "matched_by": [m.matched_by for m in matches],
                    "candidates": pa.array([", ".join(m.candidates) or None for m in matches], type=pa.string()),
                    "requests": pa.array([counts[m.gateway_name] for m in matches], type=pa.int64()),
                }
            ),
        )
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
            f"{', ...' if len(ms) > 3 else ''}); the gateway's names are in table instance_names"
        )
    known = set(engines)
    unknown = [m for m in matches if m.engine_instance is None or m.engine_instance not in known]
    if unknown:
        n = sum(counts[m.gateway_name] for m in unknown)
        examples = ", ".join(
            f"'{m.gateway_name}'" + (f" (fits {', '.join(m.candidates)})" if m.candidates else "") for m in unknown[:3]
        )
        example = unknown[0].gateway_name
        result.warnings.append(
            f"{n} request(s) name {len(unknown)} instance(s) no engine log knows ({examples}"
            f"{', ...' if len(unknown) > 3 else ''}): the pool rule cannot judge them by instance; "
            f"add [instances] map = {{ \"{example}\" = \"<engine instance>\" }} or "
            f"match = \"<regex with a (?P<instance>...) group>\" to the incident file, or the missing engine logs"
        )


def _fill_cached_tokens(con: duckdb.DuckDBPyConnection, result: IngestResult) -> None:
    """requests.cached_tokens the gateway lacks, from the engines (sql/cached_tokens.sql); where gateway and
    engine both count a request's cached tokens and differ, a warning with the counts."""
    run_script(con, "cached_tokens")
    filled = con.execute(
        "SELECT cached_tokens_source, count(*) FROM requests WHERE cached_tokens_source LIKE 'engine%' "
        "GROUP BY 1 ORDER BY 1"
    ).fetchall()
    for how, n in filled:
        what = (
            "the engine's per-request count (ReqTimeStats cached_input_len)"
            if how == "engine_request"
            else "a prefill batch of that request alone (#new-seq: 1, #cached-token)"
        )
        result.assumptions.append(
            f"{n} request(s) without cached_tokens from the gateway took it from {what}; "
            f"requests.cached_tokens_source = '{how}'"
        )
    compared, differ, example = one(
        con,
        """
        SELECT count(*), count(*) FILTER (WHERE engine_cached <> gateway_cached),
               min(request_id) FILTER (WHERE engine_cached <> gateway_cached)
        FROM engine_cached_tokens WHERE gateway_cached IS NOT NULL""",
    )
    if differ:
        result.warnings.append(
            f"cached_tokens: the gateway and the engine's own count (ReqTimeStats cached_input_len) differ for "
            f"{differ:,} of {compared:,} request(s) both count (e.g. '{example}'): the two sources contradict each "
            "other; check which engine the gateway's number comes from (table engine_cached_tokens)"
        )


def _check_models(con: duckdb.DuckDBPyConnection, result: IngestResult) -> None:
    rows = con.execute("""SELECT r.model, count(*) FROM requests r
                          WHERE NOT EXISTS (SELECT 1 FROM capacity c WHERE c.model = r.model)
                          GROUP BY 1 ORDER BY 1""").fetchall()
    for model, n in rows:
        result.warnings.append(
            f"unknown model '{model}': no engine log covers it, so the pool rule cannot judge its {n} request(s)"
        )


def _write_account_patterns(con: duckdb.DuckDBPyConnection, incident: Incident) -> None:
    con.execute(
        "CREATE OR REPLACE TABLE account_patterns (pattern VARCHAR, account_class VARCHAR, priority INTEGER)"
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
        raise StrictModeError(
            f"{reason} (--strict stops at the first record that would be quarantined)", location=f"{f}:{line}"
        )
    stopped = [f for f in result.files if any("ends early" in n for n in f.notes)]
    if stopped:
        raise StrictModeError(next(n for n in stopped[0].notes if "ends early" in n), location=stopped[0].file)


def requests_loaded(con: duckdb.DuckDBPyConnection) -> int:
    return one(con, "SELECT count(*) FROM requests")[0]
