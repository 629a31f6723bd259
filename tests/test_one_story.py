"""One story (issue 27): the audit's verdicts, the exposure windows, which rules can judge, the findings, the gate
and the report's text agree, on small hand-written incidents of the shapes the issue found them disagreeing on."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from incidents import decode_window

from kvforensics.audit import audit_paths
from kvforensics.cli import main


def run(incident: Path, out: Path) -> tuple[int, dict]:
    code = main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf"])
    return code, json.loads((out / "scope.json").read_text())


@pytest.fixture(scope="module")
def unified(shapes) -> tuple[Path, int, dict]:
    code, out = shapes["vllm-unified"]
    return out.parent, code, json.loads((out / "scope.json").read_text())


@pytest.fixture(scope="module")
def producer(shapes) -> tuple[Path, int, dict]:
    code, out = shapes["vllm-pd-running"]
    return out.parent, code, json.loads((out / "scope.json").read_text())


def test_observation_1_a_unified_server_answering_beyond_its_pool_is_one_inconclusive_story(unified, capsys):
    """vLLM 0.8.5 unified, KV cache 50,000 < max_model_len 131,072, an 80,214-token prompt answered 200 in 38 ms.
    vLLM's own admission never serves that prompt (it refuses to start with such a pool, its scheduler never runs a
    prompt it cannot allocate), so the audit does not call the start-up failed or exposed, no exposure window lists
    it, prompt_exceeds_kv_pool does not judge it, and the 2xx contradicts the engine: the run is inconclusive, its
    reason saying the latency rule could not judge either (19 + 1 points, it needs 30)."""
    root, code, scope = unified
    assert code == 3 and scope["affected_responses"] == 0
    assert scope["exposure_windows"] == []
    (reason,) = scope["inconclusive_reasons"]
    assert reason["code"] == "admission_contradicted"
    assert reason["evidence"]["examples"] == ["q-big"] and reason["evidence"]["largest_prompt"] == 80214
    assert "check_enough_kv_cache_memory" in reason["message"]
    assert "prefill_too_fast has no usable latency model for the model: only 20 usable points" in reason["message"]
    # the audit, in the report and on the command line, says the same: check 1 unknown (a reading in doubt), never
    # a FAIL under "Not exposed"
    log = root / "data" / "engine" / "vllm-0.log"
    report = audit_paths([log], year=2026)
    (check1,) = [v for v in report.verdicts if v.check == 1]
    assert (check1.status, check1.exposed) == ("unknown", False)
    assert (
        "check_enough_kv_cache_memory" in check1.detail
        and "prompts longer than the pool are admitted" not in check1.detail
    )
    md = (root / "out" / "report.md").read_text()
    assert "| 1. KV pool vs context length | unknown |" in md and "| FAIL" not in md
    assert main(["audit", "--now", "--year", "2026", str(log)]) == 0
    assert "FAIL" not in capsys.readouterr().out
    con = duckdb.connect(str(root / "out" / "evidence.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM exposure_windows").fetchall() == [(0,)]
    finally:
        con.close()


def test_a_window_no_rule_can_judge_is_inconclusive(tmp_path):
    """A decode window (pool 100,000 < context 131,072) whose requests name no decode instance, with too few timed
    requests for a latency model and no engine request lines: no stale_pages rule can judge it."""
    code, scope = run(decode_window(tmp_path / "data"), tmp_path / "out")
    assert code == 3 and [r["code"] for r in scope["inconclusive_reasons"]] == ["window_unjudged"]
    (reason,) = scope["inconclusive_reasons"]
    assert reason["evidence"]["instance"] == "d0" and reason["evidence"]["successful"] == 19
    assert "only 19 usable points (need at least 30)" in reason["message"]
    assert "needs requests naming it as their decode_instance" in reason["message"]


def test_observation_3_possible_sources_are_never_silently_zero(producer):
    """A NIXL kv_producer with no decode log: the turnover horizon (1.5 x the decode pools, none known) cannot be
    computed, so every other tenant the model served since the start-up is a possible source, with that basis."""
    root, code, scope = producer
    assert code == 0 and scope["affected_responses"] == 1
    assert scope["source_accounts"]["possible"] == 4
    con = duckdb.connect(str(root / "out" / "evidence.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT DISTINCT basis, source_account_id FROM possible_sources ORDER BY 2").fetchall() == [
            ("no_horizon_since_startup", f"tenant-{i}") for i in range(4)
        ]
    finally:
        con.close()
