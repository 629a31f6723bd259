"""The incident file: one TOML file describes one investigation.

`load_incident` parses and validates it into frozen dataclasses; every problem is a
`ConfigError` naming the key and saying what to write instead.
"""

from __future__ import annotations

import glob as globmod
import re
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kvforensics.errors import ConfigError
from kvforensics.instances import InstanceMatching, instances_from_config
from kvforensics.presets import with_preset

SOURCE_KINDS = ("requests", "engine_log", "changes", "content")
REQUEST_FORMATS = ("jsonl", "csv", "parquet", "sglang_requests", "otlp_json")
ENGINE_FORMATS = ("sglang", "vllm", "auto")
ENGINE_ENVELOPES = ("auto", "none", "kubectl", "cri", "docker", "loki", "cloudwatch", "journald")
CANONICAL_REQUEST_FIELDS = (
    "request_id", "ts", "account_id", "model", "status", "prompt_tokens",
    "completion_tokens", "cached_tokens", "ttft_ms", "latency_ms", "prefill_instance", "decode_instance",
)
REQUIRED_REQUEST_FIELDS = ("request_id", "ts", "account_id", "model", "status", "prompt_tokens")
CANONICAL_CHANGE_FIELDS = ("ts", "model", "instance", "description", "details")
CANONICAL_CONTENT_FIELDS = ("request_id", "prompt", "output")
_INCIDENT_ID = re.compile(r"^[a-z0-9-]+$")
_SOURCE_KEYS = {"name", "kind", "path", "format", "timezone", "columns", "instance", "clock_offset_s",
                "model", "year", "role", "preset", "values", "null_tokens", "envelope"}


@dataclass(frozen=True)
class Source:
    """One input of the investigation, with how to read it."""

    name: str
    kind: str
    path: str
    format: str
    timezone: str
    base_dir: Path
    columns: Mapping[str, str] = field(default_factory=dict)
    instance: str = "{stem}"
    clock_offset_s: float = 0.0
    model: str | None = None
    year: int | None = None
    # requests: value maps (canonical field -> {source text: canonical text}), texts read as NULL, the
    # parsed `columns` expressions (kvforensics/loaders/mapping.py), the preset named, the incident file
    values: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    null_tokens: tuple[str, ...] = ()
    expressions: Mapping[str, Any] = field(default_factory=dict)
    preset: str | None = None
    incident_file: str = ""
    envelope: str = "auto"  # engine_log: the collection envelope (kvforensics/loaders/envelopes.py)

    @property
    def tz(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def files(self) -> list[Path]:
        """The files this source names, sorted; a folder means every file below it (hive layout)."""
        pattern = self.base_dir / self.path
        if pattern.is_dir():
            found = [p for p in pattern.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))]
        else:
            found = [Path(p) for p in globmod.glob(str(pattern), recursive=True) if Path(p).is_file()]
        return sorted(found)

    def instance_for(self, file: Path, labels: Mapping[str, str] | None = None) -> str:
        """The instance *file* (or a record of it with envelope *labels*) belongs to. ``{label:NAME}``
        is the record's label NAME (KeyError if it has none), or the file's stem without labels."""
        name = file.name
        stem = name
        for suffix in (".gz", ".zst", ".log", ".txt", ".jsonl", ".json"):
            if stem.endswith(suffix):
                stem = stem[: -len(suffix)]
        return self.instance.format(stem=stem, name=name, parent=file.parent.name,
                                    label=_InstanceLabels(labels, stem))

    def column(self, canonical: str) -> str:
        return self.columns.get(canonical, canonical)


@dataclass(frozen=True)
class ScopeConfig:
    internal_accounts: tuple[str, ...] = ()
    reporter_accounts: tuple[str, ...] = ()
    start: datetime | None = None
    end: datetime | None = None


@dataclass(frozen=True)
class Event:
    ts: datetime
    title: str
    description: str = ""


@dataclass(frozen=True)
class Incident:
    id: str
    title: str
    path: Path
    sources: tuple[Source, ...]
    scope: ScopeConfig
    events: tuple[Event, ...] = ()
    model_aliases: Mapping[str, str] = field(default_factory=dict)
    hardware: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    rule_parameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    memory_limit: str | None = None
    year: int | None = None
    instances: InstanceMatching = field(default_factory=InstanceMatching)  # [instances]
    max_quarantine_fraction: float = 0.01  # [settings]: above it a requests source makes the run inconclusive

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def sources_of(self, kind: str) -> list[Source]:
        return [s for s in self.sources if s.kind == kind]


def parse_utc(value: Any, where: str) -> datetime:
    """An ISO-8601 timestamp (or TOML datetime) with an explicit offset, as UTC."""
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ConfigError(f"{value!r} is not an ISO-8601 timestamp", location=where) from None
    else:
        raise ConfigError(f"expected a timestamp, got {type(value).__name__}", location=where)
    if dt.tzinfo is None:
        raise ConfigError(f"timestamp {value!s} has no time zone; add 'Z' or an offset such as +02:00",
                          location=where)
    return dt.astimezone(timezone.utc)


def _require(table: Mapping[str, Any], key: str, where: str, kind: type = str) -> Any:
    if key not in table:
        raise ConfigError(f"missing required key '{key}'", location=where)
    value = table[key]
    if not isinstance(value, kind):
        raise ConfigError(f"'{key}' must be a {kind.__name__}, got {type(value).__name__}", location=where)
    return value


def _check_timezone(name: str, where: str) -> str:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"unknown time zone {name!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'",
                          location=where) from None
    return name


def _parse_source(raw: Mapping[str, Any], index: int, base_dir: Path, file_label: str) -> Source:
    where = f"{file_label}: sources[{index}]"
    unknown = sorted(set(raw) - _SOURCE_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; allowed: {sorted(_SOURCE_KEYS)}", location=where)
    name = _require(raw, "name", where)
    where = f"{file_label}: source '{name}'"
    raw = with_preset(raw, where)
    kind = _require(raw, "kind", where)
    if kind not in SOURCE_KINDS:
        raise ConfigError(f"kind {kind!r} is not one of {list(SOURCE_KINDS)}", location=where)
    path = _require(raw, "path", where)
    default_format = {"requests": None, "engine_log": "sglang", "changes": "csv", "content": "jsonl"}[kind]
    fmt = raw.get("format", default_format)
    if fmt is None:
        fmt = _guess_request_format(path)
        if fmt is None:
            raise ConfigError("cannot tell the format from the path; set format = \"jsonl\", \"csv\" or "
                              "\"parquet\"", location=where)
    allowed = ENGINE_FORMATS if kind == "engine_log" else REQUEST_FORMATS
    if fmt not in allowed:
        raise ConfigError(f"format {fmt!r} is not one of {list(allowed)} for kind {kind!r}", location=where)
    columns = raw.get("columns", {})
    if not isinstance(columns, Mapping) or not all(isinstance(v, str) for v in columns.values()):
        raise ConfigError("columns must be a table of canonical = \"source column\"", location=where)
    canonical = {"requests": CANONICAL_REQUEST_FIELDS, "changes": CANONICAL_CHANGE_FIELDS,
                 "content": CANONICAL_CONTENT_FIELDS, "engine_log": ()}[kind]
    bad = sorted(set(columns) - set(canonical))
    if bad:
        raise ConfigError(f"columns maps unknown canonical field(s) {bad}; canonical fields are "
                          f"{list(canonical)}", location=where)
    tz = _check_timezone(raw.get("timezone", "UTC"), where)
    values, null_tokens, expressions = {}, (), {}
    if kind == "requests":
        from kvforensics.loaders.mapping import source_mapping  # it imports this module

        values, null_tokens, expressions = source_mapping(raw, columns, fmt, where)
    elif set(raw) & {"preset", "values", "null_tokens"}:
        raise ConfigError("preset, values and null_tokens apply to kind \"requests\" only", location=where)
    offset = raw.get("clock_offset_s", 0.0)
    if not isinstance(offset, (int, float)):
        raise ConfigError("clock_offset_s must be a number of seconds", location=where)
    year = raw.get("year")
    if year is not None and not isinstance(year, int):
        raise ConfigError("year must be an integer", location=where)
    instance = raw.get("instance", "{stem}")
    try:
        instance.format(stem="x", name="x", parent="x", label=_InstanceLabels(None, "x"))
    except (KeyError, IndexError, ValueError, AttributeError):
        raise ConfigError(f"instance template {instance!r} may only use {{stem}}, {{name}}, {{parent}} and "
                          f"{{label:NAME}} (a label of an engine log's envelope)", location=where) from None
    envelope = raw.get("envelope", "auto")
    if kind != "engine_log" and "envelope" in raw:
        raise ConfigError("envelope applies to kind \"engine_log\" only", location=where)
    if envelope not in ENGINE_ENVELOPES:
        raise ConfigError(f"envelope {envelope!r} is not one of {list(ENGINE_ENVELOPES)}", location=where)
    if envelope == "none" and "{label:" in instance:
        raise ConfigError(f"instance template {instance!r} names an envelope label but envelope = \"none\"; "
                          "set the envelope (or \"auto\") or use {stem}, {name}, {parent}", location=where)
    return Source(name=name, kind=kind, path=path, format=fmt, timezone=tz, base_dir=base_dir,
                  columns=dict(columns), instance=instance, clock_offset_s=float(offset),
                  model=raw.get("model"), year=year, values=values, null_tokens=null_tokens,
                  expressions=expressions, preset=raw.get("preset"), incident_file=file_label,
                  envelope=envelope)


class _InstanceLabels:
    """``{label:NAME}`` in an instance template: the envelope label NAME of a record."""

    def __init__(self, labels: Mapping[str, str] | None, fallback: str) -> None:
        self.labels = labels
        self.fallback = fallback

    def __format__(self, spec: str) -> str:
        if not spec:
            raise ValueError("{label} needs a label name: {label:NAME}")
        if self.labels is None:
            return self.fallback
        return self.labels[spec]


def _guess_request_format(path: str) -> str | None:
    p = path.lower()
    for ext, fmt in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "jsonl"), (".csv", "csv"),
                     (".parquet", "parquet")):
        if ext in p:
            return fmt
    return None


def load_incident(path: str | Path) -> Incident:
    """Read and validate an incident file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"incident file not found: {path}")
    label = path.name
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", location=label) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", location=label) from None
    return incident_from_dict(data, path)


def incident_from_dict(data: Mapping[str, Any], path: Path) -> Incident:
    label = path.name
    inc = data.get("incident")
    if not isinstance(inc, Mapping):
        raise ConfigError("missing [incident] table with id and title", location=label)
    incident_id = _require(inc, "id", f"{label}: [incident]")
    if not _INCIDENT_ID.match(incident_id):
        raise ConfigError(f"id {incident_id!r} may only use a-z, 0-9 and '-'", location=f"{label}: [incident]")
    title = inc.get("title", incident_id)
    raw_sources = data.get("sources", [])
    if not isinstance(raw_sources, list) or not raw_sources:
        raise ConfigError("no [[sources]]: name at least one requests source", location=label)
    base_dir = path.resolve().parent
    sources = tuple(_parse_source(s, i, base_dir, label) for i, s in enumerate(raw_sources))
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"source names must be unique; repeated: {dupes}", location=label)
    if not any(s.kind == "requests" for s in sources):
        raise ConfigError("no source of kind 'requests': the investigation needs the gateway request log",
                          location=label)
    sc = data.get("scope", {})
    scope = ScopeConfig(
        internal_accounts=tuple(sc.get("internal_accounts", ())),
        reporter_accounts=tuple(sc.get("reporter_accounts", ())),
        start=parse_utc(sc["start"], f"{label}: [scope].start") if "start" in sc else None,
        end=parse_utc(sc["end"], f"{label}: [scope].end") if "end" in sc else None,
    )
    if scope.start and scope.end and scope.start >= scope.end:
        raise ConfigError("start must be before end", location=f"{label}: [scope]")
    events = []
    for i, ev in enumerate(data.get("events", [])):
        where = f"{label}: events[{i}]"
        events.append(Event(ts=parse_utc(_require(ev, "ts", where, object), where),
                            title=_require(ev, "title", where), description=ev.get("description", "")))
    models = data.get("models", {})
    aliases = models.get("aliases", {}) if isinstance(models, Mapping) else {}
    hardware = models.get("hardware", {}) if isinstance(models, Mapping) else {}
    if hardware:
        from kvforensics.hardware import spec_from_config

        for model, raw in hardware.items():
            spec_from_config(model, raw)  # validate early, with the key's location
    rules = data.get("rules", {})
    settings = data.get("settings", {})
    year = settings.get("year")
    max_q = settings.get("max_quarantine_fraction", 0.01)
    if isinstance(max_q, bool) or not isinstance(max_q, (int, float)) or not 0 <= max_q <= 1:
        raise ConfigError("max_quarantine_fraction must be a number from 0 to 1 (the share of a requests source's "
                          "records that may be quarantined before the run is inconclusive)",
                          location=f"{label}: [settings]")
    return Incident(id=incident_id, title=title, path=path.resolve(), sources=sources, scope=scope,
                    events=tuple(sorted(events, key=lambda e: e.ts)), model_aliases=dict(aliases),
                    hardware={k: dict(v) for k, v in hardware.items()},
                    rule_parameters={k: dict(v) for k, v in rules.items()},
                    memory_limit=settings.get("memory_limit"), year=year,
                    instances=instances_from_config(data.get("instances"), f"{label}: [instances]"),
                    max_quarantine_fraction=float(max_q))
