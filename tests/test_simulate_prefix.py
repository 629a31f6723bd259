"""Prefix-cache incidents from the simulator (issue 15): reproducible, ground truth consistent with the
files it describes, every file loaded by ``kvforensics ingest`` without quarantine, and the deployment
audit failing check 6 on the line that shows each scenario's failure."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kvforensics.audit import AuditReport, audit_paths
from kvforensics.config import load_incident
from kvforensics.db import connect
from kvforensics.ingest import ingest
from kvforensics.simulate.cli import main as simulate_main
from kvforensics.simulate.prefix import BLOCK_SIZE, SCENARIOS, simulate_prefix
from kvforensics.simulate.prefix.serve import chain_hash
from kvforensics.simulate.prefix.workload import PROBE_CANDIDATES, PROVIDER_ACCOUNT, SYSTEM_PROMPT_TOKENS

SMALL = 4000  # requests per test scenario: seconds to generate, every failure still present
HASH_BITS = 15  # the collision scenario's weak hash at this size (the default, 20 bits, needs 20k requests)


def read_lines(path: Path) -> list[Any]:
    if path.suffix == ".zst":
        with path.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as z:
            data = z.read()
    else:
        data = gzip.decompress(path.read_bytes())
    return [json.loads(line) for line in data.splitlines()]


class Incident:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.truth = json.loads((folder / "ground_truth.json").read_text())
        self.requests = {r["request_id"]: r for r in read_lines(folder / "gateway" / "requests.jsonl.gz")}
        self.content = {c["request_id"]: c for c in read_lines(folder / "content" / "content.jsonl.zst")}
        self.stored: dict[str, list[tuple[float, list, Any, list[int]]]] = {}
        for path in sorted((folder / "kv-events").glob("*.jsonl.zst")):
            self.stored[path.name.split(".")[0]] = [(ts, ev[1], ev[2], ev[3]) for ts, events, _ in read_lines(path)
                                                   for ev in events if ev[0] == "BlockStored"]

    def block(self, request_id: str, position: int) -> list[int]:
        ids = self.content[request_id]["prompt_token_ids"]
        return ids[position * BLOCK_SIZE:(position + 1) * BLOCK_SIZE]


@pytest.fixture(scope="module")
def incidents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Incident]:
    out = {}
    for name in SCENARIOS:
        folder = tmp_path_factory.mktemp(name)
        simulate_prefix(name, folder, seed=3, requests=SMALL, hash_bits=HASH_BITS)
        out[name] = Incident(folder)
    return out


def test_same_seed_same_bytes_other_seed_other_incident(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, seed in ((a, 5), (b, 5), (c, 6)):
        assert simulate_main(["--mechanism", "prefix_reuse", "--prefix-scenario", "prefix-probe", "--seed",
                              str(seed), "--requests", "1500", "--out", str(folder)]) == 0
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert {str(f) for f in files} >= {"gateway/requests.jsonl.gz", "content/content.jsonl.zst", "deploy.toml",
                                       "incident.toml", "ground_truth.json", "engine/vllm-0.log",
                                       "kv-events/vllm-0.jsonl.zst"}
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "gateway/requests.jsonl.gz").read_bytes() != (c / "gateway/requests.jsonl.gz").read_bytes()


def test_the_cli_refuses_what_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["--mechanism", "prefix_reuse", "--out", str(tmp_path)]) == 2
    assert "needs --prefix-scenario" in capsys.readouterr().err
    assert simulate_main(["--prefix-scenario", "prefix-probe", "--out", str(tmp_path)]) == 2
    assert "needs --mechanism prefix_reuse" in capsys.readouterr().err
    assert simulate_main(["--mechanism", "prefix_reuse", "--prefix-scenario", "prefix-probe", "--requests", "10",
                          "--out", str(tmp_path)]) == 2
    assert "out of range" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_recipient_reused_blocks_its_sources_stored_earlier(incidents: dict[str, Incident], name: str) -> None:
    inc = incidents[name]
    truth = inc.truth
    assert len(truth["recipients"]) >= 20, "each scenario has recipients at this size"
    collisions = set(truth["collisions"])
    assert bool(collisions) == (name == "prefix-collision")
    for rid, sources in truth["recipient_sources"].items():
        request = inc.requests[rid]
        assert request["cached_tokens"] > 0
        assert sorted({s["source_account"] for s in sources}) == truth["recipients"][rid]
        for s in sources:
            source = inc.requests[s["source_request_id"]]
            assert source["ts"] < request["ts"] and source["account_id"] != request["account_id"]
            assert s["position_to"] * BLOCK_SIZE < request["cached_tokens"]
            stored = {(tuple(tokens), ts) for ts, _, _, tokens in inc.stored[source["prefill_instance"]]}
            assert (s["source_position_from"] == s["position_from"]) or rid in collisions
            for p in range(s["position_from"], s["position_to"] + 1):
                theirs = inc.block(s["source_request_id"], p - s["position_from"] + s["source_position_from"])
                mine = inc.block(rid, p)
                # the source's request stored that block (alone or within its chain's event)
                assert any(tuple(theirs) == tokens[k:k + BLOCK_SIZE] for tokens, _ in stored
                           for k in range(0, len(tokens), BLOCK_SIZE))
                if rid in collisions:
                    continue
                assert mine == theirs
    assert PROVIDER_ACCOUNT not in truth["source_accounts"]
    assert PROVIDER_ACCOUNT not in truth["recipient_accounts"]


def test_a_collision_is_an_equal_weak_hash_over_other_tokens(incidents: dict[str, Incident]) -> None:
    inc = incidents["prefix-collision"]
    mask = (1 << HASH_BITS) - 1
    checked = 0
    for rid in inc.truth["collisions"]:
        request = inc.requests[rid]
        assert request["prefill_instance"] == "vllm-2"
        ids = inc.content[rid]["prompt_token_ids"]
        keys, parent = [], None
        for i in range(0, (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
            parent = chain_hash(parent, tuple(ids[i:i + BLOCK_SIZE]), request["cache_salt"] if i == 0 else None)
            keys.append(parent & mask)
        stored_hashes = {h for _, hashes, _, _ in inc.stored["vllm-2"] for h in hashes}
        for s in inc.truth["recipient_sources"][rid]:
            if inc.block(rid, s["position_from"]) != inc.block(s["source_request_id"], s["source_position_from"]):
                assert keys[s["position_from"]] in stored_hashes
                checked += 1
    assert checked >= 5
    assert all(h <= mask for _, hashes, _, _ in inc.stored["vllm-2"] for h in hashes)
    assert any(h > mask for _, hashes, _, _ in inc.stored["vllm-0"] for h in hashes)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_provider_wide_system_prompt_is_shared_and_never_a_finding(incidents: dict[str, Incident],
                                                                       name: str) -> None:
    inc = incidents[name]
    system = inc.content[next(rid for rid, r in inc.requests.items() if r["account_id"] == PROVIDER_ACCOUNT)
                         ]["prompt_token_ids"][:SYSTEM_PROMPT_TOKENS]
    users = [rid for rid, r in inc.requests.items() if r["account_id"] != PROVIDER_ACCOUNT
             and inc.content[rid]["prompt_token_ids"][:SYSTEM_PROMPT_TOKENS] == system]
    assert len({inc.requests[rid]["account_id"] for rid in users}) >= 10  # many tenants send it
    full = SYSTEM_PROMPT_TOKENS // BLOCK_SIZE
    for rid in users:
        for s in inc.truth["recipient_sources"].get(rid, []):
            assert s["position_from"] >= full or rid in inc.truth["collisions"]
    if name == "prefix-probe":  # unsalted: tenants reuse the provider's blocks, which is no finding
        assert sum(inc.requests[rid]["cached_tokens"] >= full * BLOCK_SIZE for rid in users) > len(users) // 2


def test_the_prober_probes_and_the_look_alikes_do_not(incidents: dict[str, Incident]) -> None:
    inc = incidents["prefix-probe"]
    truth = inc.truth
    (prober,) = truth["probers"]
    probes = sorted((r for r in inc.requests.values() if r["account_id"] == prober), key=lambda r: r["ts"])
    assert len(probes) >= 100 and all(r["completion_tokens"] <= 4 for r in probes)
    victims = set(truth["probe_victims"])
    assert {a for rid, v in truth["recipients"].items() if inc.requests[rid]["account_id"] == prober
            for a in v} == victims
    # candidates share a long prefix with a victim's document and differ in one position, tried in order
    by_prefix: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for r in probes:
        ids = inc.content[r["request_id"]]["prompt_token_ids"]
        by_prefix[tuple(ids[:-2])].append(ids[-2])
    assert all(len(v) == PROBE_CANDIDATES and v == sorted(v) for v in by_prefix.values())
    assert min(len(p) for p in by_prefix) >= 3 * BLOCK_SIZE
    victim_ids = [inc.content[rid]["prompt_token_ids"] for rid, r in inc.requests.items() if r["account_id"] in victims]
    assert sum(any(v[:3 * BLOCK_SIZE] == list(p[:3 * BLOCK_SIZE]) for v in victim_ids) for p in by_prefix) \
        == len(by_prefix)
    # the evaluation harness: one template, answers of normal length, no probed position
    (evaluator,) = truth["benign_lookalikes"]["evaluation_harness"]
    runs = [r for r in inc.requests.values() if r["account_id"] == evaluator]
    assert len(runs) >= 100 and sorted(r["completion_tokens"] for r in runs)[len(runs) // 2] > 4
    assert evaluator not in truth["recipient_accounts"] and prober not in truth["benign_lookalikes"]["retrying_clients"]
    # retrying clients: a timed-out request sent again identical by the same account
    retried = 0
    for account in truth["benign_lookalikes"]["retrying_clients"]:
        mine = sorted((r for r in inc.requests.values() if r["account_id"] == account), key=lambda r: r["ts"])
        for first, again in zip(mine, mine[1:], strict=False):
            if first["status"] == 504:
                same = inc.content[again["request_id"]]["prompt_token_ids"] == \
                    inc.content[first["request_id"]]["prompt_token_ids"]
                retried += same and again["cached_tokens"] > 0
    assert retried >= 3


def test_ttft_reflects_cache_hits(incidents: dict[str, Incident]) -> None:
    rows = [r for inc in incidents.values() for r in inc.requests.values() if r["status"] == 200]
    long = [r for r in rows if r["prompt_tokens"] > 250]
    cold = [r["ttft_ms"] for r in long if r["prompt_tokens"] - r["cached_tokens"] > 200]
    warm = [r["ttft_ms"] for r in long if r["prompt_tokens"] - r["cached_tokens"] < 40]
    assert len(cold) >= 20 and len(warm) >= 20
    assert sorted(warm)[len(warm) // 2] < sorted(cold)[len(cold) // 2]
    assert all(r["cached_tokens"] % BLOCK_SIZE == 0 and r["cached_tokens"] < r["prompt_tokens"] for r in rows)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ingest_loads_every_file_without_quarantine(incidents: dict[str, Incident], name: str) -> None:
    inc = incidents[name]
    con = connect()
    ingest(con, load_incident(inc.folder / "incident.toml"))
    assert con.execute("SELECT count(*) FROM quarantine").fetchone() == (0,)
    kinds = dict(con.execute("SELECT kind, sum(loaded) FROM load_report GROUP BY kind").fetchall())
    assert set(kinds) == {"requests", "content", "kv_events", "engine_log"}
    assert kinds["requests"] == len(inc.requests)
    assert con.execute("SELECT count(DISTINCT instance) FROM capacity").fetchone() == (4,)
    # the events' token ids fingerprint as the same blocks of the requests that stored them
    fps = con.execute("SELECT count(*) FILTER (WHERE position IS NOT NULL AND salt IS NOT NULL = $salted), "
                      "count(*) FROM kv_events WHERE kind = 'stored'",
                      {"salted": SCENARIOS[name].salted}).fetchone()
    assert fps is not None and fps[0] == fps[1] > 0


def verdicts(report: AuditReport) -> dict[str, tuple[str, str, int | None, str]]:
    return {v.instance: (v.status, Path(v.evidence_file or "").name, v.evidence_line, v.detail)
            for v in report.verdicts if v.check == 6}


def test_the_audit_fails_check_6_on_the_line_of_each_failure(incidents: dict[str, Incident]) -> None:
    def audit(name: str) -> dict[str, tuple[str, str, int | None, str]]:
        folder = incidents[name].folder
        return verdicts(audit_paths(sorted((folder / "engine").glob("*.log")), manifest=folder / "deploy.toml"))

    l3 = audit("prefix-l3-unsalted")
    assert {i: v[:3] for i, v in l3.items()} == {f"vllm-{n}": ("fail", f"vllm-{n}.log", 2) for n in range(4)}
    assert all("LMCacheConnectorV1" in v[3] for v in l3.values())
    probe = audit("prefix-probe")
    assert {v[:3] for v in probe.values()} == {("fail", "deploy.toml", 5)}
    assert all("no cache_salt" in v[3] for v in probe.values())
    collision = audit("prefix-collision")
    assert collision["vllm-2"][:3] == ("fail", "vllm-2.log", 2) and "builtin" in collision["vllm-2"][3]
    assert {i for i, v in collision.items() if v[0] == "pass"} == {"vllm-0", "vllm-1", "vllm-3"}
