"""Derive the simulator's traffic and latency parameters from public traces (run by hand).

    python -m kvforensics.simulate.calibrate /work/shared/data/traces

Prints the numbers that ``calibration.py`` records as constants. Nothing in the package imports
this module at run time and nothing reads the trace folder at run time: the traces are only the
evidence behind the constants. Sources (see each folder's LICENSE and ``MANIFEST.tsv``):

* ``azure_llm_inference_2023/`` Azure/AzurePublicDataset @ b469a113, CC-BY-4.0
  (Patel et al., "Splitwise", ISCA 2024): prompt/output token counts.
* ``mooncake_fast25/conversation_trace.jsonl.gz`` kvcache-ai/Mooncake @ 3b5a5941, Apache-2.0
  (Qin et al., FAST 2025): long-context prompt lengths and prefix-block reuse (``hash_ids``).
* ``servegen/`` alibaba/ServeGen @ f891d118, Apache-2.0 (Xiang et al., arXiv:2505.09999):
  per-client arrival CV, diurnal shape, per-client skew.
* ``minference_long_context_prefill/`` microsoft/MInference @ fb56c917, MIT: dense
  FlashAttention-2 prefill up to 1M tokens.
* ``splitwise_perf_model/perf_model.csv`` Mutinifni/splitwise-sim @ 8f99e7dc, MIT: prefill
  intercept and linear term on H100 TP8.
* ``derived/vidur_codellama34b_a100_tp2_composed_prefill.csv`` microsoft/vidur @ e2d00e9a, MIT:
  cross-check of the short-prompt regime.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

QUANTILE_LEVELS = np.linspace(0.0, 1.0, 21)


def quantiles(values: np.ndarray) -> list[int]:
    """Twenty-one evenly spaced quantiles (0%, 5%, ..., 100%), rounded to integers."""
    return [int(round(q)) for q in np.quantile(values, QUANTILE_LEVELS)]


def fit_quadratic(n: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """Least-squares fit of t = a + b n + c n^2 weighted by 1/t (minimises relative error)."""
    design = np.column_stack([np.ones_like(n), n, n**2]) / t[:, None]
    coef, *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def azure_lengths(root: Path) -> dict[str, list[int]]:
    conv = pd.read_csv(root / "azure_llm_inference_2023/AzureLLMInferenceTrace_conv.csv.gz")
    code = pd.read_csv(root / "azure_llm_inference_2023/AzureLLMInferenceTrace_code.csv.gz")
    return {
        "conv_prompt": quantiles(conv["ContextTokens"].to_numpy()),
        "conv_output": quantiles(conv["GeneratedTokens"].to_numpy()),
        "code_prompt": quantiles(code["ContextTokens"].to_numpy()),
        "code_output": quantiles(code["GeneratedTokens"].to_numpy()),
    }


def mooncake_reuse(root: Path) -> dict[str, object]:
    seen: set[int] = set()
    fractions: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    repeated = total = 0
    with gzip.open(root / "mooncake_fast25/conversation_trace.jsonl.gz", "rt") as fh:
        for line in fh:
            row = json.loads(line)
            blocks = row["hash_ids"]
            hits = 0
            for block in blocks:  # a prefix hit is the run of leading blocks already seen
                if block not in seen:
                    break
                hits += 1
            repeated += sum(1 for b in blocks if b in seen)
            total += len(blocks)
            seen.update(blocks)
            fractions.append(min(1.0, hits * 512 / max(1, row["input_length"])))
            inputs.append(row["input_length"])
            outputs.append(row["output_length"])
    frac = np.array(fractions)
    hit = frac[frac > 0]
    return {
        "repeated_block_share": round(repeated / total, 4),
        "requests_with_prefix_hit": round(float((frac > 0).mean()), 4),
        "hit_fraction_quantiles": [round(float(q), 4) for q in np.quantile(hit, QUANTILE_LEVELS)],
        "input_quantiles": quantiles(np.array(inputs)),
        "output_quantiles": quantiles(np.array(outputs)),
        "share_over_32k": round(float((np.array(inputs) > 32768).mean()), 4),
    }


def servegen_arrivals(root: Path) -> dict[str, object]:
    df = pd.read_csv(root / "servegen/servegen_arrival_windows.csv.gz")
    large = df[(df["category"] == "language") & (df["model"] == "m-large")]
    active = large[large["rate_rps"] > 0]
    gamma = active[active["arrival_dist"] == "Gamma"]
    per_client = large.groupby("client_id")["rate_rps"].mean().sort_values(ascending=False)
    shares = (per_client / per_client.sum()).to_numpy()
    ranks = np.arange(1, 51)
    slope, _ = np.polyfit(np.log(ranks), np.log(shares[:50]), 1)
    total = large.groupby("window_start_s")["rate_rps"].sum()
    hour = (total.index.to_numpy() % 86400) // 3600
    by_hour = total.groupby(hour).mean()
    diurnal = (by_hour / by_hour.mean()).round(3).tolist()
    residual = np.log(total.to_numpy() / by_hour.loc[hour].to_numpy())
    return {
        "client_cv_p50": round(float(active["cv"].median()), 3),
        "client_cv_p90": round(float(active["cv"].quantile(0.9)), 3),
        "gamma_shape_p50": round(float(gamma["dist_param1"].median()), 4),
        "top1_share": round(float(shares[0]), 4),
        "top10_share": round(float(shares[:10].sum()), 4),
        "zipf_exponent": round(float(-slope), 3),
        "clients": int(len(shares)),
        "diurnal_by_utc_hour": diurnal,
        "burst_log_sd_10min": round(float(residual.std()), 3),
    }


def prefill_fits(root: Path) -> dict[str, object]:
    mi = pd.read_csv(root / "minference_long_context_prefill/a100_llama3_8b_1m_prefill_latency.csv")
    dense = mi[(mi["engine"] == "hf_transformers") & (mi["attention_method"] == "FlashAttention-2")]
    dense = dense[dense["prompt_tokens"] >= 10_000]
    mi_fit = fit_quadratic(dense["prompt_tokens"].to_numpy(float), dense["prefill_latency_s"].to_numpy() * 1e3)
    sw = pd.read_csv(root / "splitwise_perf_model/perf_model.csv")
    bs1 = sw[(sw["model"] == "llama2-70b") & (sw["hardware"] == "h100-80gb") & (sw["batch_size"] == 1)]
    h100 = bs1[bs1["tensor_parallel"] == 8].groupby("prompt_size")["prompt_time"].median()
    sw_fit = fit_quadratic(h100.index.to_numpy(float), h100.to_numpy())
    vidur = pd.read_csv(root / "derived/vidur_codellama34b_a100_tp2_composed_prefill.csv")
    return {
        "minference_hf_fa2_ge10k": mi_fit,
        "splitwise_llama2_70b_h100_tp8": sw_fit,
        "vidur_columns": list(vidur.columns),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvforensics.simulate.calibrate /path/to/traces", file=sys.stderr)
        return 2
    root = Path(argv[0])
    result = {
        "azure": azure_lengths(root),
        "mooncake": mooncake_reuse(root),
        "servegen": servegen_arrivals(root),
        "prefill": prefill_fits(root),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
