"""Prefix-cache incidents (mechanism ``prefix_reuse``): four seeded scenarios with ground truth.

* ``prefix-l3-unsalted``: the gateway salts every tenant, but the LMCache store the instances share
  keys blocks by their tokens alone: a request misses in its own instance's (salted) cache and loads
  another tenant's blocks of the same prefix from the store.
* ``prefix-collision``: one instance keys its blocks with a weak hash of a few bits: a block of
  different content with an equal hash is reused, so the request is served another tenant's KV.
* ``prefix-probe``: no salt on a shared deployment behind a KV-aware router; one account reads two
  tenants' documents back by TTFT (many one-token requests, the known prefix plus candidate
  continuations); an evaluation harness and retrying clients are the look-alikes.
* ``prefix-hicache-l3``: four SGLang 0.5.18 servers with HiCache; a rolling restart adds a Mooncake
  storage backend whose keys drop the salt, a later one removes it; KV events as a subscriber archives
  them. Streamed (any ``--requests`` in bounded memory): :mod:`kvforensics.simulate.prefix.hicache`.

The first three share this module's vLLM model (:mod:`.serve`, :mod:`.workload`, :mod:`.files`) and
are ``SCENARIOS``; ``prefix-hicache-l3`` is modelled on its own from SGLang's documented behaviour
(``STREAMED_SCENARIOS``). ``SCENARIO_NAMES`` lists all four.

Every scenario also has a provider-wide system prompt that the provider's own account stores first
(hourly warm-ups): a benign shared prefix, never in the ground truth. :func:`simulate_prefix` writes
the files described in :mod:`kvforensics.simulate.prefix.files`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from hashlib import blake2b
from pathlib import Path

from kvforensics.core.errors import ConfigError
from kvforensics.simulate.prefix import files, hicache
from kvforensics.simulate.prefix import serve as serving
from kvforensics.simulate.prefix.workload import PROVIDER_ACCOUNT, build_workload

BLOCK_SIZE = 16
INSTANCES = ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
CAPACITY_BLOCKS = 6144  # 98,304 tokens per instance: evictions within hours
DEFAULT_REQUESTS = 20_000
MAX_REQUESTS = 100_000  # every request is kept in memory (~15 kB each)
DEFAULT_SEED = 15
START = datetime(2026, 10, 12, tzinfo=UTC)
HOURS = 48
TENANTS = 120
INTERNAL_GLOB = "provider-*"


@dataclass(frozen=True)
class PrefixScenario:
    name: str
    title: str
    salted: bool
    l3: bool = False
    weak_bits: int | None = None
    probe: bool = False


SCENARIOS = {
    s.name: s
    for s in (
        PrefixScenario(
            "prefix-l3-unsalted",
            "Tenants' KV blocks shared through an LMCache store that drops the cache salt",
            salted=True,
            l3=True,
        ),
        PrefixScenario(
            "prefix-collision",
            "Another tenant's KV served after a block-hash collision on vllm-2",
            salted=True,
            weak_bits=20,
        ),
        PrefixScenario(
            "prefix-probe",
            "Prompt read back by prefix-cache timing on an unsalted shared deployment",
            salted=False,
            probe=True,
        ),
    )
}

STREAMED_SCENARIOS = {hicache.NAME: hicache.TITLE}
SCENARIO_NAMES = (*SCENARIOS, *STREAMED_SCENARIOS)


@dataclass(frozen=True)
class PrefixResult:
    out_dir: Path
    scenario: str
    requests: int
    recipients: int
    recipient_accounts: int
    source_accounts: int


def tenant_salt(seed: int, account: str) -> str:
    """The salt the gateway sets for an account (stable per seed, unguessable from the name alone)."""
    return "ts-" + blake2b(f"{seed}:{account}".encode(), digest_size=8).hexdigest()


def simulate_prefix(
    name: str, out: Path, seed: int | None = None, requests: int | None = None, hash_bits: int | None = None
) -> PrefixResult:
    """Write one prefix-cache incident (``SCENARIOS[name]``) into *out*; the same seed and size give
    the same bytes. *hash_bits* overrides the weak hash's width of ``prefix-collision`` (fewer bits,
    more collisions: a small run still has some)."""
    seed = DEFAULT_SEED if seed is None else seed
    requests = DEFAULT_REQUESTS if requests is None else requests
    if name in STREAMED_SCENARIOS:
        return _simulate_streamed(name, out, seed, requests, hash_bits)
    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise ConfigError(f"unknown prefix scenario '{name}'; choose one of {', '.join(SCENARIO_NAMES)}")
    if not 1000 <= requests <= MAX_REQUESTS:
        raise ConfigError(
            f"--requests {requests} is out of range for a prefix-cache scenario (held in memory): "
            f"use 1000 to {MAX_REQUESTS}"
        )
    bits = scenario.weak_bits and (hash_bits or scenario.weak_bits)
    if bits is not None and not 8 <= bits <= 63:
        raise ConfigError(f"hash_bits {bits} is out of range; use 8 to 63")
    dep = serving.Deployment(
        INSTANCES, CAPACITY_BLOCKS, BLOCK_SIZE, l3=scenario.l3, weak_instance="vllm-2" if bits else None, weak_bits=bits
    )
    w = build_workload(seed, requests, START, HOURS, INSTANCES, TENANTS, BLOCK_SIZE, scenario.probe)
    accounts = {r.account for r in w.requests}
    salts = {a: tenant_salt(seed, a) for a in sorted(accounts)} if scenario.salted else {}
    served, caches = serving.serve(w.requests, dep, salts, {PROVIDER_ACCOUNT}, seed)
    out.mkdir(parents=True, exist_ok=True)
    files.write_requests(out, served, w)
    files.write_kv_events(out, caches, BLOCK_SIZE)
    files.write_engine_logs(out, dep, START - timedelta(hours=1))
    (out / "deploy.toml").write_text(files.manifest(scenario.salted), encoding="utf-8")
    (out / "incident.toml").write_text(
        files.incident_toml(scenario.name, scenario.title, INTERNAL_GLOB, scenario.salted), encoding="utf-8"
    )
    truth = files.ground_truth(scenario.name, seed, BLOCK_SIZE, served, w, [PROVIDER_ACCOUNT])
    (out / "ground_truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return PrefixResult(
        out,
        scenario.name,
        len(served),
        len(truth["recipients"]),
        len(truth["recipient_accounts"]),
        len(truth["source_accounts"]),
    )


def _simulate_streamed(name: str, out: Path, seed: int, requests: int, hash_bits: int | None) -> PrefixResult:
    if hash_bits is not None:
        raise ConfigError(f"hash_bits applies to prefix-collision only, not {name}")
    if not hicache.MIN_REQUESTS <= requests <= hicache.MAX_REQUESTS:
        raise ConfigError(
            f"--requests {requests} is out of range for {name}: use {hicache.MIN_REQUESTS} to {hicache.MAX_REQUESTS}"
        )
    r = hicache.simulate_hicache_l3(out, seed, requests)
    return PrefixResult(r.out_dir, name, r.requests, r.recipients, r.recipient_accounts, r.source_accounts)
