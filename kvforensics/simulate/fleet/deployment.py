"""The simulated fleet: three models, their engine instances, and every start-up of each instance.

* target  (``glm53``): PD-disaggregated; prefill pool < context from launch until the fix.
* control (``glm52``): PD-disaggregated; pool > context throughout (one unrelated restart).
* unified (``llama33``): one non-PD SGLang server; pool > context (one unrelated restart).

Latency scale per model (why): the MInference Llama-3-8B/A100 curve is rescaled by the model's
attention width (layers x heads x head_dim) and active parameters relative to Llama-3-8B, divided
by the tensor-parallel degree and the H100/H200-vs-A100 throughput ratio (FP8 GEMMs count twice).
GLM-5.x is assumed to have 78 layers x 64 heads x 192 (MLA) and 40B active parameters (MoE);
Llama-3.3-70B has 80 x 64 x 128 and 70B (dense BF16).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import numpy as np
from numpy.typing import NDArray

import kvforensics.simulate.calibration as cal
from kvforensics.simulate.scenario import Scenario

Role = Literal["prefill", "decode", "unified"]
ModelKey = Literal["target", "control", "unified"]
MODEL_KEYS: tuple[ModelKey, ...] = ("target", "control", "unified")
STARTUP_SECONDS = 170  # first start-up line -> "fired up and ready to roll"


@dataclass(frozen=True)
class LatencyModel:
    """TTFT curve a + b n + c n^2 over uncached tokens, plus decode time per output token."""

    a_ms: float
    b_ms_per_token: float
    c_ms_per_token2: float
    tpot_ms: float
    tpot_per_context_token_ms: float
    kv_bytes_per_token: int  # what one token of KV weighs in a prefill -> decode transfer

    def prefill_ms(self, uncached_tokens: NDArray[np.float64] | float) -> NDArray[np.float64] | float:
        n = uncached_tokens
        return self.a_ms + self.b_ms_per_token * n + self.c_ms_per_token2 * n * n


@dataclass(frozen=True)
class ModelDeployment:
    key: ModelKey
    gateway_model: str
    engine_model: str
    prefix: str
    pd: bool
    context_length: int
    tp_size: int
    latency: LatencyModel
    #: Share of background traffic once the model is live.
    traffic_share: float


@dataclass(frozen=True)
class Startup:
    """One start-up block in one engine log."""

    instance: str
    model: ModelKey
    role: Role
    ts: datetime  # first line of the block (UTC)
    pool_tokens: int
    context_length: int
    tp_size: int
    reason: str

    @property
    def mem_fraction_static(self) -> float:
        return HARDWARE[self.model].mem_fraction_static(self.pool_tokens)

    @property
    def ready(self) -> datetime:
        return self.ts + timedelta(seconds=STARTUP_SECONDS)


@dataclass(frozen=True)
class ExposureWindow:
    instance: str
    model: str
    start: datetime
    end: datetime | None
    pool_tokens: int
    context_length: int


def scaled_latency(
    active_params_b: float,
    attention_width: int,
    tp: int,
    fp8: bool,
    kv_bytes: int,
    context_slope_scale: float,
) -> LatencyModel:
    gemm_speedup = cal.GPU_SPEEDUP_FP8 if fp8 else cal.GPU_SPEEDUP_BF16
    linear = active_params_b / cal.REFERENCE_ACTIVE_PARAMS_B / (tp * gemm_speedup)
    attention = attention_width / cal.REFERENCE_ATTENTION_WIDTH / (tp * cal.GPU_SPEEDUP_BF16)
    return LatencyModel(
        a_ms=cal.SPLITWISE_H100_TP8_A_MS,
        b_ms_per_token=cal.MINFERENCE_B_MS_PER_TOKEN * linear,
        c_ms_per_token2=cal.MINFERENCE_C_MS_PER_TOKEN2 * attention,
        tpot_ms=cal.SPLITWISE_H100_TP8_TOKEN_TIME_MS,
        tpot_per_context_token_ms=cal.SPLITWISE_TOKEN_TIME_PER_CONTEXT_TOKEN_MS * context_slope_scale,
        kv_bytes_per_token=kv_bytes,
    )


@dataclass(frozen=True)
class Hardware:
    """Per-GPU memory budget of a model's instances (shapes the start-up memory lines)."""

    gpu_memory_gb: float
    weights_gb: float  # per rank
    kv_bytes_per_token_per_rank: int
    model_class: str

    def kv_gb(self, pool_tokens: int) -> float:
        return pool_tokens * self.kv_bytes_per_token_per_rank / 1e9

    def mem_fraction_static(self, pool_tokens: int) -> float:
        """The static fraction an operator would have set to get this pool (2 GB of overheads)."""
        return round(min(0.95, (self.weights_gb + self.kv_gb(pool_tokens) + 2.0) / self.gpu_memory_gb), 3)


#: B200-class (191.5 GB usable) for GLM FP8 shards (~757 GB / 8); H200 for Llama-3.3-70B BF16.
HARDWARE: dict[str, Hardware] = {
    "target": Hardware(191.5, 94.6, 30_000, "GlmMoeDsaForCausalLM"),
    "control": Hardware(191.5, 94.6, 30_000, "GlmMoeDsaForCausalLM"),
    "unified": Hardware(140.4, 17.6, 40_960, "LlamaForCausalLM"),
}

GLM_ATTENTION_WIDTH = 78 * 64 * 192
GLM_KV_BYTES_PER_TOKEN = 78 * 576 * 2  # MLA latent (512 + 64 rope) in BF16
LLAMA70_ATTENTION_WIDTH = 80 * 64 * 128


def model_deployments(s: Scenario) -> dict[ModelKey, ModelDeployment]:
    glm = scaled_latency(40.0, GLM_ATTENTION_WIDTH, s.tp_size, True, GLM_KV_BYTES_PER_TOKEN, 0.25)
    glm_control = scaled_latency(40.0, GLM_ATTENTION_WIDTH, 8, True, GLM_KV_BYTES_PER_TOKEN, 0.25)
    llama = scaled_latency(70.0, LLAMA70_ATTENTION_WIDTH, 8, False, 80 * 2 * 8 * 128 * 2, 1.0)
    return {
        "target": ModelDeployment(
            "target", s.model, s.engine_model, s.instance_prefix, True, s.context_length, s.tp_size, glm, 0.36
        ),
        "control": ModelDeployment(
            "control",
            s.control_model,
            s.control_engine_model,
            s.control_instance_prefix,
            True,
            s.control_context_length,
            8,
            glm_control,
            0.34,
        ),
        "unified": ModelDeployment(
            "unified",
            s.unified_model,
            s.unified_engine_model,
            s.unified_instance_prefix,
            False,
            s.unified_context_length,
            8,
            llama,
            0.30,
        ),
    }


def instance_name(prefix: str, role: Role, index: int) -> str:
    return f"{prefix}-{index}" if role == "unified" else f"{prefix}-{role}-{index}"


def target_startups(s: Scenario) -> list[Startup]:
    out: list[Startup] = []
    stagger = timedelta(minutes=s.restart_stagger_minutes)
    for i in range(s.prefill_instances):
        name = instance_name(s.instance_prefix, "prefill", i)
        launch = s.exposure_start + timedelta(minutes=3 * i)
        out.append(
            Startup(
                name,
                "target",
                "prefill",
                launch,
                s.exposed_pool_tokens,
                s.context_length,
                s.tp_size,
                "launch",
            )
        )
        out.append(
            Startup(
                name,
                "target",
                "prefill",
                s.fix_time + stagger * i,
                s.fixed_pool_tokens,
                s.context_length,
                s.tp_size,
                "fix: pool above context",
            )
        )
    for j in range(s.decode_instances):
        name = instance_name(s.instance_prefix, "decode", j)
        launch = s.exposure_start - timedelta(minutes=6) + timedelta(minutes=2 * j)
        out.append(
            Startup(name, "target", "decode", launch, s.decode_pool_tokens, s.context_length, s.tp_size, "launch")
        )
        restart = s.fix_time + stagger * (s.prefill_instances + j)
        out.append(
            Startup(
                name,
                "target",
                "decode",
                restart,
                s.fixed_decode_pool_tokens,
                s.context_length,
                s.tp_size,
                "fix: config aligned with glm-5.2",
            )
        )
    return out


def control_startups(s: Scenario) -> list[Startup]:
    out: list[Startup] = []
    first = s.start - timedelta(days=9, hours=-10)
    rolling = min(s.start + (s.exposure_start - s.start) / 2 + timedelta(days=6, hours=3), s.end - timedelta(hours=6))
    pools: tuple[tuple[Role, int], ...] = (
        ("prefill", s.control_pool_tokens),
        ("decode", s.control_pool_tokens + 524_288),
    )
    for role, pool in pools:
        for i in range(2):
            name = instance_name(s.control_instance_prefix, role, i)
            offset = timedelta(minutes=2 * i + (0 if role == "prefill" else 5))
            ctx = s.control_context_length
            out.append(Startup(name, "control", role, first + offset, pool, ctx, 8, "launch"))
            out.append(
                Startup(
                    name,
                    "control",
                    role,
                    rolling + offset,
                    pool,
                    ctx,
                    8,
                    "rolling restart: NIC driver update",
                )
            )
    return out


def unified_startups(s: Scenario) -> list[Startup]:
    name = instance_name(s.unified_instance_prefix, "unified", 0)
    first = s.start - timedelta(days=20, hours=-8)
    upgrade = s.start + timedelta(days=5, hours=2, minutes=30)
    return [
        Startup(name, "unified", "unified", first, s.unified_pool_tokens, s.unified_context_length, 8, "launch"),
        Startup(
            name,
            "unified",
            "unified",
            min(upgrade, s.exposure_start - timedelta(hours=2)),
            s.unified_pool_tokens,
            s.unified_context_length,
            8,
            "image upgrade",
        ),
    ]


@dataclass(frozen=True)
class Deployment:
    scenario: Scenario
    models: dict[ModelKey, ModelDeployment]
    startups: tuple[Startup, ...]

    def instances(self, model: ModelKey, role: Role) -> list[str]:
        names = {st.instance for st in self.startups if st.model == model and st.role == role}
        return sorted(names)

    def startups_of(self, instance: str) -> list[Startup]:
        return sorted((st for st in self.startups if st.instance == instance), key=lambda st: st.ts)

    def live_from(self, model: ModelKey) -> datetime:
        """When the model starts taking traffic: its first prefill/unified instance is ready."""
        return min(st.ready for st in self.startups if st.model == model and st.role != "decode")

    def exposure_windows(self) -> list[ExposureWindow]:
        out: list[ExposureWindow] = []
        for instance in self.instances("target", "prefill") + self.instances("target", "decode"):
            ups = self.startups_of(instance)
            for k, st in enumerate(ups):
                if st.pool_tokens < st.context_length:
                    end = ups[k + 1].ts if k + 1 < len(ups) else None
                    out.append(
                        ExposureWindow(
                            instance,
                            self.models["target"].gateway_model,
                            st.ts,
                            end,
                            st.pool_tokens,
                            st.context_length,
                        )
                    )
        return out


def build_deployment(s: Scenario) -> Deployment:
    startups = target_startups(s) + control_startups(s) + unified_startups(s)
    return Deployment(s, model_deployments(s), tuple(sorted(startups, key=lambda st: (st.ts, st.instance))))
