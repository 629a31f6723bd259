"""The incident file: one TOML file describes one investigation.

`load_incident` parses and validates it into frozen dataclasses; every problem is a
`ConfigError` naming the key and saying what to write instead.

Size: the contract of every table and key is checked here, in one pass, so that one module tells what an incident
file may say; the parts with rules of their own live beside it (stages/instances.py, sources/requests/presets/, stages/probing.py, config/hardware.py,
core/source_paths.py), and what a source of each kind may say is its kind's declaration (sources/<kind>/kind.yml,
read by kvforensics.sources).
"""

from __future__ import annotations

import difflib
import glob as globmod
import re
import tomllib
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kvforensics.config.hardware import PRECISIONS, SPEC_TABLE_KEYS, spec_from_config
from kvforensics.core.canonical import (
    REQUIRED_REQUEST_FIELDS as REQUIRED_REQUEST_FIELDS,  # imported from here too
)
from kvforensics.core.errors import ConfigError, InputError
from kvforensics.core.fingerprint import MAX_WINNOW_WINDOW, WINNOW_WINDOW
from kvforensics.core.source_paths import check_inside
from kvforensics.mechanisms import load_mechanisms
from kvforensics.sources import SourceKind, envelope_names, kinds_by_name, load_kinds
from kvforensics.sources.requests.mapping import source_mapping
from kvforensics.sources.requests.presets import with_preset
from kvforensics.stages.instances import InstanceMatching, instances_from_config
from kvforensics.stages.probing import probing_parameters
from kvforensics.stages.rulebook import load_rules

SOURCE_KINDS = tuple(k.name for k in load_kinds())  # each kind's own folder: kvforensics/sources/<kind>/kind.yml
ENGINE_ENVELOPES = ("auto", "none", *envelope_names())
AMBIGUOUS_TIMES = ("reject", "earlier", "later")
_INCIDENT_ID = re.compile(r"^[a-z0-9-]+$")
# the keys every source may have, and those only a source of one kind may (its kind.yml's keys)
_SOURCE_KEYS = {
    "name",
    "kind",
    "path",
    "format",
    "timezone",
    "columns",
    "instance",
    "clock_offset_s",
    "model",
    "year",
    *(key for k in load_kinds() for key, _ in k.keys),
}
_SOURCE_TEXT_KEYS = (
    "name",
    "kind",
    "path",
    "format",
    "timezone",
    "instance",
    "model",
    "preset",
    "envelope",
    "ambiguous",
)
#: The tables of an incident file and the keys each may hold ([[sources]]: _SOURCE_KEYS; [rules.<id>]: the
#: rule's parameters; [models.hardware."<model>"]: kvforensics.config.hardware.SPEC_TABLE_KEYS), and its one
#: top-level key, `mechanisms` (the ids of kvforensics/mechanisms/ to investigate; written before the tables).
TOP_LEVEL_TABLES = {
    "mechanisms": "mechanisms = [...]",
    "incident": "[incident]",
    "sources": "[[sources]]",
    "scope": "[scope]",
    "events": "[[events]]",
    "models": "[models]",
    "settings": "[settings]",
    "instances": "[instances]",
    "rules": "[rules]",
    "prefix_cache": "[prefix_cache]",
    "quarantine": "[quarantine]",
    "notice": "[notice]",
}
_PREFIX_CACHE_KEYS = {
    "block_size",
    "word_blocks",
    "probing",
    "shared_namespaces",
    # the deployment's isolation facts, the keys of the audit manifest's [prefix_cache]
    "tenants",
    "cache_salt",
    "kv_store_keys_salt",
    "engine_version",
    "models",
    "instances",
}
_ISOLATION_KEYS = ("tenants", "cache_salt", "kv_store_keys_salt", "engine_version", "models", "instances")
_INCIDENT_KEYS = {"id", "title"}
_SCOPE_KEYS = {"internal_accounts", "reporter_accounts", "start", "end"}
_EVENT_KEYS = {"ts", "title", "description"}
_MODELS_KEYS = {"aliases", "hardware"}
_SETTINGS_KEYS = {
    "year",
    "memory_limit",
    "max_quarantine_fraction",
    "spark_requests_table",
    "allow_outside",
    "winnow_window",
}
#: [notice]: what the responder declares for the notices (kvforensics.report.notices): who sends them, where to ask,
#: the reference to quote, the measures taken and the advice, in plain words.
NOTICE_KEYS = {
    "provider": "a string",
    "contact": "a string",
    "reference": "a string",
    "measures": "a list of strings",
    "advice": "a list of strings",
}
# a notice says who sends it, where to ask and the measures taken (GDPR Art. 34(2) with 33(3)(b, d)): without them
# every notice is a draft
NOTICE_REQUIRED = ("provider", "contact", "measures")


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
    # parsed `columns` expressions (kvforensics/sources/requests/mapping.py), the preset named, the incident file
    values: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    null_tokens: tuple[str, ...] = ()
    expressions: Mapping[str, Any] = field(default_factory=dict)
    preset: str | None = None
    incident_file: str = ""
    envelope: str = "auto"  # engine_log: the collection envelope (kvforensics/sources/engine_logs/envelopes/parse.py)
    # requests: a local time a DST change makes ambiguous or nonexistent: "earlier" / "later" of its
    # two UTC instants, or "reject" (quarantined)
    ambiguous: str = "reject"

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
        stem = file_stem(name)
        return self.instance.format(stem=stem, name=name, parent=file.parent.name, label=_InstanceLabels(labels, stem))

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
class NoticeConfig:
    """``[notice]``: declared by the responder, never derived: the notices print these as written."""

    provider: str | None = None  # who the notices come from ("Example Inference Ltd")
    contact: str | None = None  # where a recipient asks (an address, a page)
    reference: str | None = None  # the reference a recipient quotes (default: the incident id)
    measures: tuple[str, ...] = ()  # the measures taken, each a sentence in plain words
    advice: tuple[str, ...] = ()  # further advice to every recipient, each a sentence

    @property
    def missing(self) -> tuple[str, ...]:
        """The keys a notice cannot be sent without (``NOTICE_REQUIRED``) that are not set: its notices are drafts."""

        def given(value: str | tuple[str, ...] | None) -> bool:
            return any(v.strip() for v in value) if isinstance(value, tuple) else bool((value or "").strip())

        return tuple(k for k in NOTICE_REQUIRED if not given(getattr(self, k)))


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
    max_quarantine_fraction: float = 0.01  # [settings]: above it a source makes the run inconclusive
    # [quarantine] <kind> = fraction: the limit of the sources of that kind, where it is not the default above
    quarantine_fractions: Mapping[str, float] = field(default_factory=dict)
    mechanisms: tuple[str, ...] | None = None  # the mechanisms named; None: every one whose inputs are present
    prefix_block_size: int | None = None  # [prefix_cache] block_size: the engines' prefix-cache block size
    prefix_word_blocks: bool = False  # [prefix_cache] present: prompts without token ids cut into word blocks
    # [prefix_cache.probing]: thresholds of the prefix-cache probing assessment (kvforensics.stages.probing), the
    # ones the file sets; the others keep their defaults
    probing_parameters: Mapping[str, int | float] = field(default_factory=dict)
    # [prefix_cache] isolation facts (tenants, cache_salt, kv_store_keys_salt, engine_version and their
    # per-model / per-instance overrides): a kvforensics.config.tenancy.PrefixCachePolicy, None when unstated
    prefix_isolation: Any = None
    # [prefix_cache] shared_namespaces: cache salts (globs) the provider documents as shared by every
    # tenant (a public playground's namespace): their blocks are never another tenant's data
    prefix_shared_namespaces: tuple[str, ...] = ()
    notice: NoticeConfig = field(default_factory=NoticeConfig)  # [notice]
    # [settings] allow_outside / --allow-outside: source files may resolve outside the incident folder
    allow_outside: bool = False
    # [settings] winnow_window: of every this many consecutive shingles of a content text one is fingerprinted
    # (kvforensics/core/fingerprint.py); 1 fingerprints every shingle
    winnow_window: int = WINNOW_WINDOW

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def max_quarantine_fractions(self) -> dict[str, float]:
        """The share of a source's records that may be quarantined before the run is inconclusive, per
        source kind: ``[quarantine] <kind>``, else ``[settings] max_quarantine_fraction``."""
        return {kind: float(self.quarantine_fractions.get(kind, self.max_quarantine_fraction)) for kind in SOURCE_KINDS}

    def sources_of(self, kind: str) -> list[Source]:
        return [s for s in self.sources if s.kind == kind]

    def source_files(self) -> list[tuple[Source, list[Path]]]:
        """Each source with the files it names. A file belongs to one source: one that two sources'
        paths both match is a ConfigError naming both (a `content` file read as requests would put its
        text in the quarantine). The one exception is an SGLang server log read for its start-ups
        (kind "engine_log") and for its ``--log-requests`` lines (format "sglang_requests")."""
        owners: dict[Path, list[Source]] = {}
        plan = []
        for source in self.sources:
            files = source.files()
            if not self.allow_outside:  # kvforensics/core/source_paths.py
                check_inside(source.name, source.path, self.base_dir, files, self.path.name)
            for file in files:
                claimed = owners.setdefault(file.resolve(), [])
                other = next((o for o in claimed if not _may_share_files(o, source)), None)
                if other is not None:
                    shown = file.relative_to(self.base_dir) if file.is_relative_to(self.base_dir) else file
                    raise ConfigError(
                        f"file {shown} matches the paths of sources '{other.name}' and "
                        f"'{source.name}'; a file belongs to one source: narrow one of the paths",
                        location=self.path.name,
                    )
                claimed.append(source)
            plan.append((source, files))
        return plan


def _may_share_files(a: Source, b: Source) -> bool:
    """Whether one kind declares that a source of it in its format reads the other's files too (an engine log
    and a requests source reading the same log's ``--log-requests`` lines)."""
    kinds = kinds_by_name()
    return kinds[a.kind].may_share_files(a.format, b.kind) or kinds[b.kind].may_share_files(b.format, a.kind)


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
        raise ConfigError(f"timestamp {value!s} has no time zone; add 'Z' or an offset such as +02:00", location=where)
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
        raise ConfigError(
            f"unknown time zone {name!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'", location=where
        ) from None
    return name


def nearest(key: str, valid: Iterable[str]) -> str | None:
    """The valid name closest to a misspelt *key*, if one is close."""
    found = difflib.get_close_matches(key, sorted(valid), n=1)
    return found[0] if found else None


def check_keys(table: Mapping[str, Any], valid: Iterable[str], where: str, what: str = "key") -> None:
    """A ConfigError for the first key of *table* that is not *valid*, naming the nearest valid one."""
    valid = sorted(valid)
    for key in table:
        if key not in valid:
            near = nearest(str(key), valid)
            hint = f"did you mean '{near}'?" if near else f"valid {what}s: {', '.join(valid) or 'none'}"
            raise ConfigError(f"unknown {what} '{key}'; {hint}", location=where)


def _table(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """The sub-table *key* of *data*, empty when absent."""
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"'{key}' must be a table, got {_type_name(value)}", location=where)
    return value


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
        datetime: "a date-time",
    }.get(type(value), type(value).__name__)


def _strings(value: Any, key: str, where: str) -> tuple[str, ...]:
    """A list of strings (a single string is refused: it is not a one-item list)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            f"'{key}' must be a list of strings, e.g. {key} = [\"a\", \"b\"], got {_type_name(value)}", location=where
        )
    return tuple(value)


def _optional(table: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    """``table[key]`` (None when absent) if it is a *kind*; a boolean is never one."""
    value = table.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise ConfigError(f"'{key}' must be {what}, got {_type_name(value)}", location=where)
    return value


def _parse_source(raw: Mapping[str, Any], index: int, base_dir: Path, file_label: str) -> Source:
    where = f"{file_label}: sources[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"each [[sources]] entry must be a table, got {_type_name(raw)}", location=where)
    if isinstance(raw.get("name"), str):
        where = f"{file_label}: source '{raw['name']}'"
    check_keys(raw, _SOURCE_KEYS, where)
    name = _require(raw, "name", where)
    for key in _SOURCE_TEXT_KEYS:
        _optional(raw, key, str, where, "a string")
    raw = with_preset(raw, where)
    kind = _require(raw, "kind", where)
    if kind not in SOURCE_KINDS:
        raise ConfigError(f"kind {kind!r} is not one of {list(SOURCE_KINDS)}", location=where)
    declared = kinds_by_name()[kind]
    path = _require(raw, "path", where)
    fmt = raw.get("format", declared.default_format)
    if fmt is None:
        fmt = _guess_request_format(path)
        if fmt is None:
            raise ConfigError(
                "cannot tell the format from the path; set format = \"jsonl\", \"csv\" or \"parquet\"", location=where
            )
    if fmt not in declared.formats:
        raise ConfigError(f"format {fmt!r} is not one of {list(declared.formats)} for kind {kind!r}", location=where)
    columns = raw.get("columns", {})
    if not isinstance(columns, Mapping) or not all(isinstance(v, str) for v in columns.values()):
        raise ConfigError("columns must be a table of canonical = \"source column\"", location=where)
    canonical = declared.canonical
    bad = sorted(set(columns) - set(canonical))
    if len(bad) == 1 and nearest(bad[0], canonical):
        raise ConfigError(
            f"columns maps unknown canonical field '{bad[0]}'; did you mean '{nearest(bad[0], canonical)}'?",
            location=where,
        )
    if bad:
        raise ConfigError(
            f"columns maps unknown canonical field(s) {bad}; canonical fields are {list(canonical)}", location=where
        )
    tz = _check_timezone(raw.get("timezone", "UTC"), where)
    values, null_tokens, expressions = {}, (), {}
    _refuse_keys_of_other_kinds(raw, declared, where)
    if declared.maps_columns:
        values, null_tokens, expressions = source_mapping(raw, columns, fmt, where)
    offset = _optional(raw, "clock_offset_s", (int, float), where, "a number of seconds") or 0.0
    year = _optional(raw, "year", int, where, "an integer such as 2026")
    instance = raw.get("instance", "{stem}")
    try:
        instance.format(stem="x", name="x", parent="x", label=_InstanceLabels(None, "x"))
    except (KeyError, IndexError, ValueError, AttributeError):
        raise ConfigError(
            f"instance template {instance!r} may only use {{stem}}, {{name}}, {{parent}} and "
            f"{{label:NAME}} (a label of an engine log's envelope)",
            location=where,
        ) from None
    if declared.no_labels and "{label:" in instance:
        raise ConfigError(
            f"instance template {instance!r} names an envelope label, {declared.no_labels}", location=where
        )
    envelope = raw.get("envelope", "auto")
    if envelope not in ENGINE_ENVELOPES:
        raise ConfigError(f"envelope {envelope!r} is not one of {list(ENGINE_ENVELOPES)}", location=where)
    if envelope == "none" and "{label:" in instance:
        raise ConfigError(
            f"instance template {instance!r} names an envelope label but envelope = \"none\"; "
            "set the envelope (or \"auto\") or use {stem}, {name}, {parent}",
            location=where,
        )
    ambiguous = raw.get("ambiguous", "reject")
    if ambiguous not in AMBIGUOUS_TIMES:
        raise ConfigError(f"ambiguous {ambiguous!r} is not one of {list(AMBIGUOUS_TIMES)}", location=where)
    return Source(
        name=name,
        kind=kind,
        path=path,
        format=fmt,
        timezone=tz,
        base_dir=base_dir,
        columns=dict(columns),
        instance=instance,
        clock_offset_s=float(offset),
        ambiguous=ambiguous,
        model=raw.get("model"),
        year=year,
        values=values,
        null_tokens=null_tokens,
        expressions=expressions,
        preset=raw.get("preset"),
        incident_file=file_label,
        envelope=envelope,
    )


def _refuse_keys_of_other_kinds(raw: Mapping[str, Any], declared: SourceKind, where: str) -> None:
    """A key only another kind accepts, refused with what that kind's declaration says."""
    for other in load_kinds():
        if other.name == declared.name:
            continue
        for keys, message in other.refused_elsewhere:
            if set(raw) & set(keys):
                raise ConfigError(message, location=where)


def file_stem(name: str) -> str:
    """A log file's name without its extensions (``{stem}``): ``decode-0.log.gz`` is ``decode-0``."""
    for suffix in (".gz", ".zst", ".log", ".txt", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


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
    for ext, fmt in (
        (".jsonl", "jsonl"),
        (".ndjson", "jsonl"),
        (".json", "jsonl"),
        (".csv", "csv"),
        (".parquet", "parquet"),
    ):
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
    """Validate a parsed incident file: every table and key is known and of the right type."""
    label = path.name
    _check_top_level(data, label)
    inc = data.get("incident")
    if not isinstance(inc, Mapping):
        raise ConfigError("missing [incident] table with id and title", location=label)
    check_keys(inc, _INCIDENT_KEYS, f"{label}: [incident]")
    incident_id = _require(inc, "id", f"{label}: [incident]")
    if not _INCIDENT_ID.match(incident_id):
        raise ConfigError(f"id {incident_id!r} may only use a-z, 0-9 and '-'", location=f"{label}: [incident]")
    title = _optional(inc, "title", str, f"{label}: [incident]", "a string") or incident_id
    raw_sources = data.get("sources", [])
    if not isinstance(raw_sources, list) or not raw_sources:
        raise ConfigError("no [[sources]]: name at least one requests source", location=label)
    base_dir = path.resolve().parent
    sources = tuple(_parse_source(s, i, base_dir, label) for i, s in enumerate(raw_sources))
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"source names must be unique; repeated: {dupes}", location=label)
    for needed in (k for k in load_kinds() if k.required):
        if not any(s.kind == needed.name for s in sources):
            raise ConfigError(f"no source of kind '{needed.name}': {needed.required}", location=label)
    settings = _table(data, "settings", label)
    check_keys(settings, _SETTINGS_KEYS, f"{label}: [settings]")
    max_q = _fraction(settings.get("max_quarantine_fraction", 0.01), "max_quarantine_fraction", f"{label}: [settings]")
    for key in ("memory_limit", "spark_requests_table"):
        _optional(settings, key, str, f"{label}: [settings]", "a string")
    models = _table(data, "models", label)
    check_keys(models, _MODELS_KEYS, f"{label}: [models]")
    return Incident(
        id=incident_id,
        title=title,
        path=path.resolve(),
        sources=sources,
        scope=_parse_scope(_table(data, "scope", label), f"{label}: [scope]"),
        events=_parse_events(data.get("events", []), label),
        model_aliases=_parse_aliases(_table(models, "aliases", f"{label}: [models]"), f"{label}: [models.aliases]"),
        hardware=_parse_hardware(_table(models, "hardware", f"{label}: [models]"), label),
        rule_parameters=_parse_rules(_table(data, "rules", label), label),
        memory_limit=settings.get("memory_limit"),
        allow_outside=_flag(settings, "allow_outside", f"{label}: [settings]"),
        year=_optional(settings, "year", int, f"{label}: [settings]", "an integer such as 2026"),
        winnow_window=_winnow_window(settings, f"{label}: [settings]"),
        instances=instances_from_config(_checked_instances(data.get("instances"), label), f"{label}: [instances]"),
        max_quarantine_fraction=max_q,
        quarantine_fractions=_parse_quarantine(_table(data, "quarantine", label), f"{label}: [quarantine]"),
        mechanisms=_parse_mechanisms(data.get("mechanisms"), label),
        notice=_parse_notice(_table(data, "notice", label), f"{label}: [notice]"),
        **_parse_prefix_cache(data, label, path),
    )


def _flag(table: Mapping[str, Any], key: str, where: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"'{key}' must be true or false, got {_type_name(value)}", location=where)
    return value


def _winnow_window(settings: Mapping[str, Any], where: str) -> int:
    """``[settings] winnow_window``: a whole number of shingles from 1 to ``MAX_WINNOW_WINDOW``."""
    value = settings.get("winnow_window", WINNOW_WINDOW)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WINNOW_WINDOW:
        raise ConfigError(
            f"winnow_window must be a whole number from 1 to {MAX_WINNOW_WINDOW} (of every that many "
            f"consecutive 8-word shingles one is fingerprinted; 1: every shingle), got {value!r}",
            location=where,
        )
    return value


def _fraction(value: Any, key: str, where: str) -> float:
    """A share of a source's records that may be quarantined: a number from 0 to 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(
            f"{key} must be a number from 0 to 1 (the share of a source's records that may be "
            f"quarantined before the run is inconclusive), got {value!r}",
            location=where,
        )
    return float(value)


def _parse_notice(table: Mapping[str, Any], where: str) -> NoticeConfig:
    """``[notice]``: texts as the responder writes them (provider, contact, reference; measures and advice as lists)."""
    check_keys(table, NOTICE_KEYS, where)
    texts = {k: _optional(table, k, str, where, "a string") for k, what in NOTICE_KEYS.items() if what == "a string"}
    lists = {
        k: _strings(table[k], k, where) if k in table else () for k, what in NOTICE_KEYS.items() if what != "a string"
    }
    return NoticeConfig(**texts, **lists)


def _parse_quarantine(table: Mapping[str, Any], where: str) -> dict[str, float]:
    """``[quarantine]``: a limit per source kind (``kv_events = 0.001``), each a number from 0 to 1."""
    check_keys(table, SOURCE_KINDS, where, what="source kind")
    return {kind: _fraction(value, kind, where) for kind, value in table.items()}


def _check_top_level(data: Mapping[str, Any], label: str) -> None:
    """Every top-level key is one of the incident file's tables, written as such."""
    for key, value in data.items():
        if key in TOP_LEVEL_TABLES:
            continue
        near = nearest(key, TOP_LEVEL_TABLES)
        written = (
            f"[[{key}]]"
            if isinstance(value, list) and value and isinstance(value[0], Mapping)
            else (f"[{key}]" if isinstance(value, Mapping) else f"key '{key}'")
        )
        hint = (
            f"did you mean {TOP_LEVEL_TABLES[near]}?"
            if near
            else "the top level holds "
            + ", ".join(v for v in TOP_LEVEL_TABLES.values() if not v.startswith("["))
            + " and the tables "
            + ", ".join(v for v in TOP_LEVEL_TABLES.values() if v.startswith("["))
        )
        raise ConfigError(
            f"unknown table {written}; {hint}" if written.startswith("[") else f"unknown top-level {written}; {hint}",
            location=label,
        )


def _parse_scope(sc: Mapping[str, Any], where: str) -> ScopeConfig:
    check_keys(sc, _SCOPE_KEYS, where)
    scope = ScopeConfig(
        internal_accounts=_strings(sc.get("internal_accounts", []), "internal_accounts", where),
        reporter_accounts=_strings(sc.get("reporter_accounts", []), "reporter_accounts", where),
        start=parse_utc(sc["start"], f"{where}.start") if "start" in sc else None,
        end=parse_utc(sc["end"], f"{where}.end") if "end" in sc else None,
    )
    if scope.start and scope.end and scope.start >= scope.end:
        raise ConfigError("start must be before end", location=where)
    return scope


def _parse_events(raw: Any, label: str) -> tuple[Event, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"'events' must be a list of [[events]] tables, got {_type_name(raw)}", location=label)
    events = []
    for i, ev in enumerate(raw):
        where = f"{label}: events[{i}]"
        if not isinstance(ev, Mapping):
            raise ConfigError(f"each [[events]] entry must be a table, got {_type_name(ev)}", location=where)
        check_keys(ev, _EVENT_KEYS, where)
        events.append(
            Event(
                ts=parse_utc(_require(ev, "ts", where, object), where),
                title=_require(ev, "title", where),
                description=_optional(ev, "description", str, where, "a string") or "",
            )
        )
    return tuple(sorted(events, key=lambda e: e.ts))


def _parse_aliases(aliases: Mapping[str, Any], where: str) -> dict[str, str]:
    if not all(isinstance(v, str) for v in aliases.values()):
        raise ConfigError(
            'aliases must be a table of "<engine served_model_name>" = "<gateway model id>" strings', location=where
        )
    return dict(aliases)


def _parse_hardware(hardware: Mapping[str, Any], label: str) -> dict[str, dict[str, Any]]:
    """Each ``[models.hardware."<model>"]`` table: known keys, numbers where numbers are meant."""
    for model, raw in hardware.items():
        where = f'{label}: [models.hardware."{model}"]'
        if not isinstance(raw, Mapping):
            raise ConfigError(f"must be a table of the model's spec, got {_type_name(raw)}", location=where)
        check_keys(raw, SPEC_TABLE_KEYS, where)
        for key in SPEC_TABLE_KEYS - {"gpu", "precision"}:
            _optional(raw, key, (int, float), where, "a number")
        _optional(raw, "gpu", str, where, "a string")
        if str(raw.get("precision", "bf16")).lower() not in PRECISIONS:
            raise ConfigError(f"precision {raw['precision']!r} is not one of {list(PRECISIONS)}", location=where)
        try:
            spec_from_config(model, raw)  # validate early
        except ConfigError as e:
            raise ConfigError(str(e), location=label) from None
    return {k: dict(v) for k, v in hardware.items()}


def _parse_rules(rules: Mapping[str, Any], label: str) -> dict[str, dict[str, Any]]:
    """``[rules.<id>]`` tables: a known rule, its own parameters, each of its default's type."""
    known = {r.id: r for r in load_rules()}
    check_keys(rules, known, f"{label}: [rules]", what="rule")
    for rule_id, params in rules.items():
        where = f"{label}: [rules.{rule_id}]"
        if not isinstance(params, Mapping):
            raise ConfigError(f"must be a table of parameter = value, got {_type_name(params)}", location=where)
        check_keys(params, known[rule_id].parameters, where, what="parameter")
        for key, value in params.items():
            default = known[rule_id].parameters[key]
            numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
            if default is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                if numeric
                else isinstance(value, type(default))
            ):
                raise ConfigError(
                    f"'{key}' must be {'a number' if numeric else _type_name(default)} like its "
                    f"default {default!r}, got "
                    f"{_type_name(value)}",
                    location=where,
                )
    return {k: dict(v) for k, v in rules.items()}


def _parse_mechanisms(raw: Any, label: str) -> tuple[str, ...] | None:
    """``mechanisms = [...]``: known mechanism ids, each once; None when the key is absent."""
    if raw is None:
        return None
    names = _strings(raw, "mechanisms", label)
    if not names:
        raise ConfigError(
            "'mechanisms' is empty: name the mechanisms to investigate, or leave the key out to "
            "investigate every mechanism whose inputs are present",
            location=label,
        )
    check_keys(dict.fromkeys(names), {m.id for m in load_mechanisms()}, f"{label}: mechanisms", what="mechanism")
    if len(set(names)) < len(names):
        raise ConfigError(
            f"'mechanisms' names {sorted({n for n in names if names.count(n) > 1})} more than once", location=label
        )
    return names


def _parse_prefix_cache(data: Mapping[str, Any], label: str, path: Path) -> dict[str, Any]:
    """``[prefix_cache]``: the block size prompts are cut at, whether prompts without token ids are cut
    into blocks of words (on by default once the table is there, unless it holds only ``probing``), and
    ``[prefix_cache.probing]``, the thresholds of the probing assessment."""
    if "prefix_cache" not in data:
        return {}
    where = f"{label}: [prefix_cache]"
    table = _table(data, "prefix_cache", label)
    check_keys(table, _PREFIX_CACHE_KEYS, where)
    size = _optional(table, "block_size", int, where, "an integer (tokens per block)")
    if size is not None and not 1 <= size <= 1_000_000:
        raise ConfigError(f"block_size must be from 1 to 1000000 tokens, got {size}", location=where)
    # word blocks by default when the table says how prompts are cut (not for probing or isolation facts alone)
    words = table.get("word_blocks", bool(set(table) - {"probing", "shared_namespaces", *_ISOLATION_KEYS}))
    if not isinstance(words, bool):
        raise ConfigError(f"'word_blocks' must be true or false, got {_type_name(words)}", location=where)
    probing = _table(table, "probing", where)
    try:
        probing_parameters(probing)
    except ConfigError as e:
        raise ConfigError(str(e), location=f"{label}: [prefix_cache.probing]") from None
    shared = table.get("shared_namespaces", [])
    if not isinstance(shared, list) or not all(isinstance(x, str) and x for x in shared):
        raise ConfigError(
            "shared_namespaces must be a list of cache salts (globs allowed), e.g. [\"playground\"]", location=where
        )
    return {
        "prefix_block_size": size,
        "prefix_word_blocks": words,
        "probing_parameters": dict(probing),
        "prefix_isolation": _prefix_isolation(table, path, where),
        "prefix_shared_namespaces": tuple(shared),
    }


def _prefix_isolation(table: Mapping[str, Any], path: Path, where: str) -> Any:
    """The isolation facts of ``[prefix_cache]`` as the audit manifest's policy (same keys, same checks),
    None when the table states none."""
    facts = {k: table[k] for k in _ISOLATION_KEYS if k in table}
    if not facts:
        return None
    from kvforensics.config.tenancy import read_prefix_cache  # (the audit package imports this module)

    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
    except OSError:
        text = ""
    try:
        return read_prefix_cache({"prefix_cache": facts}, text, str(path))
    except InputError as e:
        raise ConfigError(str(e), location=where) from None


def _checked_instances(raw: Any, label: str) -> Any:
    """``[instances]`` with its keys checked (kvforensics.stages.instances validates the values)."""
    if isinstance(raw, Mapping):
        check_keys(raw, {f.name for f in fields(InstanceMatching)}, f"{label}: [instances]")
    return raw
