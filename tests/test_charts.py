"""Charts are pure functions of small frames, checked through their Vega-Lite spec."""

from __future__ import annotations

import pandas as pd

from kvforensics.report import charts

POINTS = pd.DataFrame({"prompt_tokens": [1000, 700000], "observed_ms": [100.0, 150.0],
                       "confidence": ["not flagged", "confirmed"], "request_id": ["a", "b"],
                       "account_id": ["x", "y"], "measure": ["ttft", "ttft"]})
POOLS = pd.DataFrame({"kv_pool_tokens": [681280], "label": ["KV pool 681,280 (prefill)"]})
CURVE = pd.DataFrame({"prompt_tokens": [1000, 700000], "expected_ms": [60.0, 90000.0]})


def test_money_chart_draws_points_pool_and_curve():
    spec = charts.money_chart(POINTS, POOLS, CURVE, title="m").to_dict()
    marks = [layer["mark"]["type"] if isinstance(layer["mark"], dict) else layer["mark"] for layer in spec["layer"]]
    assert marks == ["circle", "line", "rule", "text"]
    assert spec["layer"][0]["encoding"]["y"]["scale"]["type"] == "log"
    assert {"field": "request_id", "type": "nominal"} in spec["layer"][0]["encoding"]["tooltip"]


def test_interactive_money_chart_zooms_and_selects_by_legend():
    spec = charts.money_chart(POINTS, POOLS, CURVE, title="m", interactive=True).to_dict()
    params = [p for layer in spec["layer"] for p in layer.get("params", [])] + spec.get("params", [])
    binds = {str(p.get("bind")) for p in params}
    assert "legend" in binds and "scales" in binds


def test_timeline_shares_one_time_axis():
    hourly = pd.DataFrame({"hour": pd.to_datetime(["2026-08-28T10:00Z"]), "model": ["m"], "responses": [3]})
    windows = pd.DataFrame({"label": ["p0"], "start": pd.to_datetime(["2026-08-27T00:00Z"]),
                            "end": pd.to_datetime(["2026-09-09T00:00Z"])})
    events = pd.DataFrame({"ts": pd.to_datetime(["2026-09-08T23:11Z"]), "title": ["report"]})
    spec = charts.timeline_chart(hourly, windows, events, interactive=True).to_dict()
    assert spec["resolve"]["scale"]["x"] == "shared"
    assert len(spec["vconcat"]) == 2


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
