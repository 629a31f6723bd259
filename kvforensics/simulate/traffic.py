"""Vectorised background traffic: arrivals, accounts, models, token counts, statuses, latencies.

Every hour of the period is generated from its own seeded RNG stream, so the output does not
depend on how hours are grouped into chunks (the large-N path streams hour by hour).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pandas as pd

import kvforensics.simulate.calibration as cal
from kvforensics.simulate.fleet.deployment import MODEL_KEYS, Deployment, ModelKey
from kvforensics.simulate.scenario import Scenario

HOUR_MS = 3_600_000
MODEL_INDEX: dict[ModelKey, int] = {key: i for i, key in enumerate(MODEL_KEYS)}
LONG_CONTEXT_MIN = 32_768
LONG_CONTEXT_MAX = 1_150_000
#: The provider's own accounts besides ``Scenario.internal_account`` (they match ``loadtest-*``).
INTERNAL_BACKGROUND_ACCOUNTS = ("loadtest-llama-01", "loadtest-evals-01")
TRANSFER_GBPS = 40.0  # effective Mooncake RDMA bandwidth prefill -> decode, GB/s

# Streams of the per-hour RNG (so independent draws never share a stream).
STREAM_ACCOUNTS, STREAM_HOURS, STREAM_INCIDENT, STREAM_CONTENT, STREAM_IDS, STREAM_LOG_LINES = range(6)


def to_ms(ts: datetime) -> int:
    return int(ts.timestamp() * 1000)


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


@dataclass(frozen=True)
class AccountTable:
    """Accounts, their Zipf-like request weights, model preferences and long-context habit."""

    names: tuple[str, ...]
    weights: np.ndarray  # request share, sums to 1
    model_pref: np.ndarray  # [accounts, 3] preference over MODEL_KEYS
    long_context: np.ndarray  # bool per account
    target_only: np.ndarray  # bool: internal load-test accounts that only call the target model


def build_accounts(s: Scenario) -> AccountTable:
    rng = np.random.default_rng([s.seed, STREAM_ACCOUNTS])
    n = s.accounts
    codes = rng.choice(16**6, size=n, replace=False)
    names = [f"acct-{c:06x}" for c in codes]
    ranks = np.arange(1, n + 1, dtype=float)
    weights = ranks**-cal.ACCOUNT_ZIPF_EXPONENT
    weights /= weights.sum()
    pref = rng.dirichlet([0.6, 0.6, 0.6], size=n)
    long_context = np.zeros(n, dtype=bool)
    n_long = max(int(round(0.12 * n)), s.affected_customer_accounts + 12)
    long_idx = rng.choice(np.arange(12, n), size=min(n_long, n - 12), replace=False)
    long_context[long_idx] = True
    pref[long_idx] = rng.dirichlet([6.0, 2.0, 1.0], size=len(long_idx))
    internal = [s.internal_account, *INTERNAL_BACKGROUND_ACCOUNTS]
    internal_pref = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.4, 0.3, 0.3]])
    all_names = tuple(names + internal)
    all_weights = np.concatenate([weights * 0.985, [0.006, 0.005, 0.004]])
    return AccountTable(
        names=all_names,
        weights=all_weights / all_weights.sum(),
        model_pref=np.vstack([pref, internal_pref]),
        long_context=np.concatenate([long_context, [False, False, False]]),
        target_only=np.concatenate([np.zeros(n, dtype=bool), [True, False, False]]),
    )


def hour_counts(s: Scenario, total: int) -> np.ndarray:
    """Requests per hour: diurnal shape x lognormal window bursts, summing exactly to ``total``."""
    hours = int((s.end - s.start).total_seconds() // 3600)
    rng = np.random.default_rng([s.seed, STREAM_HOURS])
    hour_of_day = (np.arange(hours) + s.start.hour) % 24
    diurnal = np.asarray(cal.DIURNAL_BY_UTC_HOUR)[hour_of_day]
    burst = rng.lognormal(-(cal.BURST_LOG_SD**2) / 2, cal.BURST_LOG_SD, size=hours)
    weights = diurnal * burst
    return rng.multinomial(total, weights / weights.sum())


def arrival_offsets(rng: np.random.Generator, n: int, span_ms: int) -> np.ndarray:
    """Gamma inter-arrivals (ServeGen CV), rescaled to fill the span as ServeGen does."""
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    shape = 1.0 / cal.SERVEGEN_IAT_CV_P50**2
    gaps = rng.gamma(shape, 1.0, size=n + 1)
    cum = np.cumsum(gaps)
    return np.floor(cum[:-1] / cum[-1] * span_ms).astype(np.int64)


@functools.cache
def _log_quantiles(quantiles: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    levels = np.linspace(0.0, 1.0, len(quantiles))
    return levels, np.log(np.maximum(np.asarray(quantiles, dtype=float), 1.0))


def sample_quantiles(rng: np.random.Generator, quantiles: tuple[float, ...], n: int) -> np.ndarray:
    """Inverse-CDF sampling with log-linear interpolation between the stored quantiles."""
    levels, logq = _log_quantiles(quantiles)
    return np.exp(np.interp(rng.random(n), levels, logq))


def prompt_and_output(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    source = rng.choice(3, size=n, p=cal.LENGTH_SOURCE_WEIGHTS)
    tables = (
        (cal.AZURE_CONV_PROMPT_QUANTILES, cal.AZURE_CONV_OUTPUT_QUANTILES),
        (cal.AZURE_CODE_PROMPT_QUANTILES, cal.AZURE_CODE_OUTPUT_QUANTILES),
        (cal.MOONCAKE_PROMPT_QUANTILES, cal.MOONCAKE_OUTPUT_QUANTILES),
    )
    prompt = np.zeros(n)
    output = np.zeros(n)
    for k, (pq, oq) in enumerate(tables):
        mask = source == k
        prompt[mask] = sample_quantiles(rng, pq, int(mask.sum()))
        output[mask] = sample_quantiles(rng, oq, int(mask.sum()))
    return np.maximum(prompt.round(), 1).astype(np.int64), np.maximum(output.round(), 1).astype(np.int64)


def cached_prefix(rng: np.random.Generator, prompt: np.ndarray, page_size: int) -> np.ndarray:
    hit = rng.random(len(prompt)) < cal.PREFIX_HIT_RATE
    frac = np.interp(rng.random(len(prompt)), np.linspace(0, 1, 21), cal.MOONCAKE_HIT_FRACTION_QUANTILES)
    cached = (np.floor(prompt * frac / page_size) * page_size).astype(np.int64)
    return np.where(hit, np.minimum(cached, np.maximum(prompt - 1, 0)), 0)


def ttft_noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """Multiplicative noise: slower than the curve is common, faster than 0.85x never."""
    return cal.TTFT_NOISE_FLOOR + rng.lognormal(np.log(cal.TTFT_NOISE_SCALE), cal.TTFT_NOISE_LOG_SD, n)


def queue_ms(rng: np.random.Generator, n: int) -> np.ndarray:
    base = rng.exponential(cal.QUEUE_MEAN_MS, n)
    backlog = rng.random(n) < cal.BACKLOG_SHARE
    return np.where(backlog, rng.lognormal(np.log(cal.BACKLOG_MEDIAN_MS), 0.8, n), base)


def safe_prompts(
    rng: np.random.Generator,
    prompt: np.ndarray,
    model: np.ndarray,
    ts_ms: np.ndarray,
    s: Scenario,
    exposure_end_ms: int,
) -> np.ndarray:
    """Background prompts never fall in a scheduler-reject band (those are injected on purpose).

    * any PD model: [context - 6, context) would leak even with a large pool;
    * the target model while exposed: [min(context, pool) - 6, context) leaks.
    """
    contexts = np.array([s.context_length, s.control_context_length, s.unified_context_length])
    ctx = contexts[model]
    pd_model = model < 2
    floor = np.where(pd_model, ctx - 6, ctx)
    exposed = (model == 0) & (ts_ms < exposure_end_ms)
    floor = np.where(exposed, s.scheduler_limit, floor)
    bad = (prompt >= floor) & (prompt < ctx)
    if bad.any():
        hi = floor[bad] - 1
        prompt = prompt.copy()
        prompt[bad] = rng.integers(hi // 2, hi)
    return prompt


def background_hour(
    s: Scenario,
    dep: Deployment,
    accounts: AccountTable,
    hour: int,
    n: int,
    live_ms: dict[ModelKey, int],
    exposure_end_ms: int,
) -> dict[str, np.ndarray]:
    """All background requests received in one hour of the period (columns; accounts as indices)."""
    rng = np.random.default_rng([s.seed, STREAM_HOURS, hour])
    hour_start = to_ms(s.start) + hour * HOUR_MS
    ts = hour_start + arrival_offsets(rng, n, HOUR_MS)
    account = rng.choice(len(accounts.names), size=n, p=accounts.weights)
    live = np.array([hour_start >= live_ms[k] for k in MODEL_KEYS])
    idle = (accounts.model_pref[account] * live).sum(axis=1) == 0  # e.g. a load test before launch
    if idle.any():
        regular = accounts.weights[: s.accounts] / accounts.weights[: s.accounts].sum()
        account[idle] = rng.choice(s.accounts, size=int(idle.sum()), p=regular)
    pref = accounts.model_pref[account] * live
    pref[pref.sum(axis=1) == 0] = live / live.sum()
    pref /= pref.sum(axis=1, keepdims=True)
    model = (rng.random(n)[:, None] > np.cumsum(pref, axis=1)).sum(axis=1).clip(0, 2)
    prompt, output = prompt_and_output(rng, n)
    long = accounts.long_context[account] & (rng.random(n) < 0.3)
    long_len = np.exp(rng.uniform(np.log(LONG_CONTEXT_MIN), np.log(LONG_CONTEXT_MAX), n)).astype(np.int64)
    prompt = np.where(long, long_len, prompt)
    prompt = safe_prompts(rng, prompt, model, ts, s, exposure_end_ms)
    return {
        "ts_ms": ts,
        "account": account,
        "model_idx": model.astype(np.int8),
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "cached_tokens": cached_prefix(rng, prompt, s.page_size),
        "stream": rng.random(n) < 0.72,
        "u_status": rng.random(n),
        "u_ttft_missing": rng.random(n),
        "queue_ms": queue_ms(rng, n),
        "noise": ttft_noise(rng, n),
        "tpot_noise": rng.lognormal(0.0, 0.15, n),
        "u_route": rng.random(n),
        "u_route_decode": rng.random(n),
        "u_bootstrap": rng.random(n),
        "force_prefill": np.full(n, -1, dtype=np.int8),
    }


def iter_background(
    s: Scenario, dep: Deployment, accounts: AccountTable, total: int, hours_per_chunk: int = 1
) -> Iterator[pd.DataFrame]:
    counts = hour_counts(s, total)
    live_ms = {k: to_ms(dep.live_from(k)) for k in MODEL_KEYS}
    exposure_end_ms = exposure_end(s, dep)
    names = np.asarray(accounts.names, dtype=object)
    for first in range(0, len(counts), hours_per_chunk):
        hours = [
            background_hour(s, dep, accounts, h, int(counts[h]), live_ms, exposure_end_ms)
            for h in range(first, min(first + hours_per_chunk, len(counts)))
        ]
        columns = {key: np.concatenate([h[key] for h in hours]) for key in hours[0]}
        columns["account"] = names[columns["account"]]
        yield pd.DataFrame(columns).assign(kind="background")


def exposure_end(s: Scenario, dep: Deployment) -> int:
    """Epoch ms when the last exposed target instance stopped being exposed."""
    ends = [to_ms(w.end) if w.end else to_ms(s.end) for w in dep.exposure_windows()]
    return max(ends, default=to_ms(s.exposure_start))
