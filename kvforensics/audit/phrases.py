"""How verdict sentences write numbers, times and the file locations they rest on."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path


def iso(ts: datetime | None) -> str | None:
    """ISO-8601 in UTC with a ``Z`` (JSON and notes)."""
    return None if ts is None else ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def short_ts(ts: datetime | None) -> str:
    """Minutes in UTC for tables; ``?`` for a start-up without a timestamp."""
    return "?" if ts is None else ts.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def thousands(x: int) -> str:
    """A token count with thousands separators."""
    return f"{x:,}"


def loc(file: str | None, line: int | None) -> str:
    """``name:line`` of a piece of evidence (the file's name only, not its folder)."""
    name = Path(file).name if file else "?"
    return f"{name}:{line}" if line is not None else name


def to_int(value: str | None) -> int | None:
    """An integer setting as logged (``"8,192"`` too), None when absent or not a number."""
    if value is None:
        return None
    try:
        return int(str(value).replace(",", ""))
    except ValueError:
        return None
