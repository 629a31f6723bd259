"""Engine clocks: naive local engine stamps read in the source's zone, and a check against Docker's
UTC ``--timestamps`` prefix."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo


class LocalClock:
    """Turn naive local engine timestamps into tz-aware UTC datetimes.

    A stamp is read as wall-clock time in *tz*, converted to UTC, then shifted by
    ``clock_offset_s`` (a correction for a skewed host clock, in real seconds). Wall-clock times
    that are ambiguous (the repeated hour when DST ends) or do not exist (the skipped hour when
    DST starts) are read with ``fold=0`` and counted; :meth:`notes` describes them.
    """

    def __init__(self, tz: ZoneInfo, clock_offset_s: float = 0.0) -> None:
        self.tz = tz
        self.offset = timedelta(seconds=clock_offset_s)
        self._hour_cache: dict[tuple[int, int, int, int], tuple[timedelta, str | None]] = {}
        self._dst: dict[str, list[Any]] = {}  # kind -> [count, first line, first stamp]

    def to_utc(self, local: datetime, line: int) -> datetime:
        """The UTC instant of a naive local stamp; ValueError if it falls outside datetime's range."""
        try:
            return self._to_utc(local, line)
        except OverflowError as e:
            raise ValueError(f"out of range: {e}") from e

    def shift(self, instant: datetime | None) -> datetime | None:
        """Apply the clock offset to an instant that is already UTC (e.g. Docker's prefix)."""
        if instant is None:
            return None
        try:
            return instant + self.offset
        except OverflowError:
            return None

    def _to_utc(self, local: datetime, line: int) -> datetime:
        hour = (local.year, local.month, local.day, local.hour)
        cached = self._hour_cache.get(hour)
        if cached is None:
            cached = self._classify(local)
            if len(self._hour_cache) > 100_000:
                self._hour_cache.clear()
            self._hour_cache[hour] = cached
        utcoffset, dst_kind = cached
        if dst_kind is not None:
            # the transition may fall inside this hour: classify the exact minute
            utcoffset, dst_kind = self._classify(local)
            if dst_kind is not None:
                entry = self._dst.setdefault(dst_kind, [0, line, local])
                entry[0] += 1
        return (local - utcoffset).replace(tzinfo=UTC) + self.offset

    def hour_shift_us(self, year: int, month: int, day: int, hour: int) -> int | None:
        """Microseconds to subtract from a naive stamp of this local hour to get its UTC instant (the
        clock offset included), or None when the hour cannot be read with one offset: a daylight
        saving change falls in it, it is not a date, or it is out of range. Every stamp of a hour
        with a shift reads as :meth:`to_utc` reads it (the columnar reader relies on this)."""
        try:
            start = datetime(year, month, day, hour)
            end = start + timedelta(minutes=59, seconds=59, microseconds=999_999)
            (off, kind), (end_off, end_kind) = self._classify(start), self._classify(end)
            if kind is not None or end_kind is not None or off != end_off:
                return None
            (start - off).replace(tzinfo=UTC) + self.offset  # noqa: B018 - the range check
            (end - off).replace(tzinfo=UTC) + self.offset  # noqa: B018
        except (ValueError, OverflowError):
            return None
        return (off - self.offset) // timedelta(microseconds=1)

    def _classify(self, local: datetime) -> tuple[timedelta, str | None]:
        early = local.replace(tzinfo=self.tz, fold=0)
        late = local.replace(tzinfo=self.tz, fold=1)
        off = early.utcoffset() or timedelta(0)
        if off == (late.utcoffset() or timedelta(0)):
            return off, None
        back = early.astimezone(UTC).astimezone(self.tz).replace(tzinfo=None)
        return off, ("nonexistent" if back != local else "ambiguous")

    def notes(self) -> list[str]:
        out = []
        for kind, (count, line, stamp) in sorted(self._dst.items()):
            what = (
                "fall in the repeated hour when daylight saving time ends"
                if kind == "ambiguous"
                else "fall in the hour skipped when daylight saving time starts (they cannot exist)"
            )
            out.append(
                f"{count} line(s) {what} in {self.tz.key} (first at line {line}: {stamp:%Y-%m-%d %H:%M:%S}); "
                "read with fold=0, i.e. with the UTC offset in force before the change"
            )
        if self.offset:
            out.append(f"clock offset of {self.offset.total_seconds():+g} s added to every engine timestamp")
        return out


class DockerSkewCheck:
    """Compare engine stamps with Docker's UTC prefix, to catch a wrong ``timezone`` setting."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None

    def observe(self, line: int, engine_ts: datetime | None, docker_ts: datetime | None) -> None:
        if self.first is None and engine_ts is not None and docker_ts is not None:
            self.first = (line, (docker_ts - engine_ts).total_seconds())

    def notes(self) -> list[str]:
        if self.first is None:
            return []
        line, skew = self.first
        if abs(skew) < 300:
            return []
        return [
            (
                f"engine timestamps differ from the Docker --timestamps prefix (UTC) by {skew / 3600:+.2f} h "
                f"(first compared at line {line}): check the source's timezone or clock offset"
            )
        ]
