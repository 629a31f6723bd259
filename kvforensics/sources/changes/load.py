"""The change log (``kind = "changes"``): deployments, restarts and config changes, from CSV or JSONL.

A change needs a timestamp (ISO 8601 or epoch seconds/ms/us/ns; ISO 8601 without an offset read in
the source's timezone; the clock offset applied to both) and a description; model, instance and
details are optional. Anything else is quarantined with its reason.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import QuarantineRows, lone_surrogate, parse_ts, read_records
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
                problem = next(
                    (
                        f"field '{source.column(k)}' is not valid Unicode (a lone surrogate escape)"
                        for k, v in fields.items()
                        if v and lone_surrogate(v)
                    ),
                    None,
                )
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
        con.register(
            "changes_batch",
            pa.table(
                {
                    "ts": pa.array(rows["ts"], type=pa.timestamp("us", tz="UTC")),
                    **{k: pa.array(rows[k], type=pa.string()) for k in TEXT_FIELDS},
                    "line": pa.array(rows["line"], type=pa.int64()),
                }
            ),
        )
        try:
            con.execute(
                "INSERT INTO changes SELECT ts, model, instance, description, details, $s, $f, line FROM changes_batch",
                {"s": source.name, "f": str(path)},
            ).fetchall()
        finally:
            con.unregister("changes_batch")
    return load


def _text(value: object) -> str | None:
    """A field as the VARCHAR it was inserted as (a JSON number or boolean as its text)."""
    if value is None or isinstance(value, str):
        return value
    return str(value).lower() if isinstance(value, bool) else str(value)
