"""The physical lower bound of a prefill: the FLOPs a dense or MoE transformer must execute over the
vendor's peak throughput, which needs no traffic at all.

:func:`physical_lower_bound_ms` for a :class:`HardwareSpec`; the GPUs' peaks (``A100_SXM`` ...)
cite their datasheets. ``kvforensics/config/hardware.py`` builds a spec from the incident file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from kvforensics.latency.curve import ArrayLike, FloatArray, LatencyModelError


@dataclass(frozen=True)
class GpuPeakFlops:
    """Vendor peak dense (no 2:4 sparsity) tensor-core throughput of one GPU, in FLOP/s."""

    name: str
    bf16_dense_flops: float
    fp8_dense_flops: float | None
    source: str


#: NVIDIA A100 80GB SXM. Datasheet "NVIDIA A100 Tensor Core GPU" (2021): BFLOAT16 Tensor Core
#: 312 TFLOPS dense, 624 with sparsity. No FP8 tensor cores.
A100_SXM: Final = GpuPeakFlops(
    "NVIDIA A100 80GB SXM",
    312e12,
    None,
    "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 TFLOPS with sparsity)",
)

#: NVIDIA H100 SXM5. Datasheet "NVIDIA H100 Tensor Core GPU": BF16 1,979 and FP8 3,958 TFLOPS
#: *with sparsity*; dense is half (989.4 / 1,978.9 in the Hopper architecture whitepaper).
H100_SXM: Final = GpuPeakFlops(
    "NVIDIA H100 SXM",
    989.4e12,
    1978.9e12,
    "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 / FP8 3,958 TFLOPS with sparsity; dense = half",
)

#: NVIDIA H200 SXM: same GH100 compute as H100 SXM with more, faster memory. Datasheet "NVIDIA
#: H200 Tensor Core GPU": BF16 1,979 and FP8 3,958 TFLOPS with sparsity; dense is half.
H200_SXM: Final = GpuPeakFlops(
    "NVIDIA H200 SXM",
    989.4e12,
    1978.9e12,
    "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 / FP8 3,958 TFLOPS with sparsity; dense = half",
)

#: NVIDIA B200 in HGX B200 (1,000 W). Datasheet "NVIDIA HGX B200" / Blackwell: per GPU FP16/BF16
#: 4.5 PFLOPS and FP8 9 PFLOPS with sparsity; dense is half. (GB200 NVL72 parts run higher:
#: 5 / 10 PFLOPS with sparsity; build a GpuPeakFlops for them if that is the hardware.)
B200_HGX: Final = GpuPeakFlops(
    "NVIDIA B200 (HGX B200)",
    2.25e15,
    4.5e15,
    "NVIDIA HGX B200 datasheet: per GPU BF16 4.5 / FP8 9 PFLOPS with sparsity; dense = half",
)


@dataclass(frozen=True)
class HardwareSpec:
    """What a physical prefill bound needs to know about the model and the GPUs serving it.

    * ``active_params``: parameters every token is multiplied with. For a dense model, all
      parameters except the input embedding table and the LM head (engines compute logits for
      the last prompt position only); for an MoE, the shared parts plus the ``top-k`` routed
      experts. Counting more than this makes the bound too high, so when unsure count fewer.
    * ``layers``: layers with softmax attention over the context (only used for attention).
    * ``hidden_size``: width used for attention when the head dimensions are not given.
    * ``n_gpus``: GPUs that can work on *one* request's prefill at once (tensor x context
      parallel, plus pipeline stages only with chunked pipelining). Not data-parallel replicas.
      Overstating it keeps the bound valid.
    * ``peak_flops_per_gpu``: vendor peak *dense* FLOP/s for the precision of the matmuls
      (e.g. ``H200_SXM.fp8_dense_flops`` for an FP8 deployment). Never the sparsity figure.
    * ``mfu_ceiling``: best achievable fraction of peak; 1.0 (default) is the strict bound.
    * ``attention_heads``, ``qk_head_dim``, ``v_head_dim``: query heads and per-head dims;
      if given, attention widths are ``heads * qk_head_dim`` and ``heads * v_head_dim``
      (e.g. MLA models: 192 and 128), else both are ``hidden_size``.
    * ``attention_window``: keys each query attends at most (sliding window, or the top-k of a
      sparse attention such as DeepSeek Sparse Attention); None means dense causal attention.
    """

    active_params: float
    layers: int
    hidden_size: int
    n_gpus: int
    peak_flops_per_gpu: float
    mfu_ceiling: float = 1.0
    attention_heads: int | None = None
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    attention_window: int | None = None

    def __post_init__(self) -> None:
        if not (self.active_params > 0 and self.layers >= 0 and self.hidden_size > 0 and self.n_gpus >= 1):
            raise LatencyModelError("active_params and hidden_size must be > 0, layers >= 0, n_gpus >= 1")
        if not self.peak_flops_per_gpu > 0:
            raise LatencyModelError(f"peak_flops_per_gpu must be > 0, got {self.peak_flops_per_gpu}")
        if not 0 < self.mfu_ceiling <= 1:
            raise LatencyModelError(f"mfu_ceiling must be in (0, 1], got {self.mfu_ceiling}")
        head_fields = (self.attention_heads, self.qk_head_dim, self.v_head_dim)
        if any(v is not None for v in head_fields) and not all(v is not None and v > 0 for v in head_fields):
            raise LatencyModelError("give all of attention_heads, qk_head_dim and v_head_dim (> 0), or none")
        if self.attention_window is not None and self.attention_window < 0:
            raise LatencyModelError(f"attention_window must be >= 0, got {self.attention_window}")

    @property
    def attention_width(self) -> int:
        """``d_qk + d_v`` summed over query heads (``2 * hidden_size`` by default)."""
        if self.attention_heads and self.qk_head_dim and self.v_head_dim:
            return self.attention_heads * (self.qk_head_dim + self.v_head_dim)
        return 2 * self.hidden_size


def prefill_flops(n: ArrayLike, spec: HardwareSpec) -> FloatArray:
    """Minimum FLOPs to prefill ``n`` tokens: ``2*P*n + L*(d_qk + d_v)*pairs(n)``.

    ``pairs(n)`` is the number of (query, key) pairs of causal attention, ``n**2 / 2`` (the
    exact count ``n*(n+1)/2`` is larger), or ``W**2/2 + (n - W)*W`` beyond a window ``W``. Each
    pair costs ``2*d_qk`` FLOPs for ``QK^T`` and ``2*d_v`` for ``AV`` per layer, so dense
    attention adds ``2*L*n**2*hidden_size``. Softmax, norms, activations and communication are
    left out: they only add time.
    """
    x = np.asarray(n, dtype=np.float64)
    if spec.attention_window is None:
        pairs = x * x / 2.0
    else:
        w = float(spec.attention_window)
        pairs = np.where(x <= w, x * x / 2.0, w * w / 2.0 + (x - w) * w)
    return 2.0 * spec.active_params * x + 2.0 * spec.layers * spec.attention_width * pairs


def physical_lower_bound_ms(n: ArrayLike, spec: HardwareSpec) -> FloatArray:
    """The least time (ms) any engine needs to prefill ``n`` uncached tokens on ``spec``.

    ``prefill_flops(n) / (n_gpus * peak_flops_per_gpu * mfu_ceiling)``, i.e. (for dense
    attention) ``(2*active_params*n + 2*layers*n**2*hidden_size) / (n_gpus*peak*mfu)``.

    Assumptions, to state next to any figure derived from it:

    * every prompt token runs through every active weight once (no speculative skipping, no
      reuse beyond what ``cached_tokens`` reports) and attention is dense and causal unless
      ``attention_window`` says otherwise;
    * the GPUs reach at most the vendor's dense peak for the stated precision (real prefill
      reaches roughly 30-70% of it, so the bound is loose, which is the safe direction);
    * it ignores memory bandwidth, kernel launches, communication and queueing, which only add.

    A response faster than this bound did not run a real prefill of that many tokens. It does
    not hold for engines that skip attention work (sparse attention such as MInference or
    A-Shape beats the dense bound at long context; describe them with ``attention_window``).
    """
    throughput = spec.n_gpus * spec.peak_flops_per_gpu * spec.mfu_ceiling
    return prefill_flops(n, spec) / throughput * 1e3
