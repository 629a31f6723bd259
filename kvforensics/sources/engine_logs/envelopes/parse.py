"""Engine logs in their collection envelopes: the record around each engine line, and its clock.

Production rarely hands over an engine's stdout as it was written. It arrives wrapped by whatever
collected it (kubectl, CRI, Docker, Loki, CloudWatch, journald, Fluent Bit, syslog, docker compose; the formats are described in
:mod:`kvforensics.sources.engine_logs.envelopes.formats`), one envelope per line or record, each with a UTC
clock of its own.

:mod:`kvforensics.sources.engine_logs.envelopes.formats` reads the envelope: :func:`sniff_envelope` recognises
it from a file's first lines, and :func:`read_envelope` turns the file's lines into
:class:`EnvelopeRecord` items (one engine line each, with the envelope's clock and labels and the
physical line it starts on) or quarantined records. This module parses an export:
:func:`instance_key` finds the labels that tell the origins (pods, hosts, streams) of an
interleaved export apart, and :func:`parse_enveloped` parses each origin's lines in the envelope's
time order and maps the results back to the file's physical lines. It is called by
:func:`kvforensics.sources.engine_logs.parse.parse_engine_file`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from kvforensics.sources.engine_logs.contract import (
    EngineFileParse,
    EngineLine,
    EngineLogParse,
    InstanceNamer,
    LineParser,
)
from kvforensics.sources.engine_logs.envelopes.formats import (
    ENVELOPE_CLOCKS,
    ENVELOPES,
    read_envelope,
    sniff_envelope,
)
from kvforensics.sources.engine_logs.envelopes.records import EnvelopeRecord, utc_from_ns
from kvforensics.sources.engine_logs.lines import SNIFF_LINES

__all__ = [
    "ENVELOPES",
    "EnvelopeRecord",
    "instance_key",
    "parse_enveloped",
    "read_envelope",
    "sniff_envelope",
    "utc_from_ns",
]

# Labels that name where a record came from, most specific first: interleaved origins in one file
# are told apart by the first of these that varies, and the next ones only where it is not enough
# (see instance_key). Labels such as a stream (stdout/stderr) or a level vary within one instance
# and are never used.
NATURAL_LABELS: dict[str, tuple[str, ...]] = {
    "loki": (
        "pod",
        "pod_name",
        "k8s_pod_name",
        "container",
        "container_name",
        "k8s_container_name",
        "instance",
        "host",
        "hostname",
        "service_name",
        "job",
        "filename",
    ),
    "cloudwatch": ("logGroupName", "logStreamName"),
    "journald": ("CONTAINER_NAME", "_HOSTNAME", "_SYSTEMD_UNIT", "SYSLOG_IDENTIFIER"),
    "docker": ("tag", "container_name", "name"),
    "fluentbit": ("pod_name", "container_name", "host", "hostname", "tag", "filename", "file", "path"),
    "syslog": ("host", "program"),
    # a service's replicas (qwen3-1, qwen3-2) are engines of their own: the container tells them apart
    "compose": ("service", "container"),
    # Vector: kubernetes_logs's pod and container, docker_logs's container, the file source's host and file
    "vector": ("pod_name", "container_name", "host", "file_stem", "file"),
}


def instance_key(envelope: str, label_sets: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
    """The labels that tell the origins in *label_sets* apart (empty: one origin).

    A label joins the key when it varies among records the key so far does not tell apart, so
    ``pod`` alone names pods even when ``filename`` also varies, and ``pod`` + ``container`` names a
    pod's sidecars apart.
    """
    key: list[str] = []
    groups: dict[tuple[str | None, ...], list[Mapping[str, str]]] = {(): list(label_sets)}
    for label in NATURAL_LABELS.get(envelope, ()):
        if not any(len({ls.get(label) for ls in members}) > 1 for members in groups.values()):
            continue
        key.append(label)
        regrouped: dict[tuple[str | None, ...], list[Mapping[str, str]]] = {}
        for ls in label_sets:
            regrouped.setdefault(tuple(ls.get(k) for k in key), []).append(ls)
        groups = regrouped
    return tuple(key)


# --------------------------------------------------------------------------------------------
# Parsing an export: one parse per instance, in the envelope's time order, mapped back to the file
# --------------------------------------------------------------------------------------------

CLOCK_DISAGREEMENT_S = 300.0
_LINE_REF = re.compile(r"\bline (\d+)")
# Parser notes about lines without a time of their own: in an envelope every line has the envelope's.
_UNTIMED_NOTES = (
    "without a timestamp of their own",
    "carry no timestamp; left empty",
    "their timestamps are left empty",
)


def parse_enveloped(
    envelope: str,
    lines: Iterable[EngineLine],
    *,
    fmt: Callable[[Iterable[str | None]], str],
    parsers: Mapping[str, LineParser],
    namer: InstanceNamer,
    tz: ZoneInfo,
    year: int | None,
    clock_offset_s: float,
) -> EngineFileParse:
    """Read the records of an export in *envelope*, split them by instance, and parse each one.

    ``fmt`` picks the engine parser from the first engine lines; ``namer`` names a record's
    instance from its labels. The caller sets ``lines_read`` (the file's physical lines).
    """
    result = EngineFileParse(envelope=envelope)
    records: list[EnvelopeRecord] = []
    for item in read_envelope(envelope, lines):
        if isinstance(item, EnvelopeRecord):
            records.append(item)
        else:
            result.quarantined.append(item)
    if not records:
        result.notes.append(f"no engine line in this {envelope} export")
        return result
    names = _instance_names(envelope, records, namer, result)
    groups: dict[str, list[EnvelopeRecord]] = {}
    for r in records:
        groups.setdefault(names[id(r.labels)], []).append(r)
    parser = parsers[fmt(r.text for r in itertools.islice(records, SNIFF_LINES))]
    offset = timedelta(seconds=clock_offset_s)
    check = _ClockCheck(ENVELOPE_CLOCKS[envelope])
    for name, group in groups.items():
        ordered = _in_clock_order(group)
        origin = [r.line for r in ordered]
        clock = [_shifted(r.ts_ns, offset) for r in ordered]
        first = next((c for c in clock if c is not None), None)
        feed = ((seq, r.text, r.raw or (r.text or "").encode()) for seq, r in enumerate(ordered, start=1))
        parse = parser(
            feed,
            instance=name,
            tz=tz,
            year=year if year is not None or first is None else first.astimezone(tz).year,
            clock_offset_s=clock_offset_s,
        )
        result.instances[name] = _to_file_lines(parse, origin, clock, check)
    result.notes.extend(check.notes())
    result.warnings.extend(check.notes())
    return result


def _in_clock_order(group: list[EnvelopeRecord]) -> list[EnvelopeRecord]:
    """Records sorted by the envelope's clock, stably; a record without one stays after the one before
    it. An export that is mostly newest first is turned round first, so that records with the same
    clock keep the order they were written in."""
    steps = [
        b.ts_ns - a.ts_ns
        for a, b in itertools.pairwise(group)
        if a.ts_ns is not None and b.ts_ns is not None and a.ts_ns != b.ts_ns
    ]
    if sum(1 for d in steps if d < 0) * 2 > len(steps):
        group = group[::-1]
    keys = []
    last = -(1 << 62)
    ordered = True
    for r in group:
        key = last if r.ts_ns is None else r.ts_ns
        ordered = ordered and key >= last
        keys.append(key)
        last = key
    if ordered:
        return group
    return [group[i] for i in sorted(range(len(group)), key=keys.__getitem__)]


def _shifted(ns: int | None, offset: timedelta) -> datetime | None:
    if ns is None:
        return None
    try:
        return utc_from_ns(ns) + offset
    except OverflowError:
        return None


def _instance_names(
    envelope: str, records: list[EnvelopeRecord], namer: InstanceNamer, result: EngineFileParse
) -> dict[int, str]:
    """The instance of each distinct label set (by identity: readers share one mapping per set)."""
    label_sets = {id(r.labels): r.labels for r in records}
    own = namer(None)
    names: dict[int, str] = {}
    missing: dict[str, int] = {}
    for key, labels in label_sets.items():
        try:
            names[key] = namer(labels)
        except KeyError as e:
            names[key] = own
            label = str(e.args[0]) if e.args else "?"
            missing[label] = missing.get(label, 0) + 1
    for label, n in sorted(missing.items()):
        result.warnings.append(
            f"{n} label set(s) in this {envelope} export have no label '{label}' for the instance template: "
            f"their records are read as instance '{own}'"
        )
    if len(label_sets) > 1 and set(names.values()) == {own}:
        natural = instance_key(envelope, list(label_sets.values()))
        if natural:
            for k, labels in label_sets.items():
                names[k] = "/".join(labels.get(label, "-") for label in natural)
            found = sorted(set(names.values()))
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            result.notes.append(
                f"this {envelope} export interleaves {len(found)} origins, told apart by "
                f"{' + '.join(natural)}: each is read as its own instance ({shown}); name them otherwise with the "
                f"source's instance template, e.g. instance = \"{{label:{natural[0]}}}\""
            )
    return names


class _ClockCheck:
    """Compare the engine's own stamps with the envelope's clock, to catch a wrong ``timezone``."""

    def __init__(self, clock: str) -> None:
        self.clock = clock
        self.diffs: list[tuple[int, float]] = []  # (file line, envelope - engine, seconds)

    def observe(self, line: int, engine_ts: datetime | None, envelope_ts: datetime) -> None:
        if engine_ts is not None:
            self.diffs.append((line, (envelope_ts - engine_ts).total_seconds()))

    def notes(self) -> list[str]:
        if not self.diffs:
            return []
        values = sorted(d for _, d in self.diffs)
        median = values[len(values) // 2]
        if abs(median) < CLOCK_DISAGREEMENT_S:
            return []
        first = min(line for line, d in self.diffs if abs(d) >= CLOCK_DISAGREEMENT_S)
        return [
            f"engine timestamps differ from the {self.clock} (UTC) by {median / 3600:+.2f} h (median over "
            f"{len(values)} start-up and event line(s), first at line {first}): the {self.clock} is used as the "
            "time of each line; check the source's timezone or clock offset"
        ]


RemapPlan = tuple[tuple[str, ...], tuple[tuple[str, str], ...], bool, bool]
_PLANS: dict[type, RemapPlan] = {}


def _remap_plan(cls: type) -> RemapPlan:
    """Which fields of a parse record are line numbers, and which times go with which line: ``ts``
    with ``line``, ``<x>_ts`` with ``<x>_line`` (a start-up's last line, its shutdown line ...)."""
    plan = _PLANS.get(cls)
    if plan is None:
        names = [f.name for f in fields(cls)]
        line_fields = tuple(n for n in names if n == "line" or n.endswith("_line"))
        ts_fields = tuple(
            (n, line)
            for n in names
            if n == "ts" or n.endswith("_ts")
            if (line := "line" if n == "ts" else f"{n[:-3]}_line") in names
        )
        plan = _PLANS[cls] = (line_fields, ts_fields, "evidence" in names, "flags" in names)
    return plan


def _to_file_lines(
    parse: EngineLogParse, origin: list[int], clock: list[datetime | None], check: _ClockCheck
) -> EngineLogParse:
    """Map a parse of an instance's records (numbered 1..n in clock order) back to the file: line
    numbers become physical lines, and every time becomes the envelope's clock of its line (the
    engine's own stamp is compared with it; a start-up keeps it in ``flags['engine_stamp_utc']``)."""

    def file_line(seq: int) -> int:
        return origin[seq - 1] if 1 <= seq <= len(origin) else seq

    def remap(rec: Any) -> Any:
        line_fields, ts_fields, has_evidence, has_flags = _remap_plan(type(rec))
        changes: dict[str, Any] = {}
        for name, line_name in ts_fields:
            seq = getattr(rec, line_name)
            envelope_ts = clock[seq - 1] if type(seq) is int and 1 <= seq <= len(clock) else None
            if envelope_ts is None:
                continue
            changes[name] = envelope_ts
            if name == "ts":
                engine_ts = rec.ts
                check.observe(file_line(seq), engine_ts, envelope_ts)
                if has_flags and engine_ts is not None and abs((envelope_ts - engine_ts).total_seconds()) >= 1:
                    changes["flags"] = {**rec.flags, "engine_stamp_utc": engine_ts.isoformat()}
        for name in line_fields:
            value = getattr(rec, name)
            if type(value) is int:
                changes[name] = file_line(value)
        if has_evidence:
            changes["evidence"] = {k: file_line(v) if type(v) is int else v for k, v in rec.evidence.items()}
        if has_flags and any(k.endswith("_line") for k in rec.flags):  # a flag naming a line (prefix_cache_hit_line)
            flags = changes.get("flags", rec.flags)
            changes["flags"] = {
                k: str(file_line(int(v))) if k.endswith("_line") and v.isdigit() else v for k, v in flags.items()
            }
        return replace(rec, **changes)

    parse.startups = [remap(s) for s in parse.startups]
    parse.events = [remap(e) for e in parse.events]
    parse.prefill_batches = [remap(b) for b in parse.prefill_batches]
    parse.quarantined = [replace(q, line=file_line(q.line)) for q in parse.quarantined]
    notes = parse.notes
    if all(c is not None for c in clock):  # no line is left without a time or given another's
        notes = [n for n in notes if not any(m in n for m in _UNTIMED_NOTES)]
    parse.notes = [_LINE_REF.sub(lambda m: f"line {file_line(int(m[1]))}", n) for n in notes]
    return parse
