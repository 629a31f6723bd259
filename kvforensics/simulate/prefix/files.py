"""The files of a simulated prefix-cache incident.

* ``gateway/requests.jsonl.gz``: one record per request, the canonical field names plus ``cache_salt``
  (the salt the gateway set; absent where it set none);
* ``content/content.jsonl.zst``: ``request_id``, ``prompt``, ``output`` and ``prompt_token_ids``;
* ``kv-events/<instance>.jsonl.zst``: vLLM's ``KVEventBatch`` in msgspec's array form, one batch per line
  (``[ts, [event, ...], dp_rank]``; ``BlockStored`` fields in declaration order up to ``extra_keys``,
  the salt in the first block's extra keys), as ``vllm/distributed/kv_events.py`` publishes them
  (https://github.com/vllm-project/vllm/blob/main/vllm/distributed/kv_events.py, extra_keys:
  https://github.com/vllm-project/vllm/pull/33304);
* ``engine/<instance>.log``: vLLM start-up lines in the shape of ``tests/fixtures/audit_prefix``
  (API server version, ``non-default args``, the V1 engine config line, the KV cache size), with
  ``--enable-prefix-caching``, ``--prefix-caching-hash-algo`` and, for an L3 store, an LMCache
  ``kv_transfer_config`` (https://docs.vllm.ai/en/latest/configuration/engine_args.html);
* ``deploy.toml``: the deployment manifest of ``kvforensics audit --manifest`` (``[prefix_cache]``);
* ``incident.toml`` and ``ground_truth.json`` (not referenced by the incident file).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import zstandard

from kvforensics.simulate.prefix.serve import Cache, Deployment, Served
from kvforensics.simulate.prefix.workload import Workload

MODEL = "llama-3.1-8b"
HF_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VLLM_VERSION = "0.16.0"


def _iso(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def write_gzip_lines(path: Path, lines: Iterable[str]) -> None:
    """JSON lines, gzip with mtime 0 and no file name: the same records give the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=6) as gz:
        for line in lines:
            gz.write(line.encode("utf-8") + b"\n")
    path.write_bytes(buffer.getvalue())


def write_zstd_lines(path: Path, lines: Iterable[str]) -> None:
    """JSON lines, zstd with a 64 MiB window: chats repeat their documents and earlier turns far
    apart, which gzip's 32 KiB window cannot see. Single-threaded, so the bytes are reproducible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    params = zstandard.ZstdCompressionParameters.from_level(12, window_log=26, enable_ldm=True)
    with path.open("wb") as raw, zstandard.ZstdCompressor(compression_params=params).stream_writer(raw) as z:
        for line in lines:
            z.write(line.encode("utf-8") + b"\n")


def gateway_record(s: Served) -> dict[str, Any]:
    r = s.request
    record: dict[str, Any] = {
        "request_id": s.request_id,
        "ts": _iso(r.ts),
        "account_id": r.account,
        "model": MODEL,
        "status": s.status,
        "prompt_tokens": len(r.tokens),
        "completion_tokens": len(r.output),
        "cached_tokens": s.cached_tokens,
        "ttft_ms": s.ttft_ms,
        "latency_ms": s.latency_ms,
        "prefill_instance": s.instance,
    }
    if s.salt is not None:
        record["cache_salt"] = s.salt
    return record


def write_requests(out: Path, served: list[Served], w: Workload) -> None:
    write_gzip_lines(
        out / "gateway" / "requests.jsonl.gz", (json.dumps(gateway_record(s), separators=(",", ":")) for s in served)
    )
    write_zstd_lines(
        out / "content" / "content.jsonl.zst",
        (
            json.dumps(
                {
                    "request_id": s.request_id,
                    "prompt": w.vocabulary.text(list(s.request.tokens)),
                    "output": w.vocabulary.text(list(s.request.output)),
                    "prompt_token_ids": list(s.request.tokens),
                },
                separators=(",", ":"),
            )
            for s in served
        ),
    )


def kv_event_lines(cache: Cache, block_size: int) -> Iterable[str]:
    """One batch per store or eviction, in vLLM's array form with data-parallel rank 0."""
    for e in cache.events:
        if e.kind == "removed":
            event: list[Any] = ["BlockRemoved", e.hashes, "GPU"]
        else:
            extra = [[e.salt] if i == 0 and e.salt is not None else None for i in range(len(e.hashes))]
            event = ["BlockStored", e.hashes, e.parent, e.tokens, block_size, None, "GPU", None, extra]
        yield json.dumps([round(e.ts.timestamp(), 6), [event], 0], separators=(",", ":"))


def write_kv_events(out: Path, caches: dict[str, Cache], block_size: int) -> None:
    for name, cache in caches.items():
        write_zstd_lines(out / "kv-events" / f"{name}.jsonl.zst", kv_event_lines(cache, block_size))


def engine_log(instance: str, start: datetime, dep: Deployment, pid: int) -> str:
    """A vLLM start-up in the shape of the audit fixtures."""

    def stamp(seconds: int) -> str:
        return (start + timedelta(seconds=seconds)).strftime("%m-%d %H:%M:%S")

    args = [
        f"'model_tag': '{HF_MODEL}'",
        f"'model': '{HF_MODEL}'",
        "'max_model_len': 32768",
        f"'served_model_name': ['{MODEL}']",
        "'enable_prefix_caching': True",
    ]
    algo = "builtin" if instance == dep.weak_instance else "sha256"
    args.append(f"'prefix_caching_hash_algo': '{algo}'")
    if dep.l3:
        args.append(
            "'kv_transfer_config': KVTransferConfig(kv_connector='LMCacheConnectorV1', "
            f"engine_id='{instance}', kv_buffer_device='cuda', kv_buffer_size=1000000000.0, "
            "kv_role='kv_both', kv_rank=None, kv_parallel_size=1, kv_ip='127.0.0.1', kv_port=14579, "
            "kv_connector_extra_config={}, kv_connector_module_path=None)"
        )
    tokens = dep.capacity_blocks * dep.block_size
    api, core = "(APIServer pid=1)", f"(EngineCore_DP0 pid={pid})"
    lines = [
        f"{api} INFO {stamp(0)} [api_server.py:1839] vLLM API server version {VLLM_VERSION}",
        f"{api} INFO {stamp(0)} [utils.py:233] non-default args: {{{', '.join(args)}}}",
        f"{core} INFO {stamp(8)} [core.py:77] Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: "
        f"model='{HF_MODEL}', speculative_config=None, tokenizer='{HF_MODEL}', skip_tokenizer_init=False, "
        "tokenizer_mode=auto, revision=None, trust_remote_code=False, dtype=torch.bfloat16, max_seq_len=32768, "
        "download_dir=None, load_format=auto, tensor_parallel_size=1, pipeline_parallel_size=1, "
        "data_parallel_size=1, disable_custom_all_reduce=False, quantization=None, enforce_eager=False, "
        f"kv_cache_dtype=auto, device_config=cuda, served_model_name={MODEL}, enable_prefix_caching=True, "
        "chunked_prefill_enabled=True",
        f"{core} INFO {stamp(100)} [gpu_worker.py:298] Available KV cache memory: 8.00 GiB",
        f"{core} INFO {stamp(100)} [kv_cache_utils.py:1087] GPU KV cache size: {tokens:,} tokens",
        f"{core} INFO {stamp(100)} [kv_cache_utils.py:1091] Maximum concurrency for 32,768 tokens per "
        f"request: {tokens / 32768:.2f}x",
        f"{api} INFO {stamp(120)} [launcher.py:44] Application startup complete.",
    ]
    return "\n".join(lines) + "\n"


def write_engine_logs(out: Path, dep: Deployment, start: datetime) -> None:
    folder = out / "engine"
    folder.mkdir(parents=True, exist_ok=True)
    for n, instance in enumerate(dep.instances):
        (folder / f"{instance}.log").write_text(engine_log(instance, start, dep, 200 + 17 * n), encoding="utf-8")


def manifest(salted: bool) -> str:
    how = (
        "the gateway sets cache_salt per tenant, overwriting any value a client sends"
        if salted
        else "no cache salt is set: tenants share the prefix cache"
    )
    return (
        "# Deployment manifest (kvforensics audit --manifest): several customers share the engines;\n"
        f"# {how}.\n[prefix_cache]\ntenants = \"multi\"\n"
        f"cache_salt = \"{'gateway' if salted else 'none'}\"\n"
    )


def incident_toml(name: str, title: str, internal: str, salted: bool) -> str:
    isolation = "\n".join(manifest(salted).splitlines()[2:])  # the manifest's [prefix_cache] table
    return f"""# Generated by `kvforensics simulate --mechanism prefix_reuse`; ground_truth.json is not referenced.
[incident]
id = "{name}"
title = "{title}"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway/*.jsonl.gz"
format = "jsonl"

[[sources]]
name = "content"
kind = "content"
path = "content/content.jsonl.zst"
format = "jsonl"

[[sources]]
name = "kv-events"
kind = "kv_events"
path = "kv-events/*.jsonl.zst"

[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*.log"
format = "vllm"

[scope]
internal_accounts = ["{internal}"]

# the deployment's isolation facts (the keys of deploy.toml): the prefix_reuse exposure windows
{isolation}
"""


def ground_truth(
    scenario: str, seed: int, block_size: int, served: list[Served], w: Workload, internal: list[str]
) -> dict[str, Any]:
    recipients = {s.request_id: sorted({src[1] for src in s.sources}) for s in served if s.sources}
    return {
        "scenario": scenario,
        "seed": seed,
        "block_size": block_size,
        "requests": len(served),
        "internal_accounts": internal,
        "recipients": recipients,
        "recipient_sources": {
            s.request_id: [
                {
                    "source_request_id": rid,
                    "source_account": a,
                    "position_from": p0,
                    "position_to": p1,
                    "source_position_from": q,
                }
                for rid, a, p0, p1, q in s.sources
            ]
            for s in served
            if s.sources
        },
        "recipient_accounts": sorted({s.request.account for s in served if s.sources}),
        "source_accounts": sorted({a for v in recipients.values() for a in v}),
        "collisions": sorted(s.request_id for s in served if s.collision),
        "probers": w.probers,
        "probe_victims": w.victims,
        "benign_lookalikes": {"evaluation_harness": w.evaluators, "retrying_clients": sorted(w.retriers)},
        "provider_system_prompt_tokens": len(w.system_prompt),
    }
