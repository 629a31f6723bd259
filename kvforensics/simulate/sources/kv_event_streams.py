"""Seeded KV-cache event archives in the shapes engines publish, for the KV-event readers' agreement tests and
throughput benchmark (``benchmarks/kv_events.py``).

A stream is one engine instance's prefix cache: requests arrive with a tenant's shared prefix (one of a few
system prompts) and a prompt of their own, their uncached blocks are stored (the first one's parent the last
cached block of the prefix), each block decoding fills is stored as it fills, and the least recently used
blocks are removed when the cache is full; the events of a scheduler step form one batch. The shapes:

* ``vllm-array``: vLLM's ``KVEventBatch`` in msgspec's array form, ``[ts, [event, ...], dp_rank]``, a
  ``BlockStored`` with its fields up to ``extra_keys`` (the tenant's cache salt in the first block's) and one
  hash per ``BlockRemoved`` (``vllm/v1/core/block_pool.py`` evicts block by block), blocks of 16 tokens
  (https://github.com/vllm-project/vllm/blob/main/vllm/distributed/kv_events.py);
* ``sglang-archive``: a subscriber's archive of SGLang's publisher, ``{"recv_ts", "instance", "seq", "batch":
  [ts, [event, ...], attn_dp_rank]}``, pages of 64 tokens, a page stored on the device and then backed up to
  host memory (``CPU_PINNED``, HiCache's write-through), consecutive pages merged into one event
  (sgl-project/sglang#31479), salted stores with their ``{"cache_salt": ...}`` map (#30827), removals per
  medium (https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/disaggregation/kv_events.py);
* ``vllm-map``: vLLM's maps (vllm-project/vllm#42892), ``{"ts", "events": [{"type": ...}], "data_parallel_rank"}``.

With ``damage`` > 0 that share of the lines is damaged the ways archives are: cut short, not JSON, an unknown
event, a timestamp or rank that cannot be read, a wrong arity or block size, a sequence number sent twice or
skipped, hashes written as hex, base64 or ``0x`` text, escapes, a trailing comma, keys written twice.
"""

from __future__ import annotations

import base64
import json
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

SHAPES = ("vllm-array", "sglang-archive", "vllm-map")
# the source columns each shape is read with (incident.toml `columns`)
COLUMNS = {
    "vllm-array": {},
    "vllm-map": {},
    "sglang-archive": {
        "ts": "batch.0",
        "events": "batch.1",
        "dp_rank": "batch.2",
        "instance": "instance",
        "seq": "seq",
    },
}


@dataclass(frozen=True)
class Stream:
    """One instance's archive: *shape*, *messages* batches, the cache's *capacity* in blocks."""

    shape: str
    messages: int
    seed: int = 0
    instance: str = "engine-0"
    capacity: int = 4_000
    tenants: int = 4
    damage: float = 0.0


def lines(stream: Stream) -> Iterator[str]:
    """The archive's lines, one message each."""
    rng = random.Random(stream.seed)
    block = 64 if stream.shape == "sglang-archive" else 16
    signed = stream.shape == "sglang-archive"  # SGLang's hashes are int64, vLLM's the low 64 bits unsigned

    def new_hash() -> int:
        return rng.getrandbits(64) - (1 << 63 if signed else 0)

    cache: OrderedDict[int, None] = OrderedDict()
    prefixes = [
        [[rng.randrange(1000, 150_000) for _ in range(block)] for _ in range(rng.randint(2, 12))]
        for _ in range(stream.tenants)
    ]
    prefix_hashes: list[list[int]] = [[] for _ in prefixes]
    ts = 1_790_000_000.0 + stream.seed * 86_400
    seq = 0
    pending: list[tuple[int, int | None, list[int], int, str | None]] = []  # (hash, parent, tokens, tenant, salt)
    decoding: list[tuple[int, int, str | None]] = []  # (last hash, tokens until the next block, salt)
    sent = 0
    while sent < stream.messages:
        events: list[object] = []
        if not decoding or rng.random() < 0.25:  # a request arrives: its prefix, then its own blocks
            tenant = rng.randrange(stream.tenants)
            salt = f"tenant-{tenant}" if tenant % 2 == 0 else None
            prefix = prefixes[tenant]
            hashes = prefix_hashes[tenant]
            if len(hashes) < len(prefix) or any(h not in cache for h in hashes):
                hashes[:] = [new_hash() for _ in prefix]
                pending = [(h, hashes[i - 1] if i else None, prefix[i], tenant, salt) for i, h in enumerate(hashes)]
            parent = hashes[-1]
            for _ in range(rng.randint(1, 6)):
                h = new_hash()
                pending.append((h, parent, [rng.randrange(1000, 150_000) for _ in range(block)], tenant, salt))
                parent = h
            events.extend(_stores(stream.shape, pending, block))
            for h, *_ in pending:
                cache[h] = None
            decoding.append((parent, rng.randint(1, block), salt))
            pending = []
        else:  # a decode step fills a block of a running request
            i = rng.randrange(len(decoding))
            parent, _, salt = decoding[i]
            h = new_hash()
            events.extend(
                _stores(
                    stream.shape, [(h, parent, [rng.randrange(1000, 150_000) for _ in range(block)], 0, salt)], block
                )
            )
            cache[h] = None
            decoding[i] = (h, block, salt)
            if rng.random() < 0.1:
                decoding.pop(i)
        evicted = []
        while len(cache) > stream.capacity:
            evicted.append(cache.popitem(last=False)[0])
        events.extend(_removals(stream.shape, evicted))
        ts += rng.expovariate(50.0)
        for chunk in range(0, len(events), 4):  # a step's events, at most 4 to a batch
            yield _damaged(_message(stream, ts, events[chunk : chunk + 4], seq), stream, rng, seq)
            seq += 1
            sent += 1
            if sent >= stream.messages:
                return


def _stores(shape: str, blocks: list[tuple[int, int | None, list[int], int, str | None]], block: int) -> list[object]:
    """The stores of consecutive blocks: one event for them all (vLLM's prefill, SGLang's merged pages), SGLang's
    then again on the host."""
    if not blocks:
        return []
    hashes = [h for h, *_ in blocks]
    tokens = [t for _, _, ids, _, _ in blocks for t in ids]
    parent, salt = blocks[0][1], blocks[0][4]
    first = salt is not None and parent is None  # vLLM keeps the salt in the extra keys of a chain's first block
    if shape == "vllm-array":
        extra = [[salt] if i == 0 and first else None for i in range(len(blocks))]
        return [["BlockStored", hashes, parent, tokens, block, None, "GPU", None, extra]]
    if shape == "vllm-map":
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block,
            "lora_id": None,
            "medium": "GPU",
        }
        if first:
            event["extra_keys"] = [[salt] if i == 0 else None for i in range(len(blocks))]
        return [event]
    stores = []
    for medium in ("GPU", "CPU_PINNED"):
        event: list[object] = ["BlockStored", hashes, parent, tokens, block, None, medium]
        if salt is not None:
            event.append({"cache_salt": salt})
        stores.append(event)
    return stores


def _removals(shape: str, hashes: list[int]) -> list[object]:
    if not hashes:
        return []
    if shape == "vllm-array":
        return [["BlockRemoved", [h], "GPU"] for h in hashes]
    if shape == "vllm-map":
        return [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in hashes]
    return [["BlockRemoved", hashes, "GPU"], ["BlockRemoved", hashes, "CPU_PINNED"]]


def _message(stream: Stream, ts: float, events: list[object], seq: int) -> object:
    ts = round(ts, 6)
    if stream.shape == "vllm-map":
        return {"ts": ts, "events": events, "data_parallel_rank": 0}
    if stream.shape == "vllm-array":
        return [ts, events, 0]
    received = datetime.fromtimestamp(ts + 0.002, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "recv_ts": received,
        "instance": stream.instance,
        "topic": "kv-events",
        "seq": seq,
        "batch": [ts, events, 0],
    }


def _damaged(message: object, stream: Stream, rng: random.Random, seq: int) -> str:
    """The message as its line, damaged in one of the ways archives are for a ``stream.damage`` share of lines."""
    text = json.dumps(message, separators=(",", ":"))
    if rng.random() >= stream.damage:
        return text
    batch = message["batch"] if isinstance(message, dict) and "batch" in message else message
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    event = events[0] if events else None
    how = rng.randrange(16)
    if how == 0:
        return text[: rng.randrange(1, len(text))]  # cut short
    if how == 1:
        return text.replace(",", ", ", 3) + ","  # not JSON
    if how == 2 and event is not None:
        (event.__setitem__(0, "BlockEvicted") if isinstance(event, list) else event.__setitem__("type", "Evicted"))
    elif how == 3:
        (batch.__setitem__(0, "yesterday") if isinstance(batch, list) else batch.__setitem__("ts", "yesterday"))
    elif how == 4:
        (
            batch.__setitem__(0, "2026-10-11T23:22:53.016+02:00")
            if isinstance(batch, list)
            else batch.__setitem__("ts", "2026-10-11T23:22:53.016+02:00")
        )  # ISO 8601: loaded, by the reference
    elif how == 5 and isinstance(event, list) and event[0] == "BlockStored":
        event[4] = -event[4]
    elif how == 6 and isinstance(event, list):
        event.append(None)
        event.extend([None] * 8)  # too many fields
    elif how == 7 and isinstance(message, dict) and "seq" in message:
        message["seq"] = max(seq - 1, 0)  # sent twice
    elif how == 8 and isinstance(message, dict) and "seq" in message:
        message["seq"] = seq + rng.randint(2, 5)  # messages lost
    elif how == 9 and isinstance(event, list) and isinstance(event[1], list):
        event[1] = [base64.b64encode((int(h) & (2**64 - 1)).to_bytes(8, "big")).decode() for h in event[1]]
    elif how == 10 and isinstance(event, list) and isinstance(event[1], list):
        event[1] = [f"{int(h) & (2**64 - 1):016x}" for h in event[1]]
    elif how == 11 and isinstance(event, list) and isinstance(event[1], list):
        event[1] = [hex(int(h) & (2**64 - 1)) for h in event[1]]
    elif how == 12:
        return text.replace('"GPU"', '"G\\u0050U"', 1)  # an escape: the same text
    elif how == 13:
        return text[:-1] + ",]" if text.endswith("]") else text[:-1] + ",}"  # a trailing comma
    elif how == 14 and isinstance(message, dict):
        return text[:-1] + ',"seq":' + str(seq + 100) + "}" if "seq" in message else text  # a key twice
    elif how == 15:
        (
            batch.__setitem__(2, -1)
            if isinstance(batch, list) and len(batch) > 2
            else batch.__setitem__("data_parallel_rank", 2**40)
            if isinstance(batch, dict)
            else None
        )
    return json.dumps(message, separators=(",", ":"))
