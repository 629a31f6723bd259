"""The change log (``kind = "changes"``): deployments, restarts and config changes, from CSV or JSONL.

A change needs a timestamp (ISO 8601 or epoch seconds/ms/us/ns; ISO 8601 without an offset read in
the source's timezone; the clock offset applied to both) and a description; model, instance and
details are optional. Anything else is quarantined with its reason.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.sources.common.records import QuarantineRows, lone_surrogate, read_records
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.textio import printable_raw

TEXT_FIELDS = ("model", "instance", "description", "details")


def load_changes(con: duckdb.DuckDBPyConnection, source: Source, path: Path) -> FileLoad:
    """Load one change-log file into ``changes``: one insert for its changes, one for its refusals."""
    load = FileLoad(file=path)
    quarantine = QuarantineRows(con, source, path)
    rows: dict[str, list] = {k: [] for k in ("ts", *TEXT_FIELDS, "line")}
    for line, raw, rec, problem in read_records(source, path, load):
        load.records_read += 1
        ts: datetime | None = None
        fields: dict[str, str | None] = {}
        if rec is not None and problem is None:
            fields = {k: _text(rec.get(source.column(k))) or None for k in TEXT_FIELDS}
            ts_raw = rec.get(source.column("ts"))
            ts = parse_ts(str(ts_raw) if ts_raw is not None else None, source)
            if ts_raw in (None, ""):
                problem = "missing required field 'ts'"
            elif ts is None:
                problem = f"bad timestamp '{str(ts_raw)[:60]}'"
            elif not rec.get(source.column("description")):
                problem = "missing required field 'description'"
            else:
                problem = next((f"field '{source.column(k)}' is not valid Unicode (a lone surrogate escape)"
                                for k, v in fields.items() if v and lone_surrogate(v)), None)
        if problem or rec is None:  # the reader gives a reason with every record it cannot give
            load.quarantined += 1
            quarantine.add(line, problem or "unreadable record", printable_raw(raw))
            continue
        rows["ts"].append(ts)
        for k, v in fields.items():
            rows[k].append(v)
        rows["line"].append(line)
    load.loaded = len(rows["line"])
    quarantine.flush()
    if rows["line"]:
        con.register("changes_batch", pa.table({
            "ts": pa.array(rows["ts"], type=pa.timestamp("us", tz="UTC")),
            **{k: pa.array(rows[k], type=pa.string()) for k in TEXT_FIELDS},
            "line": pa.array(rows["line"], type=pa.int64())}))
        try:
            con.execute("INSERT INTO changes SELECT ts, model, instance, description, details, $s, $f, line "
                        "FROM changes_batch", {"s": source.name, "f": str(path)}).fetchall()
        finally:
            con.unregister("changes_batch")
    return load


def _text(value: object) -> str | None:
    """A field as the VARCHAR it was inserted as (a JSON number or boolean as its text)."""
    if value is None or isinstance(value, str):
        return value
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_ts(value: str | None, source: Source) -> datetime | None:
    """A change's timestamp in UTC: epoch seconds/ms/us/ns by magnitude, or ISO 8601 (read in the
    source's timezone when it has no offset); the source's clock offset (real seconds) applied to
    either, as the requests loader does. None if unreadable."""
    if value is None or not value.strip():
        return None
    v = value.strip()
    try:
        num = float(v)
    except ValueError:
        num = None
    offset = timedelta(seconds=source.clock_offset_s)
    if num is not None:
        scale = 1e9 if abs(num) >= 1e17 else 1e6 if abs(num) >= 1e14 else 1e3 if abs(num) >= 1e11 else 1.0
        try:
            return datetime.fromtimestamp(num / scale, tz=timezone.utc) + offset
        except (OverflowError, OSError, ValueError):  # inf, nan, beyond year 9999
            return None
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=source.tz)
    try:  # in UTC first: an offset added to a zone's local time would move across a daylight-saving change
        return dt.astimezone(timezone.utc) + offset
    except OverflowError:  # an offset carrying a time beyond year 1 or 9999
        return None
