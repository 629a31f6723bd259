"""Reading collection envelopes: the record around each engine line, and its clock.

Production rarely hands over an engine's stdout as it was written. It arrives wrapped by whatever
collected it, one envelope per line (or per record), each with a UTC clock of its own:

=========== ====================================================================================
kubectl     ``kubectl logs --timestamps``: ``<RFC3339Nano> <line>``
docker_logs ``docker logs --timestamps``: the same shape, the time always with 9 fraction digits
            (Go's ``RFC3339NanoFixed``; kubectl drops trailing zeros)
cri         containerd/CRI-O files under ``/var/log/pods``: ``<RFC3339Nano> stdout|stderr F|P <line>``
            (``P``: a partial line, continued by the next records of the same stream up to an ``F``)
docker      Docker's json-file driver: ``{"log": "<line>\\n", "stream": "stdout", "time": "<RFC3339Nano>"}``
            (a line over 16 KiB is split over several records; only the last ends with ``\\n``)
loki        Grafana Loki exports: ``logcli query --output=jsonl`` lines
            ``{"labels": {...}, "line": "...", "timestamp": "<RFC3339Nano or ns>"}``, or the HTTP API's
            ``query_range`` response (``data.result[].stream`` labels, ``values: [["<ns>", "<line>"]]``)
cloudwatch  CloudWatch Logs: ``aws logs filter-log-events`` / ``get-log-events`` output
            (``events: [{"timestamp": <ms>, "message": ..., "logStreamName": ...}]``), or such events
            one per line
journald    ``journalctl -o json`` (or ``json-pretty``): ``__REALTIME_TIMESTAMP`` (µs), ``MESSAGE``
            (a string, or an array of byte values when it is not UTF-8), ``_HOSTNAME`` ...
fluentbit   Fluent Bit's ``file`` output (``<tag>: [<seconds>, {record}]``) or JSON lines: see
            :mod:`kvforensics.sources.engine_logs.envelopes.fluentbit`
syslog      rsyslog / syslog-ng files: ``<time> <host> <program>[<pid>]: <line>``: see
            :mod:`kvforensics.sources.engine_logs.envelopes.syslog`
compose     ``docker compose logs [-t]``: ``<container> | [<RFC3339Nano> ]<line>``: see
            :mod:`kvforensics.sources.engine_logs.envelopes.compose`
vector      Vector's JSON encoding of a log event (a ``file`` sink or ``console`` sink with
            ``encoding.codec = "json"``): ``{"message": ..., "source_type": "file" | "kubernetes_logs" |
            "docker_logs" ..., "timestamp": "<RFC 3339>", "file"/"host"/"kubernetes"/"container_name" ...}``
            (the fields of the sources' documented output, vectordotdev/vector
            ``website/cue/reference/components/sources/*.cue``); with log namespacing
            (``schema.log_namespace = true``) an event is its message alone, so each line is a JSON
            string (``"<line>"``; vector.dev/guides/level-up/log_namespace) and the engine's own
            stamps are the only clock
=========== ====================================================================================

This module reads the envelope only: :func:`sniff_envelope` recognises it from a file's first
lines, and :func:`read_envelope` turns the file's lines into :class:`EnvelopeRecord` items (one
engine line each, with the envelope's clock and labels and the physical line it starts on) or
:class:`~kvforensics.sources.engine_logs.parse.QuarantinedLine` for a record whose envelope cannot be
read. Splitting an export by origin, sorting, parsing and mapping results back to the file are in
:mod:`kvforensics.sources.engine_logs.envelopes.parse`.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvforensics.config import file_stem
from kvforensics.sources.engine_logs.contract import EngineLine, unreadable_reason
from kvforensics.sources.engine_logs.envelopes.compose import PREFIX as COMPOSE_PREFIX
from kvforensics.sources.engine_logs.envelopes.compose import read_compose
from kvforensics.sources.engine_logs.envelopes.fluentbit import OUT_FILE, is_record, read_fluentbit
from kvforensics.sources.engine_logs.envelopes.records import (
    RFC3339,
    EnvelopeItem,
    EnvelopeRecord,
    Partials,
    epoch_ns,
    match_ns,
    quarantine,
    rfc3339_ns,
    split_message,
)
from kvforensics.sources.engine_logs.envelopes.syslog import header as syslog_header
from kvforensics.sources.engine_logs.envelopes.syslog import read_syslog

ENVELOPES = (
    "kubectl",
    "cri",
    "docker",
    "loki",
    "cloudwatch",
    "journald",
    "fluentbit",
    "syslog",
    "compose",
    "docker_logs",
    "vector",
)
"""Every envelope this module reads; a source's ``envelope`` may also be ``auto`` or ``none``."""

ENVELOPE_CLOCKS = {
    "kubectl": "kubectl --timestamps prefix",
    "cri": "CRI log timestamp",
    "docker": "Docker json-file time",
    "loki": "Loki entry timestamp",
    "cloudwatch": "CloudWatch event timestamp",
    "journald": "journald __REALTIME_TIMESTAMP",
    "fluentbit": "Fluent Bit event time",
    "syslog": "syslog header time",
    "compose": "docker compose --timestamps time",
    "docker_logs": "docker logs --timestamps prefix",
    "vector": "Vector event timestamp",
}

_NO_LABELS: Mapping[str, str] = {}


# --------------------------------------------------------------------------------------------
# Clocks
# --------------------------------------------------------------------------------------------


def _loki_ns(value: Any) -> int:
    """Loki timestamps: nanoseconds (string or number) or RFC 3339 (logcli prints local time)."""
    if isinstance(value, str) and not value.strip().isdigit():
        return rfc3339_ns(value)
    return epoch_ns(value, 1, "timestamp")


# --------------------------------------------------------------------------------------------
# Recognising an envelope from the first lines
# --------------------------------------------------------------------------------------------

_KUBECTL = re.compile(r"^" + RFC3339.pattern + r" ")
_CRI = re.compile(r"^(?P<ts>\S+) (?P<stream>stdout|stderr) (?P<tag>[A-Z])(?::\S*)? ?")
SNIFF_RECORDS = 20


def json_kind(obj: object) -> str | None:
    """Which envelope a JSON value belongs to, from its keys; None if none."""
    if not isinstance(obj, dict):
        return None
    # before Fluent Bit's and CloudWatch's: Vector's kubernetes_logs events carry a "kubernetes" map too, and
    # every Vector event a "message" and a "timestamp"; "source_type" is Vector's own
    if isinstance(obj.get("source_type"), str) and "message" in obj and "timestamp" in obj:
        return "vector"
    if is_record(obj):  # before Docker's: the docker parser's records keep its "log" and "time"
        return "fluentbit"
    if "log" in obj and "time" in obj:
        return "docker"
    if "line" in obj and "timestamp" in obj:
        return "loki"
    if "__REALTIME_TIMESTAMP" in obj:
        return "journald"
    if "message" in obj and "timestamp" in obj:
        return "cloudwatch"
    if isinstance(obj.get("data"), dict) and "result" in obj["data"]:
        return "loki"
    if isinstance(obj.get("events"), list):
        return "cloudwatch"
    return None


def sniff_envelope(head: Sequence[EngineLine]) -> str:
    """The envelope of a file from its first lines: one of :data:`ENVELOPES`, or ``"none"``.

    A file is in an envelope when most of its first 20 non-blank lines are; a JSON export
    pretty-printed over many lines is recognised by the keys its first lines hold.
    """
    texts = [t for _, t, _ in head if t is not None and t.strip()][:SNIFF_RECORDS]
    if not texts:
        return "none"
    first = texts[0].lstrip()
    if first.startswith(("{", "[", '"')):
        kinds = []
        for t in texts:
            try:
                value = json.loads(t)
            except (ValueError, RecursionError):
                kinds.append(None)
                continue
            # a JSON string a line: Vector's JSON encoding of an event under log namespacing (its message alone)
            kinds.append("vector" if isinstance(value, str) else json_kind(value))
        found = [k for k in kinds if k]
        if found and len(found) * 2 >= len(texts):
            return max(found, key=found.count)  # ties: the kind met first
        joined = "\n".join(t for _, t, _ in head if t)
        for key, kind in (
            ('"__REALTIME_TIMESTAMP"', "journald"),
            ('"kubernetes"', "fluentbit"),
            ('"resultType"', "loki"),
            ('"result"', "loki"),
            ('"logStreamName"', "cloudwatch"),
            ('"events"', "cloudwatch"),
            ('"ingestionTime"', "cloudwatch"),
            ('"stream"', "docker"),
        ):
            if key in joined:
                return kind
        return "none"
    cri = sum(1 for t in texts if _CRI.match(t) and RFC3339.fullmatch(t.split(" ", 1)[0]))
    if cri * 2 > len(texts):
        return "cri"
    if sum(1 for t in texts if syslog_header(t)) * 2 > len(texts):  # before kubectl: both start with a time
        return "syslog"
    stamps = [m for t in texts if (m := _KUBECTL.match(t))]
    if len(stamps) * 2 > len(texts):
        return _timestamps_writer(stamps)
    if sum(1 for t in texts if COMPOSE_PREFIX.match(t)) * 2 > len(texts):
        return "compose"
    if sum(1 for t in texts if OUT_FILE.match(t)) * 2 > len(texts):
        return "fluentbit"
    return "none"


def _timestamps_writer(stamps: Sequence[re.Match[str]]) -> str:
    """Who put the times before the lines: Docker writes 9 fraction digits always (Go's
    ``RFC3339NanoFixed``), so a fraction with a trailing zero is Docker's; kubectl drops trailing
    zeros (``RFC3339Nano``). A file that shows neither is read the same way either way."""
    fractions = [m["frac"] or "" for m in stamps]
    if all(len(f) == 9 for f in fractions) and any(f.endswith("0") for f in fractions):
        return "docker_logs"
    return "kubectl"


# --------------------------------------------------------------------------------------------
# Reading records
# --------------------------------------------------------------------------------------------


def _read_kubectl(lines: Iterable[EngineLine], what: str = "kubectl") -> Iterator[EnvelopeItem]:
    """``<RFC3339Nano> <line>`` (kubectl logs --timestamps, docker logs --timestamps)."""
    for number, text, raw in lines:
        if text is None:
            yield EnvelopeRecord(number, None, _NO_LABELS, None, raw)
            continue
        m = _KUBECTL.match(text)
        if m is None:  # a line without the prefix keeps only its own stamp
            yield EnvelopeRecord(number, None, _NO_LABELS, text, b"")
            continue
        try:
            ns = match_ns(m)
        except (ValueError, OverflowError):
            yield quarantine(number, f"bad {what} --timestamps prefix '{m.group(0).strip()}'", raw)
            continue
        yield EnvelopeRecord(number, ns, _NO_LABELS, text[m.end() :], b"")


def _read_cri(lines: Iterable[EngineLine]) -> Iterator[EnvelopeItem]:
    partials = Partials()
    streams: dict[str, Mapping[str, str]] = {}
    for number, text, raw in lines:
        if text is None:
            yield quarantine(number, unreadable_reason(raw, "not UTF-8 (a CRI log file is UTF-8 text)"), raw)
            continue
        if not text.strip():
            continue
        m = _CRI.match(text)
        if m is None or m["tag"] not in "FP":
            yield quarantine(number, "not a CRI log line (<RFC3339Nano> stdout|stderr F|P <line>)", raw)
            continue
        try:
            ns = rfc3339_ns(m["ts"])
        except (ValueError, OverflowError):
            yield quarantine(number, f"bad CRI timestamp '{m['ts'][:40]}'", raw)
            continue
        stream = m["stream"]
        labels = streams.setdefault(stream, {"stream": stream})
        joined = partials.add(stream, number, ns, labels, text[m.end() :], m["tag"] == "F")
        if joined is not None:
            yield EnvelopeRecord(joined[0], joined[1], joined[2], joined[3], b"")
    for line, ns, labels, piece in partials.rest():
        yield EnvelopeRecord(line, ns, labels, piece, b"")


# -- JSON envelopes ----------------------------------------------------------------------------


Positions = Callable[[str, int], list[int]]
"""Where the *n* records of a kind held by a JSON value start: their physical lines."""


def _same_line(line: int) -> Positions:
    """Positions for a value on one line: every record it holds is on that line."""
    return lambda _kind, n: [line] * n


class _JsonRecords:
    """Turn JSON values (one per line, or documents) into records, per envelope kind."""

    def __init__(self, envelope: str) -> None:
        self.envelope = envelope
        self.partials = Partials()
        self.label_cache: dict[tuple[tuple[str, str], ...], Mapping[str, str]] = {}

    def labels(self, pairs: Iterable[tuple[str, Any]]) -> Mapping[str, str]:
        key = tuple(sorted((str(k), v if isinstance(v, str) else json.dumps(v)) for k, v in pairs))
        cached = self.label_cache.get(key)
        if cached is None:
            cached = self.label_cache[key] = dict(key)
        return cached

    def records(
        self, obj: Any, line: int, raw: str, positions: Callable[[str, int], list[int]]
    ) -> Iterator[EnvelopeItem]:
        if isinstance(obj, str) and self.envelope == "vector":  # an event of a log namespace: its message alone,
            yield from split_message(line, None, _NO_LABELS, obj)  # without a clock or labels of Vector's
            return
        kind = json_kind(obj)
        if kind is None:
            if isinstance(obj, list):
                lines = positions("element", len(obj))
                for at, element in zip(lines, obj, strict=True):
                    yield from self.records(element, at, json.dumps(element), _same_line(at))
                return
            yield quarantine(line, f"not a {self.envelope} record (a JSON value with none of its keys)", raw)
            return
        if kind != self.envelope:
            yield quarantine(line, f"a {kind} record in a {self.envelope} export", raw)
            return
        try:
            yield from getattr(self, f"_{kind}")(obj, line, raw, positions)
        except (ValueError, OverflowError, TypeError, AttributeError) as e:
            yield quarantine(line, f"bad {kind} record: {e}", raw)

    def _docker(self, obj: dict[str, Any], line: int, raw: str, positions: Any) -> Iterator[EnvelopeItem]:
        log, stream = obj["log"], obj.get("stream", "")
        if not isinstance(log, str):
            raise ValueError("'log' is not a string")
        ns = rfc3339_ns(str(obj["time"]))
        attrs = obj.get("attrs")
        extra = attrs.items() if isinstance(attrs, dict) else ()
        labels = self.labels([("stream", stream), *extra])
        joined = self.partials.add(str(stream), line, ns, labels, log, log.endswith("\n"))
        if joined is not None:
            yield from split_message(*joined)

    def _loki(
        self, obj: dict[str, Any], line: int, raw: str, positions: Callable[[str, int], list[int]]
    ) -> Iterator[EnvelopeItem]:
        if "line" in obj:  # logcli --output=jsonl
            labels = obj.get("labels") or {}
            if not isinstance(labels, dict) or not isinstance(obj["line"], str):
                raise ValueError("'labels' is not an object or 'line' is not a string")
            yield from split_message(line, _loki_ns(obj["timestamp"]), self.labels(labels.items()), obj["line"])
            return
        streams = obj["data"]["result"]
        if not isinstance(streams, list):
            raise ValueError("data.result is not a list of streams")
        total = sum(len(s.get("values") or ()) for s in streams if isinstance(s, dict))
        lines = iter(positions("loki", total))
        for stream in streams:
            values = stream.get("values") if isinstance(stream, dict) else None
            if not isinstance(values, list):
                yield quarantine(line, "a query_range stream without 'values' (a metric query?)", json.dumps(stream))
                continue
            labels = self.labels((stream.get("stream") or stream.get("metric") or {}).items())
            for value in values:
                at = next(lines, line)
                try:
                    ns, message = _loki_ns(value[0]), value[1]
                    if not isinstance(message, str):
                        raise ValueError("the log line is not a string")
                except (ValueError, OverflowError, TypeError, IndexError, KeyError) as e:
                    yield quarantine(at, f"bad loki entry: {e}", json.dumps(value))
                    continue
                yield from split_message(at, ns, labels, message)

    def _cloudwatch(
        self, obj: dict[str, Any], line: int, raw: str, positions: Callable[[str, int], list[int]]
    ) -> Iterator[EnvelopeItem]:
        if "message" not in obj:  # a filter-log-events / get-log-events response
            events = obj["events"]
            lines = positions("cloudwatch", len(events))
            for i, event in enumerate(events):
                at = lines[i]
                if json_kind(event) != "cloudwatch":
                    yield quarantine(at, "a CloudWatch event without 'timestamp' and 'message'", json.dumps(event))
                    continue
                yield from self.records(event, at, json.dumps(event), positions)
            return
        message = obj["message"]
        if not isinstance(message, str):
            raise ValueError("'message' is not a string")
        ns = epoch_ns(obj["timestamp"], 1_000_000, "timestamp")
        labels = self.labels((k, v) for k, v in obj.items() if k in ("logStreamName", "logGroupName"))
        yield from split_message(line, ns, labels, message)

    def _vector(self, obj: dict[str, Any], line: int, raw: str, positions: Any) -> Iterator[EnvelopeItem]:
        """A Vector log event: ``message`` the line (lines, when a multiline config joined them), ``timestamp``
        RFC 3339 (chrono's, ``Z``), the other text fields and the ``kubernetes`` map's the labels, and ``file_stem``:
        the name of ``file`` without its extensions."""
        message, stamp = obj["message"], obj["timestamp"]
        if not isinstance(message, str):
            raise ValueError("'message' is not a string")
        if not isinstance(stamp, str):
            raise ValueError("'timestamp' is not an RFC 3339 text")
        pairs = [(k, v) for k, v in obj.items() if isinstance(v, str) and k not in ("message", "timestamp")]
        if isinstance(obj.get("file"), str):  # the file source's path; its name as {stem} reads a file's
            pairs.append(("file_stem", file_stem(obj["file"].rsplit("/", 1)[-1])))
        kubernetes = obj.get("kubernetes")
        if isinstance(kubernetes, dict):
            own = {k for k, _ in pairs}
            pairs += [(k, v) for k, v in kubernetes.items() if isinstance(v, str) and k not in own]
        yield from split_message(line, rfc3339_ns(stamp), self.labels(pairs), message)

    def _journald(self, obj: dict[str, Any], line: int, raw: str, positions: Any) -> Iterator[EnvelopeItem]:
        ns = epoch_ns(obj["__REALTIME_TIMESTAMP"], 1_000, "__REALTIME_TIMESTAMP")
        labels = self.labels(
            (k, v) for k, v in obj.items() if isinstance(v, str) and k != "MESSAGE" and not k.startswith("__")
        )
        message = obj.get("MESSAGE")
        if message is None:
            yield quarantine(
                line,
                "MESSAGE is null: journalctl leaves out fields over 4096 bytes (export with journalctl --all -o json)",
                raw,
            )
            return
        if isinstance(message, list) and all(isinstance(b, int) and 0 <= b < 256 for b in message):
            data = bytes(message)  # not UTF-8 text: an array of byte values
            try:
                message = data.decode("utf-8")
            except UnicodeDecodeError:
                for part in data.rstrip(b"\n").split(b"\n"):
                    try:
                        yield EnvelopeRecord(line, ns, labels, part.decode("utf-8"), b"")
                    except UnicodeDecodeError:
                        yield EnvelopeRecord(line, ns, labels, None, part)
                return
        elif isinstance(message, list):  # a field with several values
            message = "\n".join(m if isinstance(m, str) else bytes(m).decode("utf-8", "replace") for m in message)
        if not isinstance(message, str):
            raise ValueError("MESSAGE is neither a string nor an array of bytes")
        yield from split_message(line, ns, labels, message)

    def rest(self) -> Iterator[EnvelopeRecord]:
        for joined in self.partials.rest():
            yield from split_message(*joined)


# Where the arrays of records of a JSON document start. A JSON string escapes every quote, so an
# unescaped quote followed by the key name and a colon is that key.
_RECORD_ARRAYS = {
    "loki": re.compile(r'(?<!\\)"values"\s*:\s*\['),
    "cloudwatch": re.compile(r'(?<!\\)"events"\s*:\s*\['),
}
_WS = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def _element_starts(doc: str, bracket: int) -> list[int]:
    """Offsets of the elements of the JSON array whose ``[`` is at *bracket*."""
    out = []
    i = _WS.match(doc, bracket + 1).end()  # type: ignore[union-attr]
    while i < len(doc) and doc[i] != "]":
        out.append(i)
        _, end = _DECODER.raw_decode(doc, i)
        i = _WS.match(doc, end).end()  # type: ignore[union-attr]
        if i < len(doc) and doc[i] == ",":
            i = _WS.match(doc, i + 1).end()  # type: ignore[union-attr]
    return out


def _read_json_lines(lines: Iterable[EngineLine], envelope: str) -> Iterator[EnvelopeItem]:
    """JSON values one per line (Docker json-file, logcli jsonl, journalctl -o json, event lines)."""
    reader = _JsonRecords(envelope)
    for number, text, raw in lines:
        if text is None:
            yield quarantine(number, unreadable_reason(raw, "not UTF-8 (a JSON export is UTF-8 text)"), raw)
            continue
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield quarantine(number, f"malformed JSON ({e.msg} at column {e.colno})", raw)
            continue
        except (ValueError, RecursionError) as e:
            yield quarantine(number, f"malformed JSON ({type(e).__name__})", raw)
            continue
        yield from reader.records(obj, number, text, _same_line(number))
    yield from reader.rest()


def _read_json_document(lines: list[EngineLine], envelope: str) -> Iterator[EnvelopeItem]:
    """JSON documents over many lines (a query_range response, aws logs output, json-pretty)."""
    texts = []
    for number, text, raw in lines:
        if text is None:
            yield quarantine(number, unreadable_reason(raw, "not UTF-8 (a JSON export is UTF-8 text)"), raw)
            texts.append("")
        else:
            texts.append(text)
    first_line = lines[0][0] if lines else 1
    doc = "\n".join(texts)
    starts = [0]
    for t in texts[:-1]:
        starts.append(starts[-1] + len(t) + 1)

    def line_at(offset: int) -> int:
        return first_line + bisect_right(starts, offset) - 1

    reader = _JsonRecords(envelope)
    ws = _WS
    i = ws.match(doc).end()  # type: ignore[union-attr]
    while i < len(doc):
        try:
            obj, end = _DECODER.raw_decode(doc, i)
        except (ValueError, RecursionError) as e:
            reason = f"malformed JSON document ({getattr(e, 'msg', e)} at line {line_at(getattr(e, 'pos', i))})"
            for k in range(line_at(i) - first_line, len(texts)):
                if texts[k].strip():
                    yield quarantine(first_line + k, reason, texts[k])
            return
        start, stop = i, end

        def positions(kind: str, n: int, start: int = start, stop: int = stop) -> list[int]:
            try:
                if kind == "element":
                    offsets = _element_starts(doc, start)
                else:
                    offsets = [
                        o
                        for m in _RECORD_ARRAYS[kind].finditer(doc, start, stop)
                        for o in _element_starts(doc, m.end() - 1)
                    ]
            except (ValueError, RecursionError):
                offsets = []
            if len(offsets) != n:  # not where we looked: every record is placed at its document's start
                return [line_at(start)] * n
            return [line_at(o) for o in offsets]

        yield from reader.records(obj, line_at(i), doc[start:stop][:1000], positions)
        i = ws.match(doc, end).end()  # type: ignore[union-attr]
        if i < len(doc) and doc[i] == ",":  # a stray comma between documents
            i = ws.match(doc, i + 1).end()  # type: ignore[union-attr]
    yield from reader.rest()


def _read_json(lines: Iterable[EngineLine], envelope: str) -> Iterator[EnvelopeItem]:
    it = iter(lines)
    head: list[EngineLine] = []
    for item in it:
        head.append(item)
        if item[1] is not None and item[1].strip():
            break
    first = head[-1][1] if head else None
    one_per_line = False
    if first is not None:
        try:
            one_per_line = isinstance(json.loads(first), (dict, str))
        except (ValueError, RecursionError):
            one_per_line = False
    if one_per_line:
        yield from _read_json_lines([*head, *it], envelope)
    else:
        yield from _read_json_document([*head, *it], envelope)


READERS: dict[str, Callable[[Iterable[EngineLine]], Iterator[EnvelopeItem]]] = {
    "kubectl": _read_kubectl,
    "cri": _read_cri,
    "docker": lambda lines: _read_json(lines, "docker"),
    "loki": lambda lines: _read_json(lines, "loki"),
    "cloudwatch": lambda lines: _read_json(lines, "cloudwatch"),
    "journald": lambda lines: _read_json(lines, "journald"),
    "fluentbit": read_fluentbit,
    "syslog": read_syslog,
    "compose": read_compose,
    "docker_logs": lambda lines: _read_kubectl(lines, "docker logs"),
    "vector": lambda lines: _read_json(lines, "vector"),
}


def read_envelope(envelope: str, lines: Iterable[EngineLine]) -> Iterator[EnvelopeItem]:
    """The records of a file in *envelope* (one of :data:`ENVELOPES`), in file order."""
    return READERS[envelope](lines)
