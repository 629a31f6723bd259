"""The HiCache reference incident's generator (tests/hicache_reference/generate.py) keeps its own word:
the same seed writes the same bytes, and its truth agrees with the files it wrote."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent / "hicache_reference"
SIZE = 3000


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("hicache_reference_generate", HERE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen = load_generator()


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hicache") / "a"
    gen.generate(out, seed=7, requests=SIZE)
    return out


def jsonl(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def gateway(incident: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for p in sorted((incident / "gateway").glob("*.jsonl.gz")) for r in jsonl(p)}


def kv_messages(incident: Path, instance: str) -> list[dict[str, Any]]:
    return jsonl(incident / "kv-events" / f"{instance}.jsonl.gz")


def seconds(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_same_seed_same_bytes(incident: Path, tmp_path: Path) -> None:
    again = tmp_path / "b"
    gen.generate(again, seed=7, requests=SIZE)
    files = sorted(p.relative_to(incident) for p in incident.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (incident / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_every_affected_request_was_served_from_cache_inside_a_window(incident: Path) -> None:
    truth = json.loads((incident / "truth.json").read_text())
    records = gateway(incident)
    assert truth["affected_requests"], "the default traffic must expose someone"
    undelivered = set(truth["affected_undelivered"])
    for rid in truth["affected_requests"]:
        rec, src = records[rid], truth["sources"][rid]
        assert (200 <= rec["status"] < 300) != (rid in undelivered)
        cached = src["cached_tokens"]
        if rid not in undelivered:
            assert rec["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert cached >= (max(p["position"] for p in src["foreign_pages"]) + 1) * gen.PAGE
        assert rec["upstream"] == src["instance"]
        windows = truth["exposure_windows"][src["instance"]]
        t = seconds(rec["created_at"])
        assert any(seconds(w["start"]) <= t < seconds(w["end"]) for w in windows), rid
        assert rec["tenant"] not in src["source_accounts"]
        assert rec["cache_salt"] not in {p["source_salt"] for p in src["foreign_pages"]}
    assert set(truth["recipients"]) == {records[r]["tenant"] for r in truth["affected_requests"]}
    assert truth["prober"]["account"] in truth["recipients"]
    assert truth["prober"]["victim"] in truth["source_accounts"]
    internal = set(truth["internal_accounts"])
    assert not internal & set(truth["source_accounts"])
    assert all(not g["inside_exposure_window"] for g in truth["seq_gaps"])


def test_store_loads_show_as_host_then_device_stores_in_the_requesters_namespace(incident: Path) -> None:
    truth = json.loads((incident / "truth.json").read_text())
    records = gateway(incident)
    rid = truth["affected_requests"][0]
    src, rec = truth["sources"][rid], records[rid]
    t = seconds(rec["created_at"])
    media = []
    for m in kv_messages(incident, src["instance"]):
        ts = m["batch"][0]
        if t <= ts < t + 2:
            for ev in m["batch"][1]:
                if ev[0] == "BlockStored" and len(ev) == 8 and ev[7]["cache_salt"] == rec["cache_salt"]:
                    media.append(ev[6])
    assert media[:2] == ["CPU_PINNED", "GPU"]


def test_salted_hashes_follow_the_chain_and_differ_across_salts(incident: Path) -> None:
    first_pages: dict[tuple[int, ...], dict[str, int]] = {}
    shapes = set()
    for inst in gen.INSTANCES:
        for m in kv_messages(incident, inst):
            for ev in m["batch"][1]:
                if ev[0] != "BlockStored":
                    continue
                shapes.add((len(ev), len(ev[1]) > 1))
                if ev[2] is None:
                    salt = ev[7]["cache_salt"] if len(ev) == 8 else None
                    tokens = ev[3][: gen.PAGE]
                    seed = b"" if salt is None else hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()
                    packed = b"".join(x.to_bytes(4, "little") for x in tokens)
                    digest = hashlib.sha256(seed + packed).digest()
                    assert ev[1][0] == gen.hash_str_to_int64(digest)
                    first_pages.setdefault(tuple(tokens), {})[salt or ""] = ev[1][0]
    assert {(7, False), (8, False), (8, True)} <= shapes  # unsalted, salted, merged multi-page stores
    shared = [by_salt for by_salt in first_pages.values() if len(by_salt) > 1]
    assert shared, "public text must be stored under several salts"
    for by_salt in shared:
        assert len(set(by_salt.values())) == len(by_salt)


def test_sequence_restarts_per_startup_and_jumps_only_at_the_recorded_gaps(incident: Path) -> None:
    truth = json.loads((incident / "truth.json").read_text())
    gaps = {(g["instance"], g["after_seq"], g["next_seq"]) for g in truth["seq_gaps"]}
    seen = set()
    for inst in gen.INSTANCES:
        msgs = kv_messages(incident, inst)
        endpoints = [s["endpoint"] for s in truth["deployment"]["startups"][inst]]
        assert msgs[0]["seq"] == 0
        resets = [m["endpoint"] for m in msgs if m["seq"] == 0]
        assert resets == endpoints  # one sequence per start-up, each from its own publisher
        for prev, cur in zip(msgs, msgs[1:], strict=False):
            assert cur["batch"][0] >= prev["batch"][0]
            if cur["seq"] != 0 and cur["seq"] != prev["seq"] + 1:
                seen.add((inst, prev["seq"], cur["seq"]))
        assert all(m["instance"] == inst and m["topic"] == "kv-events" for m in msgs)
    assert seen == gaps and gaps


def test_engine_logs_have_three_startups_and_the_storage_backend_of_the_middle_one(incident: Path) -> None:
    for inst in gen.INSTANCES:
        with gzip.open(incident / "engines" / inst / "sglang.log.gz", "rt") as f:
            args = [line for line in f if " server_args=ServerArgs(" in line]
        assert len(args) == 3
        assert ["hicache_storage_backend='mooncake'" in a for a in args] == [False, True, False]
        assert all("hicache_write_policy='write_through'" in a and "page_size=64" in a for a in args)
