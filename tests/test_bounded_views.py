"""Issue 28, observation 6: every report element is bounded. 6,000 rows in changes.csv (or 100,000 ``[[events]]``)
crashed the report with Altair's MaxRowsError (a chart embeds at most 5,000 rows); long change logs and many pod
restarts are normal in large deployments. Beyond its limit a view samples evenly in time or aggregates, and says so."""

from __future__ import annotations

from datetime import datetime, timezone

import duckdb
from conftest import INCIDENT, write_mini

from kvforensics.cli import main
from kvforensics.report import views
from kvforensics.report.charts import timeline_chart

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _evidence(restarts: int, changes: int, hours: int) -> duckdb.DuckDBPyConnection:
    """The tables the timeline reads: every start-up exposed, one affected response an hour."""
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.execute(
        """CREATE TABLE capacity AS SELECT 'p' || (i % 7) AS instance, 'prefill' AS role, 'm' AS model,
                   $t0 + i * INTERVAL 1 HOUR AS valid_from, $t0 + (i + 1) * INTERVAL 1 HOUR AS valid_to,
                   1000 AS kv_pool_tokens, 4096 AS context_length FROM range($n) r(i)""",
        {"t0": T0, "n": restarts},
    )
    con.execute("CREATE TABLE exposure_windows AS SELECT instance, valid_from FROM capacity")
    con.execute("CREATE TABLE requests AS SELECT $t0 AS ts", {"t0": T0})
    con.execute(
        """CREATE TABLE changes AS SELECT $t0 + i * INTERVAL 1 MINUTE AS ts, 'change ' || i AS description,
                   'm' AS model, 'p0' AS instance, 'd' AS details FROM range($n) r(i)""",
        {"t0": T0, "n": changes},
    )
    con.execute(
        """CREATE TABLE affected_responses AS SELECT $t0 + i * INTERVAL 1 HOUR AS ts, 'r' || i AS request_id,
                   'a' || (i % 3) AS account_id, 'customer' AS account_class, 'm' AS model, 'probable' AS confidence,
                   5000 AS prompt_tokens, 'p0' AS prefill_instance, NULL AS pool_instance FROM range($n) r(i)""",
        {"t0": T0, "n": hours},
    )
    return con


def test_many_restarts_changes_and_hours_are_drawn_bounded_and_said():
    con = _evidence(restarts=1500, changes=6000, hours=3000)
    f = views.timeline_frames(con)
    assert len(f.events) == views.MAX_EVENTS and f.events_total == 1500 + 6000
    assert set(f.events["kind"]) == {"start-up", "restart", "config change"}
    assert (f.events["kind"] != "config change").sum() == 1500  # every start-up and restart kept
    assert f.events["ts"].is_monotonic_increasing
    assert len(f.windows) == views.MAX_WINDOWS and f.windows_total == 1500
    assert f.bar_unit == "day" and len(f.hourly) == 125  # 3,000 hours
    spec = timeline_chart(f, interactive=True).to_dict()  # raised MaxRowsError at 5,001 rows in one dataset
    assert all(len(rows) <= 5000 for rows in spec["datasets"].values())
    title = spec["vconcat"][0]["title"]
    assert title == [
        "3,000 affected responses",
        "(2,000 of 7,500 events drawn, the incident file's first, then "
        "start-ups, then changes, evenly in time; 1,000 of 1,500 exposure windows drawn, evenly in time)",
    ]
    assert spec["vconcat"][1]["title"].startswith("affected responses per day")


def test_a_small_timeline_is_drawn_whole():
    f = views.timeline_frames(_evidence(restarts=3, changes=10, hours=5))
    assert (len(f.events), f.events_total, len(f.windows), f.bar_unit, f.bounds_note()) == (13, 13, 3, "hour", "")


def test_a_long_change_log_and_many_incident_events_do_not_stop_the_report(tmp_path):
    events = "".join(
        f'\n[[events]]\nts = "2026-08-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00Z"\ntitle = "event {i}"\n'
        for i in range(6000)
    )
    incident = (
        INCIDENT + '\n[[sources]]\nname = "changes"\nkind = "changes"\npath = "changes.csv"\nformat = "csv"\n' + events
    )
    path = write_mini(tmp_path / "mini", incident=incident)
    (tmp_path / "mini" / "changes.csv").write_text(
        "ts,description,model,instance,details\n"
        + "".join(
            f"2026-08-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:{i % 59:02d}Z,change {i},m,p0,d\n" for i in range(6000)
        )
    )
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    assert "2,000 of 12,003 events drawn" in (out / "report.html").read_text()


def test_many_pool_sizes_are_drawn_bounded_and_said():
    import pandas as pd

    from kvforensics.report.charts import MAX_POOL_RULES, money_chart

    points = pd.DataFrame(
        {
            "prompt_tokens": [10],
            "observed_ms": [5.0],
            "confidence": ["probable"],
            "request_id": ["r"],
            "account_id": ["a"],
            "measure": ["ttft"],
        }
    )
    pools = pd.DataFrame({"kv_pool_tokens": range(1000, 7000), "label": [f"pool {i}" for i in range(6000)]})
    spec = money_chart(points, pools, pd.DataFrame(columns=["prompt_tokens", "expected_ms"]), title="m").to_dict()
    assert max(len(rows) for rows in spec["datasets"].values()) == MAX_POOL_RULES
    assert spec["title"] == f"m ({MAX_POOL_RULES} of 6,000 KV pool sizes drawn, evenly from the smallest)"
