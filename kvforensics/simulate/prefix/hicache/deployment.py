"""The deployment of the ``prefix-hicache-l3`` incident: four unified SGLang 0.5.18 servers, their
start-ups, and the engine log each writes.

Every instance starts three times: first without a storage backend; in a rolling restart (one instance
after another, minutes apart, each drained from the router first) with ``--hicache-storage-backend
mooncake`` added; in a second rolling restart with it removed. The provider's account warms each
start-up with the system prompt before the router sends it traffic. Mid-window, an operator drains
one instance and calls ``POST /flush_cache`` on it.

The logs are SGLang's own lines (no ``sglang version:`` line: the server never logs its version, only
the CLI prints it; the incident file states the build): ``server_args=ServerArgs(...)`` (the form up to
0.5.20, ``/work/shared/reference/engine-log-formats.md`` section 1.2), the weight and KV pool lines, the
``max_total_num_tokens`` summary, uvicorn's start and shutdown lines, ``The server is fired up and ready
to roll!``, ``SIGTERM received. ... Draining requests and shutting down...``
(``srt/managers/tokenizer_manager.py``) and ``Cache flushed successfully!`` (``srt/managers/scheduler.py``
``flush_cache``). With ``tp_size=1`` the lines carry no ``TP0`` tag. Server arguments as
https://docs.sglang.ai/advanced_features/server_arguments.html and
https://docs.sglang.ai/advanced_features/hicache.html name them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime

INSTANCES = ("sglang-0", "sglang-1", "sglang-2", "sglang-3")
ENGINE_VERSION = "0.5.18"  # stated in the incident file: the logs name none
HF_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MODEL = "llama-3.1-8b"
CONTEXT_LENGTH = 32768
DEVICE_TOKENS = 49152  # an L4's KV pool after the weights (mem_fraction_static 0.88)
HICACHE_RATIO = 2.0
DEVICE_PAGES = DEVICE_TOKENS // 64
HOST_PAGES = int(DEVICE_TOKENS * HICACHE_RATIO) // 64
STORE_PAGES = 131_072  # the Mooncake cluster's capacity (1 TiB of 8 MiB pages)
KV_EVENTS_PORT = 5557
DRAIN_S = 60.0  # an instance leaves the router this long before it stops (or is flushed)


@dataclass(frozen=True)
class Startup:
    """One start-up of one instance; times are epoch seconds."""

    instance: str
    number: int  # 0, 1, 2
    launched: float  # the server_args line
    ready: float  # fired up; the provider's warm-up follows
    routable: float  # the router sends it traffic from here
    stop: float | None  # SIGTERM (None: still serving at the end of the logs)
    storage: bool
    pid: int

    @property
    def drain(self) -> float | None:
        return None if self.stop is None else self.stop - DRAIN_S


@dataclass(frozen=True)
class Flush:
    instance: str
    ts: float


@dataclass(frozen=True)
class Timeline:
    startups: tuple[Startup, ...]
    flushes: tuple[Flush, ...]
    end: float

    def of(self, instance: str) -> list[Startup]:
        return [s for s in self.startups if s.instance == instance]

    def routable(self, instance: str, ts: float) -> bool:
        for s in self.startups:
            if s.instance == instance and s.routable <= ts and (s.drain is None or ts < s.drain):
                return not any(f.instance == instance and f.ts - DRAIN_S <= ts < f.ts + 10 for f in self.flushes)
        return False

    def store_windows(self) -> dict[str, list[tuple[float, float]]]:
        """Per instance, the start-ups with the storage backend: (launched, stopped)."""
        out: dict[str, list[tuple[float, float]]] = {}
        for s in self.startups:
            if s.storage:
                out.setdefault(s.instance, []).append((s.launched, s.stop if s.stop is not None else self.end))
        return out

    def all_shared(self) -> tuple[float, float]:
        """When every instance's start-up has the store and takes traffic: (from, to)."""
        shared = [s for s in self.startups if s.storage]
        return max(s.routable for s in shared), min(s.drain or self.end for s in shared)


def timeline(seed: int, start: float, hours: int) -> Timeline:
    """The start-ups: at the start, a rolling restart adding the store 10 h in, one removing it 34 h in
    (instances 7 minutes apart); one flush 10 h into the store's window."""
    rng = random.Random(f"hicache-l3:{seed}:deployment")
    end = start + hours * 3600
    startups = []
    for i, name in enumerate(INSTANCES):
        launches = [start - 2400 + 120 * i, start + 10 * 3600 + 420 * i + 6, start + 34 * 3600 + 420 * i + 6]
        stops: list[float | None] = [launches[1] - 6, launches[2] - 6, None]
        for n, (launched, stop) in enumerate(zip(launches, stops, strict=True)):
            ready = launched + 140 + rng.random() * 30
            startups.append(
                Startup(name, n, launched, ready, ready + 30, stop, storage=n == 1, pid=1000 + rng.randrange(60000))
            )
    return Timeline(tuple(startups), (Flush("sglang-2", start + 20 * 3600 + 900),), end)


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("[%Y-%m-%d %H:%M:%S]")


def server_args(s: Startup) -> str:
    backend = "'mooncake'" if s.storage else "None"
    events = '\'{"publisher": "zmq", "endpoint": "tcp://*:%d", "topic": "kv-events"}\'' % KV_EVENTS_PORT
    return (
        f"server_args=ServerArgs(model_path='{HF_MODEL}', tokenizer_path='{HF_MODEL}', tokenizer_mode='auto', "
        "skip_tokenizer_init=False, load_format='auto', trust_remote_code=False, "
        f"context_length={CONTEXT_LENGTH}, is_embedding=False, revision=None, model_impl='auto', host='0.0.0.0', "
        "port=30000, dtype='auto', quantization=None, kv_cache_dtype='auto', mem_fraction_static=0.88, "
        "max_running_requests=None, max_queued_requests=None, max_total_tokens=None, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, schedule_policy='fcfs', page_size=64, device='cuda', tp_size=1, pp_size=1, "
        "stream_interval=1, random_seed=42, log_level='info', log_requests=False, log_requests_level=0, "
        f"enable_metrics=True, enable_cache_report=True, served_model_name='{MODEL}', dp_size=1, "
        "load_balance_method='round_robin', dist_init_addr=None, nnodes=1, node_rank=0, "
        "attention_backend='flashinfer', enable_dp_attention=False, allow_auto_truncate=False, "
        "disable_radix_cache=False, enable_hierarchical_cache=True, "
        f"hicache_ratio={HICACHE_RATIO}, hicache_size=0, hicache_write_policy='write_through', "
        "hicache_io_backend='kernel', hicache_mem_layout='page_first', "
        f"hicache_storage_backend={backend}, hicache_storage_prefetch_policy='best_effort', "
        f"hicache_storage_backend_extra_config=None, kv_events_config={events}, "
        "disaggregation_mode='null')"
    )


def engine_log(startups: list[Startup], flushes: list[Flush], end: float) -> str:
    """One instance's log: its start-ups in order, each ended by its SIGTERM; the kubelet's health checks
    every 30 s while it serves (uvicorn access lines, until the logs were collected at *end*); flushes
    where they fell."""
    rng = random.Random(startups[0].pid)
    lines: list[tuple[float, str]] = []
    for s in startups:
        probe = s.ready + 3 + rng.random() * 27
        while probe < (s.stop if s.stop is not None else end):
            lines.append(
                (probe, f"INFO:     10.0.3.1:{40000 + rng.randrange(20000)} - \"GET /health HTTP/1.1\" 200 OK")
            )
            probe += 30
        t = s.launched
        pool_gb = DEVICE_TOKENS * 32 * 8 * 128 * 2 / 2**30  # K (and V): layers x kv heads x head dim x bf16
        lines += [
            (t, server_args(s)),
            (t + 6, "Load weight begin. avail mem=21.98 GB"),
            (
                t + 52,
                f"Load weight end. elapsed={44 + rng.random() * 4:.2f} s, type=LlamaForCausalLM, "
                "avail mem=6.82 GB, mem usage=15.16 GB.",
            ),
            (
                t + 53,
                f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {DEVICE_TOKENS}, "
                f"K size: {pool_gb:.2f} GB, V size: {pool_gb:.2f} GB",
            ),
            (t + 53, f"Memory pool end. avail mem={6.82 - 2 * pool_gb:.2f} GB"),
            (
                s.ready - 4,
                f"max_total_num_tokens={DEVICE_TOKENS}, chunked_prefill_size=8192, max_prefill_tokens=16384, "
                f"max_running_requests=2049, context_len={CONTEXT_LENGTH}, available_gpu_mem=0.71 GB",
            ),
            (s.ready - 2, f"INFO:     Started server process [{s.pid}]"),
            (s.ready - 2, "INFO:     Waiting for application startup."),
            (s.ready - 2, "INFO:     Application startup complete."),
            (s.ready - 2, "INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C to quit)"),
            (s.ready - 1, "INFO:     127.0.0.1:40312 - \"GET /get_model_info HTTP/1.1\" 200 OK"),
            (s.ready - 1, "INFO:     127.0.0.1:40318 - \"POST /generate HTTP/1.1\" 200 OK"),
            (s.ready, "The server is fired up and ready to roll!"),
        ]
        if s.stop is not None:
            lines += [
                (s.stop, "SIGTERM received. signum=None frame=None. Draining requests and shutting down..."),
                (s.stop + 1, "Gracefully exiting... Remaining number of requests 0."),
                (s.stop + 2, "INFO:     Shutting down"),
                (s.stop + 2, "INFO:     Waiting for application shutdown."),
                (s.stop + 2, "INFO:     Application shutdown complete."),
                (s.stop + 2, f"INFO:     Finished server process [{s.pid}]"),
            ]
    for f in flushes:
        lines += [
            (f.ts, "Cache flushed successfully!"),
            (f.ts, "INFO:     10.0.3.17:51844 - \"POST /flush_cache HTTP/1.1\" 200 OK"),
        ]
    lines.sort(key=lambda x: x[0])
    return "".join(f"{_stamp(ts)} {text}\n" for ts, text in lines)
