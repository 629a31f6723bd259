"""The prefix_reuse mechanism judged on an incident it was not tuned on: SGLang 0.5.18 HiCache with a
salt-blind shared L3 store added and removed by rolling restarts, written from the engines' documented
behaviour by tests/hicache_reference/generate.py (its README cites the upstream sources), scored by
tests/hicache_reference/score.py against the generator's own truth.

What was wrong before (main at 6fb57b1, issue 26): the subscriber's archive was quarantined line by line;
unwrapped by hand, hits on public content in a tenant's own salted cache, responses from before the store
existed and after it was removed, and "collisions" on SHA-256 chains were all flagged, evaluation
harnesses were named as exploiters and no exposure window was reported."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from reference_judges import (
    assert_conclusive_at_size,
    assert_prober_found_alone,
    assert_windows_within_a_minute,
    judge,
)
from reference_judges import judged as judge_incident
from reference_judges import run as _run

generate, score = judge("hicache_reference")


@pytest.fixture(scope="module")
def judged(tmp_path_factory) -> tuple[int, dict[str, Any], dict[str, Any], Path]:
    return judge_incident(generate, score, tmp_path_factory.mktemp("hicache"), seed=15, requests=4000)


def test_the_archive_as_the_subscriber_wrote_it_loads(judged, tmp_path_factory):
    assert_conclusive_at_size(judged)


@pytest.mark.parametrize("what", ["affected", "recipients", "source_accounts", "sources"])
def test_responses_recipients_and_sources_are_right(judged, what):
    got = judged[1][what]
    assert got["precision"] >= 0.95 and got["recall"] >= 0.95, got


def test_each_instance_has_its_window_within_a_minute(judged):
    assert_windows_within_a_minute(judged[1], judged[2])


def test_the_prober_is_found_and_no_look_alike_is_flagged(judged):
    assert_prober_found_alone(judged[1])


def test_the_report_says_what_each_mechanism_found_and_the_audit_calls_the_shared_cache_exposed(judged):
    """Both mechanisms are investigated; only prefix_reuse's rules flag responses, and each section says so. The
    start-ups whose shared L3 store drops the salt fail check 6: the audit's headline calls them exposed."""
    _, result, truth, out = judged
    md = (out / "report.md").read_text(encoding="utf-8")
    sections = md.split("\n### ")
    stale = next(x for x in sections if x.startswith("Stale KV pages"))
    prefix = next(x for x in sections if x.startswith("Prefix-cache blocks reused across tenants"))
    assert "**In this evidence:** its rules flagged no affected response." in stale
    # a mechanism that found nothing is one line: none of its method, which would read as a claim about this
    # deployment (no disaggregated-prefill path, no turnover horizon here)
    assert "disaggregated" not in stale and "Whose data it could have been" not in stale, stale
    assert len([line for line in stale.splitlines()[1:] if line.strip()]) == 1, stale
    affected = json.loads((out / "scope.json").read_text(encoding="utf-8"))["affected_responses"]
    # what the rules found, in their own words: every affected response loaded another tenant's pages from the
    # salt-blind store; the breach is stated as that, not as the mechanism's list of every way it can arise
    store_load = (
        "pages another tenant wrote, loaded from a shared KV store that drops the cache salt "
        f"({affected:,} responses, rule cross_tenant_store_load)"
    )
    assert f"**In this evidence:** its rules flagged {affected:,} affected responses: {store_load}" in prefix
    nature = next(x for x in sections if x.startswith("Nature of the breach"))
    assert f"Prefix-cache blocks reused across tenants: {store_load}" in nature
    assert "collision" not in nature and "Stale KV pages" not in nature
    # no start-up fails check 1: the stale-pages window table says so rather than calling the deployment exposed
    windows = next(x for x in sections if x.startswith("Exposure windows"))
    assert "No start-up in this evidence fails audit check 1" in windows and "was exposed in" not in windows
    failing = len(truth["exposure_windows"])
    assert f"**EXPOSED: prefix-cache isolation fails on {failing} start-up(s) (check 6)." in md
    # no content source: the sources the store's page owners confirm are not called unconfirmed by the missing-input note
    rows = (out / "notifications.csv").read_text(encoding="utf-8").splitlines()
    confirmed = sum(1 for row in rows if ",data_exposed_confirmed," in row)
    assert confirmed > 0
    assert f"the {confirmed:,} account(s) notified as confirmed sources rest on other evidence" in md
    assert "none as confirmed" not in md
    # nor does the consequences list say their text was found in responses: no text was compared
    assert f"prefix-cache blocks stored from the requests of {confirmed:,} account" in md
    assert "was found in responses sent to other accounts" not in md
    # the loads matched on their tokens: the responses carry nothing of another account's text (no colliding block),
    # what they disclosed is that the text had been sent; the report and the notices say that, not "fragments"
    consequences = next(x for x in sections if x.startswith("Likely consequences"))
    assert "may contain fragments" not in consequences and "for the same leading text" in consequences, consequences
    notices = list((out / "notices").rglob("*.md"))
    assert notices and not any("may contain fragments" in p.read_text(encoding="utf-8") for p in notices)


def test_the_lost_messages_are_found(judged):
    gaps = judged[1]["seq_gaps"]
    assert gaps["available"] and gaps["precision"] == 1.0 and gaps["recall"] == 1.0


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A 2,000-request incident (seed 15), generated once for the tests that each change a copy of it."""
    root = tmp_path_factory.mktemp("hicache-small") / "incident"
    generate.generate(root, seed=15, requests=2000)
    return root


def _copy(small: Path, tmp_path: Path) -> Path:
    shutil.copytree(small, tmp_path / "incident")
    return tmp_path / "incident"


def test_with_the_prompts_token_ids_the_answer_is_the_same(tmp_path):
    """The content source cuts prompts into blocks: the content-based rules run too, and must not turn a
    tenant's hits in its own salted cache into findings (nor any hit into a "collision")."""
    generate.generate(tmp_path / "incident", seed=16, requests=3000, with_content=True)
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 0
    result = score.score(tmp_path / "out", tmp_path / "incident" / "truth.json")
    for what in ("affected", "recipients", "source_accounts"):
        assert result[what]["precision"] >= 0.95 and result[what]["recall"] >= 0.95, (what, result[what])
    rules = json.loads((tmp_path / "out" / "scope.json").read_text())
    assert rules["exploitation"]["accounts_looking_deliberate"] == [result["exploitation"]["prober"]]


def test_a_gateway_that_does_not_log_the_salt_makes_the_loads_unattributable(small, tmp_path):
    """The loads are in the events but no request of the loading namespace can be named: inconclusive."""
    _copy(small, tmp_path)
    for path in (tmp_path / "incident" / "gateway").glob("*.jsonl.gz"):
        lines = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
        path.write_bytes(
            gzip.compress(
                b"".join(json.dumps({k: v for k, v in r.items() if k != "cache_salt"}).encode() + b"\n" for r in lines)
            )
        )
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 3
    reasons = [r["code"] for r in json.loads((tmp_path / "out" / "scope.json").read_text())["inconclusive_reasons"]]
    assert "prefix_store_loads_unmatched" in reasons


def test_a_gateway_that_logs_cached_tokens_for_half_the_requests_cannot_say_which_received_a_load(small, tmp_path):
    """Every other successful record without usage (streamed responses without stream_options.include_usage):
    the mechanism's share check passes (half have cached_tokens), but a load given to the request nearest in time
    could as well have served one beside it that logs none, so the recipients are not known."""
    _copy(small, tmp_path)
    for path in (tmp_path / "incident" / "gateway").glob("*.jsonl.gz"):
        records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
        for i, r in enumerate(records):
            if i % 2:
                (r.get("usage") or {}).get("prompt_tokens_details", {}).pop("cached_tokens", None)
        path.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records)))
    assert _run(tmp_path / "incident" / "incident.toml", tmp_path / "out") == 3
    reasons = json.loads((tmp_path / "out" / "scope.json").read_text())["inconclusive_reasons"]
    assert [r["code"] for r in reasons] == ["prefix_store_loads_ambiguous"], reasons


def _rewrite_events(incident: Path, keep: Any) -> None:
    """Each KV-event archive of *incident* with only the events *keep(event, on_device)* accepts, in order:
    *on_device* the hashes the instance holds on its device just before the event (stored on the GPU since its
    publisher's start, seq 0, and its last clear, not removed since)."""
    for path in (incident / "kv-events").glob("*.jsonl.gz"):
        records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
        on_device: set[Any] = set()
        for r in records:
            if r["seq"] == 0:
                on_device = set()
            kept = []
            for e in r["batch"][1]:
                if keep(e, on_device):
                    kept.append(e)
                if e[0] == "AllBlocksCleared":
                    on_device = set()
                elif e[0] == "BlockStored" and e[6] == "GPU":
                    on_device.update(e[1])
                elif e[0] == "BlockRemoved" and e[2] == "GPU":
                    on_device.difference_update(e[1])
            r["batch"][1] = kept
        path.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records)))


def test_a_build_that_publishes_no_host_store_for_a_load_is_inconclusive(small, tmp_path):
    """Builds before sgl-project/sglang#22894 publish the host store of a page's write-through backup but only the
    device store of a page loaded from the store (reference section 2): the loads leave no signature, and "none
    affected" must not be the answer."""
    incident = _copy(small, tmp_path)
    dropped = []

    def backups_only(event: list[Any], on_device: set[Any]) -> bool:
        load = event[0] == "BlockStored" and event[6] == "CPU_PINNED" and not set(event[1]) <= on_device
        dropped.append(load)
        return not load

    _rewrite_events(incident, backups_only)
    assert sum(dropped) > 20 and len(dropped) - sum(dropped) > 1000  # loads gone, backups and the rest kept
    assert _run(incident / "incident.toml", tmp_path / "out") == 3
    scope = json.loads((tmp_path / "out" / "scope.json").read_text())
    assert "prefix_window_unseen" in [r["code"] for r in scope["inconclusive_reasons"]]


def test_a_build_that_publishes_no_host_store_at_all_shows_its_loads_by_their_cached_tokens(small, tmp_path):
    """Without any host store (no write-through backup published either, as vLLM publishes none), a load from the
    store is a device store of pages the instance held nowhere, which the request it served had cached: read so,
    the answer is the one the host stores give."""
    incident = _copy(small, tmp_path)
    _rewrite_events(incident, lambda event, _: not (event[0] == "BlockStored" and event[6] == "CPU_PINNED"))
    assert _run(incident / "incident.toml", tmp_path / "out") == 0
    result = score.score(tmp_path / "out", incident / "truth.json")
    for what in ("affected", "recipients", "source_accounts", "sources"):
        assert result[what]["precision"] == 1.0 and result[what]["recall"] == 1.0, (what, result[what])
