"""Serving a prefix-cache workload: per-instance block caches, an optional L3 store, a KV-aware router.

Each instance keeps a vLLM-like prefix cache of full blocks (``block_size`` tokens), keyed by a chain
hash of (parent hash, the block's token ids, and on the first block the request's cache salt), with
LRU eviction; every store and eviction is a ``BlockStored`` / ``BlockRemoved`` event. A request looks
its full blocks up in order (never its last token: one token is always computed), first in its
instance's cache, then, with an L3 store, in the store shared by every instance, which is keyed by the
tokens alone (it drops the salt: the ``prefix-l3-unsalted`` failure). A weak hash (``weak_bits``) on one
instance keys blocks by a few bits, so different blocks collide (``prefix-collision``).

Ground truth per request: the reused blocks whose cache entry another account stored, where neither
the requesting account nor an internal account had sent that prefix before (a prefix the tenant sent
itself, or the provider's own system prompt, tells it nothing new), every reuse of a colliding
entry (other tokens under an equal hash) stored by another account, and every block loaded from the L3
store whose entry another account, not an internal one, wrote there: the store keeps a key's first write,
so the response was computed on that account's KV whatever the requester had sent before (as a load from a
salt-blind store is judged in the reference incidents, tests/hicache_reference and tests/vllm_reference).
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from hashlib import blake2b

from kvforensics.simulate.calibration import (
    MINFERENCE_C_MS_PER_TOKEN2,
    QUEUE_MEAN_MS,
    SPLITWISE_H100_TP8_A_MS,
    SPLITWISE_H100_TP8_B_MS_PER_TOKEN,
    SPLITWISE_H100_TP8_TOKEN_TIME_MS,
    TTFT_NOISE_FLOOR,
    TTFT_NOISE_LOG_SD,
    TTFT_NOISE_SCALE,
)
from kvforensics.simulate.prefix.workload import Request

L3_LOAD_MS_PER_TOKEN = 0.004  # reading a block back from the external store
_MASK64 = (1 << 64) - 1


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """A 64-bit block hash of the parent's hash, the block's ids and (first block only) the salt."""
    h = blake2b(digest_size=8)
    h.update(b"-" if parent is None else parent.to_bytes(8, "big"))
    h.update(array("I", tokens).tobytes())
    if salt is not None:
        h.update(b"|salt:" + salt.encode("utf-8"))
    return int.from_bytes(h.digest(), "big") & _MASK64


@dataclass
class Entry:
    """A cached block: who stored it (request and account) and what it holds (its token prefix key)."""

    request_id: str
    account: str
    content: int  # chain hash of the tokens alone: equal content = equal prefix up to this block
    position: int


@dataclass
class Event:
    ts: datetime
    kind: str  # "stored" or "removed"
    hashes: list[int]
    parent: int | None = None
    tokens: list[int] = field(default_factory=list)
    salt: str | None = None  # the first block's salt (vLLM extra_keys), when the chain starts here


@dataclass
class Cache:
    """One instance's prefix cache (LRU over full blocks)."""

    name: str
    capacity: int
    weak_bits: int | None = None
    blocks: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    events: list[Event] = field(default_factory=list)

    def keys(self, strong: list[int]) -> list[int]:
        """The request's block keys on this instance: the chain hashes, or a weak hash's few bits of them."""
        if self.weak_bits is None:
            return strong
        mask = (1 << self.weak_bits) - 1
        return [k & mask for k in strong]

    def store(
        self, ts: datetime, entries: list[tuple[int, Entry]], parent: int | None, tokens: list[int], salt: str | None
    ) -> None:
        removed = []
        for _ in range(max(0, len(self.blocks) + len(entries) - self.capacity)):
            removed.append(self.blocks.popitem(last=False)[0])
        if removed:
            self.events.append(Event(ts, "removed", removed))
        for h, entry in entries:
            self.blocks[h] = entry
        self.events.append(
            Event(ts, "stored", [h for h, _ in entries], parent, tokens, salt if parent is None else None)
        )


@dataclass
class Served:
    request_id: str
    request: Request
    instance: str
    salt: str | None
    status: int
    cached_tokens: int
    ttft_ms: int
    latency_ms: int
    # (source request, source account, first and last block position here, first block position in the
    # source request: another one after a collision) of each foreign reuse
    sources: list[tuple[str, str, int, int, int]] = field(default_factory=list)
    collision: bool = False


@dataclass
class Deployment:
    instances: list[str]
    capacity_blocks: int
    block_size: int
    l3: bool = False
    weak_instance: str | None = None
    weak_bits: int | None = None


def serve(
    requests: list[Request], dep: Deployment, salts: dict[str, str], internal: set[str], seed: int
) -> tuple[list[Served], dict[str, Cache]]:
    rng = random.Random(seed)
    caches = {
        i: Cache(i, dep.capacity_blocks, dep.weak_bits if i == dep.weak_instance else None) for i in dep.instances
    }
    l3: OrderedDict[int, Entry] = OrderedDict()
    sent_by: dict[int, set[str]] = {}  # content key -> accounts that sent that prefix
    out = []
    for n, r in enumerate(requests):
        rid = f"req-{n:07d}"
        salt = salts.get(r.account)
        size = dep.block_size
        blocks = [tuple(r.tokens[i : i + size]) for i in range(0, (len(r.tokens) - 1) // size * size, size)]
        contents, c = [], None
        for b in blocks:
            c = chain_hash(c, b, None)
            contents.append(c)
        strong, parent = [], None
        for i, b in enumerate(blocks):
            parent = chain_hash(parent, b, salt if i == 0 else None)
            strong.append(parent)
        instance = r.instance or _route(rng, caches, dep.instances, r.account, strong)
        cache = caches[instance]
        keys = cache.keys(strong)
        served = Served(rid, r, instance, salt, 504 if r.timed_out else 200, 0, 0, 0)
        hits: list[Entry] = []
        for k in keys:
            entry = cache.blocks.get(k)
            if entry is None:
                break
            cache.blocks.move_to_end(k)
            hits.append(entry)
        gpu_hits, loaded = len(hits), 0
        if dep.l3:
            for j in range(gpu_hits, len(blocks)):
                entry = l3.get(contents[j])
                if entry is None:
                    break
                l3.move_to_end(contents[j])
                hits.append(entry)
                loaded += 1
        _attribute(served, hits, contents, sent_by, internal, gpu_hits)
        new = [(keys[j], Entry(rid, r.account, contents[j], j)) for j in range(gpu_hits, len(blocks))]
        if new:
            cache.store(
                r.ts, new, keys[gpu_hits - 1] if gpu_hits else None, [t for b in blocks[gpu_hits:] for t in b], salt
            )
        for c in contents:
            sent_by.setdefault(c, set()).add(r.account)
        for j in range(len(hits), len(blocks)):  # computed here: the store keeps them
            if dep.l3 and contents[j] not in l3:
                l3[contents[j]] = Entry(rid, r.account, contents[j], j)
        served.cached_tokens = len(hits) * size
        served.ttft_ms, served.latency_ms = _latency(
            rng, len(r.tokens), served.cached_tokens, loaded * size, len(r.output)
        )
        if r.timed_out:
            served.latency_ms = 30_000
        out.append(served)
    return out, caches


def _route(rng: random.Random, caches: dict[str, Cache], instances: list[str], account: str, strong: list[int]) -> str:
    """A KV-aware router: the instance holding the longest prefix of the request (hashes as each
    instance keys them), else the account's home instance; one request in ten goes anywhere (load)."""
    if rng.random() < 0.1:
        return rng.choice(instances)
    home = instances[int.from_bytes(blake2b(account.encode(), digest_size=4).digest(), "big") % len(instances)]
    best, best_len = home, 0
    for name in instances:
        cached, length = caches[name].blocks, 0
        for k in caches[name].keys(strong):
            if k not in cached:
                break
            length += 1
        if length > best_len or (length == best_len and name == home):
            best, best_len = name, length
    return best


def _attribute(
    served: Served,
    hits: list[Entry],
    contents: list[int],
    sent_by: dict[int, set[str]],
    internal: set[str],
    local_hits: int,
) -> None:
    """The sources of *served*'s reused blocks: *hits*, its instance's own cache's first (*local_hits* of them),
    then those loaded from the L3 store."""
    account = served.request.account
    for j, entry in enumerate(hits):
        if entry.account == account or entry.account in internal:
            continue
        collided = entry.content != contents[j]
        if j < local_hits and not collided and sent_by.get(contents[j], set()) & ({account} | internal):
            continue  # a prefix this tenant, or the provider, had sent itself
        served.collision = served.collision or collided
        last = served.sources[-1] if served.sources else None
        if last and last[0] == entry.request_id and last[3] == j - 1 and entry.position - last[4] == j - last[2]:
            served.sources[-1] = (*last[:3], j, last[4])
        else:
            served.sources.append((entry.request_id, entry.account, j, j, entry.position))


def _latency(rng: random.Random, prompt: int, cached: int, loaded: int, output: int) -> tuple[int, int]:
    """TTFT from the calibrated prefill curve over the uncached tokens (plus reading L3 blocks back),
    with the calibration's noise and queueing; latency adds one decode step per output token."""
    n = max(1, prompt - cached)
    curve = SPLITWISE_H100_TP8_A_MS + SPLITWISE_H100_TP8_B_MS_PER_TOKEN * n + MINFERENCE_C_MS_PER_TOKEN2 * n * n
    noise = TTFT_NOISE_FLOOR + rng.lognormvariate(0.0, TTFT_NOISE_LOG_SD) * TTFT_NOISE_SCALE
    ttft = curve * noise + loaded * L3_LOAD_MS_PER_TOKEN + rng.expovariate(1 / QUEUE_MEAN_MS)
    decode = max(0, output - 1) * SPLITWISE_H100_TP8_TOKEN_TIME_MS * (0.9 + 0.2 * rng.random())
    return round(ttft), round(ttft + decode)


def window(served: list[Served]) -> tuple[datetime, datetime]:
    return served[0].request.ts, served[-1].request.ts + timedelta(minutes=5)
