"""``prefix-hicache-l3``: SGLang HiCache with a salt-blind shared L3 store, enabled and removed by rolling
restarts.

Four unified SGLang 0.5.18 servers (``sglang-0..3``; ``--enable-hierarchical-cache --hicache-write-policy
write_through --page-size 64 --enable-cache-report``, KV events over ZMQ) behind a gateway that sets
``cache_salt`` per tenant. On that build the device and host caches keep tenants apart (#30827: the radix
key carries the salt; #23300: it reaches the scheduler), but a HiCache storage backend keys pages by their
tokens alone (sgl-project/sglang#26747; fixed by #38577, merged 2026-09-08, after 0.5.18). A rolling
restart adds ``--hicache-storage-backend mooncake`` to every instance; from then on a request that misses
in its own namespace's device and host caches, with 256 tokens or more left (#12092), loads the pages
another tenant's request wrote to the store. A second rolling restart removes the backend. The engine
logs name no version (SGLang's never do), so the incident file states it (``[prefix_cache]
engine_version``).

Modelled from the engines' documented behaviour (``/work/shared/reference/kv-cache-isolation.md``
sections 1-4), not from the vLLM scenarios: :mod:`.engine` (caches, store, events), :mod:`.traffic`
(tenants, look-alikes, the prober), :mod:`.serve` (routing, each request's actions in time order, the
ground truth), :mod:`.deployment` (start-ups, engine logs), :mod:`.files`. Everything streams: memory is
bounded by the caches, the store and the requests in flight, not by ``--requests``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kvforensics.simulate.prefix.hicache import deployment as dep
from kvforensics.simulate.prefix.hicache import files
from kvforensics.simulate.prefix.hicache.engine import Instance, SharedStore
from kvforensics.simulate.prefix.hicache.serve import Server, Truth
from kvforensics.simulate.prefix.hicache.traffic import PLAYGROUND_SALT, Traffic

NAME = "prefix-hicache-l3"
TITLE = "Tenants' KV pages shared through a salt-blind HiCache L3 store (SGLang 0.5.18, Mooncake backend)"
START = datetime(2026, 10, 12, tzinfo=UTC)
HOURS = 48
MIN_REQUESTS = 1000
MAX_REQUESTS = 5_000_000


@dataclass(frozen=True)
class HicacheResult:
    out_dir: Path
    requests: int
    recipients: int
    recipient_accounts: int
    source_accounts: int


def simulate_hicache_l3(out: Path, seed: int, requests: int) -> HicacheResult:
    """Write the incident into *out*; the same seed and size give the same bytes."""
    start = START.timestamp()
    timeline = dep.timeline(seed, start, HOURS)
    warmups = sorted(_warmups(timeline, start))
    traffic = Traffic(seed, requests, start, HOURS, START.hour, warmups, timeline.all_shared())
    out.mkdir(parents=True, exist_ok=True)
    archives = {name: files.EventArchive(out, name, n) for n, name in enumerate(dep.INSTANCES)}
    instances = {name: Instance(name, dep.DEVICE_PAGES, dep.HOST_PAGES, archives[name]) for name in dep.INSTANCES}
    store = SharedStore(dep.STORE_PAGES)
    truth = Truth(frozenset(traffic.accounts.internal), frozenset({PLAYGROUND_SALT}))
    writer = files.RequestFiles(out, traffic.vocab)
    try:
        served = Server(seed, timeline, instances, store, traffic, writer, truth).run()
    finally:
        writer.close()
        for archive in archives.values():
            archive.writer.close()
    files.write_engine_logs(out, timeline, dep.engine_log)
    (out / "deploy.toml").write_text(files.manifest(), encoding="utf-8")
    (out / "incident.toml").write_text(files.incident_toml(NAME, TITLE), encoding="utf-8")
    stats = {"capacity_pages": store.capacity, "writes": store.writes, "evictions": store.evictions}
    gt = files.ground_truth(NAME, seed, served, truth, traffic.accounts, timeline, stats)
    (out / "ground_truth.json").write_text(json.dumps(gt, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return HicacheResult(out, served, len(gt["recipients"]), len(gt["recipient_accounts"]), len(gt["source_accounts"]))


def _warmups(timeline: dep.Timeline, start: float) -> list[tuple[float, str]]:
    """The provider's warm-ups: each start-up 5 s after it is up (before the router sends it traffic),
    then every hour on every instance that takes traffic."""
    out = [(s.ready + 5, s.instance) for s in timeline.startups]
    for hour in range(HOURS):
        for n, name in enumerate(dep.INSTANCES):
            ts = start + hour * 3600 + 7 * n + 1
            if timeline.routable(name, ts):
                out.append((ts, name))
    return out
