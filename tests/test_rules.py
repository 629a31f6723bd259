"""Every rule's own test cases, and a lint of the rule set as a whole."""

from __future__ import annotations

import re

import pytest

from kvforensics.core.db import connect
from kvforensics.stages.detect import evaluate_case, load_rules

RULES = load_rules()
CASES = [pytest.param(rule, case, id=f"{rule.id}: {case['name']}") for rule in RULES for case in rule.tests]


@pytest.mark.parametrize(("rule", "case"), CASES)
def test_rule_case(rule, case):
    flagged = evaluate_case(rule, case)
    assert sorted(flagged["request_id"]) == sorted(case["expect"])
    assert flagged["request_id"].is_unique, "a rule returns one row per request"
    for rid, strength in (case.get("expect_strength") or {}).items():
        assert flagged.set_index("request_id").loc[rid, "strength"] == strength


def test_rule_ids_are_unique_and_match_file_names():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    assert {
        "prompt_exceeds_kv_pool",
        "prefill_too_fast",
        "engine_abort_but_success",
        "engine_token_count_mismatch",
        "transfer_integrity",
    } <= set(ids)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_rule_lint(rule):
    for key in ("id", "title", "severity", "description", "references", "false_positives", "parameters", "tests"):
        assert key in rule.meta, f"{rule.id}: missing {key}"
    assert rule.severity in ("low", "medium", "high", "critical")
    assert rule.used_parameters() == set(rule.parameters), "every declared parameter is used and vice versa"
    positives = {rid for c in rule.tests for rid in c["expect"]}
    negatives = {
        row["request_id"]
        for c in rule.tests
        for row in c["tables"].get("requests", [])
        if row["request_id"] not in c["expect"]
    }
    assert positives and negatives, "at least one positive and one negative case"
    for case in rule.tests:
        assert {"name", "tables", "expect"} <= set(case)
    # the SQL binds against the canonical schema
    con = connect()
    con.execute("EXPLAIN " + rule.sql, {k: v for k, v in rule.parameters.items()} or None).fetchall()
    cols = [d[0] for d in con.execute(rule.sql, rule.parameters or None).description]
    assert cols == ["request_id", "strength", "evidence"]
    # portable SQL only: no DuckDB-only syntax inside rules
    for banned in (r"\bASOF\b", r"::", r"\bQUALIFY\b", r"\bEXCLUDE\b", r"list_", r"\bepoch_ms\b", r"\barg_min\b"):
        assert not re.search(banned, rule.sql, re.IGNORECASE), f"{rule.id} uses {banned}"
