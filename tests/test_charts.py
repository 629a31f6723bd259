"""Charts are pure functions of small frames, checked through their Vega-Lite spec."""

from __future__ import annotations

import pandas as pd

from kvforensics.report import charts
from kvforensics.report.views import AccountFrames, TimelineFrames

POINTS = pd.DataFrame(
    {
        "prompt_tokens": [1000, 700000],
        "observed_ms": [100.0, 150.0],
        "confidence": ["not flagged", "confirmed"],
        "request_id": ["a", "b"],
        "account_id": ["x", "y"],
        "measure": ["ttft", "ttft"],
    }
)
POOLS = pd.DataFrame({"kv_pool_tokens": [681280], "label": ["KV pool 681,280 (prefill)"]})
CURVE = pd.DataFrame({"prompt_tokens": [1000, 700000], "expected_ms": [60.0, 90000.0]})


def test_money_chart_draws_points_pool_and_curve():
    spec = charts.money_chart(POINTS, POOLS, CURVE, title="m").to_dict()
    marks = [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in spec["layer"]]
    assert marks == ["circle", "line", "rule", "text"]
    assert spec["layer"][0]["encoding"]["y"]["scale"]["type"] == "log"
    assert {"field": "request_id", "type": "nominal"} in spec["layer"][0]["encoding"]["tooltip"]


def test_money_chart_says_when_it_draws_a_sample_of_the_flagged_requests():
    points = POINTS.copy()
    points.attrs["flagged_total"] = 9000  # report.data.money_frames: more flagged requests than a chart holds
    spec = charts.money_chart(points, POOLS, CURVE, title="m").to_dict()
    assert spec["title"] == "m (1 of 9,000 flagged requests drawn: confirmed first, then probable)"
    points.attrs["flagged_total"] = 1
    assert charts.money_chart(points, POOLS, CURVE, title="m").to_dict()["title"] == "m"


def test_interactive_money_chart_zooms_and_selects_by_legend():
    spec = charts.money_chart(POINTS, POOLS, CURVE, title="m", interactive=True).to_dict()
    params = [p for layer in spec["layer"] for p in layer.get("params", [])] + spec.get("params", [])
    binds = {str(p.get("bind")) for p in params}
    assert "legend" in binds and "scales" in binds


def _timeline_frames(affected_total: int = 2) -> TimelineFrames:
    ts = pd.to_datetime(["2026-08-28T10:00Z", "2026-08-28T11:30Z"], utc=True)
    windows = pd.DataFrame(
        {
            "lane": ["p0 (prefill, pool 681,280)"],
            "instance": ["p0"],
            "role": ["prefill"],
            "model": ["m"],
            "start": pd.to_datetime(["2026-08-27T00:00Z"], utc=True),
            "end": pd.to_datetime(["2026-09-09T00:00Z"], utc=True),
            "pool_tokens": [681280],
            "context_length": [1048576],
            "from": ["2026-08-27T00:00:00Z"],
            "to": ["2026-09-09T00:00:00Z"],
        }
    )
    events = pd.DataFrame(
        {
            "ts": pd.to_datetime(["2026-08-27T00:00Z", "2026-09-08T23:11Z"], utc=True),
            "kind": ["start-up", "incident file"],
            "title": ["p0 started", "report received"],
            "detail": ["", ""],
            "time": ["2026-08-27T00:00:00Z", "2026-09-08T23:11:00Z"],
        }
    )
    affected = pd.DataFrame(
        {
            "ts": ts,
            "request_id": ["a", "b"],
            "account_id": ["x", "y"],
            "account_class": ["customer", "internal"],
            "model": ["m", "m"],
            "confidence": ["confirmed", "probable"],
            "prompt_tokens": [700000, 690000],
            "instance": ["p0", "p0"],
            "time": ["2026-08-28T10:00:00Z", "2026-08-28T11:30:00Z"],
        }
    )
    hourly = pd.DataFrame(
        {
            "hour": pd.to_datetime(["2026-08-28T10:00Z", "2026-08-28T11:00Z"], utc=True),
            "model": ["m", "m"],
            "responses": [1, 1],
            "time": ["2026-08-28T10:00:00Z", "2026-08-28T11:00:00Z"],
        }
    )
    return TimelineFrames(
        windows=windows, events=events, affected=affected, hourly=hourly, affected_total=affected_total
    )


def _params(spec: dict) -> list[dict]:
    """Every selection parameter of a (layered / concatenated) Vega-Lite spec."""
    found = list(spec.get("params", []))
    for key in ("layer", "vconcat", "hconcat"):
        for part in spec.get(key, []):
            found += _params(part)
    return found


def test_timeline_zooms_brushes_and_shares_one_utc_time_axis():
    spec = charts.timeline_chart(_timeline_frames()).to_dict()
    assert spec["resolve"]["scale"]["x"] == "shared"
    detail, hourly = spec["vconcat"]
    params = {p["name"]: p for p in _params(spec)}
    assert params["zoom"]["bind"] == "scales" and params["zoom"]["select"]["encodings"] == ["x"]
    assert params["period"]["select"] == {"type": "interval", "encodings": ["x"]}
    assert params["period"]["views"] == [hourly["name"]]  # brushed on the hourly bars
    assert params["zoom"]["views"] == [detail["layer"][0]["name"]]  # zoomed on the timeline above
    lanes = detail["layer"][0]["encoding"]["y"]["sort"]
    assert lanes == [
        "incident file (reports, fixes)",
        "engine start-ups and restarts",
        "p0 (prefill, pool 681,280)",
        "affected responses",
    ]
    assert all(layer["encoding"]["x"]["scale"]["type"] == "utc" for layer in detail["layer"])
    assert detail["title"] == "2 affected responses"


def test_timeline_says_when_it_draws_a_sample():
    spec = charts.timeline_chart(_timeline_frames(affected_total=9000)).to_dict()
    assert spec["vconcat"][0]["title"] == "9,000 affected responses (2 drawn, a sample by request id)"


def test_static_timeline_has_no_selections():
    assert _params(charts.timeline_chart(_timeline_frames(), interactive=False).to_dict()) == []


def test_account_view_filters_responses_by_the_account_picked():
    accounts = pd.DataFrame(
        {
            "account_id": ["x", "y"],
            "account_class": ["customer", "internal"],
            "responses": [1, 1],
            "first_time": ["a", "b"],
            "last_time": ["a", "b"],
            "models": ["m", "m"],
        }
    )
    frames = AccountFrames(accounts=accounts, affected=_timeline_frames().affected, accounts_total=3, affected_total=3)
    spec = charts.account_chart(frames).to_dict()
    bars, dots = spec["hconcat"]
    (pick,) = spec["params"]
    assert pick["views"] == [bars["name"]]  # click a bar ...
    assert pick["bind"]["input"] == "select" and pick["bind"]["options"] == [None, "x", "y"]  # ... or pick one
    assert pick["select"] == {"type": "point", "fields": ["account_id"]}
    assert dots["transform"] == [{"filter": {"param": pick["name"]}}]
    assert bars["title"] == "2 of 3 accounts"


def test_altair_is_imported_without_rfc3987_syntax_which_stays_importable():
    """The charts module keeps jsonschema from compiling rfc3987_syntax's grammars (seconds per
    report run) while importing Altair; charts still validate, and the package imports later."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import pandas as pd\n"
        "import kvforensics.report.charts as c\n"
        "assert 'rfc3987_syntax' not in sys.modules, 'rfc3987_syntax was loaded'\n"
        "c.alt.Chart(pd.DataFrame({'a': [1]})).mark_point().encode(x='a:Q').to_dict()\n"
        "try:\n"
        "    c.alt.Chart(pd.DataFrame({'a': [1]})).mark_point().encode(x='a:Q').properties(width='wide').to_dict()\n"
        "except Exception as e:\n"
        "    assert 'wide' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('an invalid spec passed validation')\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('rfc3987_syntax') is None or __import__('rfc3987_syntax')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
