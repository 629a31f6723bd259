"""Prefix-cache incidents from the simulator (issue 15): reproducible, ground truth consistent with the
files it describes, every file loaded by ``kvforensics ingest`` without quarantine, and the deployment
audit failing check 6 on the line that shows each scenario's failure."""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kvforensics.audit import AuditReport, audit_paths
from kvforensics.audit.isolation import write_prefix_windows
from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.simulate.cli import main as simulate_main
from kvforensics.simulate.prefix import BLOCK_SIZE, SCENARIOS, simulate_prefix
from kvforensics.simulate.prefix.serve import chain_hash
from kvforensics.simulate.prefix.workload import PROBE_CANDIDATES, PROVIDER_ACCOUNT, SYSTEM_PROMPT_TOKENS
from kvforensics.stages.ingest import ingest

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
            self.stored[path.name.split(".")[0]] = [
                (ts, ev[1], ev[2], ev[3])
                for ts, events, _ in read_lines(path)
                for ev in events
                if ev[0] == "BlockStored"
            ]

    def block(self, request_id: str, position: int) -> list[int]:
        ids = self.content[request_id]["prompt_token_ids"]
        return ids[position * BLOCK_SIZE : (position + 1) * BLOCK_SIZE]


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
        assert (
            simulate_main(
                [
                    "--mechanism",
                    "prefix_reuse",
                    "--prefix-scenario",
                    "prefix-probe",
                    "--seed",
                    str(seed),
                    "--requests",
                    "1500",
                    "--out",
                    str(folder),
                ]
            )
            == 0
        )
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert {str(f) for f in files} >= {
        "gateway/requests.jsonl.gz",
        "content/content.jsonl.zst",
        "deploy.toml",
        "incident.toml",
        "ground_truth.json",
        "engine/vllm-0.log",
        "kv-events/vllm-0.jsonl.zst",
    }
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "gateway/requests.jsonl.gz").read_bytes() != (c / "gateway/requests.jsonl.gz").read_bytes()


def test_the_cli_refuses_what_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["--mechanism", "prefix_reuse", "--out", str(tmp_path)]) == 2
    assert "needs --prefix-scenario" in capsys.readouterr().err
    assert simulate_main(["--prefix-scenario", "prefix-probe", "--out", str(tmp_path)]) == 2
    assert "needs --mechanism prefix_reuse" in capsys.readouterr().err
    assert (
        simulate_main(
            [
                "--mechanism",
                "prefix_reuse",
                "--prefix-scenario",
                "prefix-probe",
                "--requests",
                "10",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
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
                assert any(
                    tuple(theirs) == tokens[k : k + BLOCK_SIZE]
                    for tokens, _ in stored
                    for k in range(0, len(tokens), BLOCK_SIZE)
                )
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
            parent = chain_hash(parent, tuple(ids[i : i + BLOCK_SIZE]), request["cache_salt"] if i == 0 else None)
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
def test_the_provider_wide_system_prompt_is_shared_and_never_a_finding(
    incidents: dict[str, Incident], name: str
) -> None:
    inc = incidents[name]
    system = inc.content[next(rid for rid, r in inc.requests.items() if r["account_id"] == PROVIDER_ACCOUNT)][
        "prompt_token_ids"
    ][:SYSTEM_PROMPT_TOKENS]
    users = [
        rid
        for rid, r in inc.requests.items()
        if r["account_id"] != PROVIDER_ACCOUNT and inc.content[rid]["prompt_token_ids"][:SYSTEM_PROMPT_TOKENS] == system
    ]
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
    assert {
        a for rid, v in truth["recipients"].items() if inc.requests[rid]["account_id"] == prober for a in v
    } == victims
    # candidates share a long prefix with a victim's document and differ in one position, tried in order
    by_prefix: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for r in probes:
        ids = inc.content[r["request_id"]]["prompt_token_ids"]
        by_prefix[tuple(ids[:-2])].append(ids[-2])
    assert all(len(v) == PROBE_CANDIDATES and v == sorted(v) for v in by_prefix.values())
    assert min(len(p) for p in by_prefix) >= 3 * BLOCK_SIZE
    victim_ids = [inc.content[rid]["prompt_token_ids"] for rid, r in inc.requests.items() if r["account_id"] in victims]
    assert sum(any(v[: 3 * BLOCK_SIZE] == list(p[: 3 * BLOCK_SIZE]) for v in victim_ids) for p in by_prefix) == len(
        by_prefix
    )
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
                same = (
                    inc.content[again["request_id"]]["prompt_token_ids"]
                    == inc.content[first["request_id"]]["prompt_token_ids"]
                )
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
    fps = con.execute(
        "SELECT count(*) FILTER (WHERE position IS NOT NULL AND salt IS NOT NULL = $salted), "
        "count(*) FROM kv_events WHERE kind = 'stored'",
        {"salted": SCENARIOS[name].salted},
    ).fetchone()
    assert fps is not None and fps[0] == fps[1] > 0


def verdicts(report: AuditReport) -> dict[str, tuple[str, str, int | None, str]]:
    return {
        v.instance: (v.status, Path(v.evidence_file or "").name, v.evidence_line, v.detail)
        for v in report.verdicts
        if v.check == 6
    }


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


# --- prefix-hicache-l3: SGLang HiCache with a salt-blind L3 store (kvforensics/simulate/prefix/hicache) ---------

HICACHE = "prefix-hicache-l3"
HICACHE_SMALL = 3000
PAGE = 64


class HicacheIncident:
    """One prefix-hicache-l3 folder read back: the gateway log, content, archived KV messages, truth."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.truth = json.loads((folder / "ground_truth.json").read_text())
        self.requests = {r["id"]: r for r in read_lines(folder / "gateway" / "requests.jsonl.gz")}
        self.content = {c["request_id"]: c for c in read_lines(folder / "content" / "content.jsonl.zst")}
        self.messages = {p.name.split(".")[0]: read_lines(p) for p in sorted((folder / "kv-events").glob("*.zst"))}

    def stores(self, instance: str) -> list[tuple[float, str, str | None, list, Any, list[int]]]:
        """(ts, medium, salt, hashes, parent, token ids) of every BlockStored of an instance, in order."""
        return [
            (m["batch"][0], e[6], e[7]["cache_salt"], e[1], e[2], e[3])
            for m in self.messages[instance]
            for e in m["batch"][1]
            if e[0] == "BlockStored"
        ]


@pytest.fixture(scope="module")
def hicache(tmp_path_factory: pytest.TempPathFactory) -> HicacheIncident:
    folder = tmp_path_factory.mktemp(HICACHE)
    simulate_prefix(HICACHE, folder, seed=3, requests=HICACHE_SMALL)
    return HicacheIncident(folder)


def _iso_epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_hicache_same_seed_same_bytes(tmp_path: Path, hicache: HicacheIncident) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, seed in ((a, 3), (b, 4)):
        assert (
            simulate_main(
                [
                    "--mechanism",
                    "prefix_reuse",
                    "--prefix-scenario",
                    HICACHE,
                    "--seed",
                    str(seed),
                    "--requests",
                    str(HICACHE_SMALL),
                    "--out",
                    str(folder),
                ]
            )
            == 0
        )
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(hicache.folder)) for p in hicache.folder.rglob("*") if p.is_file())
    assert set(files) >= {
        "gateway/requests.jsonl.gz",
        "content/content.jsonl.zst",
        "deploy.toml",
        "incident.toml",
        "ground_truth.json",
        "engine/sglang-0/sglang.log",
        "kv-events/sglang-3.jsonl.zst",
    }
    assert all((a / f).read_bytes() == (hicache.folder / f).read_bytes() for f in files)
    assert (a / "content/content.jsonl.zst").read_bytes() != (b / "content/content.jsonl.zst").read_bytes()
    assert len(hicache.requests) == HICACHE_SMALL == hicache.truth["requests"]


def test_hicache_engine_logs_have_three_startups_the_middle_one_with_the_store(hicache: HicacheIncident) -> None:
    for n in range(4):
        log = (hicache.folder / "engine" / f"sglang-{n}" / "sglang.log").read_text()
        args = [line for line in log.splitlines() if "server_args=ServerArgs(" in line]
        assert [("hicache_storage_backend='mooncake'" in a, "hicache_storage_backend=None" in a) for a in args] == [
            (False, True),
            (True, False),
            (False, True),
        ]
        assert all(
            "enable_hierarchical_cache=True" in a
            and "hicache_write_policy='write_through'" in a
            and "page_size=64" in a
            and "enable_cache_report=True" in a
            for a in args
        )
        assert "sglang version" not in log and log.count("The server is fired up and ready to roll!") == 3
        assert log.count("SIGTERM received") == 2
    incident = (hicache.folder / "incident.toml").read_text()
    assert 'engine_version = "0.5.18"' in incident and 'instance = "{parent}"' in incident
    assert 'shared_namespaces = ["playground"]' in incident
    assert 'seq = "seq"' in incident and 'ts = "batch.0"' in incident


def test_hicache_seq_starts_at_0_at_each_startup(hicache: HicacheIncident) -> None:
    for instance, messages in hicache.messages.items():
        assert {m["instance"] for m in messages} == {instance}
        seqs = [m["seq"] for m in messages]
        restarts = [i for i, s in enumerate(seqs) if s == 0]
        assert len(restarts) == 3 and restarts[0] == 0, instance
        assert all(b == a + 1 for a, b in zip(seqs, seqs[1:], strict=False) if b != 0)
        times = [m["batch"][0] for m in messages]
        assert times == sorted(times) and all(m["batch"][2] == 0 for m in messages)


def test_hicache_salted_chains_differ_across_salts_for_equal_tokens(hicache: HicacheIncident) -> None:
    by_tokens: dict[tuple[int, ...], dict[str, int]] = defaultdict(dict)
    for instance in hicache.messages:
        for _, medium, salt, hashes, parent, ids in hicache.stores(instance):
            assert len(ids) == PAGE * len(hashes) and medium in ("GPU", "CPU_PINNED")
            if parent is None:  # a chain's first page: SHA256(SHA256(seed + salt) || ids as uint32 LE), 64 bits
                seed = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()
                digest = hashlib.sha256(seed + struct.pack(f"<{PAGE}I", *ids[:PAGE])).digest()
                assert hashes[0] == int.from_bytes(digest[:8], "big", signed=True)
                by_tokens[tuple(ids[:PAGE])][salt] = hashes[0]
    shared = [salts for salts in by_tokens.values() if len(salts) > 1]
    assert len(shared) >= 5  # the system prompt, templates, public documents under many salts
    assert all(len(set(salts.values())) == len(salts) for salts in shared)


def test_hicache_every_recipient_loaded_foreign_pages_inside_its_store_window(hicache: HicacheIncident) -> None:
    truth = hicache.truth
    windows = {
        i: [(_iso_epoch(w["start"]), _iso_epoch(w["end"])) for w in ws] for i, ws in truth["exposure_windows"].items()
    }
    assert sorted(windows) == [f"sglang-{n}" for n in range(4)] and all(len(w) == 1 for w in windows.values())
    assert len(truth["recipients"]) >= 20
    internal, shared = set(truth["internal_accounts"]), set(truth["shared_namespaces"])
    for rid, sources in truth["recipient_sources"].items():
        request, load = hicache.requests[rid], truth["recipient_loads"][rid]
        ts = _iso_epoch(request["created"])
        assert load["instance"] == request["upstream"]
        assert any(a <= ts < b for a, b in windows[request["upstream"]]), rid
        ids = hicache.content[rid]["prompt_token_ids"]
        assert {s["source_account"] for s in sources} == set(truth["recipients"][rid])
        for s in sources:
            source = hicache.requests[s["source_request_id"]]
            assert source["account"] == s["source_account"] != request["account"]
            assert s["source_salt"] not in shared | {request["cache_salt"]} and s["source_account"] not in internal
            assert _iso_epoch(source["created"]) < ts
            theirs = hicache.content[s["source_request_id"]]["prompt_token_ids"]
            end = (s["position_to"] + 1) * PAGE  # the whole prefix up to the page: the store's keys chain
            assert len(theirs) >= end or s["source_position_from"] == s["position_from"]
            assert request["usage"]["prompt_tokens_details"]["cached_tokens"] >= end
        # the load shows in the events: a host store under the requester's salt, then the device store
        stores = [
            (medium, ids_)
            for t, medium, salt, _, _, ids_ in hicache.stores(request["upstream"])
            if salt == request["cache_salt"] and ts <= t < ts + 60
        ]
        first = sources[0]["position_from"] * PAGE
        page = ids[first : first + PAGE]
        media = [m for m, ids_ in stores if any(ids_[k : k + PAGE] == page for k in range(0, len(ids_), PAGE))]
        assert media[:2] == ["CPU_PINNED", "GPU"], (rid, media)
    assert not set(truth["recipient_accounts"]) & internal


def test_hicache_lookalikes_and_the_prober(hicache: HicacheIncident) -> None:
    truth, rows = hicache.truth, list(hicache.requests.values())
    mine = lambda account: sorted((r for r in rows if r["account"] == account), key=lambda r: r["created"])  # noqa: E731
    look = truth["benign_lookalikes"]
    assert {k: len(v) for k, v in look.items()} == {
        "evaluation_harness": 2,
        "retrying_clients": 3,
        "keepalive_pings": 2,
        "autocomplete": 3,
    }
    for account in look["evaluation_harness"]:  # one template, many items, one token out
        runs = mine(account)
        assert len(runs) >= 100 and {r["max_tokens"] for r in runs} == {1}
        prompts = [hicache.content[r["id"]]["prompt_token_ids"] for r in runs]
        assert len({tuple(p[: 5 * PAGE]) for p in prompts}) == 1 and len({tuple(p) for p in prompts}) == len(prompts)
    for account in look["keepalive_pings"]:
        pings = mine(account)
        assert len(pings) >= 30 and len({tuple(hicache.content[r["id"]]["prompt_token_ids"]) for r in pings}) == 1
    growing = 0
    for account in look["autocomplete"]:
        for a, b in zip(mine(account), mine(account)[1:], strict=False):
            pa, pb = (hicache.content[r["id"]]["prompt_token_ids"] for r in (a, b))
            growing += pb[: len(pa)] == pa and 0 < len(pb) - len(pa) <= 24
    assert growing >= 20
    retried = 0
    for account in look["retrying_clients"]:
        reqs = mine(account)
        for a, b in zip(reqs, reqs[1:], strict=False):
            retried += (
                a["status"] == 504
                and hicache.content[a["id"]]["prompt_token_ids"] == hicache.content[b["id"]]["prompt_token_ids"]
            )
    assert retried >= 1
    assert truth["playground_accounts"] and {
        hicache.requests[r]["cache_salt"]
        for r in hicache.requests
        if hicache.requests[r]["account"] in truth["playground_accounts"]
    } == {"playground"}
    # the prober: while every instance has the store, one page at a time of the victim's document
    (prober,) = truth["probers"]
    probes = mine(prober)
    assert 20 <= len(probes) and {r["max_tokens"] for r in probes} == {1}
    shared_from = max(_iso_epoch(w[0]["start"]) for w in truth["exposure_windows"].values())
    shared_to = min(_iso_epoch(w[0]["end"]) for w in truth["exposure_windows"].values())
    assert all(shared_from < _iso_epoch(r["created"]) < shared_to for r in probes)
    (victim,) = truth["probe_victims"]
    document = next(hicache.content[r["id"]]["prompt_token_ids"] for r in rows if r["account"] == victim)
    known = 3
    for r in probes:
        ids, cached = hicache.content[r["id"]]["prompt_token_ids"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert ids[: known * PAGE] == document[: known * PAGE]
        candidate, true_page = ids[known * PAGE : (known + 1) * PAGE], document[known * PAGE : (known + 1) * PAGE]
        assert 0 <= sum(x != y for x, y in zip(candidate, true_page, strict=True)) <= 3
        assert len(ids) - known * PAGE >= 256  # enough left for the store to be asked
        if cached >= (known + 1) * PAGE:
            assert candidate == true_page
            known += 1  # the prefix grows by the page that came back
    assert known >= 6 and victim in truth["source_accounts"] and prober in truth["recipient_accounts"]
    # their own templates and prompts: never another namespace's pages (retrying and autocomplete clients are
    # ordinary tenants otherwise, who may paste a public document another tenant's request put in the store)
    assert not set(truth["recipient_accounts"]) & {*look["evaluation_harness"], *look["keepalive_pings"]}


def test_hicache_ingest_loads_every_file_and_sees_the_restarts(tmp_path: Path) -> None:
    folder = tmp_path / "incident"
    simulate_prefix(HICACHE, folder, seed=5, requests=1000)
    con = connect()
    incident = load_incident(folder / "incident.toml")
    ingest(con, incident)
    write_prefix_windows(con, incident)
    assert con.execute("SELECT count(*) FROM quarantine").fetchone() == (0,)
    kinds = dict(con.execute("SELECT kind, sum(loaded) FROM load_report GROUP BY kind").fetchall())
    assert set(kinds) == {"requests", "content", "kv_events", "engine_log"} and kinds["requests"] == 1000
    assert con.execute(
        "SELECT count(*) FILTER (WHERE cached_tokens IS NOT NULL AND cache_salt IS NOT NULL "
        "AND prefill_instance LIKE 'sglang-%'), count(*) FROM requests"
    ).fetchone() == (1000, 1000)
    assert con.execute("SELECT DISTINCT kind FROM kv_event_gaps").fetchall() == [("restart",)]
    assert con.execute("SELECT count(*) FROM kv_event_gaps").fetchone() == (8,)
    windows = con.execute("SELECT instance, path, status FROM prefix_windows ORDER BY instance, valid_from").fetchall()
    assert windows == [
        (f"sglang-{n}", path, status)
        for n in range(4)
        for path, status in (("isolated", "pass"), ("salt_blind_store", "fail"), ("isolated", "pass"))
    ]
    media = dict(con.execute("SELECT medium, count(*) FROM kv_events WHERE kind = 'stored' GROUP BY 1").fetchall())
    assert set(media) == {"GPU", "CPU_PINNED"}
    assert con.execute(
        "SELECT count(*) FROM kv_events WHERE kind = 'stored' AND (chain_fp IS NULL OR salt IS NULL)"
    ).fetchone() == (0,)
