"""SGLang HiCache as the ``prefix-hicache-l3`` incident runs it: per-instance device and host page
caches keyed by namespace, a shared L3 store keyed by tokens alone, and the KV events they publish.

Modelled from the engines' documented behaviour (``/work/shared/reference/kv-cache-isolation.md``
sections 1-4), each behaviour cited to its upstream source:

* **Pages and hashes.** ``--page-size 64``: the radix cache keeps whole pages only. A page's event
  hash chains the previous page's SHA-256 digest and the page's token ids as uint32 little-endian
  (``python/sglang/srt/mem_cache/utils.py`` ``get_hash_str``), published as the digest's first 64 bits
  as a signed integer (``hash_str_to_int64``). A salted chain starts from
  ``SHA256(b"sglang-cache-salt-v1\\0" + cache_salt)`` (sgl-project/sglang#30827,
  ``compute_node_event_hash_values``), so equal tokens under two salts carry different hashes.
* **Namespaces.** The radix key is ``(extra_key, cache_salt)`` plus the tokens (#30827; the salt reaches
  the scheduler from #23300): device (GPU) and host (L2, ``CPU_PINNED``) pages never cross salts, and
  host memory is private to its instance (#37050). Here a page is keyed by its salted hash.
* **HiCache, write_through** (``--enable-hierarchical-cache --hicache-write-policy write_through``,
  #22894 for the media, #18205 for the ``medium`` field): a computed page is ``BlockStored(GPU)`` at the
  radix insert and ``BlockStored(CPU_PINNED)`` when its host backup completes; a host hit is
  ``BlockStored(GPU)`` when loaded back; an eviction is ``BlockRemoved`` with the medium it left.
  Device eviction takes least recently used leaves (a page's parent is touched after it); a page that
  leaves the device keeps its host copy, and the host evicts only pages no longer on the device.
* **The L3 store** (``--hicache-storage-backend mooncake``): backed-up pages are written to the store
  under token-only keys (sgl-project/sglang#26747; fixed for salted requests by #38577, after 0.5.18),
  the store keeping a key's first write; **no event** for a write to L3 (#29709, #29948 unmerged). A
  request missing in its device and host caches with at least 256 tokens left
  (``hicache_storage_prefetch_threshold``, #12092) prefetches the store's pages that continue its
  match: ``BlockStored(CPU_PINNED)`` when they land in host memory, then ``BlockStored(GPU)`` when
  loaded to the device, both in the **requester's** namespace (``HiRadixCache._insert_helper_host``).
  The ``best_effort`` prefetch policy can cut a prefetch short: the pages not yet fetched are computed.
  Only start-ups with the backend read or write the store; it outlives restarts.
* **Stores are merged** (#31479): consecutive chained stores of one medium and salt are one
  ``BlockStored`` with several hashes and all their token ids; removals of one step are one
  ``BlockRemoved`` per medium. No event for a cache hit.
* **Restarts and flushes.** A start-up begins with empty device and host caches and a new sequence
  number from 0 (the publisher's ``_seq_gen = count()``); ``POST /flush_cache`` is one
  ``AllBlocksCleared`` and empties the host pool too.
* **Cache report** (``--enable-cache-report``): ``cached_tokens`` counts device + host + storage hits.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

PAGE_SIZE = 64
PREFETCH_THRESHOLD = 256  # tokens left after the device and host match before the store is asked (#12092)
SALT_SEED = b"sglang-cache-salt-v1\0"
_PAGE_BYTES = PAGE_SIZE * 4  # uint32 token ids
assert array("I").itemsize == 4


class Publisher(Protocol):
    """Where an instance's KV events go: a ZMQ publisher, numbering its messages from 0 per process."""

    def emit(self, ts: float, events: list[Any]) -> None: ...

    def restart(self) -> None: ...


def salt_seed(salt: str) -> bytes:
    """The digest a salted chain starts from (sgl-project/sglang#30827)."""
    return hashlib.sha256(SALT_SEED + salt.encode("utf-8")).digest()


def event_hash(digest: bytes) -> int:
    """``hash_str_to_int64``: the digest's first 16 hex digits as a signed 64-bit integer."""
    return int.from_bytes(digest[:8], "big", signed=True)


class Chains:
    """The page hashes of one growing token sequence (a chat's context, an autocomplete buffer): the
    salted chain the events carry and the token-only chain the L3 store keys pages by. Sequences only
    grow at their end, so each page is hashed once however many requests send it."""

    __slots__ = ("tokens", "seed", "salted", "content", "_salted_digest", "_content_digest")

    def __init__(self, tokens: array, salt: str, seed: bytes | None = None) -> None:
        self.tokens = tokens
        self.seed = seed if seed is not None else salt_seed(salt)
        self.salted: list[int] = []
        self.content: list[int] = []
        self._salted_digest = self.seed
        self._content_digest = b""

    def salted_upto(self, pages: int) -> list[int]:
        """The event hashes of the first *pages* pages (signed 64-bit, as published)."""
        if pages > len(self.salted):
            self._salted_digest = _extend(self.tokens, self._salted_digest, self.salted, pages, True)
        return self.salted

    def content_upto(self, pages: int) -> list[int]:
        """The store's keys of the first *pages* pages: the chain without the salt."""
        if pages > len(self.content):
            self._content_digest = _extend(self.tokens, self._content_digest, self.content, pages, False)
        return self.content


def _extend(tokens: array, digest: bytes, out: list[int], pages: int, signed: bool) -> bytes:
    """Hash pages ``len(out)``..*pages*-1 of *tokens* on from *digest*, appending each page's first 64
    bits to *out*; returns the last digest."""
    sha = hashlib.sha256
    with memoryview(tokens) as view:
        data = view.cast("B")
        for i in range(len(out), pages):
            h = sha(digest)
            h.update(data[i * _PAGE_BYTES : (i + 1) * _PAGE_BYTES])
            digest = h.digest()
            out.append(int.from_bytes(digest[:8], "big", signed=signed))
    return digest


@dataclass(frozen=True, slots=True)
class StoredPage:
    """An object of the L3 store: the first write of its key, and who wrote it."""

    salt: str
    account: str
    request_id: str
    instance: str
    position: int
    written: float


class SharedStore:
    """The Mooncake store every instance with the backend shares: token-only keys, the first write of a
    key kept (an existing key is not written again), least recently read objects evicted when full."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self.pages: OrderedDict[int, StoredPage] = OrderedDict()
        self.writes = 0
        self.evictions = 0

    def read(self, key: int) -> StoredPage | None:
        page = self.pages.get(key)
        if page is not None:
            self.pages.move_to_end(key)
        return page

    def write(self, key: int, page: StoredPage) -> None:
        if key in self.pages:
            return
        self.pages[key] = page
        self.writes += 1
        if len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
            self.evictions += 1


@dataclass
class Instance:
    """One SGLang server: its device and host page caches (salted page hash -> LRU order), the pages
    in-flight requests hold, and its event publisher's sequence."""

    name: str
    device_pages: int
    host_pages: int
    publisher: Publisher
    device: OrderedDict[int, None] = field(default_factory=OrderedDict)
    host_only: OrderedDict[int, None] = field(default_factory=OrderedDict)  # on host, no longer on device
    locks: dict[int, int] = field(default_factory=dict)
    storage: bool = False  # this start-up has the L3 backend
    epoch: int = 0  # start-ups so far: actions of an earlier one are dropped

    def start(self, storage: bool) -> None:
        """A new process: empty caches, the publisher's sequence from 0 (the caller's archive)."""
        self.device.clear()
        self.host_only.clear()
        self.locks.clear()
        self.storage = storage
        self.epoch += 1
        self.publisher.restart()

    def emit(self, ts: float, events: list[Any]) -> None:
        self.publisher.emit(ts, events)

    def flush(self, ts: float) -> None:
        """``POST /flush_cache``: device and host pools cleared, one ``AllBlocksCleared``."""
        self.device.clear()
        self.host_only.clear()
        self.emit(ts, [["AllBlocksCleared"]])

    def match(self, salted: list[int], pages: int) -> tuple[int, int]:
        """The longest prefix of *pages* pages held here: (pages matched, first of them only on host)."""
        device, host = self.device, self.host_only
        i = 0
        while i < pages and salted[i] in device:
            i += 1
        on_device = i
        while i < pages and salted[i] in host:
            i += 1
        return i, on_device

    def lock(self, keys: list[int]) -> None:
        locks = self.locks
        for k in keys:
            locks[k] = locks.get(k, 0) + 1

    def unlock(self, keys: list[int]) -> None:
        locks = self.locks
        for k in keys:
            n = locks.get(k, 0) - 1
            if n > 0:
                locks[k] = n
            else:
                locks.pop(k, None)

    def touch(self, keys: list[int]) -> None:
        """A matched path is used: deepest page first, so a parent is always more recent than its children."""
        device, host = self.device, self.host_only
        for k in reversed(keys):
            if k in device:
                device.move_to_end(k)
            elif k in host:
                host.move_to_end(k)

    def _make_room(self, pages: int, host_incoming: int, events: list[Any]) -> None:
        """Evict least recently used unlocked device pages (to host) and host-only pages, as *pages* new
        device pages (*host_incoming* of them new to host memory too) need; the removals become events
        (one per medium)."""
        device, host, locks = self.device, self.host_only, self.locks
        gone_gpu: list[int] = []
        skips = 0
        while len(device) + pages > self.device_pages and device and skips <= len(device):
            k, _ = device.popitem(last=False)
            if k in locks:
                device[k] = None
                skips += 1
                continue
            gone_gpu.append(k)
            host[k] = None
        gone_cpu = self._trim_host(host_incoming)
        if gone_gpu:
            events.append(["BlockRemoved", gone_gpu, "GPU"])
        if gone_cpu:
            events.append(["BlockRemoved", gone_cpu, "CPU_PINNED"])

    def _trim_host(self, incoming: int) -> list[int]:
        host, locks = self.host_only, self.locks
        gone: list[int] = []
        skips = 0
        while len(self.device) + len(host) + incoming > self.host_pages and host and skips <= len(host):
            k, _ = host.popitem(last=False)
            if k in locks:
                host[k] = None
                skips += 1
                continue
            gone.append(k)
        return gone

    def store_device(
        self,
        ts: float,
        salt: str,
        salted: list[int],
        tokens: array,
        first: int,
        last: int,
    ) -> list[int]:
        """Pages *first*..*last*-1 of a request placed on the device (computed, or loaded from host): the
        ones not there yet are stored, as runs of chained pages (``BlockStored(GPU)``), after the evictions
        they need. Returns the pages that had no host copy (to back up)."""
        device, host = self.device, self.host_only
        new = [i for i in range(first, last) if salted[i] not in device]
        if not new:
            return []
        fresh = [i for i in new if salted[i] not in host]  # no host copy yet: to back up
        events: list[Any] = []
        self._make_room(len(new), len(fresh), events)
        for i in new:
            k = salted[i]
            if k in host:
                del host[k]
            device[k] = None
        events.extend(_stored(new, salted, tokens, salt, "GPU"))
        self.emit(ts, events)
        return fresh

    def store_host(
        self,
        ts: float,
        salt: str,
        salted: list[int],
        tokens: array,
        positions: list[int],
    ) -> None:
        """Pages that reached host memory (a write-through backup, or a prefetch from the store):
        ``BlockStored(CPU_PINNED)``. A backed-up page stays on the device; a prefetched one waits on host."""
        device, host = self.device, self.host_only
        events: list[Any] = []
        landing = [i for i in positions if salted[i] not in device and salted[i] not in host]
        if landing:
            gone = self._trim_host(len(landing))
            if gone:
                events.append(["BlockRemoved", gone, "CPU_PINNED"])
            for i in landing:
                host[salted[i]] = None
        events.extend(_stored(positions, salted, tokens, salt, "CPU_PINNED"))
        self.emit(ts, events)


def _stored(positions: list[int], salted: list[int], tokens: array, salt: str, medium: str) -> list[Any]:
    """``BlockStored`` events of *positions*, one per run of consecutive pages (#31479 merges a run)."""
    events: list[Any] = []
    run_start = prev = -2
    for i in [*positions, -1]:
        if i == prev + 1:
            prev = i
            continue
        if run_start >= 0:
            events.append(
                [
                    "BlockStored",
                    salted[run_start : prev + 1],
                    salted[run_start - 1] if run_start else None,
                    tokens[run_start * PAGE_SIZE : (prev + 1) * PAGE_SIZE].tolist(),
                    PAGE_SIZE,
                    None,
                    medium,
                    {"cache_salt": salt},
                ]
            )
        run_start = prev = i
    return events
