"""The change log's timestamps: epoch numbers and ISO 8601 texts read to the same instant, the source's clock
offset added to both in real seconds, as the requests loader does."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.sources.common.records import parse_ts
from kvforensics.stages.ingest import ingest

INSTANT = datetime(2026, 8, 28, 10, 0, 0, tzinfo=timezone.utc)
EPOCH_S = 1_787_911_200  # INSTANT


def incident(tmp_path: Path, extra: str = "") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "incident.toml").write_text(f"""[incident]
id = "changes-test"
title = "change log timestamps"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"
format = "jsonl"
{extra}

[[sources]]
name = "changes"
kind = "changes"
path = "changes.csv"
format = "csv"
{extra}
""")
    return tmp_path / "incident.toml"


def change_source(tmp_path: Path, extra: str = ""):
    return load_incident(incident(tmp_path, extra)).sources[1]


def test_the_epoch_constant_is_the_instant() -> None:
    assert datetime.fromtimestamp(EPOCH_S, tz=timezone.utc) == INSTANT


@pytest.mark.parametrize(
    "text",
    [
        str(EPOCH_S),
        f"{EPOCH_S}.0",
        str(EPOCH_S * 1000),
        str(EPOCH_S * 1_000_000),
        str(EPOCH_S * 1_000_000_000),
        "2026-08-28T10:00:00Z",
        "2026-08-28T12:00:00+02:00",
        "2026-08-28T06:00:00",
    ],
)  # the last in the source's zone, New York (EDT)
def test_epoch_and_iso_timestamps_get_the_clock_offset_alike(tmp_path: Path, text: str) -> None:
    source = change_source(tmp_path, 'timezone = "America/New_York"\nclock_offset_s = -90.5')
    assert parse_ts(text, source) == datetime(2026, 8, 28, 9, 58, 29, 500000, tzinfo=timezone.utc)
    assert parse_ts(text, change_source(tmp_path / "plain", 'timezone = "America/New_York"')) == INSTANT


def test_the_offset_is_real_seconds_across_a_daylight_saving_change(tmp_path: Path) -> None:
    # 00:30 EDT on 2026-11-01 is 04:30 UTC; two real hours later is 06:30 UTC (01:30 EST), not 02:30 EST
    source = change_source(tmp_path, 'timezone = "America/New_York"\nclock_offset_s = 7200')
    assert parse_ts("2026-11-01T00:30:00", source) == datetime(2026, 11, 1, 6, 30, tzinfo=timezone.utc)


@pytest.mark.parametrize("text", ["", "  ", "yesterday", "nan", "inf", "1e30", "9999-12-31T23:59:59"])
def test_unreadable_or_out_of_range_timestamps_are_none(tmp_path: Path, text: str) -> None:
    assert parse_ts(text, change_source(tmp_path, "clock_offset_s = 3600")) is None


def test_a_change_and_a_request_at_the_same_epoch_are_at_the_same_instant_after_ingest(tmp_path: Path) -> None:
    (tmp_path / "gateway.jsonl").write_text(
        f'{{"request_id": "r1", "ts": {EPOCH_S * 1000}, "account_id": "a", "model": "m", "status": 200, "prompt_tokens": 10}}\n'
        f'{{"request_id": "r2", "ts": "2026-08-28T06:00:00", "account_id": "a", "model": "m", "status": 200, "prompt_tokens": 10}}\n'
    )
    (tmp_path / "changes.csv").write_text(
        f"ts,description\n{EPOCH_S * 1000},deploy by epoch\n2026-08-28T06:00:00,deploy by local time\n"
    )
    con = connect()
    try:
        ingest(con, load_incident(incident(tmp_path, 'timezone = "America/New_York"\nclock_offset_s = 30')))
        requests = [r[0] for r in con.execute("SELECT ts FROM requests ORDER BY request_id").fetchall()]
        changes = [r[0] for r in con.execute("SELECT ts FROM changes ORDER BY description").fetchall()]
        assert con.execute("SELECT reason FROM quarantine").fetchall() == []
    finally:
        con.close()
    shifted = datetime(2026, 8, 28, 10, 0, 30, tzinfo=timezone.utc)
    assert requests == [shifted, shifted]
    assert changes == [shifted, shifted]
