"""Serving the ``prefix-hicache-l3`` traffic: the gateway's routing, each request's path through an
instance's caches and the shared store, in time order, and the ground truth of the store's loads.

One heap orders the engines' actions; requests arrive from :class:`~.traffic.Traffic` in between. A
request's actions, each at its own time (so that every instance's events are published in time order):

1. arrival: the gateway routes it (the account's home instance seven times in ten, else any; never an
   instance that is starting, draining or being flushed) and sets its salt; the instance matches its
   pages on the device, then in host memory; with the store and >= 256 tokens left, the store's pages
   that continue the match are fetched (``best_effort``: sometimes cut short). The matched pages are
   locked until the request finishes. ``cached_tokens`` = device + host + store pages;
2. prefetch done: the store's pages land in host memory (``CPU_PINNED``, requester's namespace);
3. scheduled: host and store pages are loaded to the device (``GPU``);
4. prefill done: the computed prompt pages are inserted (``GPU``), 5. their backup completes
   (``CPU_PINNED``) and, with the store, they are written to it (no event);
6. finished: the pages the answer filled are inserted and backed up the same way; the locks go.

The ground truth: a **recipient** is a request that loaded from the store pages whose object another
namespace wrote there first (not its own, not the shared playground's, not an internal account's).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

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
from kvforensics.simulate.prefix.hicache.deployment import Startup, Timeline
from kvforensics.simulate.prefix.hicache.engine import (
    PAGE_SIZE,
    PREFETCH_THRESHOLD,
    Instance,
    SharedStore,
    StoredPage,
)
from kvforensics.simulate.prefix.hicache.traffic import Request, Traffic

HOME_SHARE = 0.7
PREFETCH_CUT_SHARE = 0.08  # best_effort: the request was scheduled before its prefetch completed
TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Served:
    """What the gateway logs of one request."""

    request: Request
    request_id: str
    instance: str
    status: int
    cached_tokens: int
    ttft_ms: int
    latency_ms: int


@dataclass
class Truth:
    """The store's loads as they happened."""

    internal: frozenset[str]
    shared: frozenset[str]
    # request id -> (account, instance, ts, pages loaded, [(source request, source account, source salt,
    # source instance, first position, last position)])
    recipients: dict[str, tuple[str, str, float, int, list[tuple[str, str, str, str, int, int]]]] = field(
        default_factory=dict
    )
    loaded_pages: dict[str, int] = field(
        default_factory=lambda: {"foreign": 0, "own": 0, "shared_namespace": 0, "internal": 0}
    )
    requests_loading: int = 0
    prefetches_cut: int = 0

    def record(
        self, request_id: str, r: Request, instance: str, ts: float, first: int, pages: list[StoredPage]
    ) -> None:
        sources: list[tuple[str, str, str, str, int, int]] = []
        self.requests_loading += 1
        for i, p in enumerate(pages, start=first):
            kind = (
                "own"
                if p.salt == r.salt
                else "shared_namespace"
                if p.salt in self.shared
                else "internal"
                if p.account in self.internal
                else "foreign"
            )
            self.loaded_pages[kind] += 1
            if kind != "foreign":
                continue
            last = sources[-1] if sources else None
            if last and last[0] == p.request_id and last[5] == i - 1:
                sources[-1] = (*last[:5], i)
            else:
                sources.append((p.request_id, p.account, p.salt, p.instance, i, i))
        if sources:
            self.recipients[request_id] = (r.account, instance, ts, len(pages), sources)


class Server:
    """The deployment at work: instances, the shared store, the gateway's router and the action heap."""

    def __init__(
        self,
        seed: int,
        timeline: Timeline,
        instances: dict[str, Instance],
        store: SharedStore,
        traffic: Traffic,
        log: Callable[[Served], None],
        truth: Truth,
    ) -> None:
        self.rng = random.Random(f"hicache-l3:{seed}:serve")
        self.timeline, self.instances, self.store = timeline, instances, store
        self.names = list(instances)
        self.traffic, self.log, self.truth = traffic, log, truth
        self._actions: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = 0
        self._served = 0
        self._homes: dict[str, int] = {}
        for s in timeline.startups:
            self._at(s.launched, self._start, s)
        for f in timeline.flushes:
            self._at(f.ts, self._flush, f.instance)

    def _at(self, ts: float, action: Callable[..., None], *args: Any) -> None:
        self._order += 1
        heapq.heappush(self._actions, (ts, self._order, action, args))

    def run(self) -> int:
        actions, traffic = self._actions, self.traffic
        while True:
            next_request = traffic.peek()
            if actions and (next_request is None or actions[0][0] <= next_request):
                ts, _, action, args = heapq.heappop(actions)
                action(ts, *args)
                continue
            if next_request is None:
                return self._served
            self._arrive(traffic.pop())
            traffic.served()

    # --- the deployment's own events ---------------------------------------------------------------

    def _start(self, ts: float, s: Startup) -> None:
        self.instances[s.instance].start(s.storage)

    def _flush(self, ts: float, name: str) -> None:
        self.instances[name].flush(ts)

    # --- routing -----------------------------------------------------------------------------------

    def _route(self, r: Request) -> str:
        if r.instance is not None:
            return r.instance
        names, routable, ts = self.names, self.timeline.routable, r.ts
        home = self._homes.get(r.account)
        if home is None:
            home = int.from_bytes(blake2b(r.account.encode(), digest_size=4).digest(), "big") % len(names)
            self._homes[r.account] = home
        if self.rng.random() >= HOME_SHARE:
            home = self.rng.randrange(len(names))
        for k in range(len(names)):
            name = names[(home + k) % len(names)]
            if routable(name, ts):
                return name
        return names[home]

    # --- a request ---------------------------------------------------------------------------------

    def _arrive(self, r: Request) -> None:
        rng, t0 = self.rng, r.ts
        name = self._route(r)
        inst = self.instances[name]
        request_id = f"req-{self._served:08d}"
        self._served += 1
        r.request_id = request_id
        full = r.prompt // PAGE_SIZE  # inserted after prefill
        matchable = (r.prompt - 1) // PAGE_SIZE  # one token is always computed
        answered = 0 if r.timed_out else r.output
        total = max(full, (r.prompt + answered - 1) // PAGE_SIZE) if answered else full
        salted = r.chains.salted_upto(total)
        matched, on_device = inst.match(salted, matchable)
        fetched: list[StoredPage] = []
        if inst.storage and matched < matchable and r.prompt - matched * PAGE_SIZE >= PREFETCH_THRESHOLD:
            content = r.chains.content_upto(matchable)
            read = self.store.read
            for i in range(matched, matchable):
                page = read(content[i])
                if page is None:
                    break
                fetched.append(page)
            if len(fetched) > 1 and rng.random() < PREFETCH_CUT_SHARE:
                fetched = fetched[: rng.randrange(1, len(fetched))]
                self.truth.prefetches_cut += 1
        loaded = len(fetched)
        if loaded:
            self.truth.record(request_id, r, name, t0, matched, fetched)
        cached = (matched + loaded) * PAGE_SIZE
        inst.lock(salted[:matched])
        inst.touch(salted[:matched])
        # time to first token: queueing, the store's prefetch, loading to the device, the prefill
        queue = rng.expovariate(1 / QUEUE_MEAN_MS)
        prefetch = (2.0 + 0.5 * loaded) if loaded else 0.0
        load = 0.3 * (matched - on_device + loaded)
        n = max(1, r.prompt - cached)
        curve = SPLITWISE_H100_TP8_A_MS + SPLITWISE_H100_TP8_B_MS_PER_TOKEN * n + MINFERENCE_C_MS_PER_TOKEN2 * n * n
        noise = TTFT_NOISE_FLOOR + rng.lognormvariate(0.0, TTFT_NOISE_LOG_SD) * TTFT_NOISE_SCALE
        ttft = queue + prefetch + load + curve * noise
        decode = max(0, r.output - 1) * SPLITWISE_H100_TP8_TOKEN_TIME_MS * (0.9 + 0.2 * rng.random())
        latency = TIMEOUT_S * 1000 if r.timed_out else ttft + decode
        epoch = inst.epoch
        if loaded:
            self._at(t0 + prefetch / 1000, self._prefetched, inst, epoch, r, salted, matched, loaded)
        if matched > on_device or loaded:
            self._at(
                t0 + (queue + prefetch + load) / 1000, self._loaded, inst, epoch, r, salted, on_device, matched + loaded
            )
        self._at(t0 + ttft / 1000, self._prefilled, inst, epoch, r, salted, matched + loaded, full)
        self._at(t0 + latency / 1000, self._finished, inst, epoch, r, salted, full, total)
        self.log(Served(r, request_id, name, 504 if r.timed_out else 200, cached, round(ttft), round(latency)))
        if r.observe is not None:
            r.observe(r, cached, t0 + ttft / 1000)

    def _prefetched(
        self, ts: float, inst: Instance, epoch: int, r: Request, salted: list[int], first: int, count: int
    ) -> None:
        if inst.epoch != epoch:
            return
        positions = list(range(first, first + count))
        inst.store_host(ts, r.salt, salted, r.tokens, positions)
        inst.lock(salted[first : first + count])

    def _loaded(
        self, ts: float, inst: Instance, epoch: int, r: Request, salted: list[int], first: int, last: int
    ) -> None:
        if inst.epoch == epoch:
            inst.store_device(ts, r.salt, salted, r.tokens, first, last)

    def _prefilled(
        self, ts: float, inst: Instance, epoch: int, r: Request, salted: list[int], first: int, last: int
    ) -> None:
        if inst.epoch != epoch:
            return
        inst.lock(salted[first:last])
        fresh = inst.store_device(ts, r.salt, salted, r.tokens, first, last)
        if fresh:
            self._at(ts + 0.005 + 0.03 * self.rng.random(), self._backed_up, inst, epoch, r, salted, fresh)

    def _finished(
        self, ts: float, inst: Instance, epoch: int, r: Request, salted: list[int], full: int, total: int
    ) -> None:
        if inst.epoch != epoch:
            return
        if total > full:
            fresh = inst.store_device(ts, r.salt, salted, r.tokens, full, total)
            if fresh:
                self._at(ts + 0.005 + 0.03 * self.rng.random(), self._backed_up, inst, epoch, r, salted, fresh)
        inst.unlock(salted[:full])

    def _backed_up(
        self, ts: float, inst: Instance, epoch: int, r: Request, salted: list[int], positions: list[int]
    ) -> None:
        """Write-through: the host copies are done; with the store, the pages are written to it too."""
        if inst.epoch != epoch:
            return
        inst.store_host(ts, r.salt, salted, r.tokens, positions)
        if inst.storage:
            content = r.chains.content_upto(positions[-1] + 1)
            write, held = self.store.write, self.store.pages
            for i in positions:
                if content[i] not in held:  # the backend checks that a key exists before it sets it
                    write(content[i], StoredPage(r.salt, r.account, r.request_id, inst.name, i, ts))
