"""The timestamp format of every output: UTC ISO-8601 with a trailing ``Z``, milliseconds when not whole."""

from __future__ import annotations

from datetime import datetime, timezone


def iso(ts: datetime | None) -> str | None:
    """UTC ISO-8601 with a trailing Z (the output contract's timestamp format)."""
    if ts is None:
        return None
    ts = ts.astimezone(timezone.utc)
    text = ts.strftime("%Y-%m-%dT%H:%M:%S")
    if ts.microsecond:
        text += f".{ts.microsecond // 1000:03d}"
    return text + "Z"
