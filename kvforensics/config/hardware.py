"""Model/hardware specs from the incident file, for the physical prefill bound in the report.

```toml
[models.hardware."@cf/zai-org/glm-5.3"]
active_params = 32e9     # parameters each token passes through (MoE: shared + routed top-k)
layers = 78
hidden_size = 6144
n_gpus = 8               # GPUs working on one request's prefill (TP x CP)
gpu = "H200_SXM"         # A100_SXM | H100_SXM | H200_SXM | B200_HGX
precision = "fp8"        # bf16 | fp8
```
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from kvforensics import latency
from kvforensics.core.errors import ConfigError

GPUS = {
    "A100_SXM": latency.A100_SXM,
    "H100_SXM": latency.H100_SXM,
    "H200_SXM": latency.H200_SXM,
    "B200_HGX": latency.B200_HGX,
}
_SPEC_KEYS = {
    "active_params",
    "layers",
    "hidden_size",
    "n_gpus",
    "mfu_ceiling",
    "attention_heads",
    "qk_head_dim",
    "v_head_dim",
    "attention_window",
}
SPEC_TABLE_KEYS = frozenset(_SPEC_KEYS | {"gpu", "precision", "peak_flops_per_gpu"})  # a [models.hardware."m"] table
PRECISIONS = ("bf16", "fp8")


def spec_from_config(model: str, raw: Mapping[str, Any]) -> latency.HardwareSpec:
    where = f'[models.hardware."{model}"]'
    unknown = set(raw) - SPEC_TABLE_KEYS
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)}", location=where)
    if "peak_flops_per_gpu" in raw:
        peak = float(raw["peak_flops_per_gpu"])
    else:
        gpu = GPUS.get(str(raw.get("gpu", "")))
        if gpu is None:
            raise ConfigError(f"gpu must be one of {sorted(GPUS)} (or give peak_flops_per_gpu)", location=where)
        precision = str(raw.get("precision", "bf16")).lower()
        chosen = gpu.fp8_dense_flops if precision == "fp8" else gpu.bf16_dense_flops
        if chosen is None:
            raise ConfigError(f"{gpu.name} has no {precision} tensor cores", location=where)
        peak = chosen
    args = {k: raw[k] for k in _SPEC_KEYS if k in raw}
    try:
        return latency.HardwareSpec(peak_flops_per_gpu=peak, **args)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e), location=where) from None


def physical_bounds(specs: Mapping[str, latency.HardwareSpec], affected: Any) -> list[dict[str, Any]]:
    """Per model: how much faster than the hardware allows the affected responses were.

    ``affected``: DataFrame with model, prompt_tokens, cached_tokens, ttft_ms. Responses without a
    measured TTFT are left out (end-to-end latency includes decoding and proves nothing here).
    """
    out = []
    for model, spec in sorted(specs.items()):
        rows = affected[affected["model"] == model]
        if rows.empty:
            continue
        observed = rows["ttft_ms"].astype(float)  # TTFT only: e2e latency includes decoding
        n = (rows["prompt_tokens"] - rows["cached_tokens"].fillna(0)).astype(float)
        bound = latency.physical_lower_bound_ms(n.to_numpy(), spec)
        ok = observed.notna().to_numpy() & (observed.to_numpy() > 0)
        if not ok.any():
            continue
        ratio = np.asarray(bound)[ok] / observed.to_numpy()[ok]
        out.append(
            {
                "model": model,
                "responses": int(ok.sum()),
                "min_bound_ms": float(np.min(np.asarray(bound)[ok])),
                "median_observed_ms": float(np.median(observed.to_numpy()[ok])),
                "min_speedup": float(np.min(ratio)),
                "median_speedup": float(np.median(ratio)),
            }
        )
    return out
