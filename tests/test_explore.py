"""The notebooks' drill-downs (kvforensics.explore): on the sample, checked against the run's own output files
and independent pandas over the evidence tables; on odd input, empty views that say why, names escaped."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import mini_requests, write_mini

from kvforensics import explore
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.investigation import Investigation

RULES = sorted(p.stem for p in (Path(explore.__file__).parent.parent / "mechanisms").glob("*/rules/*.yml"))


@pytest.fixture(scope="module")
def sample(sample_run):
    con = connect(sample_run / "evidence.duckdb", read_only=True)
    yield sample_run, con
    con.close()


def table(con, name: str) -> pd.DataFrame:
    return con.execute(f"SELECT * FROM {name}").df()  # whole tables; the checks below are pandas


def test_loaded_matches_the_manifest(sample):
    out, con = sample
    manifest = json.loads((out / "manifest.json").read_text())
    view = explore.loaded(con, 0.01)
    for column in ("records_read", "loaded", "quarantined", "duplicates"):
        assert int(view.frame[column].sum()) == manifest["totals"][column]
    per_source = pd.DataFrame(manifest["inputs"]).groupby("source")["records_read"].sum()
    assert view.frame.set_index("source")["records_read"].to_dict() == per_source.to_dict()
    assert f"{manifest['totals']['records_read']:,} records read" in view.note
    assert len(explore.loaded_files(con)) == len(manifest["inputs"])


def test_recipients_are_the_affected_accounts(sample):
    out, con = sample
    affected = pd.read_csv(out / "affected_requests.csv")
    view = explore.recipients(con)
    expected = affected.groupby("account_id").size().to_dict()
    assert view.frame.set_index("account_id")["responses"].to_dict() == expected
    classes = view.frame["account_class"].tolist()
    assert classes == sorted(classes, key=lambda c: c != "customer"), "customers first"
    matches = table(con, "content_matches")
    mine = matches[matches["confirmed"] & (matches["source_account_id"] != matches["recipient_account_id"])]
    confirmed = mine.groupby("recipient_account_id")["source_account_id"].nunique()
    for row in view.frame.itertuples():
        assert row.confirmed_source_accounts == confirmed.get(row.account_id, 0)
    scope = json.loads((out / "scope.json").read_text())
    assert f"{scope['affected_accounts']} accounts received {scope['affected_responses']:,} affected" in view.note


def test_tiers_and_notification_lists_match_the_outputs(sample):
    out, con = sample
    scope = json.loads((out / "scope.json").read_text())
    tiers = explore.tiers(con).frame.groupby("confidence")["requests"].sum()
    assert {t: int(tiers.get(t, 0)) for t in ("confirmed", "probable")} == scope["by_confidence"]
    notifications = pd.read_csv(out / "notifications.csv")
    for role in explore.NOTIFICATION_ROLES:
        assert len(explore.notification_list(con, role)) == int((notifications["role"] == role).sum())
    with pytest.raises(ValueError, match="role must be one of"):
        explore.notification_list(con, "everyone")


def test_examples_pick_from_the_evidence(sample):
    out, con = sample
    affected = pd.read_csv(out / "affected_requests.csv", parse_dates=["ts"])
    ex = explore.examples(con)
    customers = affected[affected["account_class"] == "customer"].groupby("account_id").size()
    top = customers[customers == customers.max()].index.min()
    assert ex.account == top
    mine = affected[affected["account_id"] == top].sort_values(["ts", "request_id"])
    assert ex.response == mine["request_id"].iloc[0]


def test_account_timeline(sample):
    out, con = sample
    ex = explore.examples(con)
    view = explore.account_timeline(con, ex.account)
    requests = table(con, "requests")
    mine = requests[requests["account_id"] == ex.account]
    assert len(view) == len(mine)
    assert sorted(view.frame["request_id"]) == sorted(mine["request_id"])
    assert view.frame["ts"].is_monotonic_increasing
    affected = pd.read_csv(out / "affected_requests.csv")
    assert set(view.frame.loc[view.frame["affected"], "request_id"]) == set(
        affected.loc[affected["account_id"] == ex.account, "request_id"]
    )
    tiers = table(con, "request_tiers").set_index("request_id")["confidence"]
    for row in view.frame.itertuples():
        assert row.confidence == tiers.get(row.request_id, "not flagged")
    spec = view.chart.to_dict()
    assert spec["mark"]["type"] == "point" and spec["encoding"]["x"]["field"] == "ts"


def test_instance_history(sample):
    _, con = sample
    ex = explore.examples(con)
    view = explore.instance_history(con, ex.instance)
    capacity = table(con, "capacity")
    mine = capacity[capacity["instance"] == ex.instance]
    assert len(view) == len(mine)
    assert list(view.frame["kv_pool_tokens"]) == list(mine.sort_values("valid_from")["kv_pool_tokens"])
    affected = table(con, "affected_responses")
    served = affected[
        (affected["prefill_instance"] == ex.instance)
        | (affected["decode_instance"] == ex.instance)
        | (affected["pool_instance"] == ex.instance)
    ]
    assert int(view.frame["affected_responses"].sum()) == len(served) > 0
    assert view.frame["exposed"].astype(bool).any()
    assert all(isinstance(e, str) and e for e in view.frame["ended"])


def test_response_evidence_covers_every_rule(sample):
    _, con = sample
    ex = explore.examples(con)
    view = explore.response_evidence(con, ex.response)
    assert sorted(view.frame["rule_id"]) == RULES
    findings = table(con, "findings")
    flagged = set(findings.loc[findings["request_id"] == ex.response, "rule_id"])
    assert set(view.frame.loc[view.frame["flagged"], "rule_id"]) == flagged
    assert all(view.frame.loc[view.frame["flagged"], "evidence"].str.len() > 0)
    assert "confirmed" in view.note or "probable" in view.note


def test_response_sources_and_account_exposure(sample):
    _, con = sample
    ex = explore.examples(con)
    possible, matches = table(con, "possible_sources"), table(con, "content_matches")
    view = explore.response_sources(con, ex.response)
    expected = set(possible.loc[possible["affected_request_id"] == ex.response, "source_request_id"]) | set(
        matches.loc[matches["affected_request_id"] == ex.response, "source_request_id"]
    )
    assert set(view.frame["source_request_id"]) == expected and len(view) == len(expected)
    confirmed = matches[(matches["affected_request_id"] == ex.response) & matches["confirmed"]]
    assert set(view.frame.loc[view.frame["confirmed"], "source_request_id"]) == set(confirmed["source_request_id"])
    exposure = explore.account_exposure(con, ex.source_account)
    theirs = possible[
        (possible["source_account_id"] == ex.source_account) & (possible["recipient_account_id"] != ex.source_account)
    ]
    content = matches[
        (matches["source_account_id"] == ex.source_account) & (matches["recipient_account_id"] != ex.source_account)
    ]
    assert set(exposure.frame["affected_request_id"]) == set(theirs["affected_request_id"]) | set(
        content["affected_request_id"]
    )
    assert exposure.frame["confirmed"].any()
    assert set(exposure.frame.loc[exposure.frame["confirmed"], "basis"]) <= {
        "output_shingles",
        "output_shingles turnover_horizon",
    }


def test_unknown_and_missing_names_give_an_empty_view_that_says_so(sample):
    _, con = sample
    for view in (
        explore.account_timeline(con, "no-such-account"),
        explore.account_exposure(con, "no-such-account"),
        explore.instance_history(con, "no-such-instance"),
        explore.response_evidence(con, "no-such-request"),
        explore.response_sources(con, "no-such-request"),
    ):
        assert view.empty and "no-such-" in view.note
    assert "accounts with affected responses:" in explore.account_timeline(con, "no-such-account").note
    for view in (
        explore.account_timeline(con, None),
        explore.instance_history(con, None),
        explore.response_sources(con, None),
    ):
        assert view.empty and view.note
    # a value is a parameter, never SQL
    assert explore.quarantined_records(con, reason="x' OR 1=1 --").empty


ODD = "<img src=x onerror=alert(1)>*[link](http://e.x)_\x07"


def test_names_with_html_and_markdown_specials_are_escaped(tmp_path):
    rows = mini_requests()
    for row in rows[:40]:
        row["account_id"] = ODD
    rows[-2]["account_id"] = ODD  # the leak's recipient
    incident = write_mini(tmp_path / "odd", rows)
    inv = Investigation.open_or_build(incident, tmp_path / "out", through="scope", progress=False)
    try:
        view = explore.account_timeline(inv.con, ODD)
        assert len(view) == 41 and view.frame["affected"].any()
        assert view.frame["request_id"].notna().all()
        html = view._repr_html_() + explore.recipients(inv.con)._repr_html_()
        assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
        assert "\x07" not in html and "\\x07" in html
        missing = explore.account_timeline(inv.con, "<b>nobody</b>")
        assert "<b>" not in missing._repr_html_() and "&lt;b&gt;nobody&lt;/b&gt;" in missing._repr_html_()
    finally:
        inv.close()


def test_open_or_build_builds_only_what_is_missing(tmp_path):
    incident = write_mini(tmp_path / "mini")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="through must be one of"):
        Investigation.open_or_build(incident, out, through="everything", progress=False)
    inv = Investigation.open_or_build(incident, out, through="detect", progress=False)
    try:
        assert inv.has("ingest") and inv.has("detect") and not inv.has("scope") and not inv.has("report")
        inv.con.execute("DELETE FROM findings").fetchall()  # a detect run again would fill it
    finally:
        inv.close()
    inv = Investigation.open_or_build(incident, out, through="detect", progress=False)
    try:
        assert inv.con.execute("SELECT count(*) FROM findings").fetchone()[0] == 0, "detect ran again"
    finally:
        inv.close()
    inv = Investigation.open_or_build(incident, out, through="report", progress=False, pdf=False)
    try:
        assert inv.has("scope") and inv.has("report")
        assert (out / "scope.json").is_file() and (out / "manifest.json").is_file()
    finally:
        inv.close()


def test_offline_charts_need_no_network():
    from kvforensics.explore.offline import RENDERER, chart_html
    from kvforensics.report.charts import alt
    from kvforensics.report.embed import vega_javascript

    shown = explore.offline_charts()
    assert alt.renderers.active == RENDERER
    names = pd.DataFrame({"name": ["</script><script>alert(1)</script>"], "n": [1]})
    chart = alt.Chart(names).mark_bar().encode(x="n:Q", y="name:N")
    bundle = chart._repr_mimebundle_()
    html = (bundle[0] if isinstance(bundle, tuple) else bundle)["text/html"]
    assert "http" not in html.split("var spec", 1)[0] and "<script src" not in html
    assert html.count("</script>") == 1, "text in the spec cannot close the script"
    assert "vegaEmbed" in html and chart_html({"t": "</script>"}).count("</script>") == 1
    page = shown._repr_html_()
    assert "window.vegaEmbed" in page and "<script src" not in page
    assert "window.vegaEmbed=" in vega_javascript().replace(" ", "")


def test_a_view_before_its_stage_says_which_stage_to_build(tmp_path):
    from kvforensics.core.errors import InputError

    inv = Investigation.open_or_build(write_mini(tmp_path / "mini"), tmp_path / "out", through="ingest", progress=False)
    try:
        assert len(explore.startups(inv.con)) == 3
        with pytest.raises(
            InputError,
            match=r"reads affected_responses, which the 'scope' stage writes.*"
            r'through="scope"',
        ):
            explore.recipients(inv.con)
        with pytest.raises(InputError, match="'detect' stage"):
            explore.tiers(inv.con)
    finally:
        inv.close()
