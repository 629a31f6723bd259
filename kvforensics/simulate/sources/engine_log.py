"""SGLang engine logs in the real format (see /work/shared/reference/engine-log-formats.md).

* envelope ``[YYYY-MM-DD HH:MM:SS TPn] `` in the engine's local time, rank suffix only when tp > 1;
  launcher / HTTP lines carry no rank;
* ``server_args=ServerArgs(...)`` (<= 0.5.15) or ``server_args={...}`` (>= 0.5.20);
* the KV pool line on every rank, the ``max_total_num_tokens=...`` summary on TP0 only;
* per oversize prompt on the prefill node, on TP0: ``Input length (N tokens) exceeds the maximum
  allowed length (M tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='...'``;
* ``ReqTimeStats(...)`` per target-model prefill request (``input_len=1`` for the stubs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd

from kvforensics.simulate.fleet.deployment import HARDWARE, Deployment, ModelDeployment, Startup
from kvforensics.simulate.scenario import Scenario
from kvforensics.simulate.traffic import to_ms


@dataclass(order=True)
class LogLine:
    ts_ms: int
    seq: int
    text: str = field(compare=False)


@dataclass
class EngineLog:
    """Lines of one instance's log, collected out of order and sorted when rendered."""

    instance: str
    lines: list[LogLine] = field(default_factory=list)

    def add(self, ts_ms: int, text: str) -> None:
        self.lines.append(LogLine(ts_ms, len(self.lines), text))


def envelope(ts_ms: int, zone: ZoneInfo, rank: int | None, tp: int) -> str:
    local = datetime.fromtimestamp(ts_ms // 1000, tz=UTC).astimezone(zone)
    suffix = f" TP{rank}" if rank is not None and tp > 1 else ""
    return f"[{local:%Y-%m-%d %H:%M:%S}{suffix}] "


def server_args(s: Scenario, st: Startup, m: ModelDeployment) -> dict[str, object]:
    role = {"prefill": "prefill", "decode": "decode", "unified": "null"}[st.role]
    args: dict[str, object] = {
        "model_path": f"/mnt/models/{m.engine_model}",
        "tokenizer_path": f"/mnt/models/{m.engine_model}",
        "tokenizer_mode": "auto",
        "load_format": "auto",
        "trust_remote_code": True,
        "context_length": st.context_length,
        "dtype": "auto",
        "kv_cache_dtype": "auto",
        "quantization": "fp8" if m.key != "unified" else None,
        "served_model_name": m.engine_model,
        "host": "0.0.0.0",
        "port": 30000,
        "mem_fraction_static": st.mem_fraction_static,
        "max_running_requests": 256,
        "max_total_tokens": None,
        "chunked_prefill_size": 16384,
        "max_prefill_tokens": 16384,
        "schedule_policy": "fcfs",
        "tp_size": st.tp_size,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": s.page_size,
        "random_seed": 1234,
        "log_level": "info",
        "log_requests": False,
        "log_requests_level": 2,
        "enable_metrics": True,
        "enable_request_time_stats_logging": m.key == "target" and st.role == "prefill",
        "allow_auto_truncate": False,
        "enable_dp_attention": False,
        "disaggregation_mode": role,
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": 8998,
        "disaggregation_ib_device": "mlx5_0,mlx5_1,mlx5_2,mlx5_3" if m.pd else None,
        "disaggregation_decode_enable_offload_kvcache": False,
        "kv_canary": "none",
    }
    return args


def render_server_args(s: Scenario, args: dict[str, object]) -> str:
    if s.sglang_version == "0.5.15":
        return "server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
    return f"server_args={args!r}"


def startup_lines(
    log: EngineLog, s: Scenario, st: Startup, m: ModelDeployment, zone: ZoneInfo, rng: np.random.Generator
) -> None:
    t0 = to_ms(st.ts)
    tp = st.tp_size
    ranks = list(range(tp))

    def at(seconds: float, text: str, rank: int | None = None) -> None:
        log.add(t0 + int(seconds * 1000), envelope(t0 + int(seconds * 1000), zone, rank, tp) + text)

    at(0, render_server_args(s, server_args(s, st, m)))
    hw = HARDWARE[m.key]
    weights = hw.weights_gb
    kv_gb = hw.kv_gb(st.pool_tokens)
    free_gb = hw.gpu_memory_gb - 1.2
    load_s = float(rng.uniform(70, 95))
    for r in ranks:
        at(6, f"Load weight begin. avail mem={free_gb:.2f} GB", r)
    for r in ranks:
        after = free_gb - weights - rng.uniform(0, 0.05)
        at(
            6 + load_s,
            f"Load weight end. elapsed={load_s + rng.uniform(0, 0.4):.2f} s, "
            f"type={hw.model_class}, avail mem={after:.2f} GB, mem usage={weights:.2f} GB.",
            r,
        )
    for r in ranks:
        at(
            8 + load_s,
            f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {st.pool_tokens}, KV size: {kv_gb:.2f} GB",
            r,
        )
    avail = free_gb - weights - kv_gb
    for r in ranks:
        at(8 + load_s, f"Memory pool end. avail mem={avail:.2f} GB", r)
    at(
        9 + load_s,
        f"max_total_num_tokens={st.pool_tokens}, chunked_prefill_size=16384, "
        f"max_prefill_tokens=16384, max_running_requests=256, context_len={st.context_length}, "
        f"available_gpu_mem={avail - 0.3:.2f} GB",
        0,
    )
    if st.role != "prefill":
        begin, end = cuda_graph_lines(s.sglang_version, avail)
        for r in ranks:
            at(10 + load_s, begin, r)
        for r in ranks:
            at(49 + load_s, end, r)
    if st.role == "prefill":
        at(150, "CommonKVBootstrapServer started successfully on 0.0.0.0:8998")
    at(170, "The server is fired up and ready to roll!")


def cuda_graph_lines(version: str, avail_gb: float) -> tuple[str, str]:
    if version == "0.5.15":
        return (
            f"Capture cuda graph begin. This can take up to several minutes. avail mem={avail_gb - 0.3:.2f} GB",
            f"Capture cuda graph end. Time elapsed: 38.41 s. mem usage=2.87 GB. avail mem={avail_gb - 3.2:.2f} GB.",
        )
    return (
        f"Capture decode CUDA graph begin. backend=full, num_tokens=256, avail mem={avail_gb - 0.3:.2f} GB",
        f"Capture decode CUDA graph end. elapsed=38.41 s, mem usage=2.87 GB, avail mem={avail_gb - 3.2:.2f} GB.",
    )


def abort_line(prompt: int, limit: int, rid: str) -> str:
    return (
        f"Input length ({prompt} tokens) exceeds the maximum allowed length ({limit} tokens). "
        f"Use a shorter input or enable --allow-auto-truncate., self.rid='{rid}'"
    )


def req_time_stats(
    rid: str,
    room: int,
    input_len: int,
    cached: int,
    bootstrap_ms: float,
    queue_ms: float,
    forward_ms: float,
    entry_s: float,
    transfer_mb: float,
    transfer_s: float,
) -> str:
    speed = transfer_mb / 1000 / max(transfer_s, 1e-4)
    return (
        f"ReqTimeStats(rid={rid}, bootstrap_room={room}, input_len={input_len}, cached_input_len={cached}, "
        f"output_len=1, attempts=1, type=prefill): bootstrap_duration={bootstrap_ms:.2f}ms, "
        f"queue_duration={queue_ms:.2f}ms, forward_duration={forward_ms:.2f}ms, entry_time={entry_s:.3f}, "
        f"transfer_speed={speed:.2f} GB/s, transfer_total={transfer_mb:.2f} MB"
    )


def request_lines(
    logs: dict[str, EngineLog],
    served: pd.DataFrame,
    dep: Deployment,
    zone: ZoneInfo,
    with_time_stats: bool,
    rng: np.random.Generator,
) -> None:
    """Abort and ReqTimeStats lines on the target model's prefill instances."""
    s = dep.scenario
    m = dep.models["target"]
    tp = m.tp_size
    rows = served[(served["model_idx"] == 0) & (served["status"] == 200)]
    if not with_time_stats:
        rows = rows[rows["affected"]]
    r: Any
    for r in rows.itertuples(index=False):
        log = logs[r.prefill_instance]
        received = int(r.ts_ms)
        start = received + int(r.queue_ms)
        if r.affected:
            limit = min(s.context_length, int(r.pool_tokens)) - 6
            log.add(start, envelope(start, zone, 0, tp) + abort_line(int(r.prompt_tokens), limit, r.rid))
        if not with_time_stats:
            continue
        input_len = 1 if r.affected else int(r.prompt_tokens)
        cached = 0 if r.affected else int(r.cached_tokens)
        forward = float(m.latency.prefill_ms(input_len - cached)) * float(r.noise)
        bootstrap = 3.0 + 25.0 * float(r.u_bootstrap)
        transfer_mb = input_len * m.latency.kv_bytes_per_token / 1e6
        done = start + int(bootstrap + forward)
        text = req_time_stats(
            r.rid,
            int(rng.integers(1, 2**62)),
            input_len,
            cached,
            bootstrap,
            float(r.queue_ms),
            forward,
            received / 1000,
            transfer_mb,
            transfer_mb / (1000 * rng.uniform(22, 46)),
        )
        log.add(done, envelope(done, zone, 0, tp) + text)


def batch_lines(log: EngineLog, st: Startup, until_ms: int, zone: ZoneInfo, rng: np.random.Generator) -> None:
    """A sprinkling of periodic batch lines (every few hours) while the instance is up."""
    t = to_ms(st.ready) + int(rng.integers(600_000, 3_600_000))
    while t < until_ms:
        usage = rng.uniform(0.0, 0.3)
        if st.role == "decode":
            text = (
                f"Decode batch, #running-req: {rng.integers(1, 40)}, #token: {int(usage * st.pool_tokens)}, "
                f"token usage: {usage:.2f}, pre-allocated usage: {rng.uniform(0, 0.05):.2f}, "
                f"#prealloc-req: 0, #transfer-req: {rng.integers(0, 3)}, #retracted-req: 0, "
                "cuda graph: True, "
                f"gen throughput (token/s): {rng.uniform(150, 900):.2f}, #queue-req: 0"
            )
        else:
            pd_part = "#bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, " if st.role == "prefill" else ""
            text = (
                f"Prefill batch, #new-seq: 1, #new-token: {rng.integers(200, 16384)}, "
                f"#cached-token: {rng.integers(0, 8192)}, token usage: {usage:.2f}, "
                f"#running-req: {rng.integers(0, 6)}, #queue-req: 0, #pending-token: 0, {pd_part}"
                f"cuda graph: False, input throughput (token/s): {rng.uniform(2000, 60000):.2f}"
            )
        rank = 0 if st.tp_size > 1 else None
        log.add(t, envelope(t, zone, rank, st.tp_size) + text)
        t += int(rng.integers(3, 7) * 3_600_000)


def build_engine_logs(dep: Deployment, rng: np.random.Generator) -> dict[str, EngineLog]:
    s = dep.scenario
    zone = ZoneInfo(s.engine_timezone)
    logs: dict[str, EngineLog] = {}
    end_ms = to_ms(s.end)
    for st in dep.startups:
        log = logs.setdefault(st.instance, EngineLog(st.instance))
        startup_lines(log, s, st, dep.models[st.model], zone, rng)
    for instance, log in logs.items():
        ups = dep.startups_of(instance)
        for k, st in enumerate(ups):
            until = to_ms(ups[k + 1].ts) if k + 1 < len(ups) else end_ms
            batch_lines(log, st, until, zone, rng)
    return logs


def write_engine_logs(logs: dict[str, EngineLog], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for instance in sorted(logs):
        path = out_dir / f"{instance}.log"
        lines = sorted(logs[instance].lines)
        path.write_text("".join(line.text + "\n" for line in lines), encoding="utf-8")
        paths.append(path)
    return paths
