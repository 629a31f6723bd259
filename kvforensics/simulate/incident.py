"""The incident's own requests: the affected responses, the reporter, the load test, exploiters,
and the traps that must not look affected (prefix-cache hits, oversize 400s, post-fix long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import kvforensics.simulate.calibration as cal
from kvforensics.simulate.fleet.deployment import STARTUP_SECONDS, Deployment
from kvforensics.simulate.scenario import Scenario
from kvforensics.simulate.traffic import (
    STREAM_INCIDENT,
    AccountTable,
    exposure_end,
    safe_prompts,
    sample_quantiles,
    to_ms,
    ttft_noise,
)

TARGET, CONTROL, UNIFIED = 0, 1, 2
EXPLOITER_RESPONSES = 12  # affected responses per exploiter (capped at half the total)


@dataclass(frozen=True)
class AffectedPlan:
    """How the ``affected`` responses split over account groups."""

    customers: dict[str, int]
    internal: int
    reporter: int
    exploiters: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.customers.values()) + self.internal + self.reporter + sum(self.exploiters.values())


def exploiter_names(s: Scenario, rng: np.random.Generator, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < s.exploiters:
        name = f"acct-{int(rng.integers(16**6)):06x}"
        if name not in taken and name not in names:
            names.append(name)
    return names


def plan_affected(s: Scenario, accounts: AccountTable, rng: np.random.Generator) -> AffectedPlan:
    remaining = s.affected
    names = exploiter_names(s, rng, set(accounts.names))
    exploit_total = min(len(names) * EXPLOITER_RESPONSES, remaining // 2)
    exploiters: dict[str, int] = {}
    if names and exploit_total:
        share = np.full(len(names), exploit_total // len(names))
        share[: exploit_total - int(share.sum())] += 1
        exploiters = {n: int(k) for n, k in zip(names, share, strict=True) if k > 0}
    remaining -= sum(exploiters.values())
    reporter = min(s.reporter_affected, remaining)
    remaining -= reporter
    internal = min(s.internal_affected, remaining // 2)
    remaining -= internal
    n_accounts = min(s.affected_customer_accounts, remaining)
    customers: dict[str, int] = {}
    if n_accounts:
        pool = np.flatnonzero(accounts.long_context)
        chosen = rng.choice(pool, size=n_accounts, replace=False)
        weights = np.arange(1, n_accounts + 1, dtype=float) ** -1.0
        extra = rng.multinomial(remaining - n_accounts, weights / weights.sum())
        customers = {accounts.names[a]: int(1 + e) for a, e in zip(chosen, extra, strict=True)}
    plan = AffectedPlan(customers, internal, reporter, exploiters)
    assert plan.total == s.affected
    return plan


def diurnal_times(rng: np.random.Generator, n: int, lo_ms: int, hi_ms: int) -> np.ndarray:
    """``n`` arrival times in [lo, hi) following the diurnal profile (rejection sampling)."""
    profile = np.asarray(cal.DIURNAL_BY_UTC_HOUR)
    out: list[int] = []
    while len(out) < n:
        cand = rng.integers(lo_ms, hi_ms, size=2 * n + 8)
        hour = (cand // 3_600_000) % 24
        keep = cand[rng.random(len(cand)) < profile[hour] / profile.max()]
        out.extend(int(c) for c in keep[: n - len(out)])
    return np.sort(np.array(out, dtype=np.int64))


def rows(
    rng: np.random.Generator,
    ts_ms: np.ndarray,
    account: list[str] | str,
    model_idx: int,
    prompt: np.ndarray,
    kind: str,
    cached: np.ndarray | None = None,
    completion: np.ndarray | None = None,
    force_prefill: int = -1,
) -> pd.DataFrame:
    """Injected requests with the same columns as background traffic (no random errors)."""
    n = len(ts_ms)
    if completion is None:
        completion = np.maximum(sample_quantiles(rng, cal.MOONCAKE_OUTPUT_QUANTILES, n).round(), 16)
    return pd.DataFrame(
        {
            "ts_ms": np.asarray(ts_ms, dtype=np.int64),
            "account": np.asarray([account] * n if isinstance(account, str) else account, dtype=object),
            "model_idx": np.full(n, model_idx, dtype=np.int8),
            "prompt_tokens": np.asarray(prompt, dtype=np.int64),
            "completion_tokens": np.asarray(completion, dtype=np.int64),
            "cached_tokens": np.zeros(n, dtype=np.int64) if cached is None else np.asarray(cached, dtype=np.int64),
            "stream": rng.random(n) < 0.72,
            "u_status": np.ones(n),
            "u_ttft_missing": rng.random(n),
            "queue_ms": rng.exponential(cal.QUEUE_MEAN_MS, n),
            "noise": ttft_noise(rng, n),
            "tpot_noise": rng.lognormal(0.0, 0.15, n),
            "u_route": rng.random(n),
            "u_route_decode": rng.random(n),
            "u_bootstrap": rng.random(n),
            "force_prefill": np.full(n, force_prefill, dtype=np.int8),
            "kind": kind,
        }
    )


@dataclass(frozen=True)
class Window:
    """Where incident requests may be placed (epoch ms)."""

    live: int  # target model takes traffic
    fix: int  # first prefill restart
    fixed_all: int  # every target instance restarted and ready
    end: int


def incident_window(s: Scenario, dep: Deployment) -> Window:
    last_restart = max(st.ready for st in dep.startups if st.model == "target")
    return Window(
        to_ms(dep.live_from("target")) + 600_000,
        to_ms(s.fix_time) - 300_000,
        to_ms(last_restart) + 600_000,
        to_ms(s.end) - 3_600_000,
    )


def leak_prompts(rng: np.random.Generator, s: Scenario, n: int) -> np.ndarray:
    """Oversize prompts that pass the context check: strictly above the exposed pool."""
    return rng.integers(s.exposed_pool_tokens + 1, s.context_length - 6, size=n)


def customer_rows(rng: np.random.Generator, s: Scenario, w: Window, plan: AffectedPlan) -> pd.DataFrame:
    accounts = [a for a, k in plan.customers.items() for _ in range(k)]
    if not accounts:
        return rows(rng, np.zeros(0), [], TARGET, np.zeros(0), "affected_customer")
    ts = diurnal_times(rng, len(accounts), w.live, w.fix)
    order = rng.permutation(len(accounts))
    return rows(
        rng,
        ts,
        [accounts[i] for i in order],
        TARGET,
        leak_prompts(rng, s, len(accounts)),
        "affected_customer",
    )


def internal_rows(rng: np.random.Generator, s: Scenario, w: Window, n: int) -> list[pd.DataFrame]:
    """A load test sweeping prompt sizes: leaking sizes, a few over the context, a few that fit."""
    if n == 0:
        return []
    day = 86_400_000
    start = (w.live + 6 * day) // day * day + 10 * 3_600_000 + 720_000  # 10:12 UTC, day 6
    span = (n + 10) * 110_000
    start = max(w.live, min(start, w.fix - span - 3_600_000))
    leak = np.linspace(s.exposed_pool_tokens + 4_000, s.context_length - 1_000, n).round(-3).astype(np.int64)
    leak = np.clip(leak, s.exposed_pool_tokens + 1, s.context_length - 7)
    over = s.context_length + np.array([0, 1, 8_192, 51_424, 100_000, 250_000])
    fits = (s.scheduler_limit * np.array([0.55, 0.7, 0.8, 0.9])).astype(np.int64)
    gaps = rng.integers(45_000, 110_000, size=n + len(over) + len(fits))
    ts = start + np.cumsum(gaps)
    order = rng.permutation(len(ts))
    leak_ts, over_ts, fit_ts = ts[order[:n]], ts[order[n : n + len(over)]], ts[order[n + len(over) :]]
    return [
        rows(rng, np.sort(leak_ts), s.internal_account, TARGET, leak, "affected_internal"),
        rows(rng, np.sort(over_ts), s.internal_account, TARGET, over, "trap_oversize_400"),
        rows(rng, np.sort(fit_ts), s.internal_account, TARGET, fits, "long_prompt_fits"),
    ]


def reporter_rows(rng: np.random.Generator, s: Scenario, w: Window, n: int) -> list[pd.DataFrame]:
    report = to_ms(s.report_time)
    out: list[pd.DataFrame] = []
    if n:
        minutes = np.sort(rng.choice(np.arange(12, 100), size=n, replace=False))[::-1]
        ts = np.clip(report - minutes * 60_000 - rng.integers(0, 59_000, size=n), w.live, w.fix)
        prompt = rng.integers((s.exposed_pool_tokens + s.context_length) // 2, s.context_length - 6, size=n)
        out.append(rows(rng, ts, s.reporter_account, TARGET, prompt, "affected_reporter"))
    probe_ts = np.clip(np.array([report - 62 * 60_000]), w.live, w.fix)
    out.append(
        rows(
            rng,
            probe_ts,
            s.reporter_account,
            TARGET,
            np.array([s.context_length + 20_000]),
            "trap_oversize_400",
        )
    )
    k = 24
    ts = np.sort(rng.integers(max(w.live, report - 6 * 86_400_000), report - 2 * 3_600_000, size=k))
    model = rng.choice([TARGET, CONTROL], size=k, p=[0.7, 0.3])
    prompt = sample_quantiles(rng, cal.MOONCAKE_PROMPT_QUANTILES, k).astype(np.int64)
    for m in (TARGET, CONTROL):
        sel = model == m
        out.append(rows(rng, ts[sel], s.reporter_account, m, prompt[sel], "background"))
    return out


def exploiter_rows(rng: np.random.Generator, s: Scenario, w: Window, plan: AffectedPlan) -> list[pd.DataFrame]:
    """Deliberate probing: clustered just above the pool, repeated identical prompts, bursts."""
    out: list[pd.DataFrame] = []
    for name, n in plan.exploiters.items():
        first = int(rng.integers(w.live, max(w.live + 1, w.fix - 2 * 86_400_000)))
        bursts = int(rng.integers(2, 4))
        burst_of = np.sort(rng.integers(0, bursts, size=n))
        burst_start = first + np.sort(rng.integers(0, 36 * 3_600_000, size=bursts))
        ts = np.minimum(burst_start[burst_of] + rng.integers(0, 240_000, size=n), w.fix - 1)
        distinct = rng.integers(s.exposed_pool_tokens + 1, s.exposed_pool_tokens + 2_500, size=max(1, n // 4))
        prompt = distinct[np.minimum(np.arange(n) // 4, len(distinct) - 1)]
        out.append(rows(rng, np.sort(ts), name, TARGET, prompt, "affected_exploiter"))
        over_ts = burst_start[0] + rng.integers(0, 300_000, size=4)
        out.append(
            rows(
                rng,
                np.sort(over_ts),
                name,
                TARGET,
                s.context_length + rng.integers(0, 5_000, 4),
                "trap_oversize_400",
            )
        )
        below_ts = burst_start[-1] + rng.integers(0, 300_000, size=3)
        out.append(
            rows(
                rng,
                np.sort(below_ts),
                name,
                TARGET,
                s.scheduler_limit - rng.integers(1, 2_000, 3),
                "long_prompt_fits",
            )
        )
        normal_ts = np.sort(rng.integers(w.live, w.end, size=15))
        out.append(
            rows(
                rng,
                normal_ts,
                name,
                TARGET,
                sample_quantiles(rng, cal.AZURE_CONV_PROMPT_QUANTILES, 15).astype(np.int64),
                "background",
            )
        )
    return out


def trap_rows(
    rng: np.random.Generator, s: Scenario, dep: Deployment, w: Window, accounts: AccountTable
) -> list[pd.DataFrame]:
    long_accounts = [accounts.names[i] for i in np.flatnonzero(accounts.long_context)]

    def pick(k: int) -> list[str]:
        return [long_accounts[i] for i in rng.integers(0, len(long_accounts), size=k)]

    out: list[pd.DataFrame] = []
    # Prefix-cache hits: long prompts below the pool, mostly cached -> legitimately fast.
    k = 30
    prompt = rng.integers(s.scheduler_limit // 3, s.scheduler_limit - 1, size=k)
    cached = (prompt * rng.uniform(0.9, 0.995, size=k) // s.page_size * s.page_size).astype(np.int64)
    out.append(
        rows(
            rng,
            diurnal_times(rng, k, w.live, w.fix),
            pick(k),
            TARGET,
            prompt,
            "trap_prefix_cache",
            cached=cached,
        )
    )
    k = 6
    prompt = rng.integers(200_000, s.control_context_length - 7, size=k)
    cached = (prompt * rng.uniform(0.9, 0.99, size=k) // s.page_size * s.page_size).astype(np.int64)
    out.append(
        rows(
            rng,
            diurnal_times(rng, k, w.live, w.end),
            pick(k),
            CONTROL,
            prompt,
            "trap_prefix_cache",
            cached=cached,
        )
    )
    # Oversize prompts correctly rejected by the tokenizer (HTTP 400), in and out of the window.
    for model, lo, hi, k, ctx in (
        (TARGET, w.live, w.fix, 10, s.context_length),
        (TARGET, w.fixed_all, w.end, 4, s.context_length),
        (CONTROL, to_ms(s.start), w.end, 4, s.control_context_length),
        (UNIFIED, to_ms(s.start), w.end, 6, s.unified_context_length),
    ):
        over = ctx + rng.integers(0, ctx // 4, size=k)
        out.append(rows(rng, diurnal_times(rng, k, lo, hi), pick(k), model, over, "trap_oversize_400"))
    # After the fix: long prompts served normally, with real (minutes-long) prefills.
    k = 20
    out.append(
        rows(
            rng,
            diurnal_times(rng, k, w.fixed_all, w.end),
            pick(k),
            TARGET,
            leak_prompts(rng, s, k),
            "postfix_long",
        )
    )
    # Between staggered restarts: an oversize prompt sent to the already-fixed instance 0.
    stagger_ms = s.restart_stagger_minutes * 60_000
    if s.prefill_instances > 1 and stagger_ms // 2 > (STARTUP_SECONDS + 30) * 1000:
        ts = np.array([to_ms(s.fix_time) + stagger_ms // 2 + 20_000])
        out.append(rows(rng, ts, pick(1), TARGET, leak_prompts(rng, s, 1), "postfix_long", force_prefill=0))
    return out


def incident_rows(s: Scenario, dep: Deployment, accounts: AccountTable) -> tuple[pd.DataFrame, AffectedPlan]:
    rng = np.random.default_rng([s.seed, STREAM_INCIDENT])
    plan = plan_affected(s, accounts, rng)
    w = incident_window(s, dep)
    frames = [customer_rows(rng, s, w, plan)]
    frames += internal_rows(rng, s, w, plan.internal)
    frames += reporter_rows(rng, s, w, plan.reporter)
    frames += exploiter_rows(rng, s, w, plan)
    frames += trap_rows(rng, s, dep, w, accounts)
    out = pd.concat([f for f in frames if len(f)], ignore_index=True)
    ordinary = (out["kind"] == "background").to_numpy()
    out.loc[ordinary, "prompt_tokens"] = safe_prompts(
        rng,
        out["prompt_tokens"].to_numpy()[ordinary],
        out["model_idx"].to_numpy()[ordinary],
        out["ts_ms"].to_numpy()[ordinary],
        s,
        exposure_end(s, dep),
    )
    return out, plan
