"""Start-ups as the checks see them: one configuration interval of one engine instance.

Every start-up of every engine instance is one interval, from its first line until it ended by the
ingest's rule (:func:`kvforensics.stages.instances.lifetimes`, so the audit and the evidence database's
``capacity`` table agree): its own shutdown lines (``shutdown``), the next start-up of the same
instance (``next_startup``), or the end of its log when a successor of the same model and role took
over on another instance (``log_end``: a pod replaced in a rollout). A log that merely stops, with
no successor, leaves the start-up **in force**.

A restart that logs no ``server_args`` takes the role (and model) of the instance's previous
start-up (:func:`link`), or the ``disaggregation_mode`` of a ``server_info`` dump
(:func:`attach_server_info`), and the verdict says so. An engine event belongs to the last start-up
before it in its file, else (a rotated file) to the start-up running at its time
(:func:`assign_events`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvforensics.audit.inputs import ServerInfo
from kvforensics.audit.model import AUDIT_EVENT_KINDS, PD_ROLES
from kvforensics.audit.phrases import iso, thousands
from kvforensics.sources.engine_logs.contract import EngineEvent, StartupRecord
from kvforensics.stages.instances import (
    UNKNOWN_ROLE,
    PlacedStartup,
    lifetimes,
    role_carried_over,
    roles_carried_over,
)


@dataclass
class EventStat:
    """The engine events of one kind in one start-up: how many, the first, and the limits they report."""

    count: int
    first_file: str | None
    first_line: int | None
    min_limit: int | None
    max_limit: int | None


@dataclass
class Startup:
    """One start-up of one instance, normalised from a parsed log or a ``capacity`` row, as the checks
    judge it: its settings, where each was read (``evidence``), how it ended and its events."""

    instance: str
    file: str | None
    line: int | None
    ts: datetime | None
    engine: str
    version: str | None
    version_source: str | None
    role: str
    model: str | None
    engine_model: str | None
    pool: int | None
    pool_line: int | None
    context: int | None
    dp_size: int | None
    flags: dict[str, str]
    evidence: dict[str, int]
    refused: bool = False
    pool_file: str | None = None  # where the pool comes from when not this start-up's log
    to: datetime | None = None  # valid_to: when it ended (kvforensics/stages/instances.py)
    end_reason: str | None = None
    end_file: str | None = None
    end_line: int | None = None
    successor: str | None = None
    last_ts: datetime | None = None  # how far its log goes, and its own shutdown line (parsed logs only)
    last_line: int | None = None
    shutdown_ts: datetime | None = None
    shutdown_line: int | None = None
    role_certain: bool = True
    role_note: str | None = None
    server_info: ServerInfo | None = None
    events: dict[str, EventStat] = field(default_factory=dict)

    def where(self, key: str | None = None) -> tuple[str | None, int | None]:
        """(file, line) of the evidence for *key*, else of the start-up itself."""
        if key is not None and key in self.evidence:
            return self.file, self.evidence[key]
        return self.file, self.line

    @property
    def pd(self) -> bool | None:
        """True for prefill/decode, False for a unified server, None when the role is unknown."""
        if not self.role_certain:
            return None
        return self.role in PD_ROLES


def from_record(r: StartupRecord, file: str | None, aliases: Mapping[str, str]) -> Startup:
    flags = dict(r.flags)
    role_source = flags.get("role_source", "")
    return Startup(
        instance=r.instance,
        file=file,
        line=r.line,
        ts=r.ts,
        engine=r.engine,
        version=r.engine_version,
        version_source=r.version_source,
        role=r.role,
        model=_alias(r.model, aliases),
        engine_model=r.model,
        pool=r.kv_pool_tokens,
        pool_line=r.pool_source_line,
        context=r.context_length,
        dp_size=r.dp_size,
        flags=flags,
        evidence=dict(r.evidence),
        refused=flags.get("startup_refused", "").lower() == "true",
        last_ts=r.last_ts,
        last_line=r.last_line,
        shutdown_ts=r.shutdown_ts,
        shutdown_line=r.shutdown_line,
        role_certain=r.role != UNKNOWN_ROLE and not role_source.startswith("default"),
    )


def _alias(model: str | None, aliases: Mapping[str, str]) -> str | None:
    if model is None:
        return None
    if model in aliases:
        return aliases[model]
    lowered = {k.lower(): v for k, v in aliases.items()}
    return lowered.get(model.lower(), model)


def _event_kind(kind: str, detail: str) -> str:
    if kind == "abort_input_too_long" and "maximum allowed length" in detail:
        return "scheduler_abort"
    return kind


def _add_event(s: Startup, kind: str, file: str | None, line: int | None, limit: int | None) -> None:
    stat = s.events.get(kind)
    if stat is None:
        s.events[kind] = EventStat(1, file, line, limit, limit)
        return
    stat.count += 1
    if limit is not None:
        stat.min_limit = limit if stat.min_limit is None else min(stat.min_limit, limit)
        stat.max_limit = limit if stat.max_limit is None else max(stat.max_limit, limit)


def _sort_key(s: Startup) -> tuple[Any, ...]:
    return (s.instance, s.ts is None, s.ts or datetime.min.replace(tzinfo=UTC), s.file or "", s.line or 0)


def end_lifetimes(startups: list[Startup], handover_s: float) -> None:
    """End each start-up as the ingest does (shutdown, next start-up, or retired when a successor took
    over), with the role and model the parse gave, so that the audit agrees with ``capacity``."""
    placed = [
        PlacedStartup(
            instance=s.instance,
            role=s.role,
            model=s.model,
            ts=s.ts,
            file=s.file or "",
            line=s.line or 0,
            last_ts=s.last_ts,
            last_line=s.last_line,
            shutdown_ts=s.shutdown_ts,
            shutdown_line=s.shutdown_line,
        )
        for s in startups
    ]
    for s, end in zip(startups, lifetimes(placed, handover_s), strict=True):
        s.to, s.end_reason, s.end_file, s.end_line, s.successor = (
            end.valid_to,
            end.end_reason,
            end.end_file or None,
            end.end_line,
            end.successor,
        )


def link(startups: list[Startup]) -> None:
    """Order start-ups per instance and carry a role over a bare restart, by the rule the ingest's
    ``capacity`` table follows (:func:`kvforensics.stages.instances.roles_carried_over`)."""
    startups.sort(key=_sort_key)
    placed = [
        PlacedStartup(
            instance=s.instance,
            role=s.role if s.role_certain else UNKNOWN_ROLE,
            model=s.model,
            ts=s.ts,
            file=s.file or "",
            line=s.line or 0,
        )
        for s in startups
    ]
    for s, k in zip(startups, roles_carried_over(placed), strict=True):
        if k is None:
            continue
        prev = startups[k]
        s.role, s.role_certain = prev.role, True
        what = "role"
        if s.model is None and prev.model is not None:
            s.model, s.engine_model = prev.model, prev.engine_model
            what = "role and model"
        s.role_note = f"{what} {role_carried_over(Path(prev.file or '').name, prev.line or 0)}"


def assign_events(startups: list[Startup], events: Iterable[tuple[str | None, EngineEvent]]) -> int:
    """Give each event to its start-up: same file and after its first line, else by time."""
    by_file: dict[tuple[str, str | None], list[Startup]] = {}
    by_instance: dict[str, list[Startup]] = {}
    for s in startups:
        by_file.setdefault((s.instance, s.file), []).append(s)
        by_instance.setdefault(s.instance, []).append(s)
    for group in by_file.values():
        group.sort(key=lambda x: x.line or 0)
    lost = 0
    for file, e in events:
        kind = _event_kind(e.kind, e.detail)
        if e.kind not in AUDIT_EVENT_KINDS:
            continue
        target = None
        for s in by_file.get((e.instance, file), []):
            if (s.line or 0) <= e.line:
                target = s
        if target is None and e.ts is not None:
            for s in by_instance.get(e.instance, []):
                if s.ts is not None and s.ts <= e.ts and (s.to is None or e.ts < s.to):
                    target = s
        if target is None:
            lost += 1
            continue
        _add_event(target, kind, file, e.line, e.limit_tokens)
    return lost


def attach_server_info(startups: list[Startup], infos: Sequence[ServerInfo], notes: list[str]) -> None:
    for info in infos:
        mine = [s for s in startups if s.instance == info.instance]
        if not mine:
            notes.append(
                f"{info.file}: server_info for instance '{info.instance}', which has no start-up in "
                "the engine logs; not used"
            )
            continue
        target = mine[-1]
        if info.captured_at is not None:
            hits = [
                s
                for s in mine
                if s.ts is not None and s.ts <= info.captured_at and (s.to is None or info.captured_at < s.to)
            ]
            if not hits:
                notes.append(
                    f"{info.file}: captured at {iso(info.captured_at)}, when no logged start-up of "
                    f"'{info.instance}' was running; not used"
                )
                continue
            target = hits[-1]
        target.server_info = info
        if not target.role_certain and "disaggregation_mode" in info.args:
            mode = info.args["disaggregation_mode"]
            target.role = mode if mode in PD_ROLES else "unified"
            target.role_certain = True
            target.role_note = f"role from {Path(info.file).name} (disaggregation_mode={mode})"
        reported = info.max_total_num_tokens
        if reported is not None and (target.pool is None or reported < target.pool):
            if target.pool is not None:
                target.flags["kv_pool_log_tokens"] = str(target.pool)
            target.pool, target.pool_file, target.pool_line = (
                reported,
                info.file,
                info.line_of("max_total_num_tokens"),
            )
            target.flags["kv_pool_source"] = f"server_info {Path(info.file).name}" + (
                f", smaller than the {thousands(int(target.flags['kv_pool_log_tokens']))} in the log"
                if "kv_pool_log_tokens" in target.flags
                else ""
            )


def from_capacity_row(row: Sequence[Any]) -> Startup:
    """A start-up from one row of the ``audit_capacity`` query: the evidence database's ``capacity`` table
    with each start-up's end. The database keeps the start-up's first line and its pool line; other
    evidence (server args, version) points at the first line, a refused vLLM start-up at its pool line."""
    (
        instance,
        role,
        model,
        engine_model,
        valid_from,
        valid_to,
        pool,
        context,
        _page,
        engine,
        version,
        version_source,
        _tp,
        dp,
        flags_json,
        refused,
        _source,
        source_file,
        source_line,
        pool_line,
        end_reason,
        end_file,
        end_line,
        successor,
    ) = row
    try:
        flags = {str(k): str(v) for k, v in json.loads(flags_json or "{}").items()}
    except (json.JSONDecodeError, AttributeError):
        flags = {}
    line = int(source_line) if source_line is not None else None
    role_source = flags.get("role_source", "")
    evidence = {"server_args": line} if line is not None and "role_source" not in flags else {}
    is_refused = bool(refused) or flags.get("startup_refused", "").lower() == "true"
    if is_refused and pool_line is not None:  # vLLM: the pool of a refused start comes from the refusal
        evidence["startup_refused"] = int(pool_line)
    return Startup(
        instance=instance,
        file=source_file,
        line=line,
        ts=_utc(valid_from),
        engine=engine,
        version=version,
        version_source=version_source,
        role=role,
        model=model or engine_model,
        engine_model=engine_model,
        pool=pool,
        pool_line=pool_line,
        context=context,
        dp_size=dp,
        flags=flags,
        evidence=evidence,
        refused=is_refused,
        to=_utc(valid_to),
        end_reason=end_reason,
        end_file=end_file,
        end_line=end_line,
        successor=successor,
        role_certain=role != UNKNOWN_ROLE and not role_source.startswith("default"),
        role_note=(
            f"{'role and model' if flags.get('model_source', '').startswith('assumed') else 'role'} {role_source}"
            if role_source.startswith("assumed")
            else None
        ),
    )


def _utc(ts: datetime | None) -> datetime | None:
    if ts is None:
        return None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
