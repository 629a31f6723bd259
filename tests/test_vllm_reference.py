"""The vLLM + LMCache reference incident's generator (tests/vllm_reference/generate.py) keeps its own word:
the same seed writes the same bytes, its files have vLLM's shapes, and its truth agrees with them."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent / "vllm_reference"
SIZE = 2000


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_reference_generate", HERE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = load_generator()


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "a"
    gen.generate(out, seed=7, requests=SIZE)
    return out


@pytest.fixture(scope="module")
def truth(incident: Path) -> dict[str, Any]:
    return json.loads((incident / "truth.json").read_text())


@pytest.fixture(scope="module")
def records(incident: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for p in sorted((incident / "gateway").glob("*.jsonl.gz")) for r in jsonl(p)}


@pytest.fixture(scope="module")
def archives(incident: Path) -> dict[str, list[dict[str, Any]]]:
    return {inst: jsonl(incident / "kv-events" / f"{inst}.jsonl.gz") for inst in gen.INSTANCES}


def jsonl(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def seconds(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_same_seed_same_bytes(incident: Path, tmp_path: Path) -> None:
    again = tmp_path / "b"
    gen.generate(again, seed=7, requests=SIZE)
    files = sorted(p.relative_to(incident) for p in incident.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (incident / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_incident_toml_uses_only_documented_keys(incident: Path) -> None:
    doc = tomllib.loads((incident / "incident.toml").read_text())
    assert set(doc) == {"incident", "sources", "scope", "prefix_cache"}
    source_keys = {"name", "kind", "path", "format", "timezone", "columns", "null_tokens", "instance", "year"}
    for src in doc["sources"]:
        assert set(src) <= source_keys, src
    kinds = {s["name"]: s for s in doc["sources"]}
    assert kinds["engines"]["format"] == "vllm" and kinds["engines"]["year"] == gen.YEAR
    assert kinds["kv-events"]["columns"]["events"] == "batch.events"
    assert set(doc["prefix_cache"]) <= {"tenants", "cache_salt", "engine_version", "block_size", "shared_namespaces"}
    assert doc["prefix_cache"]["tenants"] == "multi" and doc["prefix_cache"]["cache_salt"] == "gateway"
    assert doc["scope"]["internal_accounts"] == [gen.INTERNAL_PATTERN]
    assert "truth" not in (incident / "incident.toml").read_text().split("\n", 1)[1]


def test_gateway_records(records: dict[str, dict[str, Any]], truth: dict[str, Any]) -> None:
    statuses = {r["status"] for r in records.values()}
    assert {200, 400, 499} <= statuses
    for r in records.values():
        assert r["model"] == gen.MODEL and r["cache_salt"]
        cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
        if r["status"] == 200:
            assert 0 <= cached < r["usage"]["prompt_tokens"]
        else:
            assert cached is None
        if r["status"] == 400:
            assert r["usage"]["prompt_tokens"] > gen.MAX_MODEL_LEN and r["upstream"]
    assert set(truth["rejected_too_long"]) == {i for i, r in records.items() if r["status"] == 400}
    assert len(records) == truth["counts"]["gateway_requests"]


def test_every_affected_request_was_loaded_from_lmcache_inside_a_window(
    truth: dict[str, Any], records: dict[str, dict[str, Any]]
) -> None:
    assert truth["affected_requests"], "the default traffic must expose someone"
    assert truth["same_tenant_l3_loads"] and truth["shared_namespace_l3_loads"] and truth["secondary_requests"]
    undelivered = set(truth["affected_undelivered"])
    for rid in truth["affected_requests"]:
        rec, src = records[rid], truth["sources"][rid]
        assert (200 <= rec["status"] < 300) != (rid in undelivered)
        if rid not in undelivered:
            assert rec["usage"]["prompt_tokens_details"]["cached_tokens"] == src["cached_tokens"]
        last_chunk = max(src["l3_loaded_chunks"])
        assert src["cached_tokens"] == (last_chunk + 1) * gen.CHUNK  # LMCache's hit ends on a chunk
        assert src["cached_tokens"] == src["local_hit_tokens"] + src["external_tokens"]
        assert src["external_tokens"] > 0
        assert rec["upstream"] == src["instance"]
        t = seconds(rec["created_at"])
        assert any(seconds(w["start"]) <= t < seconds(w["end"]) for w in truth["exposure_windows"][src["instance"]])
        assert rec["tenant"] not in src["source_accounts"]
        assert rec["cache_salt"] not in {p["source_salt"] for p in src["foreign_pages"]}
        assert all(seconds(p["written_at"]) <= t + 5 for p in src["foreign_pages"])
    assert set(truth["recipients"]) == {records[r]["tenant"] for r in truth["affected_requests"]}
    assert truth["prober"]["account"] in truth["recipients"]
    assert truth["prober"]["victim"] in truth["source_accounts"]
    assert truth["prober"]["hits"] and set(truth["prober"]["hits"]) <= set(truth["affected_requests"])
    assert not set(truth["internal_accounts"]) & set(truth["source_accounts"])
    assert truth["seq_gaps"] and all(not g["inside_exposure_window"] for g in truth["seq_gaps"])


def test_a_load_is_one_gpu_store_in_the_requesters_namespace(
    truth: dict[str, Any], records: dict[str, dict[str, Any]], archives: dict[str, list[dict[str, Any]]]
) -> None:
    """No event says "loaded from LMCache": vLLM caches loaded and computed blocks alike (one GPU store)."""
    checked = 0
    for rid in truth["affected_requests"]:
        src, rec = truth["sources"][rid], records[rid]
        if src["local_hit_tokens"]:
            continue
        t = seconds(rec["created_at"])
        stores = [
            ev
            for m in archives[src["instance"]]
            if t <= m["batch"]["ts"] < t + 5
            for ev in m["batch"]["events"]
            if ev["type"] == "BlockStored" and ev["medium"] == "GPU" and ev["parent_block_hash"] is None
            if ev.get("extra_keys") and ev["extra_keys"][0] == [rec["cache_salt"]]
        ]
        assert stores, rid
        assert any(len(ev["block_hashes"]) * gen.BLOCK >= src["cached_tokens"] for ev in stores), rid
        checked += 1
    assert checked


def test_event_shapes_are_vllms_maps(archives: dict[str, list[dict[str, Any]]]) -> None:
    media: dict[str, int] = {}
    for inst, msgs in archives.items():
        for m in msgs:
            assert set(m) == {"recv_ts", "instance", "endpoint", "topic", "seq", "batch"}
            assert set(m["batch"]) == {"ts", "events", "data_parallel_rank"} and m["instance"] == inst
            for ev in m["batch"]["events"]:
                if ev["type"] == "BlockRemoved":
                    assert ev == {
                        "type": "BlockRemoved",
                        "block_hashes": ev["block_hashes"],
                        "medium": "GPU",
                        "group_idx": 0,
                    }
                    continue
                assert ev["type"] == "BlockStored"
                media[ev["medium"]] = media.get(ev["medium"], 0) + 1
                assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in ev["block_hashes"])
                assert len(ev["token_ids"]) == len(ev["block_hashes"]) * ev["block_size"]
                if ev["medium"] == "GPU":
                    assert ev["block_size"] == gen.BLOCK and ev["group_idx"] == 0
                    if "extra_keys" in ev:
                        assert len(ev["extra_keys"]) == len(ev["block_hashes"])
                        assert all(k is None for k in ev["extra_keys"][1:])
                        assert (ev["extra_keys"][0] is not None) == (ev["parent_block_hash"] is None)
                else:  # the connector's LMCache save: one chunk per event, token-only chain, defaults omitted
                    assert ev["medium"] == gen.LMCACHE_MEDIUM and ev["block_size"] == gen.CHUNK
                    assert len(ev["block_hashes"]) == 1 and "extra_keys" not in ev and "group_idx" not in ev
    assert set(media) == {"GPU", gen.LMCACHE_MEDIUM}


def test_salted_chains_differ_across_salts(archives: dict[str, list[dict[str, Any]]]) -> None:
    first: dict[tuple[int, ...], dict[str, int]] = {}
    for msgs in archives.values():
        for m in msgs:
            for ev in m["batch"]["events"]:
                if ev["type"] == "BlockStored" and ev["medium"] == "GPU" and ev["parent_block_hash"] is None:
                    salt = ev["extra_keys"][0][0] if "extra_keys" in ev else ""
                    tokens = tuple(ev["token_ids"][: gen.BLOCK])
                    first.setdefault(tokens, {})[salt] = ev["block_hashes"][0]
                    assert ev["block_hashes"][0] == gen.block_hashes(gen.array("I", tokens), 1, salt or None)[0]
    shared = [by_salt for by_salt in first.values() if len(by_salt) > 1]
    assert shared, "public text must be stored under several salts"
    for by_salt in shared:
        assert len(set(by_salt.values())) == len(by_salt)


def test_sequence_restarts_per_startup_and_jumps_only_at_the_recorded_gaps(
    truth: dict[str, Any], archives: dict[str, list[dict[str, Any]]]
) -> None:
    gaps = {(g["instance"], g["after_seq"], g["next_seq"]) for g in truth["seq_gaps"]}
    seen = set()
    for inst, msgs in archives.items():
        endpoints = [s["endpoint"] for s in truth["deployment"]["startups"][inst]]
        assert msgs[0]["seq"] == 0
        assert [m["endpoint"] for m in msgs if m["seq"] == 0] == endpoints
        for prev, cur in zip(msgs, msgs[1:], strict=False):
            assert cur["batch"]["ts"] >= prev["batch"]["ts"]
            if cur["seq"] != 0 and cur["seq"] != prev["seq"] + 1:
                seen.add((inst, prev["seq"], cur["seq"]))
    assert seen == gaps and gaps


def test_engine_logs_have_three_startups_and_the_connector_in_the_middle_one(
    incident: Path, truth: dict[str, Any]
) -> None:
    envelope = re.compile(
        r"^\((APIServer|EngineCore|Worker_TP\d) pid=\d+\) (INFO|WARNING|ERROR)( \d\d-\d\d \d\d:\d\d:\d\d \[|:     )"
    )
    for inst in gen.INSTANCES:
        with gzip.open(incident / "engines" / inst / "vllm.log.gz", "rt") as f:
            lines = f.read().splitlines()
        assert all(envelope.match(line) for line in lines), inst
        args = [line for line in lines if "non-default args: {" in line]
        assert len(args) == 3
        assert ["'kv_connector': " not in a and "kv_connector='LMCacheConnectorV1'" in a for a in args] == [
            False,
            True,
            False,
        ]
        assert all("'enable_prefix_caching': True" in a and "enable_kv_cache_events=True" in a for a in args)
        configs = [line for line in lines if "Initializing a V1 LLM engine (v0.33.0)" in line]
        assert len(configs) == 3 and all("enable_prefix_caching=True" in c for c in configs)
        sizes = [
            int(m.group(1).replace(",", ""))
            for m in map(re.compile(r"KV cache size: ([\d,]+) tokens").search, lines)
            if m
        ]
        assert len(sizes) == 3 and all(s >= gen.MAX_MODEL_LEN for s in sizes)
        assert sum("Creating v1 connector with name: LMCacheConnectorV1" in line for line in lines) == gen.TP_SIZE + 1
        assert sum("Shutting down FastAPI HTTP server." in line for line in lines) == 2
        assert not any(re.search(rf"\b{gen.YEAR}-\d\d-\d\d", line) for line in lines)  # stamps have no year
        assert len(truth["exposure_windows"][inst]) == 1
