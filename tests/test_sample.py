"""The bundled sample incident end to end, scored against the simulator's ground truth.

The toolkit never reads ``ground_truth.json``; only these tests do.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.slow
ZULU = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")


@pytest.fixture(scope="module")
def truth(sample_incident) -> dict:
    return json.loads((sample_incident.parent / "ground_truth.json").read_text())


@pytest.fixture(scope="module")
def scope(sample_run) -> dict:
    return json.loads((sample_run / "scope.json").read_text())


def rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def accounts(con, role_like: str) -> set[str]:
    return {r[0] for r in con.execute("SELECT account_id FROM notifications WHERE role LIKE ?", [role_like]).fetchall()}


def test_headline_numbers(scope):
    assert scope["affected_responses"] == 155
    assert scope["windows"] and {w["model"] for w in scope["windows"]} == {"@cf/zai-org/glm-5.3"}
    w = scope["windows"][0]
    assert "2026-08-27" <= w["first"] < w["last"] <= "2026-09-09T23:59:59Z"
    assert all(n == 0 for m, n in scope["responses_by_model"].items() if m != "@cf/zai-org/glm-5.3")
    assert "@cf/zai-org/glm-5.2" in scope["responses_by_model"]
    exposed = [e for e in scope["exposure_windows"] if e["model"] == "@cf/zai-org/glm-5.3"]
    assert exposed and all(
        e["pool_tokens"] == 681280 and e["context_length"] == 1048576 and e["role"] == "prefill" for e in exposed
    )
    assert all(e["start"].startswith("2026-08-27") and e["end"].startswith("2026-09-09") for e in exposed)
    assert not [e for e in scope["exposure_windows"] if e["model"] != "@cf/zai-org/glm-5.3"]
    assert scope["by_account_class"]["internal"]["responses"] > 0
    assert scope["by_account_class"]["reporter"]["responses"] > 0
    assert scope["exploitation"]["accounts_looking_deliberate"] == []


def test_recipients_are_exact(sample_run, truth):
    got = {r["request_id"] for r in rows(sample_run / "affected_requests.csv")}
    assert got == {a["request_id"] for a in truth["affected"]}
    con = duckdb.connect(str(sample_run / "evidence.duckdb"), read_only=True)
    assert accounts(con, "received_foreign_data") == {a["account_id"] for a in truth["affected"]}


def score(got: set[str], want: set[str]) -> tuple[float, float]:
    tp = len(got & want)
    return tp / max(len(got), 1), tp / max(len(want), 1)


def test_source_accounts_against_ground_truth(sample_run, truth):
    con = duckdb.connect(str(sample_run / "evidence.duckdb"), read_only=True)
    want_confirmed = set().union(
        *(set(a["content_leaked_from_accounts"]) - {a["account_id"]} for a in truth["affected"])
    )
    want_possible = set().union(*(set(a["pages_read_from_accounts"]) - {a["account_id"]} for a in truth["affected"]))
    precision, recall = score(accounts(con, "data_exposed_confirmed"), want_confirmed)
    print(f"confirmed sources (with content): precision {precision:.3f}, recall {recall:.3f}")
    assert precision >= 0.95 and recall >= 0.95
    precision, recall = score(accounts(con, "data_exposed_%"), want_possible)
    print(f"possible sources: precision {precision:.3f}, recall {recall:.3f}")
    assert recall >= 0.95


def test_outputs_follow_the_contract(sample_run, scope):
    for name in [
        "scope.json",
        "affected_requests.csv",
        "notifications.csv",
        "report.html",
        "report.md",
        "manifest.json",
        "quarantine.csv",
        "evidence.duckdb",
    ]:
        assert (sample_run / name).exists(), name
    for w in scope["windows"]:
        assert ZULU.match(w["first"]) and ZULU.match(w["last"])
    for r in rows(sample_run / "affected_requests.csv"):
        assert ZULU.match(r["ts"]) and r["confidence"] in ("confirmed", "probable")
    for r in rows(sample_run / "notifications.csv"):
        assert r["role"] in ("received_foreign_data", "data_exposed_confirmed", "data_exposed_possible")
        assert ZULU.match(r["first_ts"]) and ZULU.match(r["last_ts"])
    manifest = json.loads((sample_run / "manifest.json").read_text())
    for item in manifest["inputs"]:
        assert re.fullmatch(r"[0-9a-f]{64}", item["sha256"])
        assert (
            item["records_read"] == item["loaded"] + item["quarantined"] + item["duplicates"]
            or item["kind"] == "engine_log"
        )


def test_figures_agree_across_outputs(sample_run, scope):
    """scope.json, the CSVs, the report and the database tell the same story."""
    con = duckdb.connect(str(sample_run / "evidence.duckdb"), read_only=True)
    affected = rows(sample_run / "affected_requests.csv")
    notifications = rows(sample_run / "notifications.csv")
    assert (
        len(affected)
        == scope["affected_responses"]
        == con.execute("SELECT count(*) FROM affected_responses").fetchall()[0][0]
    )
    assert len({r["account_id"] for r in affected}) == scope["affected_accounts"]
    received = [r for r in notifications if r["role"] == "received_foreign_data"]
    assert sum(int(r["responses"]) for r in received) == scope["affected_responses"]
    assert sorted(" ".join(r["request_ids"] for r in received).split()) == sorted(r["request_id"] for r in affected)
    for cls, v in scope["by_account_class"].items():
        assert v["responses"] == sum(1 for r in affected if r["account_class"] == cls)
    assert scope["source_accounts"]["confirmed"] == len(
        {r["account_id"] for r in notifications if r["role"] == "data_exposed_confirmed"}
    )
    html = (sample_run / "report.html").read_text()
    md = (sample_run / "report.md").read_text()
    assert f'id="fig-affected-responses">{scope["affected_responses"]}<' in html
    assert f'id="fig-affected-accounts">{scope["affected_accounts"]}<' in html
    assert f"**{scope['affected_responses']}** affected responses" in md
    for w in scope["windows"]:
        assert w["first"] in html and w["last"] in md
    from kvforensics.evidence.verify import verify

    assert verify(sample_run) == []


def test_raw_text_never_leaves_ingest(sample_run, sample_incident):
    import gzip

    with gzip.open(sample_incident.parent / "content" / "content.jsonl.gz", "rt") as fh:
        texts = [json.loads(line) for _, line in zip(range(200), fh, strict=False)]
    phrases = {" ".join(t["prompt"].split()[:6]) for t in texts if t.get("prompt")}
    outputs = [p for p in sample_run.rglob("*") if p.is_file() and p.suffix in (".csv", ".json", ".md", ".html")]
    for path in outputs:
        body = path.read_text(errors="replace")
        leaked = [p for p in phrases if p in body]
        assert not leaked, f"{path.name} contains content text"
    con = duckdb.connect(str(sample_run / "evidence.duckdb"), read_only=True)
    for (table,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall():
        cols = [c[0] for c in con.execute(f'DESCRIBE "{table}"').fetchall()]
        assert "prompt" not in cols and "output" not in cols


def test_report_states_the_physical_bound(sample_run):
    md = (sample_run / "report.md").read_text()
    assert "times faster than the hardware allows" in md


def _table(html: str, table_id: str) -> list[list[str]]:
    from bs4 import BeautifulSoup

    table = BeautifulSoup(html, "html.parser").find("table", id=table_id)
    assert table is not None, table_id
    return [[td.get_text(strip=True) for td in tr.find_all("td")] for tr in table.find("tbody").find_all("tr")]


def _n(text: str) -> int:
    return int(text.replace(",", ""))


def test_every_report_table_matches_scope_and_database(sample_run, scope):
    """The numbers in the report's tables are the numbers in scope.json and evidence.duckdb."""
    html = (sample_run / "report.html").read_text()
    con = duckdb.connect(str(sample_run / "evidence.duckdb"), read_only=True)
    by_class = {r[0]: (_n(r[1]), _n(r[2])) for r in _table(html, "t-by-class")}
    assert by_class == {c: (v["responses"], v["accounts"]) for c, v in scope["by_account_class"].items()}
    roles = {(r[0], r[1]): (_n(r[2]), _n(r[3])) for r in _table(html, "t-roles")}
    assert roles == {
        (role, cls): (n, recs)
        for role, cls, n, recs in con.execute(
            "SELECT role, account_class, count(*), sum(responses) FROM notifications GROUP BY 1, 2"
        ).fetchall()
    }
    models = {r[0]: (_n(r[1]), _n(r[2]), _n(r[3])) for r in _table(html, "t-models")}
    assert models == {
        m: (n, ok, aff)
        for m, n, ok, aff in con.execute(
            """SELECT r.model, count(*), count(*) FILTER (WHERE r.status BETWEEN 200 AND 299), count(a.request_id)
           FROM requests r LEFT JOIN affected_responses a USING (request_id) GROUP BY 1"""
        ).fetchall()
    }
    assert {m: v[2] for m, v in models.items()} == scope["responses_by_model"]
    exposure = [(r[0], r[1], r[3], r[4], _n(r[5]), _n(r[6])) for r in _table(html, "t-exposure")]
    assert exposure == [
        (w["instance"], w["role"], w["start"], w["end"], w["pool_tokens"], w["context_length"])
        for w in scope["exposure_windows"]
    ]
    rules = {r[0]: (_n(r[3]), _n(r[4])) for r in _table(html, "t-rules")}
    assert rules == {
        rid: (n, aff)
        for rid, n, aff in con.execute(
            """SELECT rule_id, count(*), count(*) FILTER (WHERE confidence IN ('confirmed', 'probable'))
           FROM findings GROUP BY 1"""
        ).fetchall()
    } | {r: (0, 0) for r in rules if rules[r] == (0, 0)}
    loads = [(_n(r[2]), _n(r[3]), _n(r[4]), _n(r[5])) for r in _table(html, "t-load")]
    assert sorted(loads) == sorted(
        con.execute("SELECT records_read, loaded, quarantined, duplicates FROM load_report").fetchall()
    )


def test_exposure_windows_are_joined_with_config_changes(scope):
    for w in scope["exposure_windows"]:
        assert w["opened_by_change"] == "Deploy @cf/zai-org/glm-5.3 (prefill)"
        assert w["closed_by_change"].startswith("Restart prefill")


def _microseconds(ts: pd.Series, ms: pd.Series) -> pd.Series:
    """ts + ms milliseconds at microsecond resolution, rounded half to even (as the scope SQL does)."""
    return ts + pd.to_timedelta(np.round(ms.to_numpy(dtype=float) * 1000).astype("int64"), unit="us")


def test_possible_sources_match_a_brute_force_turnover_horizon(sample_run):
    """Every (affected response, possible source) pair, recomputed in pandas over each KV group's whole
    timeline (no minute windows, no cut): the scope SQL, which sorts only the minutes an affected
    response's horizon can reach, must give exactly the same pairs and token counts."""
    con = duckdb.connect(str(sample_run / "evidence.duckdb"), read_only=True)
    from kvforensics.stages.scope import SCOPE_PARAMETERS

    factor = SCOPE_PARAMETERS["horizon_factor"]  # the sample incident file does not override it
    req = con.execute(
        "SELECT request_id, account_id, model, ts, ttft_ms, latency_ms, prompt_tokens, "
        "completion_tokens, decode_instance FROM requests WHERE status BETWEEN 200 AND 299"
    ).df()
    affected = set(r for (r,) in con.execute("SELECT request_id FROM affected_responses").fetchall())
    cap = con.execute("SELECT instance, role, model, kv_pool_tokens, valid_from, valid_to FROM capacity").df()
    req["kv_group"] = req["decode_instance"].fillna("(model) " + req["model"])
    req["alloc"] = _microseconds(req["ts"], req["ttft_ms"].fillna(0))
    req["free"] = _microseconds(req["ts"], req["latency_ms"].fillna(req["ttft_ms"]).fillna(0))
    req["is_affected"] = req["request_id"].isin(affected)
    req["written"] = np.where(
        req["is_affected"],
        1 + req["completion_tokens"].fillna(0),
        req["prompt_tokens"] + req["completion_tokens"].fillna(0),
    )
    want = set()
    cut_something = False
    for group, g in req.groupby("kv_group"):
        if not g["is_affected"].any():
            continue
        ev = pd.concat(
            [
                pd.DataFrame({"t": g["alloc"], "marker": 0, "w": g["written"], "rid": g["request_id"]}),
                pd.DataFrame({"t": g["free"], "marker": 1, "w": 0, "rid": g["request_id"]}),
            ]
        )
        ev = ev.sort_values(["t", "marker", "rid"], kind="stable").reset_index(drop=True)
        ev["cum"] = ev["w"].cumsum()
        cum_alloc = dict(zip(ev.loc[ev.marker == 0, "rid"], ev.loc[ev.marker == 0, "cum"], strict=True))
        cum_free = dict(zip(ev.loc[ev.marker == 1, "rid"], ev.loc[ev.marker == 1, "cum"], strict=True))
        for a in g[g["is_affected"]].itertuples():
            valid = cap[(cap.valid_from <= a.alloc) & (cap.valid_to.isna() | (a.alloc < cap.valid_to))]
            if pd.notna(a.decode_instance):
                pool = valid.loc[valid.instance == group, "kv_pool_tokens"].max()
            else:
                pool = valid.loc[(valid.model == a.model) & (valid.role == "decode"), "kv_pool_tokens"].sum(min_count=1)
            horizon = factor * (0 if pd.isna(pool) else pool)
            cum_before = cum_alloc[a.request_id] - a.written
            for s in g[(~g["is_affected"]) & (g["free"] <= a.alloc) & (g["request_id"] != a.request_id)].itertuples():
                since = cum_before - cum_free[s.request_id]
                if since < horizon:
                    want.add((a.request_id, s.request_id, int(since)))
                else:
                    cut_something = True
    got = set(
        (a, s, int(n))
        for a, s, n in con.execute(
            "SELECT affected_request_id, source_request_id, tokens_written_since FROM possible_sources"
        ).fetchall()
    )
    assert cut_something, "the sample never reaches past a horizon: the test would not exercise the cut"
    assert len(want) > 100
    assert got == want
