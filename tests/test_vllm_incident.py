"""The prefix_reuse mechanism judged on a second incident it was not tuned on: vLLM 0.33 instances with a
salt-blind LMCache store (LMCacheConnectorV1) added and removed by rolling restarts, written from the engines'
documented behaviour by tests/vllm_reference/generate.py (its README cites the upstream sources), scored by
tests/vllm_reference/score.py against the generator's own truth.

vLLM publishes no host store: a load from the connector's store is cached with the blocks the step computed, in
one device store of the requester's namespace. Before the rule read such a store by the request's cached_tokens,
this incident gave no affected response (exit 3, prefix_window_unseen) and, with the prompts' token ids, named
the wrong sources for 106 of 116 responses (the earliest sender of the prefix on any instance, before the store
existed)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from reference_judges import (
    assert_conclusive_at_size,
    assert_prober_found_alone,
    assert_windows_within_a_minute,
    judge,
)
from reference_judges import judged as judge_incident
from reference_judges import run as _run

generate, score = judge("vllm_reference")


def _rewrite_gateway(incident: Path, change: Callable[[int, dict], dict | None]) -> None:
    """Rewrite the incident's gateway files record by record: *change* gets each record's number across the files
    (in file order) and the record, and returns it changed, or None to drop it."""
    n = 0
    for path in sorted((incident / "gateway").glob("*.jsonl.gz")):
        kept = []
        for line in gzip.decompress(path.read_bytes()).splitlines():
            record = change(n, json.loads(line))
            n += 1
            if record is not None:
                kept.append(json.dumps(record).encode() + b"\n")
        path.write_bytes(gzip.compress(b"".join(kept)))


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> tuple[int, dict[str, Any], dict[str, Any], Path]:
    return judge_incident(generate, score, tmp_path_factory.mktemp("vllm"), seed=3, requests=5000)


def test_the_run_is_conclusive(judged):
    assert_conclusive_at_size(judged)


@pytest.mark.parametrize("what", ["affected", "recipients", "source_accounts", "sources"])
def test_responses_recipients_and_sources_are_right(judged, what):
    got = judged[1][what]
    assert got["precision"] >= 0.98 and got["recall"] >= 0.98, got


def test_responses_the_client_gave_up_on_are_found_without_their_cached_tokens(judged):
    """A 499 carries no usage: its loaded pages are the leading ones the store held (written there before)."""
    _, result, truth, out = judged
    undelivered = set(truth["affected_undelivered"])
    assert undelivered
    found = {line.split(",")[0] for line in (out / "affected_requests.csv").read_text().splitlines()[1:]}
    assert undelivered <= found


def test_each_instance_has_its_window_within_a_minute(judged):
    assert_windows_within_a_minute(judged[1], judged[2])


def test_the_prober_is_found_and_no_look_alike_is_flagged(judged):
    assert_prober_found_alone(judged[1])


def test_the_lost_messages_are_found(judged):
    gaps = judged[1]["seq_gaps"]
    assert gaps["available"] and gaps["precision"] == 1.0 and gaps["recall"] == 1.0


def test_with_the_prompts_token_ids_the_sources_are_the_stores_writers(tmp_path):
    """The content source cuts prompts into blocks: the content-based rules run too, and the sources stay the
    namespaces that wrote the pages to the store, not the earliest senders of the prefix anywhere."""
    generate.generate(tmp_path / "incident", seed=7, requests=3000, with_content=True)
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 0
    result = score.score(tmp_path / "out", tmp_path / "incident" / "truth.json")
    for what in ("affected", "recipients", "source_accounts", "sources"):
        assert result[what]["precision"] >= 0.98 and result[what]["recall"] >= 0.98, (what, result[what])


def test_a_gateway_that_does_not_log_cached_tokens_cannot_tell_loads_from_computation(tmp_path):
    """Without cached_tokens the mechanism has nothing to judge a hit by: inconclusive, never "none affected"."""
    generate.generate(tmp_path / "incident", seed=7, requests=2000)

    def without_cached_tokens(_: int, r: dict) -> dict:
        (r.get("usage") or {}).get("prompt_tokens_details", {}).pop("cached_tokens", None)
        return r

    _rewrite_gateway(tmp_path / "incident", without_cached_tokens)
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 3


def test_the_events_of_an_instance_lost_leave_its_window_unanswered(tmp_path):
    """One instance's KV-event archive missing: its loads cannot be seen, so the run must not say none happened
    there."""
    generate.generate(tmp_path / "incident", seed=7, requests=2000)
    archives = sorted((tmp_path / "incident" / "kv-events").glob("*.jsonl.gz"))
    shutil.move(archives[0], tmp_path / archives[0].name)
    code = _run(tmp_path / "incident" / "incident.toml", tmp_path / "out")
    assert code == 3, code


@pytest.mark.parametrize("every", [2, 50])
def test_a_gateway_that_drops_cache_salt_on_some_records_is_inconclusive(tmp_path, every):
    """cache_salt blanked on every n-th gateway record (an export that drops the field on some): loads go to the
    requests of their namespace, so a response without its salt can never be given its load, and the loads go to
    its namespace's other requests or to none. With half blanked the run gave 72 of 131 affected with exit 0;
    with one in 50, 129. The engine stored those requests' pages under a salt (no unsalted store near them), so
    the gate says the log lost it."""
    generate.generate(tmp_path / "incident", seed=7, requests=4000, step_s=0.5)

    def salt_blanked(n: int, r: dict) -> dict:
        if n % every == 0:
            r.pop("cache_salt", None)
        return r

    _rewrite_gateway(tmp_path / "incident", salt_blanked)
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 3
    scope = json.loads((tmp_path / "out" / "scope.json").read_text())
    # the requests whose salt is blank made stores no request of their namespace explains, too
    assert "cache_salt_unlogged" in [r["code"] for r in scope["inconclusive_reasons"]], scope["inconclusive_reasons"]


def test_a_gateway_log_that_lost_a_tenth_of_its_records_is_inconclusive(tmp_path):
    """Every tenth gateway record lost: the responses among them that received foreign pages cannot be named, and
    their loads went to other requests of their namespaces (117 of 131 found, two of them wrong, with exit 0). The
    engines stored pages for namespaces no logged request explains, so the gate says records are missing."""
    generate.generate(tmp_path / "incident", seed=7, requests=3000, step_s=0.5)
    _rewrite_gateway(tmp_path / "incident", lambda n, r: None if n % 10 == 3 else r)
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 3
    scope = json.loads((tmp_path / "out" / "scope.json").read_text())
    assert [r["code"] for r in scope["inconclusive_reasons"]] == ["gateway_requests_missing"], scope[
        "inconclusive_reasons"
    ]


def test_the_report_tells_files_of_one_name_apart(judged):
    """Every instance's engine log is vllm.log.gz in its own folder: the data-quality and provenance tables name
    each by its folder too, so a hash can be traced to its file."""
    md = (judged[3] / "report.md").read_text(encoding="utf-8")
    rows = [line for line in md.splitlines() if line.startswith("| engines |")]
    labels = [line.split("|")[2].strip() for line in rows]
    assert labels and all(label.endswith("/vllm.log.gz") for label in labels), labels
    assert len(set(labels)) * 2 == len(labels)  # once in the data-quality table, once in provenance
    # a grammatical count of the probing accounts
    assert "1 accounts" not in md


def test_a_gateway_source_whose_instance_is_mapped_to_a_missing_key_is_inconclusive(tmp_path):
    """prefill_instance mapped to a key the records lack: the loads, seen per instance in the KV events, can be given
    to no request, so the run found none and must not call that an all-clear."""
    generate.generate(tmp_path / "incident", seed=7, requests=2000)
    toml = tmp_path / "incident" / "incident.toml"
    toml.write_text(toml.read_text().replace('prefill_instance = "upstream"', 'prefill_instance = "upstream_host"'))
    assert _run(toml, tmp_path / "out") == 3
    reasons = json.loads((tmp_path / "out" / "scope.json").read_text())["inconclusive_reasons"]
    assert any(r["code"] == "rule_field_missing" and "prefill_instance" in r["message"] for r in reasons), reasons
