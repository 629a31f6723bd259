"""KV page allocator of each decode instance, and which earlier requests each affected response read.

The allocator mirrors SGLang's paged token pool closely enough for forensics: a FIFO free list
(allocation takes pages from the front, freeing appends to the back), pages are never zeroed,
and each page remembers the request that last wrote it. A normal request writes all its pages;
an affected request reserves pages for its full prompt but only page 0 (the 1-token stub) and its
output pages are written, so pages 1..k-1 still hold, and are read as, earlier requests' KV.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvforensics.simulate.fleet.serving import InstanceTimeline

NEVER_WRITTEN = -1
FREE = -1


class OutOfPages(RuntimeError):
    """More pages requested than are free."""


class PageAllocator:
    """Pages ``0..n_pages-1`` with a FIFO free list (a ring buffer), holders and last writers."""

    def __init__(self, n_pages: int) -> None:
        self.n_pages = n_pages
        self._ring = np.arange(n_pages, dtype=np.int64)
        self._head = 0
        self._free = n_pages
        self.holder = np.full(n_pages, FREE, dtype=np.int64)
        self.writer = np.full(n_pages, NEVER_WRITTEN, dtype=np.int64)

    @property
    def free_pages(self) -> int:
        return self._free

    @property
    def used_pages(self) -> int:
        return int((self.holder != FREE).sum())

    def alloc(self, n: int, request: int) -> np.ndarray:
        if n > self._free:
            raise OutOfPages(f"need {n} pages, {self._free} free")
        idx = (self._head + np.arange(n)) % self.n_pages
        pages = self._ring[idx].copy()
        if (self.holder[pages] != FREE).any():
            raise AssertionError("allocator handed out a page that is still held")
        self.holder[pages] = request
        self._head = (self._head + n) % self.n_pages
        self._free -= n
        return pages

    def free(self, pages: np.ndarray) -> None:
        tail = (self._head + self._free + np.arange(len(pages))) % self.n_pages
        self._ring[tail] = pages
        self.holder[pages] = FREE
        self._free += len(pages)

    def write(self, pages: np.ndarray, request: int) -> None:
        self.writer[pages] = request


@dataclass
class DecodeInstance:
    timeline: InstanceTimeline
    page_size: int
    startup: int = -1
    allocator: PageAllocator | None = None
    held: list[tuple[int, int, np.ndarray]] = field(default_factory=list)  # heap (end_ms, seq, pages)

    def sync(self, ts: int) -> None:
        """Start a fresh (unzeroed-but-unwritten) pool after a restart; free finished requests."""
        k = int(np.searchsorted(self.timeline.start_ms, ts, side="right") - 1)
        if k != self.startup:
            self.startup = k
            pool = int(self.timeline.pool[max(k, 0)])
            self.allocator = PageAllocator(pool // self.page_size)
            self.held = []
        while self.held and self.held[0][0] <= ts:
            _, _, pages = heapq.heappop(self.held)
            assert self.allocator is not None
            self.allocator.free(pages)

    def wait_for(self, need: int, ts: int) -> int:
        """Free the earliest-ending requests until ``need`` pages are free; return the new start."""
        assert self.allocator is not None
        while self.allocator.free_pages < need and self.held:
            end, _, pages = heapq.heappop(self.held)
            self.allocator.free(pages)
            ts = max(ts, end)
        return ts


@dataclass(frozen=True)
class PageReads:
    """Ground truth for one affected response: writers of the stale pages it attended over."""

    pages_read: dict[int, int]  # writer row -> pages read
    never_written_pages: int


@dataclass(frozen=True)
class PageSimulation:
    decode_instance: np.ndarray  # per input row (object: instance name)
    wait_ms: np.ndarray
    reads: dict[int, PageReads]  # affected row -> reads


def pages_for(tokens: int, page_size: int) -> int:
    return max(1, -(-tokens // page_size))


def simulate_pages(df: pd.DataFrame, decode_lines: list[InstanceTimeline], page_size: int) -> PageSimulation:
    """Replay served target-model requests through the decode instances in decode-start order.

    ``df`` rows need ``ts_ms, ttft_true_ms, latency_ms, prompt_tokens, completion_tokens, affected``.
    The router sends each request to the up decode instance with the most free pages.
    """
    instances = [DecodeInstance(line, page_size) for line in decode_lines]
    start = (df["ts_ms"].to_numpy() + df["ttft_true_ms"].to_numpy()).astype(np.int64)
    duration = (df["latency_ms"].to_numpy() - df["ttft_true_ms"].to_numpy()).astype(np.int64)
    prompt = df["prompt_tokens"].to_numpy()
    total = prompt + df["completion_tokens"].to_numpy()
    affected = df["affected"].to_numpy()
    chosen = np.full(len(df), None, dtype=object)
    wait = np.zeros(len(df))
    reads: dict[int, PageReads] = {}
    for seq, row in enumerate(np.argsort(start, kind="stable")):
        ts = int(start[row])
        for inst in instances:
            inst.sync(ts)
        up = [i for i in instances if i.timeline.up(np.array([ts]))[0]] or instances
        most = max(i.allocator.free_pages if i.allocator else -1 for i in up)
        ties = [i for i in up if i.allocator is not None and i.allocator.free_pages == most] or up
        inst = ties[seq % len(ties)]
        need = pages_for(int(total[row]), page_size)
        begin = inst.wait_for(need, ts)
        assert inst.allocator is not None
        pages = inst.allocator.alloc(need, int(row))
        if affected[row]:
            k = pages_for(int(prompt[row]), page_size)
            stale = inst.allocator.writer[pages[1:k]]
            written = stale[stale != NEVER_WRITTEN]
            ids, counts = np.unique(written, return_counts=True)
            reads[int(row)] = PageReads(
                dict(zip(ids.tolist(), counts.tolist(), strict=True)), int((stale == NEVER_WRITTEN).sum())
            )
            inst.allocator.write(pages[:1], int(row))
            inst.allocator.write(pages[k:], int(row))
        else:
            inst.allocator.write(pages, int(row))
        heapq.heappush(inst.held, (begin + int(duration[row]), seq, pages))
        chosen[row] = inst.timeline.name
        wait[row] = begin - ts
    return PageSimulation(chosen, wait, reads)
