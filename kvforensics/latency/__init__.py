"""Prefill-latency model: how fast can a real prefill of ``n`` uncached prompt tokens be?

The affected responses of a KV-cache leak are answered *faster than a real prefill of that many
tokens could take* (the rejected prompt was swapped for a one-token placeholder). To say so in a
disclosure report a responder needs a floor for time-to-first-token (TTFT) that they can defend.
This package gives two independent ones:

* an **empirical lower envelope** fitted to the deployment's own healthy traffic
  (:func:`fit_lower_envelope` for arrays, :func:`fit_models` for the ``requests`` table), and
* a **physical lower bound** from the FLOPs a dense or MoE transformer must execute and the
  vendor's peak throughput (:func:`physical_lower_bound_ms`), which needs no traffic at all.

Both use the prefill curve ``t(n) = a + b*n + c*n**2`` (ms), with ``a, b, c >= 0``: a fixed
cost per forward pass, the weight matmuls (linear in n) and causal attention (quadratic in n).
The curve is fitted by least squares on *relative* error (weights ``1/t``) with non-negative
coefficients (:func:`fit_curve`); ``tests/test_latency.py`` checks it against public GPU
measurements (Splitwise, Vidur, MInference; see ``tests/data/traces/README.md``).

The package, one module per part: ``curve.py`` (the curve and its fit), ``envelope.py`` (the
envelope algorithm, for arrays), ``from_requests.py`` (per-model envelopes of the ``requests``
table, written to ``latency_model``) and ``physical.py`` (the physical bound).
"""

from __future__ import annotations

from kvforensics.latency.curve import CurveFit, LatencyModelError, PrefillCurve, fit_curve
from kvforensics.latency.envelope import ENVELOPE_METHOD, LatencyFit, fit_lower_envelope
from kvforensics.latency.from_requests import LATENCY_MODEL_DDL, fit_models
from kvforensics.latency.physical import (
    A100_SXM,
    B200_HGX,
    H100_SXM,
    H200_SXM,
    GpuPeakFlops,
    HardwareSpec,
    physical_lower_bound_ms,
    prefill_flops,
)

__all__ = [
    "A100_SXM",
    "B200_HGX",
    "ENVELOPE_METHOD",
    "H100_SXM",
    "H200_SXM",
    "LATENCY_MODEL_DDL",
    "CurveFit",
    "GpuPeakFlops",
    "HardwareSpec",
    "LatencyFit",
    "LatencyModelError",
    "PrefillCurve",
    "fit_curve",
    "fit_lower_envelope",
    "fit_models",
    "physical_lower_bound_ms",
    "prefill_flops",
]
