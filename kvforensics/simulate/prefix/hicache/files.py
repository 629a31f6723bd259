"""The files of the ``prefix-hicache-l3`` incident, written as the simulation streams.

* ``gateway/requests.jsonl.gz``: the gateway's log, one record per request: ``id``, ``created``,
  ``account``, ``model``, ``cache_salt`` (the salt it set), ``upstream`` (the instance it routed to),
  ``status``, ``max_tokens``, ``ttft_ms``, ``latency_ms`` and the OpenAI ``usage`` object with
  ``prompt_tokens_details.cached_tokens`` (SGLang ``--enable-cache-report``);
* ``content/content.jsonl.zst``: ``request_id``, ``prompt``, ``output``, ``prompt_token_ids``;
* ``kv-events/<instance>.jsonl.zst``: the KV events as a ZMQ subscriber archives them, one JSON object
  per message: ``recv_ts``, ``instance``, ``endpoint``, ``topic``, the publisher's ``seq`` (from 0 at
  each start-up) and the batch decoded untyped, positional ``[ts, [event, ...], attn_dp_rank]``
  (``/work/shared/reference/kv-cache-isolation.md`` section 1): salted stores have 8 elements (#30827);
* ``engine/<instance>/sglang.log``: the instance's start-ups (:mod:`.deployment`);
* ``deploy.toml`` (``kvforensics audit --manifest``), ``incident.toml`` and ``ground_truth.json``
  (not referenced by the incident file).
"""

from __future__ import annotations

import gzip
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from kvforensics.simulate.prefix.hicache.deployment import ENGINE_VERSION, KV_EVENTS_PORT, MODEL, Timeline
from kvforensics.simulate.prefix.hicache.serve import Served, Truth
from kvforensics.simulate.prefix.hicache.traffic import PLAYGROUND_SALT, Accounts
from kvforensics.simulate.prefix.workload import Vocabulary

INTERNAL_GLOB = "provider-*"


_ID_TEXT = [str(i) for i in range(1 << 16)]  # token ids as text (the vocabulary's ids are below 2^16)
_second: list[object] = [None, ""]


def iso_ms(ts: float) -> str:
    """``2026-10-12T00:00:01.234Z`` (the second's text kept from the last call: times come in order)."""
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)  # as datetime.fromtimestamp rounds
    second = int(whole) + us // 1_000_000
    if _second[0] != second:
        _second[0], _second[1] = second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{_second[1]}.{us % 1_000_000 // 1000:03d}Z"


def event_json(event: list[Any]) -> str:
    """One event as msgspec's untyped JSON writes it (``json.dumps`` of it, compact), built directly for
    the store events that make up most of the archive."""
    if event[0] != "BlockStored":
        return json.dumps(event, separators=(",", ":"))
    _, hashes, parent, ids, size, _, medium, meta = event
    text = _ID_TEXT.__getitem__
    return (
        f'["BlockStored",[{",".join(map(str, hashes))}],{"null" if parent is None else parent},'
        f'[{",".join(map(text, ids))}],{size},null,"{medium}",{{"cache_salt":"{meta["cache_salt"]}"}}]'
    )


class GzipLines:
    """JSON lines into a gzip file with mtime 0 and no file name: the same lines give the same bytes."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._raw: BinaryIO = path.open("wb")
        self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0, compresslevel=6)

    def write(self, line: str) -> None:
        self._gz.write(line.encode("utf-8") + b"\n")

    def close(self) -> None:
        self._gz.close()
        self._raw.close()


class ZstdLines:
    """JSON lines into a zstd stream, single-threaded (reproducible bytes), with a long-distance window:
    chats repeat their documents far apart."""

    def __init__(self, path: Path, window_log: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._raw: BinaryIO = path.open("wb")
        params = zstandard.ZstdCompressionParameters.from_level(1, window_log=window_log, enable_ldm=True)
        self._z = zstandard.ZstdCompressor(compression_params=params).stream_writer(self._raw, closefd=False)
        self._buffer: list[bytes] = []
        self._size = 0

    def write(self, line: str) -> None:
        data = line.encode("utf-8")
        self._buffer.append(data)
        self._size += len(data) + 1
        if self._size > 1 << 20:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            self._z.write(b"\n".join(self._buffer) + b"\n")
            self._buffer, self._size = [], 0

    def close(self) -> None:
        self._flush()
        self._z.close()
        self._raw.close()


class EventArchive:
    """A subscriber's archive of one instance's publisher: one JSON object per message."""

    def __init__(self, out: Path, instance: str, number: int) -> None:
        self.instance = instance
        self.endpoint = f"tcp://10.0.3.{11 + number}:{KV_EVENTS_PORT}"
        self.writer = ZstdLines(out / "kv-events" / f"{instance}.jsonl.zst", window_log=24)
        self.seq = 0
        self.messages = 0
        self._recv = 0.0
        self._head = f'"instance":"{instance}","endpoint":"{self.endpoint}","topic":"kv-events","seq":'

    def restart(self) -> None:
        """A new engine process: its publisher numbers messages from 0 again."""
        self.seq = 0

    def emit(self, ts: float, events: list[Any]) -> None:
        if not events:
            return
        self._recv = max(self._recv, ts + 0.0008 + (self.messages % 7) * 0.0003)
        batch = ",".join(map(event_json, events))
        self.writer.write(f'{{"recv_ts":"{iso_ms(self._recv)}",{self._head}{self.seq},"batch":[{ts:.6f},[{batch}],0]}}')
        self.seq += 1
        self.messages += 1


class RequestFiles:
    """The gateway log and the content file, a record of each as a request is served."""

    def __init__(self, out: Path, vocab: Vocabulary) -> None:
        self.gateway = GzipLines(out / "gateway" / "requests.jsonl.gz")
        self.content = ZstdLines(out / "content" / "content.jsonl.zst", window_log=26)
        top = max(vocab.ids) + 1
        words = [""] * top
        for i, w in zip(vocab.ids, vocab.words, strict=True):
            words[i] = w
        self._word = words.__getitem__
        self._id = _ID_TEXT.__getitem__

    def __call__(self, s: Served) -> None:
        r = s.request
        completion = 0 if r.timed_out else r.output
        salt = r.salt
        self.gateway.write(
            f'{{"id":"{s.request_id}","created":"{iso_ms(r.ts)}","account":"{r.account}","model":"{MODEL}",'
            f'"cache_salt":"{salt}","upstream":"{s.instance}","status":{s.status},"max_tokens":{r.max_tokens},'
            f'"ttft_ms":{s.ttft_ms},"latency_ms":{s.latency_ms},"usage":{{"prompt_tokens":{r.prompt},'
            f'"completion_tokens":{completion},"total_tokens":{r.prompt + completion},'
            f'"prompt_tokens_details":{{"cached_tokens":{s.cached_tokens}}}}}}}'
        )
        prompt = r.tokens[: r.prompt]
        output = r.tokens[r.prompt : r.prompt + completion]
        word, ident = self._word, self._id
        self.content.write(
            f'{{"request_id":"{s.request_id}","prompt":"{" ".join(map(word, prompt))}",'
            f'"output":"{" ".join(map(word, output))}","prompt_token_ids":[{",".join(map(ident, prompt))}]}}'
        )

    def close(self) -> None:
        self.gateway.close()
        self.content.close()


def write_engine_logs(out: Path, timeline: Timeline, log_text: Any) -> None:
    for name in sorted({s.instance for s in timeline.startups}):
        folder = out / "engine" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sglang.log").write_text(
            log_text(timeline.of(name), [f for f in timeline.flushes if f.instance == name], timeline.end),
            encoding="utf-8",
        )


def manifest() -> str:
    return (
        "# Deployment manifest (kvforensics audit --manifest): several customers share the engines;\n"
        "# the gateway sets cache_salt per tenant, overwriting any value a client sends. SGLang's logs\n"
        "# name no version: the build is stated here.\n"
        f"[prefix_cache]\ntenants = \"multi\"\ncache_salt = \"gateway\"\nengine_version = \"{ENGINE_VERSION}\"\n"
    )


def incident_toml(name: str, title: str) -> str:
    return f"""# Generated by `kvforensics simulate --mechanism prefix_reuse`; ground_truth.json is not referenced.
[incident]
id = "{name}"
title = "{title}"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway/*.jsonl.gz"
format = "jsonl"
columns = {{ request_id = "id", ts = "created", account_id = "account", prefill_instance = "upstream", prompt_tokens = "usage.prompt_tokens", completion_tokens = "usage.completion_tokens", cached_tokens = "usage.prompt_tokens_details.cached_tokens" }}

[[sources]]
name = "content"
kind = "content"
path = "content/content.jsonl.zst"
format = "jsonl"

[[sources]]
name = "kv-events"
kind = "kv_events"
path = "kv-events/*.jsonl.zst"
columns = {{ ts = "batch.0", events = "batch.1", dp_rank = "batch.2", instance = "instance", seq = "seq" }}

[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*/sglang.log"
format = "sglang"
instance = "{{parent}}"

[scope]
internal_accounts = ["{INTERNAL_GLOB}"]

# the deployment's isolation facts (deploy.toml's keys) and the namespace the provider documents as shared
[prefix_cache]
tenants = "multi"
cache_salt = "gateway"
engine_version = "{ENGINE_VERSION}"
shared_namespaces = ["{PLAYGROUND_SALT}"]
"""


def ground_truth(
    name: str, seed: int, served: int, truth: Truth, accounts: Accounts, timeline: Timeline, store: dict[str, int]
) -> dict[str, Any]:
    recipients = {rid: sorted({src[1] for src in sources}) for rid, (_, _, _, _, sources) in truth.recipients.items()}
    return {
        "scenario": name,
        "seed": seed,
        "block_size": 64,
        "requests": served,
        "engine_version": ENGINE_VERSION,
        "internal_accounts": accounts.internal,
        "shared_namespaces": [PLAYGROUND_SALT],
        "playground_accounts": accounts.playground,
        "recipients": recipients,
        "recipient_sources": {
            rid: [
                {
                    "source_request_id": s[0],
                    "source_account": s[1],
                    "source_salt": s[2],
                    "source_instance": s[3],
                    "position_from": s[4],
                    "position_to": s[5],
                    "source_position_from": s[4],
                }
                for s in sources
            ]
            for rid, (_, _, _, _, sources) in truth.recipients.items()
        },
        "recipient_loads": {
            rid: {"instance": inst, "ts": iso_ms(ts), "pages_loaded": pages}
            for rid, (_, inst, ts, pages, _) in truth.recipients.items()
        },
        "recipient_accounts": sorted({v[0] for v in truth.recipients.values()}),
        "source_accounts": sorted({a for v in recipients.values() for a in v}),
        "collisions": [],
        "probers": accounts.probers,
        "probe_victims": accounts.victims,
        "benign_lookalikes": {
            "evaluation_harness": accounts.evaluators,
            "retrying_clients": sorted(accounts.retriers),
            "keepalive_pings": accounts.pingers,
            "autocomplete": sorted(accounts.autocomplete),
        },
        "exposure_windows": {
            inst: [{"start": iso_ms(a), "end": iso_ms(b)} for a, b in windows]
            for inst, windows in sorted(timeline.store_windows().items())
        },
        "flushes": [{"instance": f.instance, "ts": iso_ms(f.ts)} for f in timeline.flushes],
        "store_loads": {
            "requests": truth.requests_loading,
            "pages": truth.loaded_pages,
            "prefetches_cut_short": truth.prefetches_cut,
        },
        "store": store,
    }
