"""What the engines did with each request: status, routing, the leak, TTFT and latency.

Engine faithfulness (SGLang 0.5.5-0.5.20, PD mode):
* tokenizer: ``prompt >= context_len`` -> HTTP 400 (never reaches the scheduler);
* scheduler: ``prompt >= min(context_len, max_total_num_tokens) - 6`` -> ``set_finish_with_abort``;
  on a PD prefill node the request drains as a 1-token stub and the client gets 200 with the real
  ``prompt_tokens``, fast: that is an *affected response*. On a unified server the client gets 400.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvforensics.simulate.fleet.deployment import MODEL_KEYS, Deployment, ModelDeployment
from kvforensics.simulate.traffic import TRANSFER_GBPS, to_ms

STATUS_TOO_LONG = 400
RATE_LIMIT_SHARE = 0.010
SERVER_ERROR_SHARE = 0.0015
UNAVAILABLE_SHARE = 0.0015


@dataclass(frozen=True)
class InstanceTimeline:
    """Start-ups of one instance as arrays: first line, ready, pool (sorted by time)."""

    name: str
    start_ms: np.ndarray
    ready_ms: np.ndarray
    pool: np.ndarray

    def up(self, ts: np.ndarray) -> np.ndarray:
        k = np.searchsorted(self.start_ms, ts, side="right") - 1
        return (k >= 0) & (ts >= self.ready_ms[np.maximum(k, 0)])

    def pool_at(self, ts: np.ndarray) -> np.ndarray:
        k = np.searchsorted(self.start_ms, ts, side="right") - 1
        return np.where(k >= 0, self.pool[np.maximum(k, 0)], 0)


def timelines(dep: Deployment, model: str, role: str) -> list[InstanceTimeline]:
    out = []
    for name in dep.instances(model, role):  # type: ignore[arg-type]
        ups = dep.startups_of(name)
        out.append(
            InstanceTimeline(
                name,
                np.array([to_ms(u.ts) for u in ups], dtype=np.int64),
                np.array([to_ms(u.ready) for u in ups], dtype=np.int64),
                np.array([u.pool_tokens for u in ups], dtype=np.int64),
            )
        )
    return out


def route(ts: np.ndarray, u: np.ndarray, lines: list[InstanceTimeline], forced: np.ndarray | None = None) -> np.ndarray:
    """Index of the chosen instance (uniform among those up), -1 when none is up."""
    up = np.column_stack([t.up(ts) for t in lines])
    n_up = up.sum(axis=1)
    rank = np.floor(u * np.maximum(n_up, 1)).astype(np.int64)
    chosen = np.argmax(np.cumsum(up, axis=1) > rank[:, None], axis=1)
    chosen = np.where(n_up > 0, chosen, -1)
    if forced is not None:
        chosen = np.where(forced >= 0, forced, chosen)
    return chosen


def tokenizer_error(prompt: np.ndarray, context: np.ndarray) -> np.ndarray:
    return np.array(
        [
            f"The input ({p} tokens) is longer than the model's context length ({c} tokens)."
            for p, c in zip(prompt, context, strict=True)
        ],
        dtype=object,
    )


def decode_step_ms(m: ModelDeployment, context_tokens: np.ndarray, noise: np.ndarray) -> np.ndarray:
    lat = m.latency
    return (lat.tpot_ms + lat.tpot_per_context_token_ms * context_tokens) * noise


def serve(frame: pd.DataFrame, dep: Deployment) -> pd.DataFrame:
    """Add status, error, instances, ``affected`` and timings to a frame of received requests."""
    df = frame.reset_index(drop=True)
    n = len(df)
    status = np.full(n, 200, dtype=np.int16)
    error = np.full(n, None, dtype=object)
    prefill = np.full(n, None, dtype=object)
    decode = np.full(n, None, dtype=object)
    pool = np.zeros(n, dtype=np.int64)
    affected = np.zeros(n, dtype=bool)
    ttft = np.full(n, np.nan)
    latency = np.zeros(n)
    ts = df["ts_ms"].to_numpy()
    prompt = df["prompt_tokens"].to_numpy()
    u = df["u_status"].to_numpy()

    for idx, key in enumerate(MODEL_KEYS):
        m = dep.models[key]
        rows = np.flatnonzero(df["model_idx"].to_numpy() == idx)
        if len(rows) == 0:
            continue
        ctx = np.full(len(rows), m.context_length)
        too_long = prompt[rows] >= m.context_length
        status[rows[too_long]] = STATUS_TOO_LONG
        error[rows[too_long]] = tokenizer_error(prompt[rows[too_long]], ctx[too_long])
        ok = rows[~too_long]
        ur = u[ok]
        s429 = ur < RATE_LIMIT_SHARE
        s500 = (ur >= RATE_LIMIT_SHARE) & (ur < RATE_LIMIT_SHARE + SERVER_ERROR_SHARE)
        s503 = (ur >= RATE_LIMIT_SHARE + SERVER_ERROR_SHARE) & (
            ur < RATE_LIMIT_SHARE + SERVER_ERROR_SHARE + UNAVAILABLE_SHARE
        )
        status[ok[s429]] = 429
        error[ok[s429]] = "Rate limit exceeded: too many requests for this account, retry later."
        status[ok[s500]] = 500
        error[ok[s500]] = "Internal server error."
        status[ok[s503]] = 503
        error[ok[s503]] = "Service unavailable: no healthy upstream."
        served = ok[~(s429 | s500 | s503)]
        role = "prefill" if m.pd else "unified"
        lines = timelines(dep, key, role)
        chosen = route(
            ts[served],
            df["u_route"].to_numpy()[served],
            lines,
            df["force_prefill"].to_numpy()[served].astype(np.int64),
        )
        none_up = chosen < 0
        status[served[none_up]] = 503
        error[served[none_up]] = "Service unavailable: no healthy upstream."
        served, chosen = served[~none_up], chosen[~none_up]
        for i, line in enumerate(lines):
            pick = served[chosen == i]
            pool[pick] = line.pool_at(ts[pick])
            if m.pd:
                prefill[pick] = line.name
        limit = np.minimum(m.context_length, pool[served]) - 6
        rejected = prompt[served] >= limit
        if not m.pd:
            status[served[rejected]] = STATUS_TOO_LONG
            error[served[rejected]] = [
                f"Input length ({p} tokens) exceeds the maximum allowed length ({lim} tokens)."
                for p, lim in zip(prompt[served[rejected]], limit[rejected], strict=True)
            ]
            served = served[~rejected]
            rejected = np.zeros(len(served), dtype=bool)
        affected[served[rejected]] = True
        if m.pd:
            dlines = timelines(dep, key, "decode")
            dchosen = route(ts[served], df["u_route_decode"].to_numpy()[served], dlines)
            for i, line in enumerate(dlines):
                decode[served[dchosen == i]] = line.name
        ttft[served], latency[served] = timings(df.iloc[served], m, affected[served])

    failed = status != 200
    latency[failed] = error_latency(df, status)[failed]
    out = df.assign(
        status=status,
        error=error,
        prefill_instance=prefill,
        decode_instance=decode,
        pool_tokens=pool,
        affected=affected,
        ttft_true_ms=ttft,
        latency_ms=latency,
    )
    out.loc[failed, ["completion_tokens", "cached_tokens"]] = 0
    logged = out["stream"].to_numpy() & (out["u_ttft_missing"].to_numpy() >= 0.03) & ~failed
    out["ttft_ms"] = np.where(logged, out["ttft_true_ms"].round(1), np.nan)
    out["latency_ms"] = out["latency_ms"].round(1)
    return out


def timings(rows: pd.DataFrame, m: ModelDeployment, affected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """True TTFT and end-to-end latency (ms) for served requests of one model."""
    lat = m.latency
    prompt = rows["prompt_tokens"].to_numpy().astype(float)
    cached = rows["cached_tokens"].to_numpy().astype(float)
    completion = rows["completion_tokens"].to_numpy().astype(float)
    noise = rows["noise"].to_numpy()
    tpot_noise = rows["tpot_noise"].to_numpy()
    queue = rows["queue_ms"].to_numpy()
    # An affected request prefills the 1-token stub and ships one page; decode then attends over
    # every reserved page of the real prompt on its first step.
    uncached = np.where(affected, 1.0, prompt - cached)
    shipped = np.where(affected, 1.0, prompt)
    prefill = lat.prefill_ms(uncached) * noise
    if m.pd:
        bootstrap = 3.0 + 25.0 * rows["u_bootstrap"].to_numpy()
        transfer = shipped * lat.kv_bytes_per_token / (TRANSFER_GBPS * 1e6)
    else:
        bootstrap = transfer = np.zeros(len(rows))
    step = decode_step_ms(m, prompt, tpot_noise)
    ttft = queue + prefill + bootstrap + transfer + step
    e2e = ttft + np.maximum(completion - 1, 0) * decode_step_ms(m, prompt + completion / 2, tpot_noise)
    return ttft, e2e


def error_latency(df: pd.DataFrame, status: np.ndarray) -> np.ndarray:
    u = df["noise"].to_numpy()
    fast = 2.0 + 18.0 * (u - 0.85)
    slow = 50.0 + 3000.0 * (u - 0.85) ** 2
    return np.where(status == 500, slow, fast)
