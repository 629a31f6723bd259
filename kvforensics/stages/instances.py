"""Engine instances: when each start-up was in force, and which engine instance a gateway name means.

**Lifetimes.** A start-up holds until the first of:

* ``shutdown``      its own shutdown lines (``sources/engine_logs/shutdown.py``): ``valid_to`` is the first such line;
* ``next_startup``  the next start-up of the same instance: ``valid_to`` is that start-up's first line;
* ``log_end``       its log ends and a successor took over: a start-up of the same model and role on
  another instance that began after it, at most ``handover_s`` before its last line (or any time
  after), and whose instance still logs after that last line. The pod was retired: ``valid_to`` is its
  last line, or the successor's start when that came within ``handover_s`` after the last line (a
  pod replaced under a new name is treated like one restarted under its own name).

Otherwise ``end_reason`` is NULL and so is ``valid_to``: the log merely stops, which is what a log
exported while the server still runs looks like, so requests after its last line are not left
unserved. ``last_ts`` / ``last_line`` always say how far its log goes, so a log that merely stops can
be told from a clean shutdown; ``end_ts`` / ``end_file`` / ``end_line`` point at the evidence of the end.

**Instance names.** Gateways name instances their own way (``glm53-prefill-0.pd.svc.cluster.local:30000``)
while engine logs are named by file (``glm53-prefill-0``). A gateway name is matched to an engine
instance by the first of these that gives exactly one engine instance:

1. ``map``          ``[instances] map = { "<gateway name>" = "<engine instance>" }``;
2. ``exact``        the same name;
3. ``match``        ``[instances] match``: a regular expression with an ``(?P<instance>...)`` group,
   searched in both names (a name it does not match is kept whole); equal groups match;
4. ``host``         the host part on both sides: without scheme, path and ``:port``, lower case;
5. ``first_label``  the first DNS label of that host (never of an IP address), when one host is the other
   plus more domain (``prefill-0`` and ``prefill-0.ns.svc`` are one pod; ``prefill-0.a`` and
   ``prefill-0.b`` are two), and no other gateway host with that label lies in a different domain.

A name that two engine instances fit is ``ambiguous`` and stays as it is, like an ``unmatched`` one.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import regex

from kvforensics.core.errors import ConfigError

DEFAULT_HANDOVER_S = 3600.0
_INSTANCES_KEYS = {"match", "map", "handover_s"}


@dataclass(frozen=True)
class InstanceMatching:
    """The ``[instances]`` table of the incident file."""

    match: str | None = None  # regex with a named group "instance", searched in both names
    map: Mapping[str, str] = field(default_factory=dict)  # gateway name -> engine instance
    handover_s: float = DEFAULT_HANDOVER_S  # how long a successor may start before a retired pod's log ends


def instances_from_config(raw: Any, where: str) -> InstanceMatching:
    """Validate the ``[instances]`` table; every problem is a ConfigError naming the key."""
    if raw is None:
        return InstanceMatching()
    if not isinstance(raw, Mapping):
        raise ConfigError("[instances] must be a table with match, map or handover_s", location=where)
    unknown = sorted(set(raw) - _INSTANCES_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}; allowed: {sorted(_INSTANCES_KEYS)}", location=where)
    match = raw.get("match")
    if match is not None:
        if not isinstance(match, str):
            raise ConfigError(
                "match must be a string: a regular expression with a (?P<instance>...) group", location=f"{where}.match"
            )
        try:
            compiled = regex.compile(match)
        except (regex.error, ValueError) as e:
            raise ConfigError(f"match is not a valid regular expression: {e}", location=f"{where}.match") from None
        if "instance" not in compiled.groupindex:
            raise ConfigError(
                "match needs a named group (?P<instance>...) saying which part names the instance",
                location=f"{where}.match",
            )
    mapping = raw.get("map", {})
    if not isinstance(mapping, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in mapping.items()
    ):
        raise ConfigError(
            'map must be a table of "<gateway name>" = "<engine instance>" strings', location=f"{where}.map"
        )
    handover = raw.get("handover_s", DEFAULT_HANDOVER_S)
    if isinstance(handover, bool) or not isinstance(handover, int | float) or handover < 0:
        raise ConfigError("handover_s must be a number of seconds >= 0", location=f"{where}.handover_s")
    return InstanceMatching(match=match, map=dict(mapping), handover_s=float(handover))


# --------------------------------------------------------------------------------------------
# Instance names
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NameMatch:
    gateway_name: str
    engine_instance: str | None  # None when unmatched or ambiguous
    matched_by: str  # map | exact | match | host | first_label | ambiguous | unmatched
    candidates: tuple[str, ...] = ()  # the engine instances an ambiguous name fits


def host_of(name: str) -> str:
    """``http://Pod-0.ns.svc:30000/generate`` -> ``pod-0.ns.svc``."""
    host = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*://", "", name.strip())
    host = host.split("/", 1)[0]
    if host.startswith("[") and "]" in host:  # [IPv6]:port
        return host[1 : host.index("]")].lower()
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.lower()


def first_label(host: str) -> str | None:
    """The first DNS label of a host name; None for an IP address, which has none."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    label = host.split(".", 1)[0]
    return label or None


def _same_pod(a: str, b: str) -> bool:
    """Two host names with one first label name one pod when one is the other plus more domain."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


MATCH_BUDGET_S = 2.0
"""How long ``[instances] match`` may take over all the names of one investigation. The expression is the
user's: one that backtracks without end (nested quantifiers ``(a+)+``, overlapping alternatives ``(a|aa)+``) would
hang the run, so it runs in the ``regex`` module with a timeout, and running over is a configuration error."""


class _BudgetedPattern:
    """A user's regular expression searched within one time budget shared by every search."""

    def __init__(self, pattern: str, where: str, budget_s: float) -> None:
        self.pattern, self.where, self.budget_s = regex.compile(pattern), where, budget_s
        self.deadline = time.monotonic() + budget_s

    def search(self, text: str) -> Any:
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return self.pattern.search(text, timeout=left)
        except TimeoutError:
            raise ConfigError(
                f"match takes more than {self.budget_s:g} s to search the instance names (at {text[:80]!r}): it "
                "backtracks without end, as nested quantifiers such as '(a+)+' or overlapping alternatives such as "
                "'(a|aa)+' do; simplify it (e.g. '^(?:https?://)?(?P<instance>[^.:/]+)') or name the pairs in map",
                location=f"{self.where}.match",
            ) from None


def match_instance_names(
    gateway_names: Iterable[str],
    engine_instances: Iterable[str],
    matching: InstanceMatching,
    *,
    where: str = "[instances]",
    budget_s: float | None = None,
) -> list[NameMatch]:
    """Match every gateway instance name to an engine instance (see the module docstring). ``[instances] match``
    searches all the names within ``budget_s`` seconds (default ``MATCH_BUDGET_S``), else a ConfigError located at
    ``{where}.match``."""
    gateway = sorted(set(gateway_names))
    engines = sorted(set(engine_instances))
    budget = MATCH_BUDGET_S if budget_s is None else budget_s
    pattern = _BudgetedPattern(matching.match, where, budget) if matching.match else None

    def regex_key(name: str) -> str:
        m = pattern.search(name) if pattern is not None else None
        return m["instance"] if m is not None and m["instance"] else name

    by_regex = _index(engines, regex_key) if pattern is not None else {}
    by_host = _index(engines, host_of)
    by_label = _index(engines, lambda e: first_label(host_of(e)))
    hosts_by_label: dict[str, set[str]] = {}
    for g in gateway:
        label = first_label(host_of(g))
        if label is not None:
            hosts_by_label.setdefault(label, set()).add(host_of(g))

    out = []
    for g in gateway:
        if g in matching.map:
            out.append(NameMatch(g, matching.map[g], "map"))
            continue
        if g in engines:
            out.append(NameMatch(g, g, "exact"))
            continue
        found: NameMatch | None = None
        steps: list[tuple[str, list[str]]] = []
        if pattern is not None:
            steps.append(("match", by_regex.get(regex_key(g), [])))
        steps.append(("host", by_host.get(host_of(g), [])))
        for how, candidates in steps:
            if candidates:
                found = (
                    NameMatch(g, candidates[0], how)
                    if len(candidates) == 1
                    else NameMatch(g, None, "ambiguous", tuple(candidates))
                )
                break
        host = host_of(g)
        label = first_label(host)
        fitting = [e for e in by_label.get(label, []) if _same_pod(host_of(e), host)] if label else []
        if found is None and fitting:
            other_pod = any(not _same_pod(h, host) for h in hosts_by_label.get(label or "", ()))
            found = (
                NameMatch(g, fitting[0], "first_label")
                if len(fitting) == 1 and not other_pod
                else NameMatch(g, None, "ambiguous", tuple(fitting))
            )
        out.append(found or NameMatch(g, None, "unmatched"))
    return out


def _index(names: Sequence[str], key: Any) -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for n in names:
        k = key(n)
        if k is not None:
            index.setdefault(k, []).append(n)
    return index


# --------------------------------------------------------------------------------------------
# Lifetimes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacedStartup:
    """A start-up with what the lifetime rule needs besides the parse: its file and gateway model."""

    instance: str
    role: str
    model: str | None  # gateway model id (after aliases)
    ts: datetime | None
    file: str
    line: int
    last_ts: datetime | None = None
    last_line: int | None = None
    shutdown_ts: datetime | None = None
    shutdown_line: int | None = None


@dataclass(frozen=True)
class Lifetime:
    valid_to: datetime | None  # NULL while still running
    end_reason: str | None  # next_startup | shutdown | log_end | None (still running when its log ends)
    end_ts: datetime | None = None
    end_file: str | None = None
    end_line: int | None = None
    successor: str | None = None  # log_end: the instance that took over


def _sort_key(s: PlacedStartup) -> tuple[bool, datetime, str, int]:
    return (s.ts is None, s.ts or datetime.min.replace(tzinfo=timezone.utc), s.file, s.line)


def lifetimes(startups: Sequence[PlacedStartup], handover_s: float = DEFAULT_HANDOVER_S) -> list[Lifetime]:
    """How long each start-up was in force (in the order given); see the module docstring."""
    by_instance: dict[str, list[int]] = {}
    for i, s in enumerate(startups):
        by_instance.setdefault(s.instance, []).append(i)
    out: list[Lifetime | None] = [None] * len(startups)
    open_ends: list[int] = []
    for idx in by_instance.values():
        idx.sort(key=lambda i: _sort_key(startups[i]))
        for k, i in enumerate(idx):
            s = startups[i]
            nxt = startups[idx[k + 1]] if k + 1 < len(idx) else None
            if s.shutdown_line is not None and (
                nxt is None or nxt.ts is None or s.shutdown_ts is None or s.shutdown_ts <= nxt.ts
            ):
                out[i] = Lifetime(
                    s.shutdown_ts if s.shutdown_ts is not None else nxt.ts if nxt else None,
                    "shutdown",
                    s.shutdown_ts,
                    s.file,
                    s.shutdown_line,
                )
            elif nxt is not None:
                out[i] = Lifetime(nxt.ts, "next_startup", nxt.ts, nxt.file, nxt.line)
            else:
                open_ends.append(i)
    last_seen: dict[str, datetime] = {}
    for s in startups:
        seen = s.last_ts or s.ts
        if seen is not None and (s.instance not in last_seen or seen > last_seen[s.instance]):
            last_seen[s.instance] = seen
    handover = timedelta(seconds=handover_s)
    for i in open_ends:
        out[i] = _log_end(startups[i], startups, last_seen, handover)
    return [lt for lt in out if lt is not None]


UNKNOWN_ROLE = "unknown"  # a start-up no line of whose log says its role (sources/engine_logs/sglang/startup.py)


def roles_carried_over(startups: Sequence[PlacedStartup]) -> list[int | None]:
    """For each start-up whose role no line of its own shows (``unknown``), the index of the same
    instance's latest earlier start-up whose role one does: a restart that logs no ``server_args`` runs
    with the arguments it was started with before, so it keeps that role. None for the others and where
    no earlier start-up says. The ingest (``capacity``) and the audit both take the role so."""
    out: list[int | None] = [None] * len(startups)
    by_instance: dict[str, list[int]] = {}
    for i, s in enumerate(startups):
        by_instance.setdefault(s.instance, []).append(i)
    for idx in by_instance.values():
        idx.sort(key=lambda i: _sort_key(startups[i]))
        known: int | None = None
        for i in idx:
            if startups[i].role != UNKNOWN_ROLE:
                known = i
            else:
                out[i] = known
    return out


def role_carried_over(file_name: str, line: int) -> str:
    """How a start-up's role was taken over from the earlier start-up at *file_name*:*line* (its ``role_source``)."""
    return f"assumed from the previous start-up ({file_name}:{line}): this one logged no server_args"


def _log_end(
    s: PlacedStartup, startups: Sequence[PlacedStartup], last_seen: Mapping[str, datetime], handover: timedelta
) -> Lifetime:
    last = s.last_ts or s.ts
    if s.ts is None or last is None or s.model is None:
        return Lifetime(None, None)
    successors = [
        c
        for c in startups
        if c.instance != s.instance
        and c.model == s.model
        and c.role == s.role
        and c.ts is not None
        and c.ts > s.ts
        and c.ts >= last - handover
        and last_seen.get(c.instance, c.ts) > last
    ]
    if not successors:
        return Lifetime(None, None)
    first = min(successors, key=_sort_key)
    assert first.ts is not None
    valid_to = max(last, first.ts) if first.ts <= last + handover else last
    return Lifetime(valid_to, "log_end", last, s.file, s.last_line or s.line, first.instance)
