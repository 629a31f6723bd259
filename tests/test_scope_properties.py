"""Invariants of scoping on the sample's evidence: widening the period never shrinks the scope;
removing the content source never removes a recipient."""

from __future__ import annotations

import dataclasses
import shutil
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.stages.scope import scope

pytestmark = pytest.mark.slow
BASE = datetime(2026, 8, 27, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def evidence(sample_run, sample_incident, tmp_path_factory):
    db = tmp_path_factory.mktemp("props") / "evidence.duckdb"
    shutil.copy(sample_run / "evidence.duckdb", db)
    return connect(db), load_incident(sample_incident)


def sets(con):
    return (
        {r[0] for r in con.execute("SELECT request_id FROM affected_responses").fetchall()},
        {(r[0], r[1]) for r in con.execute("SELECT account_id, role FROM notifications").fetchall()},
    )


def scoped(con, incident, start, end):
    inc = dataclasses.replace(incident, scope=dataclasses.replace(incident.scope, start=start, end=end))
    return scope(con, inc).summary, sets(con)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    a=st.integers(0, 14 * 24),
    b=st.integers(1, 14 * 24),
    widen_before=st.integers(0, 72),
    widen_after=st.integers(0, 72),
)
def test_widening_the_period_never_shrinks_the_scope(evidence, a, b, widen_before, widen_after):
    con, incident = evidence
    start = BASE + timedelta(hours=a)
    end = start + timedelta(hours=b)
    narrow, (n_aff, n_notif) = scoped(con, incident, start, end)
    wide, (w_aff, w_notif) = scoped(
        con, incident, start - timedelta(hours=widen_before), end + timedelta(hours=widen_after)
    )
    assert n_aff <= w_aff
    received = lambda s: {x for x in s if x[1] == "received_foreign_data"}  # noqa: E731
    assert received(n_notif) <= received(w_notif)
    assert narrow["affected_responses"] <= wide["affected_responses"]
    assert narrow["affected_accounts"] <= wide["affected_accounts"]


def test_removing_content_never_removes_a_recipient(evidence):
    con, incident = evidence
    with_content, (aff, notif) = scoped(con, incident, None, None)
    con.execute("CREATE TEMP TABLE saved_fp AS SELECT * FROM content_fingerprints").fetchall()
    con.execute("DELETE FROM content_fingerprints").fetchall()
    try:
        without, (aff2, notif2) = scoped(con, incident, None, None)
    finally:
        con.execute("INSERT INTO content_fingerprints SELECT * FROM saved_fp").fetchall()
    assert aff == aff2
    assert {a for a, r in notif if r == "received_foreign_data"} == {
        a for a, r in notif2 if r == "received_foreign_data"
    }
    assert without["source_accounts"]["confirmed"] == 0
    # without content every exposed account is still at least a possible source
    exposed = {a for a, r in notif if r.startswith("data_exposed")}
    assert exposed <= {a for a, r in notif2 if r == "data_exposed_possible"} | {
        a for a, r in notif if r == "data_exposed_confirmed"
    }


def _matching(con, affected, source):
    row = con.execute(
        "SELECT matching_shingles FROM output_matches WHERE affected_request_id = $a AND source_request_id = $s",
        {"a": affected, "s": source},
    ).fetchall()
    return row[0][0] if row else 0


def test_a_shingle_in_enough_accounts_texts_is_boilerplate_and_stops_matching(evidence):
    con, incident = evidence
    threshold = scope(con, incident).parameters["max_accounts_per_shingle"]
    affected, source = con.execute(
        "SELECT affected_request_id, source_request_id FROM output_matches WHERE confirmed "
        "ORDER BY affected_request_id, source_request_id LIMIT 1"
    ).fetchall()[0]
    fp = con.execute(
        "SELECT min(o.fp) FROM content_fingerprints o JOIN content_fingerprints s ON s.fp = o.fp "
        "WHERE o.request_id = $a AND o.part = 'output' AND s.request_id = $s",
        {"a": affected, "s": source},
    ).fetchall()[0][0]
    holders = {
        r[0]
        for r in con.execute(
            "SELECT DISTINCT r.account_id FROM content_fingerprints c JOIN requests r USING (request_id) "
            "WHERE c.fp = $fp AND c.request_id NOT IN (SELECT request_id FROM affected_responses)",
            {"fp": fp},
        ).fetchall()
    }
    assert 0 < len(holders) < threshold
    # one unaffected request of each of as many other accounts as the fingerprint needs to be boilerplate
    others = [
        r[0]
        for r in con.execute(
            "SELECT min(request_id) FROM requests WHERE account_id NOT IN (SELECT unnest($held)) "
            "AND request_id NOT IN (SELECT request_id FROM affected_responses) "
            "GROUP BY account_id ORDER BY account_id LIMIT $n",
            {"held": sorted(holders), "n": threshold - len(holders)},
        ).fetchall()
    ]
    before = _matching(con, affected, source)
    try:
        for request_id in others[:-1]:  # in one account short of the threshold's texts: still a match
            con.execute("INSERT INTO content_fingerprints VALUES ($r, 'prompt', $fp)", {"r": request_id, "fp": fp})
        scope(con, incident)
        assert _matching(con, affected, source) == before
        con.execute("INSERT INTO content_fingerprints VALUES ($r, 'prompt', $fp)", {"r": others[-1], "fp": fp})
        scope(con, incident)
        assert _matching(con, affected, source) == before - 1
        assert con.execute("SELECT count(*) FROM common_shingles WHERE fp = $fp", {"fp": fp}).fetchall()[0][0] == 1
        # counted over the asked shingles only, the filter is the count over every fingerprint, where asked
        everywhere = {
            r[0]
            for r in con.execute(
                "SELECT c.fp FROM content_fingerprints c JOIN requests r USING (request_id) "
                "WHERE c.request_id NOT IN (SELECT request_id FROM affected_responses) "
                "GROUP BY c.fp HAVING count(DISTINCT r.account_id) >= $n",
                {"n": threshold},
            ).fetchall()
        }
        asked = {
            r[0]
            for r in con.execute(
                "SELECT c.fp FROM stale_page_responses a JOIN content_fingerprints c "
                "ON c.request_id = a.request_id AND c.part = 'output'"
            ).fetchall()
        }
        assert {r[0] for r in con.execute("SELECT fp FROM common_shingles").fetchall()} == everywhere & asked
    finally:
        con.execute(
            "DELETE FROM content_fingerprints WHERE part = 'prompt' AND fp = $fp AND list_contains($r, request_id)",
            {"fp": fp, "r": others},
        )
        scope(con, incident)
