"""Engine lines taken out of their collection envelope: the record type, envelope clocks, and the
helpers every envelope reader shares (splitting a message into lines, joining partial pieces,
quarantining a record). The readers are in :mod:`kvforensics.sources.engine_logs.envelopes.formats`,
:mod:`kvforensics.sources.engine_logs.envelopes.fluentbit` and :mod:`kvforensics.sources.engine_logs.envelopes.syslog`."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kvforensics.sources.engine_logs.contract import QuarantinedLine, raw_for_quarantine


@dataclass(frozen=True, slots=True)
class EnvelopeRecord:
    """One engine line taken out of its envelope."""

    line: int  # 1-based physical line of the file the record starts on
    ts_ns: int | None  # the envelope's clock: UTC nanoseconds since the epoch (None: the record has none)
    labels: Mapping[str, str]  # the record's labels / fields (pod, _HOSTNAME, logStreamName, stream ...)
    text: str | None  # the engine line; None when its bytes are not UTF-8
    raw: bytes  # the engine line's bytes when text is None (b"" otherwise: text holds the line)


EnvelopeItem = EnvelopeRecord | QuarantinedLine

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utc_from_ns(ns: int) -> datetime:
    """The UTC instant of *ns* nanoseconds since the epoch (to the microsecond)."""
    return _EPOCH + timedelta(microseconds=ns // 1000)


RFC3339 = re.compile(
    r"(?P<date>\d{4}-\d{2}-\d{2})[Tt ](?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,9}))?"
    r"(?P<tz>[Zz]|[+-]\d{2}:?\d{2})"
)


def rfc3339_ns(value: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 stamp with an offset; ValueError otherwise."""
    m = RFC3339.fullmatch(value.strip())
    if m is None:
        raise ValueError(f"not an RFC 3339 timestamp with an offset: {value[:60]!r}")
    return match_ns(m)


_SECONDS: dict[tuple[str, str, str], int] = {}


def match_ns(m: re.Match[str]) -> int:
    key = (m["date"], m["time"], m["tz"])
    seconds = _SECONDS.get(key)
    if seconds is None:
        base = datetime.fromisoformat(f"{key[0]}T{key[1]}").replace(tzinfo=UTC)
        tz = key[2]
        if tz not in ("Z", "z"):
            sign = -1 if tz[0] == "-" else 1
            digits = tz[1:].replace(":", "")
            base -= sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        seconds = (base - _EPOCH) // timedelta(seconds=1)
        if len(_SECONDS) > 100_000:
            _SECONDS.clear()
        _SECONDS[key] = seconds
    frac = m["frac"]
    return seconds * 1_000_000_000 + (int(frac.ljust(9, "0")) if frac else 0)


def epoch_ns(value: Any, unit_ns: int, what: str) -> int:
    """An epoch count (int, or a string of digits) in units of *unit_ns* nanoseconds."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what} is not an epoch count: {str(value)[:60]!r}")
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ValueError(f"{what} is not an epoch count: {value[:60]!r}")
        value = int(value)
    ns = value * unit_ns
    utc_from_ns(ns)  # OverflowError if outside datetime's range
    return ns


def split_message(line: int, ts_ns: int | None, labels: Mapping[str, str], message: str) -> Iterator[EnvelopeRecord]:
    """One record per engine line of a message (a message may hold several lines, e.g. a traceback)."""
    if message.endswith("\n"):
        message = message[:-1]
    if "\n" not in message:
        text = message[:-1] if message.endswith("\r") else message
        yield EnvelopeRecord(line, ts_ns, labels, text, b"")
        return
    for part in message.split("\n"):
        text = part[:-1] if part.endswith("\r") else part
        yield EnvelopeRecord(line, ts_ns, labels, text, b"")


def quarantine(line: int, reason: str, raw: bytes | str) -> QuarantinedLine:
    """A record whose envelope cannot be read, at its physical line."""
    return QuarantinedLine(line, reason, raw_for_quarantine(raw))


class Partials:
    """Join the pieces of a line split over several records, per stream, until its last piece."""

    def __init__(self) -> None:
        self.open: dict[str, tuple[int, int | None, Mapping[str, str], list[str]]] = {}

    def add(
        self, stream: str, line: int, ns: int | None, labels: Mapping[str, str], piece: str, last: bool
    ) -> tuple[int, int | None, Mapping[str, str], str] | None:
        held = self.open.get(stream)
        if held is None:
            if last:
                return line, ns, labels, piece
            self.open[stream] = (line, ns, labels, [piece])
            return None
        held[3].append(piece)
        if not last:
            return None
        del self.open[stream]
        return held[0], held[1], held[2], "".join(held[3])

    def rest(self) -> Iterator[tuple[int, int | None, Mapping[str, str], str]]:
        """Pieces still open at the end of the file (the collector stopped mid-line)."""
        for line, ns, labels, pieces in self.open.values():
            yield line, ns, labels, "".join(pieces)
        self.open.clear()
