"""Traffic and latency constants of the simulator, derived once from public traces.

Regenerate the raw figures with ``python -m kvforensics.simulate.calibrate <traces dir>``
(figures below are from the copies under ``/work/shared/data/traces``; see that folder's
``MANIFEST.tsv``). Nothing here is read from disk at run time.

Attribution (licences travel with the numbers):

* Azure LLM inference trace 2023, Azure/AzurePublicDataset @ b469a113cedca53ddc3bdea71a143dc4b7d8700c,
  ``data/AzureLLMInferenceTrace_{conv,code}.csv``. CC-BY-4.0. Patel et al., "Splitwise: Efficient
  generative LLM inference using phase splitting", ISCA 2024.
* Mooncake FAST'25 conversation trace, kvcache-ai/Mooncake @ 3b5a594133958449a1feaf1c9e0fc1b553e34a28,
  ``FAST25-release/traces/conversation_trace.jsonl``. Apache-2.0. Qin et al., FAST 2025.
* ServeGen, alibaba/ServeGen @ f891d1189eb32b3868dfc443800c4150548c282a, ``data/language/m-large``
  (arrival windows, reformatted losslessly). Apache-2.0. Xiang et al., arXiv:2505.09999.
* MInference, microsoft/MInference @ fb56c917f618e8645f1cfc37535afd7424d78f0d,
  ``experiments/README.md`` dense FlashAttention-2 table. MIT (c) Microsoft. Jiang et al., NeurIPS 2024.
* Splitwise simulator perf model, Mutinifni/splitwise-sim @ 8f99e7dc9b407f4ce2488d03dd44c0b8b946dab0,
  ``data/perf_model.csv``. MIT (c) 2024 Pratyush Patel.
* Vidur profiling, microsoft/vidur @ e2d00e9afba96cec9f0e7ea560bbfc4a539fae6a. MIT (c) Microsoft.
  Agrawal et al., MLSys 2024 (cross-check of the short-prompt regime only).
"""

from __future__ import annotations

from typing import Final

# Quantile tables stay compact:
# fmt: off

# --- Token-length distributions: 21 quantiles (0%, 5%, ..., 100%), sampled by log-linear
# interpolation of the inverse CDF. ---------------------------------------------------------

#: Azure 2023 conversation trace, ContextTokens (19,366 rows).
AZURE_CONV_PROMPT_QUANTILES: Final = (
    2, 181, 207, 372, 387, 396, 403, 414, 703, 984, 1020,
    1045, 1071, 1097, 1130, 1189, 1315, 1876, 2734, 4083, 14050,
)
#: Azure 2023 conversation trace, GeneratedTokens.
AZURE_CONV_OUTPUT_QUANTILES: Final = (
    7, 41, 54, 67, 77, 85, 91, 96, 103, 113, 129,
    151, 177, 217, 384, 395, 400, 411, 424, 451, 1000,
)
#: Azure 2023 code trace, ContextTokens (8,819 rows).
AZURE_CODE_PROMPT_QUANTILES: Final = (
    3, 75, 147, 232, 386, 578, 770, 939, 1075, 1261, 1469,
    1690, 1909, 2164, 2433, 2744, 3192, 3920, 5188, 7303, 7437,
)
#: Azure 2023 code trace, GeneratedTokens.
AZURE_CODE_OUTPUT_QUANTILES: Final = (
    6, 6, 7, 7, 8, 9, 9, 10, 11, 12, 13,
    14, 16, 18, 20, 24, 29, 39, 55, 90, 1899,
)
#: Mooncake conversation trace, input_length (12,031 rows; 6.9% above 32K).
MOONCAKE_PROMPT_QUANTILES: Final = (
    891, 901, 964, 1261, 1662, 2306, 3263, 4251, 4993, 5870, 6909,
    8187, 9570, 11238, 13196, 15367, 17869, 21464, 27367, 39550, 126195,
)
#: Mooncake conversation trace, output_length.
MOONCAKE_OUTPUT_QUANTILES: Final = (
    1, 10, 24, 46, 100, 156, 213, 256, 291, 322, 350,
    375, 399, 423, 447, 472, 504, 543, 597, 698, 2000,
)

#: Share of requests drawn from each length source (Azure conv / Azure code / Mooncake).
#: Our choice: a general chat platform, with Mooncake standing in for document/chat-history use.
LENGTH_SOURCE_WEIGHTS: Final = (0.5, 0.2, 0.3)

# --- Prefix-cache reuse (Mooncake hash_ids, 512-token blocks) ------------------------------

#: 36.6% of all hash blocks repeat an earlier block.
MOONCAKE_REPEATED_BLOCK_SHARE: Final = 0.3664
#: Share of requests whose leading block(s) were seen before (a shared system prompt: 99.99%).
#: We apply a lower rate (our accounts do not all share one system prompt): an assumption.
PREFIX_HIT_RATE: Final = 0.55
#: Quantiles of the cached share of the prompt among requests with a prefix hit.
MOONCAKE_HIT_FRACTION_QUANTILES: Final = (
    0.0041, 0.0177, 0.0276, 0.0379, 0.0521, 0.0688, 0.0899, 0.1116, 0.1459, 0.2476, 0.3627,
    0.4604, 0.5372, 0.5676, 0.5732, 0.7124, 0.8357, 0.9094, 0.9482, 0.9756, 1.0,
)

# --- Arrivals (ServeGen language/m-large, 162 clients, 14 days of 10-minute windows) --------

#: Median per-client inter-arrival coefficient of variation over active windows (p90: 4.318).
SERVEGEN_IAT_CV_P50: Final = 1.168
SERVEGEN_IAT_CV_P90: Final = 4.318
#: Median Gamma shape fitted by ServeGen (0.885, i.e. CV 1.06): consistent with the CV above.
SERVEGEN_GAMMA_SHAPE_P50: Final = 0.885
#: Per-client share of the request rate: top-1 16.05%, top-10 63.22%; a power law fitted to
#: ranks 1-50 has exponent 1.164 (share ~ rank^-1.164).
SERVEGEN_TOP1_SHARE: Final = 0.1605
SERVEGEN_TOP10_SHARE: Final = 0.6322
ACCOUNT_ZIPF_EXPONENT: Final = 1.164
#: Total rate by hour of the trace day, normalised to mean 1. ServeGen windows are relative
#: seconds; we read hour 0 as 00:00 UTC (the real offset is not published).
DIURNAL_BY_UTC_HOUR: Final = (
    0.994, 1.002, 0.986, 0.936, 0.908, 0.883, 0.854, 0.817, 0.788, 0.868, 1.046,
    1.106, 0.971, 0.981, 1.047, 1.047, 1.109, 1.078, 1.040, 1.143, 1.133, 1.074,
    1.103, 1.086,
)
#: Standard deviation of log(total 10-minute rate / hour-of-day mean): window-to-window bursts.
BURST_LOG_SD: Final = 0.39

# --- Prefill latency t = a + b n + c n^2 (ms, n = uncached prompt tokens) ------------------

#: MInference, HF transformers dense FlashAttention-2, Llama-3-8B-1M on one A100-80GB, n >= 10K
#: (7 points, 10K-1M tokens; mean relative error 1.7%): b = 0.0867 ms/tok, c = 1.629e-6 ms/tok^2.
MINFERENCE_B_MS_PER_TOKEN: Final = 0.08668461007652353
MINFERENCE_C_MS_PER_TOKEN2: Final = 1.6292728507866228e-06
#: Splitwise llama2-70b on H100 x8 (TP8), batch 1, 128-8192 tokens: a = 46.5 ms (the fixed cost
#: of a TP8 forward pass; the MInference intercept is negative and not usable).
SPLITWISE_H100_TP8_A_MS: Final = 46.52815979429797
SPLITWISE_H100_TP8_B_MS_PER_TOKEN: Final = 0.02185022437303165

#: Reference shape of the MInference model (Llama-3-8B): layers x heads x head_dim, active params.
REFERENCE_ATTENTION_WIDTH: Final = 32 * 32 * 128
REFERENCE_ACTIVE_PARAMS_B: Final = 8.0
#: Dense BF16 throughput ratio H100/H200 vs A100 (989 / 312 TFLOP/s), and x2 again for FP8 GEMMs.
#: Our extrapolation: no public long-context H200 prefill measurement exists (traces README 2.5).
GPU_SPEEDUP_BF16: Final = 989.0 / 312.0
GPU_SPEEDUP_FP8: Final = 2.0 * 989.0 / 312.0

# --- Latency noise -----------------------------------------------------------------------------

#: TTFT = curve x (floor + lognormal(log(scale), sd)): never below 0.85x the curve, median ~1.03x.
TTFT_NOISE_FLOOR: Final = 0.85
TTFT_NOISE_SCALE: Final = 0.17
TTFT_NOISE_LOG_SD: Final = 0.7
#: Ordinary scheduler queueing (exponential mean, ms), and the share of requests caught in a
#: backlog (lognormal queue with the given median in ms): the "queued request" traps.
QUEUE_MEAN_MS: Final = 15.0
BACKLOG_SHARE: Final = 0.015
BACKLOG_MEDIAN_MS: Final = 9000.0

# --- Decode step time (ms per output token) --------------------------------------------------

#: Splitwise llama2-70b on H100 x8: median token_time 29.9-31.4 ms for batch 1-16 and prompts
#: 128-8192; the slope over prompt size is ~1.9e-4 ms per context token (noisy: 5 repeats).
SPLITWISE_H100_TP8_TOKEN_TIME_MS: Final = 30.0
SPLITWISE_TOKEN_TIME_PER_CONTEXT_TOKEN_MS: Final = 1.9e-4
