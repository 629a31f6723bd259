"""Fluent Bit's records around engine lines: its file output and its JSON lines, with Kubernetes metadata.

Fluent Bit tails container logs (``/var/log/containers/*.log``), parses the runtime's envelope with its
``docker`` or ``cri`` parser, optionally adds the pod's metadata (the ``kubernetes`` filter), and writes
records out. Two shapes reach a responder as files:

* the ``file`` output's default format, ``out_file``: ``<tag>: [<seconds>.<fraction>, {record}]`` per
  line (``%f``, 6 digits, before Fluent Bit 2.1; seconds and 9 digits of nanoseconds since);
* JSON lines, one record per line, with the event time under ``date`` (``json_lines`` of the stdout,
  http, tcp ... outputs; ``json_date_key`` and ``json_date_format``: ``double`` by default, or
  ``epoch``, ``epoch_ms``, ``iso8601``, ``java_sql_timestamp``, all UTC), or without a time of their own
  (the ``plain`` file format) when the ``kubernetes`` filter's metadata says what they are.

The engine line is the record's ``log`` (``docker`` parser, the ``cri`` multiline parser, or no parser)
or ``message`` (the ``cri`` regex parser). The ``cri`` regex parser keeps the runtime's partial flag in
``logtag`` (the multiline parser in ``_p``): ``P`` pieces are joined up to the ``F`` by the reader (a
line Docker split over 16 KiB records is joined by the tail input's ``Docker_Mode``, not here). The
labels are the record's other text fields (``stream``, a ``Path_Key`` ...), the ``kubernetes`` map's
text fields (``pod_name``, ``namespace_name``, ``container_name``, ``host`` ...) and the ``out_file``
tag (``tag``).

:func:`read_fluentbit` reads a file's lines: one record each, partial pieces joined, a record that
cannot be read quarantined with its reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvforensics.sources.engine_logs.contract import EngineLine, unreadable_reason
from kvforensics.sources.engine_logs.envelopes.records import (
    EnvelopeItem,
    Partials,
    quarantine,
    rfc3339_ns,
    split_message,
)

OUT_FILE = re.compile(r"^(?P<tag>[^\s\[{][^\s]*?): \[(?P<sec>\d{1,12})(?:\.(?P<frac>\d{1,9}))?, ")
"""The start of an ``out_file`` line: the tag, then the event time in seconds."""

MESSAGE_KEYS = ("log", "message")
_NOT_LABELS = frozenset({*MESSAGE_KEYS, "date", "time", "logtag", "_p", "kubernetes"})
_ZONE = re.compile(r"(?:[Zz]|[+-]\d{2}:?\d{2})$")


@dataclass(frozen=True, slots=True)
class FluentBitRecord:
    """One Fluent Bit record: its clock (None: the record has none), labels, engine text, and whether
    it is a partial piece of a longer line (``logtag`` / ``_p`` = ``P``)."""

    ns: int | None
    labels: dict[str, str]
    message: str
    partial: bool


def is_record(obj: object) -> bool:
    """Whether a JSON value is a Fluent Bit record: an engine line under ``log`` or ``message`` with
    Fluent Bit's ``date`` or its ``kubernetes`` metadata."""
    return (
        isinstance(obj, dict)
        and any(isinstance(obj.get(k), str) for k in MESSAGE_KEYS)
        and ("date" in obj or isinstance(obj.get("kubernetes"), dict))
    )


def out_file_line(text: str) -> tuple[str, int, Any]:
    """``(tag, ns, record)`` of an ``out_file`` line; ValueError when it is not one."""
    m = OUT_FILE.match(text)
    if m is None:
        raise ValueError("not a Fluent Bit out_file line (<tag>: [<time>, {record}])")
    if not text.rstrip().endswith("]"):
        raise ValueError("an out_file line cut short (no closing ']')")
    ns = int(m["sec"]) * 1_000_000_000 + int((m["frac"] or "0").ljust(9, "0"))
    try:
        record = json.loads(text[m.end() : text.rstrip().rindex("]")])
    except (ValueError, RecursionError) as e:
        raise ValueError(f"malformed out_file record ({getattr(e, 'msg', type(e).__name__)})") from None
    return m["tag"], ns, record


def record_of(obj: Any, *, tag: str | None = None, ns: int | None = None) -> FluentBitRecord:
    """The engine line, clock and labels of a record (*ns*: the ``out_file`` time, which wins over a
    ``date`` in the record); ValueError for a record without a text ``log`` or ``message``."""
    if not isinstance(obj, dict):
        raise ValueError("the record is not a JSON object")
    key = next((k for k in MESSAGE_KEYS if isinstance(obj.get(k), str)), None)
    if key is None:
        raise ValueError("the record has no text 'log' or 'message'")
    if ns is None and "date" in obj:
        ns = date_ns(obj["date"])
    labels = {k: v for k, v in obj.items() if k not in _NOT_LABELS and isinstance(v, str)}
    kubernetes = obj.get("kubernetes")
    if isinstance(kubernetes, Mapping):
        labels.update((k, v) for k, v in kubernetes.items() if isinstance(v, str) and k not in labels)
    if tag is not None:
        labels["tag"] = tag
    flag = obj.get("logtag", obj.get("_p"))
    return FluentBitRecord(ns, labels, obj[key], isinstance(flag, str) and flag.startswith("P"))


def date_ns(value: Any) -> int:
    """Nanoseconds since the epoch of a ``date`` as Fluent Bit writes it: a number (seconds, or ms, µs,
    ns by its size) or an ISO 8601 text in UTC (``iso8601``, ``java_sql_timestamp``)."""
    if isinstance(value, bool):
        raise ValueError(f"'date' {value!r} is not a time")
    if isinstance(value, (int, float)):
        if value != value or value < 0 or value >= 1e19:
            raise ValueError(f"'date' {value!r} is out of range")
        digits = len(str(int(value)))
        scale = 10**9 if digits <= 11 else 10**6 if digits <= 14 else 10**3 if digits <= 17 else 1
        if isinstance(value, int):
            return value * scale
        return round(value * scale / 1000) * 1000  # a double holds about microseconds, no finer
    if isinstance(value, str):  # UTC when it names no zone (java_sql_timestamp)
        text = value.strip()
        return rfc3339_ns(text if _ZONE.search(text) else text + "Z")
    raise ValueError(f"'date' {str(value)[:40]!r} is not a time")


def read_fluentbit(lines: Iterable[EngineLine]) -> Iterator[EnvelopeItem]:
    """Fluent Bit's out_file lines or JSON records; partial pieces joined per origin and stream."""
    partials = Partials()
    origins: dict[tuple[tuple[str, str], ...], Mapping[str, str]] = {}
    for number, text, raw in lines:
        if text is None or not text.strip():
            if text is None:
                yield quarantine(number, unreadable_reason(raw, "not UTF-8 (Fluent Bit writes UTF-8 text)"), raw)
            continue
        try:
            if text.lstrip().startswith("{"):
                record = record_of(json.loads(text))
            else:
                tag, ns, obj = out_file_line(text)
                record = record_of(obj, tag=tag, ns=ns)
        except json.JSONDecodeError as e:
            yield quarantine(number, f"malformed JSON ({e.msg} at column {e.colno})", raw)
            continue
        except (ValueError, OverflowError, RecursionError) as e:
            yield quarantine(number, f"bad fluentbit record: {e}", raw)
            continue
        labels = origins.setdefault(key := tuple(sorted(record.labels.items())), record.labels)
        joined = partials.add(repr(key), number, record.ns, labels, record.message, not record.partial)
        if joined is not None:
            yield from split_message(*joined)
    for joined in partials.rest():
        yield from split_message(*joined)
