"""Entry points of the audit: engine logs, parsed logs, an incident file or an evidence database in,
an :class:`~kvforensics.audit.report.AuditReport` out.

Each gathers the start-ups (:mod:`kvforensics.audit.startups`), ends them, links bare restarts to
their predecessors, places the engine events and the ``/get_server_info`` dumps, and runs the six
checks (:mod:`kvforensics.audit.checks`) on every start-up. Unreadable inputs raise
:class:`~kvforensics.core.errors.InputError` (the CLI exits 2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kvforensics.audit.checks.common import Judged
from kvforensics.audit.checks.corruption_detection import check_corruption_detection
from kvforensics.audit.checks.engine_version import check_engine_version, exact_version
from kvforensics.audit.checks.load_balancer import check_load_balancer
from kvforensics.audit.checks.pool_vs_context import check_pool_vs_context
from kvforensics.audit.checks.prefix_cache import check_prefix_cache
from kvforensics.audit.checks.release_and_batch import check_release_and_batch
from kvforensics.audit.inputs import DeploymentManifest, ServerInfo, read_manifest, read_server_info
from kvforensics.audit.model import AUDIT_EVENT_KINDS, CHECKS, Verdict
from kvforensics.audit.report import AuditReport
from kvforensics.audit.startups import (
    EventStat,
    Startup,
    assign_events,
    attach_server_info,
    end_lifetimes,
    from_capacity_row,
    from_record,
    link,
)
from kvforensics.config import Incident, Source
from kvforensics.core.errors import InputError
from kvforensics.sources.engine_logs.contract import EngineEvent, EngineLogParse, StartupRecord
from kvforensics.sources.engine_logs.parse import parse_engine_log
from kvforensics.stages.instances import DEFAULT_HANDOVER_S

if TYPE_CHECKING:
    import duckdb


def _verdict(
    s: Startup,
    check: int,
    status: str,
    detail: str,
    file: str | None,
    line: int | None,
    exposed: bool = False,
) -> Verdict:
    return Verdict(
        instance=s.instance,
        role=s.role if s.role_certain else "unknown",
        model=s.model,
        startup_from=s.ts,
        startup_to=s.to,
        check=check,
        check_name=CHECKS[check],
        status=status,
        exposed=exposed,
        detail=detail,
        evidence_file=file,
        evidence_line=line,
        engine=s.engine,
        engine_version=s.version,
        startup_file=s.file,
        startup_line=s.line,
        end_reason=s.end_reason,
        end_file=s.end_file,
        end_line=s.end_line,
        successor=s.successor,
    )


def _judge(startups: list[Startup], manifest: DeploymentManifest | None) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for s in startups:
        status, detail, file, line, exposed = check_pool_vs_context(s)
        verdicts.append(_verdict(s, 1, status, detail, file, line, exposed))
        if s.engine == "vllm" and s.refused:
            others: list[Judged] = [("not_applicable", "vLLM refused to start: nothing served", *s.where())] * (
                len(CHECKS) - 1
            )
        else:
            others = [
                check_engine_version(s),
                check_release_and_batch(s),
                check_corruption_detection(s),
                check_load_balancer(s, manifest),
                check_prefix_cache(s, manifest),
            ]
        # a check-6 fail is an exposure too: a prefix cache one tenant's request can read another's KV from
        verdicts += [
            _verdict(s, check, *judged, exposed=check == 6 and judged[0] == "fail")
            for check, judged in enumerate(others, start=2)
        ]
    return verdicts


def declare_versions(startups: Iterable[Startup], manifest: DeploymentManifest | None) -> None:
    """A start-up whose log names no exact version takes the one ``[prefix_cache] engine_version`` declares
    (source ``declared``); a version the log or a server-info dump states wins."""
    if manifest is None or manifest.prefix_cache is None:
        return
    for s in startups:
        said = manifest.prefix_cache.for_startup(s.instance, (s.model, s.engine_model)).get("engine_version")
        if said is not None and exact_version(s) is None:
            s.version, s.version_source = str(said.value), "declared"


def _report(
    startups: list[Startup],
    *,
    server_info: Sequence[ServerInfo | str | Path],
    manifest: DeploymentManifest | str | Path | None,
    notes: list[str],
    inputs: list[str],
    events: Iterable[tuple[str | None, EngineEvent]] | None = None,
    handover_s: float | None = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """*handover_s* None: the start-ups already carry their ends (the ``capacity`` table)."""
    infos = [i if isinstance(i, ServerInfo) else read_server_info(i) for i in server_info]
    lb = manifest if manifest is None or isinstance(manifest, DeploymentManifest) else read_manifest(manifest)
    if handover_s is not None:
        end_lifetimes(startups, handover_s)
    link(startups)
    if events is not None:
        lost = assign_events(startups, events)
        if lost:
            notes.append(
                f"{lost} engine event(s) could not be placed in any start-up (no start-up before them "
                "in their file and no timestamp inside a logged interval); not audited"
            )
    attach_server_info(startups, infos, notes)
    declare_versions(startups, lb)
    if not startups:
        notes.append("no engine start-up found in the inputs: nothing to audit")
    inputs = inputs + [i.file for i in infos] + ([lb.file] if lb is not None else [])
    return AuditReport(verdicts=_judge(startups, lb), notes=notes, inputs=inputs)


def audit_startups(
    startups: Iterable[StartupRecord | tuple[str | Path, StartupRecord]],
    events: Iterable[EngineEvent | tuple[str | Path, EngineEvent]] = (),
    *,
    source_file: str | Path | None = None,
    server_info: Sequence[ServerInfo | str | Path] = (),
    manifest: DeploymentManifest | str | Path | None = None,
    model_aliases: Mapping[str, str] | None = None,
    handover_s: float = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """Audit parsed start-ups (pure when given parsed :class:`ServerInfo` / :class:`DeploymentManifest`).

    Items may be bare records (their file is *source_file*) or ``(file, record)`` pairs.
    *model_aliases* maps engine model names to gateway model ids, as in the incident file;
    *handover_s* is the ``[instances] handover_s`` of the lifetime rule.
    """
    aliases = dict(model_aliases or {})
    default = str(source_file) if source_file is not None else None
    norm = []
    for item in startups:
        file, rec = (str(item[0]), item[1]) if isinstance(item, tuple) else (default, item)
        norm.append(from_record(rec, file, aliases))
    evs = [(str(e[0]), e[1]) if isinstance(e, tuple) else (default, e) for e in events]
    files = sorted({s.file for s in norm if s.file})
    return _report(
        norm,
        server_info=server_info,
        manifest=manifest,
        notes=[],
        inputs=files,
        events=evs,
        handover_s=handover_s,
    )


def audit_parses(
    parses: Mapping[str | Path, EngineLogParse],
    *,
    server_info: Sequence[ServerInfo | str | Path] = (),
    manifest: DeploymentManifest | str | Path | None = None,
    model_aliases: Mapping[str, str] | None = None,
    handover_s: float = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """Audit engine logs already parsed by :func:`~kvforensics.sources.engine_logs.parse.parse_engine_log`."""
    aliases = dict(model_aliases or {})
    norm: list[Startup] = []
    events: list[tuple[str | None, EngineEvent]] = []
    notes: list[str] = []
    names = [Path(p).name for p in parses]
    shared = {n for n in names if names.count(n) > 1}  # engines/*/sglang.log.gz: named with their folder
    for path, parse in parses.items():
        file = str(path)
        norm += [from_record(r, file, aliases) for r in parse.startups]
        events += [(file, e) for e in parse.events if e.kind in AUDIT_EVENT_KINDS]
        name = Path(file).name if Path(file).name not in shared else f"{Path(file).parent.name}/{Path(file).name}"
        notes += [f"{name}: {n}" for n in parse.notes]
        if parse.quarantined:
            notes.append(
                f"{name}: {len(parse.quarantined)} line(s) could not be read and were skipped "
                f"(first at line {parse.quarantined[0].line}: {parse.quarantined[0].reason})"
            )
        if not parse.startups:
            notes.append(f"{name}: no engine start-up found; this file gives no KV pool size")
    return _report(
        norm,
        server_info=server_info,
        manifest=manifest,
        notes=notes,
        inputs=[str(p) for p in parses],
        events=events,
        handover_s=handover_s,
    )


def _zone(tz: str | ZoneInfo) -> ZoneInfo:
    if isinstance(tz, ZoneInfo):
        return tz
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise InputError(f"unknown time zone {tz!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'") from e


def audit_paths(
    paths: Sequence[str | Path],
    *,
    fmt: str = "auto",
    tz: str | ZoneInfo = "UTC",
    year: int | None = None,
    instance_template: str | None = None,
    clock_offset_s: float = 0.0,
    server_info: Sequence[str | Path | ServerInfo] = (),
    manifest: str | Path | DeploymentManifest | None = None,
    model_aliases: Mapping[str, str] | None = None,
    envelope: str = "auto",
    handover_s: float = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """Parse engine logs (plain, .gz, .zst; SGLang or vLLM) and audit every start-up in them.

    ``tz`` is the zone of the engines' naive timestamps, ``year`` the year of vLLM's year-less
    stamps, ``instance_template`` names the instance from the file (``{stem}``, ``{name}``,
    ``{parent}``, or an envelope label ``{label:NAME}``; by default :func:`default_instance_template`,
    which says in a note when it is not ``{stem}``), ``envelope`` the collection envelope
    (``auto``: recognised; a file of several instances gives several), ``handover_s`` how long a
    successor may start before a replaced pod's log ends (``[instances] handover_s``). Raises
    :class:`~kvforensics.core.errors.InputError` for an unreadable input.
    """
    if not paths:
        raise InputError("no engine logs given: name at least one SGLang or vLLM log file")
    zone = _zone(tz)
    notes: list[str] = []
    if instance_template is None:
        instance_template, note = default_instance_template([Path(p) for p in paths])
        notes += [note] if note else []
    template = _instance_source(instance_template, fmt, zone)
    parses: dict[str | Path, EngineLogParse] = {}
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise InputError("engine log not found", location=str(path))
        parses[str(path)] = parse_engine_log(
            path,
            fmt=fmt,
            instance=partial(template.instance_for, path),
            tz=zone,
            year=year,
            clock_offset_s=clock_offset_s,
            envelope=envelope,
        )
    infos = [
        i if isinstance(i, ServerInfo) else read_server_info(i, instance_template=instance_template)
        for i in server_info
    ]
    report = audit_parses(
        parses, server_info=infos, manifest=manifest, model_aliases=model_aliases, handover_s=handover_s
    )
    report.notes[:0] = notes
    return report


def _instance_source(instance_template: str, fmt: str, zone: ZoneInfo) -> Source:
    """A source that names instances with *instance_template* (refused unless its placeholders are known)."""
    try:
        template = Source(
            name="audit",
            kind="engine_log",
            path="",
            format=fmt,
            timezone=zone.key,
            base_dir=Path("."),
            instance=instance_template,
        )
        template.instance_for(Path("x.log"))
    except (KeyError, IndexError, ValueError) as e:
        raise InputError(
            f"instance template {instance_template!r} may only use {{stem}}, {{name}}, {{parent}} and "
            "{label:NAME}: e.g. --instance '{parent}'"
        ) from e
    return template


def default_instance_template(paths: Sequence[Path]) -> tuple[str, str | None]:
    """The instance template of engine logs audited without one, and a note when it is not ``{stem}``.

    ``{stem}`` (the file name without its extensions) unless files in different folders share a stem,
    as ``engines/*/sglang.log.gz`` do: merged into one instance, their start-ups would be judged as one
    engine's. Then each folder is an instance: ``{parent}`` when every folder holds files of one stem
    (and no two folders share a name), else ``{parent}/{stem}``."""
    stem = _instance_source("{stem}", "auto", ZoneInfo("UTC"))
    folders: dict[str, set[Path]] = {}
    for path in paths:
        folders.setdefault(stem.instance_for(path), set()).add(path.resolve().parent)
    shared = sorted(name for name, where in folders.items() if len(where) > 1)
    if not shared:
        return "{stem}", None
    stems_of: dict[Path, set[str]] = {}
    for path in paths:
        stems_of.setdefault(path.resolve().parent, set()).add(stem.instance_for(path))
    one_stem_each = all(len(stems) == 1 for stems in stems_of.values())
    distinct_names = len({folder.name for folder in stems_of}) == len(stems_of)
    chosen = "{parent}" if one_stem_each and distinct_names else "{parent}/{stem}"
    files = sum(len(folders[name]) for name in shared)
    names = ", ".join(f"'{name}'" for name in shared[:3]) + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
    return chosen, (
        f"{files} files in different folders share the instance name {names} that --instance '{{stem}}' gives: "
        f"told apart by their folder instead (--instance '{chosen}'); pass --instance '{{stem}}' if they are "
        "one engine's logs"
    )


def audit_incident(
    incident: Incident,
    *,
    server_info: Sequence[str | Path | ServerInfo] = (),
    manifest: str | Path | DeploymentManifest | None = None,
) -> AuditReport:
    """Audit the engine logs an incident file names, with each source's zone, format and year."""
    parses: dict[str | Path, EngineLogParse] = {}
    sources = incident.sources_of("engine_log")
    if not sources:
        raise InputError("the incident file names no engine_log source: nothing to audit", location=str(incident.path))
    for source in sources:
        files = source.files()
        if not files:
            raise InputError(
                f"engine_log source '{source.name}' matches no file ({source.path})",
                location=str(incident.path),
            )
        for path in files:
            parses[str(path)] = parse_engine_log(
                path,
                fmt=source.format,
                instance=partial(source.instance_for, path),
                tz=source.tz,
                year=source.year or incident.year,
                clock_offset_s=source.clock_offset_s,
                envelope=source.envelope,
            )
    return audit_parses(
        parses,
        server_info=server_info,
        manifest=manifest,
        model_aliases=incident.model_aliases,
        handover_s=incident.instances.handover_s,
    )


def audit_database(
    con: duckdb.DuckDBPyConnection,
    *,
    server_info: Sequence[str | Path | ServerInfo] = (),
    manifest: str | Path | DeploymentManifest | None = None,
) -> AuditReport:
    """Audit the start-ups in an evidence database's ``capacity`` table (with ``engine_events``).

    The database keeps the start-up's first line and its pool line; other evidence (server args,
    version) points at the start-up's first line, and a refused vLLM start-up at its pool line.
    ``model`` is the gateway id the ingest resolved; each start-up ends where the ingest ended it.
    """
    import duckdb

    from kvforensics.core.db import sql

    try:
        rows = con.execute(sql("audit_capacity")).fetchall()
    except (duckdb.CatalogException, duckdb.BinderException) as e:
        raise InputError(
            f"the evidence database has no capacity table with start-up ends ({str(e).splitlines()[0]}): "
            "open it writable (its schema is then brought up to date) or run 'kvforensics ingest' again"
        ) from e
    norm = [from_capacity_row(row) for row in rows]
    index = {(s.instance, s.file, s.line): s for s in norm}
    for (
        instance,
        startup_file,
        startup_line,
        kind,
        count,
        first_file,
        first_line,
        min_limit,
        max_limit,
    ) in con.execute(sql("audit_events")).fetchall():
        found = index.get((instance, startup_file, startup_line))
        if found is not None:
            found.events[kind] = EventStat(int(count), first_file, first_line, min_limit, max_limit)
    files = sorted({s.file for s in norm if s.file})
    return _report(norm, server_info=server_info, manifest=manifest, notes=[], inputs=files, handover_s=None)
