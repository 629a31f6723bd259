"""Prefill-latency model: how fast can a real prefill of ``n`` uncached prompt tokens be?

The affected responses of a KV-cache leak are answered *faster than a real prefill of that many
tokens could take* (the rejected prompt was swapped for a one-token placeholder). To say so in a
disclosure report a responder needs a floor for time-to-first-token (TTFT) that they can defend.
This module gives two independent ones:

* an **empirical lower envelope** fitted to the deployment's own healthy traffic
  (:func:`fit_lower_envelope` for arrays, :func:`fit_models` for the ``requests`` table), and
* a **physical lower bound** from the FLOPs a dense or MoE transformer must execute and the
  vendor's peak throughput (:func:`physical_lower_bound_ms`), which needs no traffic at all.

Both use the prefill curve ``t(n) = a + b*n + c*n**2`` (ms), with ``a, b, c >= 0``: a fixed
cost per forward pass, the weight matmuls (linear in n) and causal attention (quadratic in n).
The curve is fitted by least squares on *relative* error (weights ``1/t``) with non-negative
coefficients (:func:`fit_curve`); ``tests/test_latency.py`` checks it against public GPU
measurements (Splitwise, Vidur, MInference; see ``tests/data/traces/README.md``).

Envelope algorithm (the same for arrays and DuckDB; only the aggregation backend differs):

1. Keep points with ``n >= 1`` uncached token and ``TTFT > 0``; put them in log-spaced bins
   ``floor(log10(n) * bins_per_decade)``; skip bins with fewer than ``min_bin_points`` points.
2. Take a low quantile (``bin_quantile``, default 10%) of TTFT per bin. Reject bins that are
   physically inconsistent with the others: a curve with non-negative coefficients never
   decreases and never grows faster than ``n**2``, so a bin whose quantile is more than 2x
   below a shorter-prompt bin, or more than 2x above what quadratic growth allows from a longer
   one, is dropped (most violations first). This removes bins filled with too-fast responses,
   e.g. every prompt above the KV pool size in the incident.
3. Fit the curve to the bin quantiles, then refine it a few times: per bin, the ``bin_quantile``
   of ``TTFT / curve(n)`` over points that are not *far below* the curve
   (``ratio < far_below_ratio``, default 5x faster than the 10% curve), which removes the
   in-bin slope bias and ignores contaminating too-fast responses.
4. Scale the curve by the ``quantile`` (default 2%) of ``TTFT / curve(n)`` over all points that
   are not far below, so at most ``quantile`` of them lie below the envelope. Far-below points
   are counted (``n_far_below``), never used to place the envelope: they are what the detection
   rules look for.
"""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final, Literal, Protocol

import duckdb
import numpy as np
import numpy.typing as npt

from kvforensics.errors import KvForensicsError

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

ArrayLike = npt.ArrayLike
FloatArray = npt.NDArray[np.float64]

#: Name of the envelope method, stored in ``latency_model.method``.
ENVELOPE_METHOD: Final = "log-binned quantile lower envelope, NNLS relative fit, scaled to quantile (v1)"

#: Two bins are inconsistent when one is this factor off what a non-negative curve allows.
_BIN_CONSISTENCY_FACTOR: Final = 2.0
_REFINE_ITERATIONS: Final = 8
_REFINE_TOLERANCE: Final = 1e-4
#: The point at the envelope quantile lies on the envelope; shaving the scale by this factor keeps
#: floating-point rounding from counting it as below.
_ON_ENVELOPE: Final = 1.0 - 1e-9
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LatencyModelError(KvForensicsError):
    """A latency model cannot be fitted or used as asked."""


# --------------------------------------------------------------------------------------------
# The curve and its least-squares fit
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillCurve:
    """Prefill time ``t(n) = a + b*n + c*n**2`` in ms for ``n`` uncached prompt tokens.

    All coefficients are finite and ``>= 0``, so the curve never decreases in ``n``.
    """

    a_ms: float
    b_ms_per_token: float
    c_ms_per_token2: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise LatencyModelError(f"{f.name} must be a finite number >= 0, got {value!r}")

    def predict(self, n: ArrayLike) -> FloatArray:
        """Prefill time in ms for each ``n`` (array in, array out; a scalar gives a 0-d array)."""
        x = np.asarray(n, dtype=np.float64)
        return self.a_ms + self.b_ms_per_token * x + self.c_ms_per_token2 * x * x

    def scaled(self, factor: float) -> PrefillCurve:
        """The same curve multiplied by ``factor`` (>= 0)."""
        return PrefillCurve(self.a_ms * factor, self.b_ms_per_token * factor, self.c_ms_per_token2 * factor)

    def to_dict(self) -> dict[str, float]:
        """Coefficients as a JSON-ready dict."""
        return {
            "a_ms": self.a_ms,
            "b_ms_per_token": self.b_ms_per_token,
            "c_ms_per_token2": self.c_ms_per_token2,
        }


@dataclass(frozen=True)
class CurveFit:
    """A :class:`PrefillCurve` fitted to measured points, with its goodness of fit.

    ``r2`` is the ordinary coefficient of determination on the ms scale; ``mean_rel_err`` and
    ``max_rel_err`` are ``|predicted / measured - 1|`` over the fitted points.
    """

    curve: PrefillCurve
    weights: str
    n_points: int
    min_tokens: float
    max_tokens: float
    r2: float
    mean_rel_err: float
    max_rel_err: float

    def predict(self, n: ArrayLike) -> FloatArray:
        """Fitted prefill time in ms (see :meth:`is_extrapolated` for points outside the data)."""
        return self.curve.predict(n)

    def is_extrapolated(self, n: ArrayLike) -> npt.NDArray[np.bool_]:
        """True where ``n`` lies outside the token range the curve was fitted on."""
        x = np.asarray(n, dtype=np.float64)
        return (x < self.min_tokens) | (x > self.max_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN becomes ``None``)."""
        return {
            **self.curve.to_dict(),
            "weights": self.weights,
            "n_points": self.n_points,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "r2": _json_float(self.r2),
            "mean_rel_err": _json_float(self.mean_rel_err),
            "max_rel_err": _json_float(self.max_rel_err),
        }

    def _repr_html_(self) -> str:
        return _html_table("Prefill curve fit", self.to_dict())


def fit_curve(
    n: ArrayLike, t_ms: ArrayLike, *, weights: Literal["relative", "absolute"] = "relative"
) -> CurveFit:
    """Fit ``t ≈ a + b*n + c*n**2`` with ``a, b, c >= 0`` by (weighted) least squares.

    ``weights="relative"`` minimises ``sum(((pred - t) / t) ** 2)``, i.e. relative error, so a
    1-second point counts as much as a 30-minute one; ``"absolute"`` is ordinary least squares.
    The non-negative solution is exact: the optimum of a non-negative least-squares problem is
    the unconstrained least-squares solution on its own support, so solving all 7 non-empty
    subsets of the 3 coefficients and keeping the best feasible one finds it.

    Raises :class:`LatencyModelError` for mismatched, non-finite or non-positive input, or
    fewer than 3 distinct token counts (a 3-coefficient curve would be underdetermined).
    """
    x = np.asarray(n, dtype=np.float64).ravel()
    y = np.asarray(t_ms, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise LatencyModelError(f"n and t_ms differ in length ({x.size} vs {y.size})")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise LatencyModelError("n and t_ms must be finite: drop missing values before fitting")
    if (x < 0).any() or (y <= 0).any():
        raise LatencyModelError("n must be >= 0 and t_ms > 0")
    if np.unique(x).size < 3:
        raise LatencyModelError(
            f"need at least 3 distinct token counts to fit a + b*n + c*n^2, got {np.unique(x).size}"
        )
    if weights not in ("relative", "absolute"):
        raise LatencyModelError(f"weights must be 'relative' or 'absolute', got {weights!r}")

    w = 1.0 / y if weights == "relative" else np.ones_like(y)
    design = np.column_stack([np.ones_like(x), x, x * x]) * w[:, None]
    target = y * w
    coef = _nnls_3(design, target)
    curve = PrefillCurve(float(coef[0]) + 0.0, float(coef[1]) + 0.0, float(coef[2]) + 0.0)  # no -0.0
    pred = curve.predict(x)
    rel = np.abs(pred / y - 1.0)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else math.nan
    return CurveFit(
        curve=curve,
        weights=weights,
        n_points=int(x.size),
        min_tokens=float(x.min()),
        max_tokens=float(x.max()),
        r2=r2,
        mean_rel_err=float(rel.mean()),
        max_rel_err=float(rel.max()),
    )


def _nnls_3(design: FloatArray, target: FloatArray) -> FloatArray:
    """Exact non-negative least squares for a 3-column design, by enumerating supports."""
    scale = np.linalg.norm(design, axis=0)
    scale[scale == 0] = 1.0
    scaled = design / scale
    best_coef = np.zeros(3)
    best_rss = float((target**2).sum())
    for size in (1, 2, 3):
        for support in itertools.combinations(range(3), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(scaled[:, cols], target, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(3)
            coef[cols] = sol / scale[cols]
            rss = float(((design @ coef - target) ** 2).sum())
            if rss < best_rss * (1 - 1e-12):
                best_coef, best_rss = coef, rss
    return best_coef


# --------------------------------------------------------------------------------------------
# Empirical lower envelope
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyFit:
    """A lower envelope of TTFT vs uncached prompt tokens, or the reason there is none.

    ``curve`` is the envelope (ms); at most ``quantile`` of the points that are not far below it
    (``fraction_below``) lie under it. ``min_tokens``/``max_tokens`` is the token range of the
    bins the fit used: a bound for a longer prompt is an extrapolation, and
    :meth:`is_extrapolated` says so. ``r2`` and the relative errors compare the un-scaled curve
    with the per-bin quantiles it was fitted to.
    """

    usable: bool
    reason: str | None
    curve: PrefillCurve | None
    quantile: float
    bin_quantile: float
    bins_per_decade: int
    envelope_scale: float | None
    n_points: int
    n_far_below: int
    n_bins: int
    n_bins_rejected: int
    min_tokens: int | None
    max_tokens: int | None
    r2: float | None
    mean_rel_err: float | None
    max_rel_err: float | None
    fraction_below: float | None
    notes: tuple[str, ...] = ()
    method: str = ENVELOPE_METHOD

    @property
    def max_observed_tokens(self) -> int | None:
        """Longest prompt (uncached tokens) covered by the fitted bins."""
        return self.max_tokens

    def lower_bound_ms(self, n: ArrayLike) -> FloatArray:
        """Envelope TTFT in ms for ``n`` uncached tokens; raises if the fit is not usable."""
        if not self.usable or self.curve is None:
            raise LatencyModelError(f"no usable latency model: {self.reason}")
        return self.curve.predict(n)

    def is_extrapolated(self, n: ArrayLike) -> npt.NDArray[np.bool_]:
        """True where ``n`` lies outside the observed token range (all True if not usable)."""
        x = np.asarray(n, dtype=np.float64)
        if self.min_tokens is None or self.max_tokens is None:
            return np.ones_like(x, dtype=bool)
        return (x < self.min_tokens) | (x > self.max_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN becomes ``None``)."""
        curve = (
            self.curve.to_dict()
            if self.curve
            else dict.fromkeys(("a_ms", "b_ms_per_token", "c_ms_per_token2"))
        )
        return {
            "usable": self.usable,
            "reason": self.reason,
            **curve,
            "quantile": self.quantile,
            "bin_quantile": self.bin_quantile,
            "bins_per_decade": self.bins_per_decade,
            "envelope_scale": _json_float(self.envelope_scale),
            "n_points": self.n_points,
            "n_far_below": self.n_far_below,
            "n_bins": self.n_bins,
            "n_bins_rejected": self.n_bins_rejected,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "r2": _json_float(self.r2),
            "mean_rel_err": _json_float(self.mean_rel_err),
            "max_rel_err": _json_float(self.max_rel_err),
            "fraction_below": _json_float(self.fraction_below),
            "notes": list(self.notes),
            "method": self.method,
        }

    def _repr_html_(self) -> str:
        row = self.to_dict()
        row["notes"] = "; ".join(self.notes)
        return _html_table("Prefill-latency lower envelope", row)


@dataclass(frozen=True)
class _EnvelopeSettings:
    quantile: float
    bin_quantile: float
    bins_per_decade: int
    min_points: int
    min_bin_points: int
    far_below_ratio: float
    min_token_span: float

    def __post_init__(self) -> None:
        if not 0 < self.quantile < self.bin_quantile <= 0.5:
            raise LatencyModelError(
                f"need 0 < quantile < bin_quantile <= 0.5, got quantile={self.quantile}, "
                f"bin_quantile={self.bin_quantile}"
            )
        if self.bins_per_decade < 1 or self.min_points < 1 or self.min_bin_points < 2:
            raise LatencyModelError("bins_per_decade and min_points must be >= 1, min_bin_points >= 2")
        if not 0 < self.far_below_ratio < 1:
            raise LatencyModelError(f"far_below_ratio must be in (0, 1), got {self.far_below_ratio}")
        if self.min_token_span < 1:
            raise LatencyModelError(f"min_token_span must be >= 1, got {self.min_token_span}")


@dataclass(frozen=True)
class _BinStat:
    """One log bin: point count, median tokens and a quantile (of TTFT, or of TTFT/curve)."""

    bin: int
    points: int
    n_median: float
    value: float


@dataclass(frozen=True)
class _RatioSummary:
    n_far_below: int
    n_kept: int
    scale: float | None


class _EnvelopeSample(Protocol):
    """Where the envelope algorithm reads its aggregates from: numpy arrays or a DuckDB table."""

    def point_count(self) -> int: ...

    def bin_quantiles(
        self, q: float, per_decade: int, curve: PrefillCurve | None, far: float
    ) -> list[_BinStat]:
        """Per bin: quantile ``q`` of TTFT (``curve`` None) or of TTFT/curve over ratios >= far."""
        ...

    def token_range(self, per_decade: int, bins: Sequence[int]) -> tuple[int, int]: ...

    def ratio_summary(self, curve: PrefillCurve, far: float, quantile: float) -> _RatioSummary: ...

    def count_below(self, curve: PrefillCurve, far: float, scale: float) -> int: ...


@dataclass(frozen=True)
class _ArraySample:
    """In-memory points (already cleaned: n >= 1, t > 0, finite)."""

    n: FloatArray
    t: FloatArray

    def point_count(self) -> int:
        return int(self.n.size)

    def _bins(self, per_decade: int) -> npt.NDArray[np.int64]:
        bins: npt.NDArray[np.int64] = np.floor(np.log10(self.n) * per_decade).astype(np.int64)
        return bins

    def bin_quantiles(
        self, q: float, per_decade: int, curve: PrefillCurve | None, far: float
    ) -> list[_BinStat]:
        bins = self._bins(per_decade)
        values = self.t if curve is None else self.t / curve.predict(self.n)
        keep = np.ones_like(values, dtype=bool) if curve is None else values >= far
        out = []
        for b in np.unique(bins[keep]):
            sel = keep & (bins == b)
            out.append(
                _BinStat(
                    int(b), int(sel.sum()), float(np.median(self.n[sel])), float(np.quantile(values[sel], q))
                )
            )
        return out

    def token_range(self, per_decade: int, bins: Sequence[int]) -> tuple[int, int]:
        sel = np.isin(self._bins(per_decade), np.asarray(bins, dtype=np.int64))
        return int(self.n[sel].min()), int(self.n[sel].max())

    def ratio_summary(self, curve: PrefillCurve, far: float, quantile: float) -> _RatioSummary:
        ratio = self.t / curve.predict(self.n)
        kept = ratio[ratio >= far]
        scale = (
            float(np.quantile(kept, quantile, method="inverted_cdf")) * _ON_ENVELOPE if kept.size else None
        )
        return _RatioSummary(int((ratio < far).sum()), int(kept.size), scale)

    def count_below(self, curve: PrefillCurve, far: float, scale: float) -> int:
        ratio = self.t / curve.predict(self.n)
        return int(((ratio >= far) & (ratio < scale)).sum())


def fit_lower_envelope(
    uncached_tokens: ArrayLike,
    ttft_ms: ArrayLike,
    *,
    quantile: float = 0.02,
    min_points: int = 30,
    bins_per_decade: int = 5,
    bin_quantile: float = 0.10,
    min_bin_points: int = 10,
    far_below_ratio: float = 0.2,
    min_token_span: float = 4.0,
) -> LatencyFit:
    """Fit the lower envelope of observed TTFT vs uncached prompt tokens (see the module doc).

    Points with non-finite values, fewer than 1 uncached token or TTFT <= 0 are not used (they
    are counted in ``notes``). The fit is ``usable=False`` with a ``reason`` when there are fewer
    than ``min_points`` points, fewer than 3 consistent bins of ``min_bin_points`` points, or the
    bins span less than ``min_token_span`` (ratio of longest to shortest bin median): too little
    to fit three coefficients honestly. Use this for in-memory data; :func:`fit_models` does the
    same with the aggregation in DuckDB.
    """
    settings = _EnvelopeSettings(
        quantile, bin_quantile, bins_per_decade, min_points, min_bin_points, far_below_ratio, min_token_span
    )
    n = np.asarray(uncached_tokens, dtype=np.float64).ravel()
    t = np.asarray(ttft_ms, dtype=np.float64).ravel()
    if n.shape != t.shape:
        raise LatencyModelError(f"uncached_tokens and ttft_ms differ in length ({n.size} vs {t.size})")
    valid = np.isfinite(n) & np.isfinite(t) & (n >= 1) & (t > 0)
    notes = []
    if (~valid).any():
        notes.append(
            f"{int((~valid).sum())} points not used: missing values, no uncached tokens or TTFT <= 0"
        )
    return _fit_envelope(_ArraySample(n[valid], t[valid]), settings, notes)


def _fit_envelope(sample: _EnvelopeSample, s: _EnvelopeSettings, notes: list[str]) -> LatencyFit:
    n_points = sample.point_count()

    def unusable(reason: str, **counts: int) -> LatencyFit:
        return LatencyFit(
            usable=False,
            reason=reason,
            curve=None,
            quantile=s.quantile,
            bin_quantile=s.bin_quantile,
            bins_per_decade=s.bins_per_decade,
            envelope_scale=None,
            n_points=n_points,
            n_far_below=counts.get("n_far_below", 0),
            n_bins=counts.get("n_bins", 0),
            n_bins_rejected=counts.get("n_bins_rejected", 0),
            min_tokens=None,
            max_tokens=None,
            r2=None,
            mean_rel_err=None,
            max_rel_err=None,
            fraction_below=None,
            notes=tuple(notes),
        )

    if n_points < s.min_points:
        return unusable(f"only {n_points} usable points (need at least {s.min_points})")

    # Step 2: raw bin quantiles, minus bins that no non-negative curve could pass through.
    raw = [
        b
        for b in sample.bin_quantiles(s.bin_quantile, s.bins_per_decade, None, 0.0)
        if b.points >= s.min_bin_points
    ]
    consistent, rejected = _consistent_bins(raw)
    if rejected:
        notes.append(
            f"{len(rejected)} bins rejected as inconsistent with a non-decreasing, at most quadratic curve "
            f"(median tokens {', '.join(f'{b.n_median:.0f}' for b in rejected)})"
        )
    if len(consistent) < 3:
        return unusable(
            f"only {len(consistent)} consistent token bins with >= {s.min_bin_points} points (need 3)",
            n_bins=len(consistent),
            n_bins_rejected=len(rejected),
        )

    # Step 3: fit, then refine on per-bin quantiles of TTFT / curve. The goodness of fit is the
    # last refinement's: the curve against the per-bin targets it converged to.
    allowed = {b.bin for b in consistent}
    bins = consistent
    fit = fit_curve([b.n_median for b in bins], [b.value for b in bins])
    for _ in range(_REFINE_ITERATIONS):
        stats = sample.bin_quantiles(s.bin_quantile, s.bins_per_decade, fit.curve, s.far_below_ratio)
        stats = [b for b in stats if b.points >= s.min_bin_points and b.bin in allowed]
        if len(stats) < 3:
            break
        n_med = np.array([b.n_median for b in stats])
        target = np.array([b.value for b in stats]) * fit.curve.predict(n_med)
        new_fit = fit_curve(n_med, target)
        change = float(np.abs(new_fit.curve.predict(n_med) / fit.curve.predict(n_med) - 1.0).max())
        fit, bins = new_fit, stats
        if change < _REFINE_TOLERANCE:
            break

    span = max(b.n_median for b in bins) / min(b.n_median for b in bins)
    if span < s.min_token_span:
        return unusable(
            f"the token bins span only {span:.1f}x (need {s.min_token_span:g}x) to extrapolate honestly",
            n_bins=len(bins),
            n_bins_rejected=len(rejected),
        )

    # Step 4: place the envelope.
    summary = sample.ratio_summary(fit.curve, s.far_below_ratio, s.quantile)
    if summary.scale is None or summary.n_kept < s.min_points:
        return unusable(
            f"only {summary.n_kept} points are not far below the fitted curve (need {s.min_points})",
            n_far_below=summary.n_far_below,
            n_bins=len(bins),
            n_bins_rejected=len(rejected),
        )
    if summary.n_far_below:
        notes.append(
            f"{summary.n_far_below} points more than {1 / s.far_below_ratio:g}x faster than the "
            f"{s.bin_quantile:g}-quantile curve were not used to place the envelope"
        )
    envelope = fit.curve.scaled(summary.scale)
    below = sample.count_below(fit.curve, s.far_below_ratio, summary.scale)
    lo, hi = sample.token_range(s.bins_per_decade, [b.bin for b in bins])
    return LatencyFit(
        usable=True,
        reason=None,
        curve=envelope,
        quantile=s.quantile,
        bin_quantile=s.bin_quantile,
        bins_per_decade=s.bins_per_decade,
        envelope_scale=summary.scale,
        n_points=n_points,
        n_far_below=summary.n_far_below,
        n_bins=len(bins),
        n_bins_rejected=len(rejected),
        min_tokens=lo,
        max_tokens=hi,
        r2=fit.r2,
        mean_rel_err=fit.mean_rel_err,
        max_rel_err=fit.max_rel_err,
        fraction_below=below / summary.n_kept,
        notes=tuple(notes),
    )


def _consistent_bins(bins: list[_BinStat]) -> tuple[list[_BinStat], list[_BinStat]]:
    """Drop bins that no curve ``a + b*n + c*n**2`` with ``a, b, c >= 0`` could pass near.

    Such a curve satisfies ``t(n_i) <= t(n_j) <= (n_j / n_i)**2 * t(n_i)`` for ``n_i < n_j``.
    A pair violates it when off by more than ``_BIN_CONSISTENCY_FACTOR``; the bin in most
    violations (ties: the one with the lower quantile) goes first, until none remain.
    """
    kept = sorted(bins, key=lambda b: b.n_median)
    rejected: list[_BinStat] = []
    f = _BIN_CONSISTENCY_FACTOR
    while True:
        counts = [0] * len(kept)
        for i, j in itertools.combinations(range(len(kept)), 2):
            lo, hi = kept[i], kept[j]
            growth = (hi.n_median / lo.n_median) ** 2
            if hi.value * f < lo.value or hi.value > f * growth * lo.value:
                counts[i] += 1
                counts[j] += 1
        worst = max(counts, default=0)
        if worst == 0:
            return kept, rejected
        idx = min((k for k in range(len(kept)) if counts[k] == worst), key=lambda k: kept[k].value)
        rejected.append(kept.pop(idx))


# --------------------------------------------------------------------------------------------
# DuckDB: per-model envelopes from the requests table
# --------------------------------------------------------------------------------------------

#: The ``latency_model`` table; must match ``kvforensics/sql/schema.sql`` (a test checks it).
LATENCY_MODEL_DDL: Final = """
CREATE OR REPLACE TABLE latency_model (
    model             VARCHAR NOT NULL,
    usable            BOOLEAN NOT NULL,
    reason            VARCHAR,
    a_ms              DOUBLE,
    b_ms_per_token    DOUBLE,
    c_ms_per_token2   DOUBLE,
    quantile          DOUBLE,
    n_points          BIGINT,
    n_bins            BIGINT,
    min_tokens        BIGINT,
    max_tokens        BIGINT,
    r2                DOUBLE,
    mean_rel_err      DOUBLE,
    method            VARCHAR
)
"""

_OBSERVATIONS_SQL: Final = """
CREATE OR REPLACE TEMP VIEW latency_observation AS
SELECT r.model,
       CAST(r.prompt_tokens - coalesce(r.cached_tokens, 0) AS DOUBLE) AS uncached,
       CAST(r.ttft_ms AS DOUBLE) AS ttft_ms
FROM requests AS r
WHERE r.status BETWEEN 200 AND 299
  AND r.ttft_ms IS NOT NULL
  AND r.model IS NOT NULL
  {exclusion}
"""

# NOT IN over the (small) exclusion table's non-null ids: a correlated NOT EXISTS was planned as a
# scan-and-probe of every request (33 s instead of 2.5 s at 100M requests)
_EXCLUSION_SQL: Final = "AND r.request_id NOT IN (SELECT x.request_id FROM {table} AS x WHERE x.request_id IS NOT NULL)"

_MODEL_COUNTS_SQL: Final = """
SELECT model,
       count(*) FILTER (WHERE uncached >= 1 AND ttft_ms > 0) AS usable_points,
       count(*) FILTER (WHERE NOT (uncached >= 1 AND ttft_ms > 0)) AS unusable_points
FROM temp.latency_observation
GROUP BY model
ORDER BY model
"""

# One model's usable points, which every step of that model's fit reads (not the whole of
# latency_observation filtered by model each time: at 100M requests that was a scan of all of them
# per query).
_POINTS_SQL: Final = """
CREATE OR REPLACE TEMP TABLE latency_points AS
SELECT uncached, ttft_ms
FROM temp.latency_observation
WHERE model = $model AND uncached >= 1 AND ttft_ms > 0
"""

_BIN_TTFT_SQL: Final = """
SELECT CAST(floor(log10(uncached) * $per_decade) AS BIGINT) AS bin,
       count(*) AS points, median(uncached) AS n_median, quantile_cont(ttft_ms, $q) AS value
FROM temp.latency_points
GROUP BY bin
ORDER BY bin
"""

_RATIO_CTE: Final = """
WITH obs AS (
    SELECT uncached, ttft_ms / ($a + $b * uncached + $c * uncached * uncached) AS ratio
    FROM temp.latency_points
)
"""

_BIN_RATIO_SQL: Final = (
    _RATIO_CTE
    + """
SELECT CAST(floor(log10(uncached) * $per_decade) AS BIGINT) AS bin,
       count(*) AS points, median(uncached) AS n_median, quantile_cont(ratio, $q) AS value
FROM obs
WHERE ratio >= $far
GROUP BY bin
ORDER BY bin
"""
)

_RATIO_SUMMARY_SQL: Final = (
    _RATIO_CTE
    + """
SELECT count(*) FILTER (WHERE ratio < $far) AS far_below,
       count(*) FILTER (WHERE ratio >= $far) AS kept,
       quantile_disc(ratio, $quantile) FILTER (WHERE ratio >= $far) AS scale
FROM obs
"""
)

_COUNT_BELOW_SQL: Final = (
    _RATIO_CTE
    + """
SELECT count(*) FROM obs WHERE ratio >= $far AND ratio < $scale
"""
)

_TOKEN_RANGE_SQL: Final = """
SELECT CAST(min(uncached) AS BIGINT), CAST(max(uncached) AS BIGINT)
FROM temp.latency_points
WHERE list_contains($bins, CAST(floor(log10(uncached) * $per_decade) AS BIGINT))
"""


@dataclass(frozen=True)
class _DuckDBSample:
    """One model's points in ``temp.latency_points`` (filled for that model before its fit),
    aggregated by DuckDB."""

    con: duckdb.DuckDBPyConnection
    points: int

    def point_count(self) -> int:
        return self.points

    def _curve_params(self, curve: PrefillCurve) -> dict[str, Any]:
        return {"a": curve.a_ms, "b": curve.b_ms_per_token, "c": curve.c_ms_per_token2}

    def bin_quantiles(
        self, q: float, per_decade: int, curve: PrefillCurve | None, far: float
    ) -> list[_BinStat]:
        if curve is None:
            rows = self.con.execute(
                _BIN_TTFT_SQL, {"per_decade": per_decade, "q": q}
            ).fetchall()
        else:
            params = {**self._curve_params(curve), "per_decade": per_decade, "q": q, "far": far}
            rows = self.con.execute(_BIN_RATIO_SQL, params).fetchall()
        return [_BinStat(int(b), int(p), float(m), float(v)) for b, p, m, v in rows]

    def token_range(self, per_decade: int, bins: Sequence[int]) -> tuple[int, int]:
        params = {"per_decade": per_decade, "bins": [int(b) for b in bins]}
        lo, hi = self.con.execute(_TOKEN_RANGE_SQL, params).fetchone() or (0, 0)
        return int(lo), int(hi)

    def ratio_summary(self, curve: PrefillCurve, far: float, quantile: float) -> _RatioSummary:
        params = {**self._curve_params(curve), "far": far, "quantile": quantile}
        far_below, kept, scale = self.con.execute(_RATIO_SUMMARY_SQL, params).fetchone() or (0, 0, None)
        return _RatioSummary(
            int(far_below), int(kept), None if scale is None else float(scale) * _ON_ENVELOPE
        )

    def count_below(self, curve: PrefillCurve, far: float, scale: float) -> int:
        params = {**self._curve_params(curve), "far": far, "scale": scale}
        row = self.con.execute(_COUNT_BELOW_SQL, params).fetchone()
        return int(row[0]) if row else 0


def fit_models(
    con: duckdb.DuckDBPyConnection,
    *,
    exclude_table: str | None = None,
    quantile: float = 0.02,
    min_points: int = 30,
    bins_per_decade: int = 5,
    bin_quantile: float = 0.10,
    min_bin_points: int = 10,
    far_below_ratio: float = 0.2,
    min_token_span: float = 4.0,
) -> dict[str, LatencyFit]:
    """Fit one lower envelope per model from ``requests`` and write table ``latency_model``.

    Uses successful (2xx) requests with a TTFT, ``uncached = prompt_tokens - cached_tokens``
    (NULL cached counts as 0), minus requests listed in ``exclude_table`` (any table with a
    ``request_id`` column, e.g. responses already flagged). Requests without a model are not
    attributable and not used. All per-bin and per-point aggregation runs in DuckDB (a temp
    view ``latency_observation`` and, per model, a temp table ``latency_points`` are created and
    dropped), so only a few dozen numbers per model reach Python. The keyword arguments are those
    of :func:`fit_lower_envelope`.

    Raises :class:`LatencyModelError` if ``exclude_table`` is not a plain identifier or a table
    is missing.
    """
    settings = _EnvelopeSettings(
        quantile, bin_quantile, bins_per_decade, min_points, min_bin_points, far_below_ratio, min_token_span
    )
    exclusion = ""
    if exclude_table is not None:
        if not _IDENTIFIER.fullmatch(exclude_table):
            raise LatencyModelError(
                f"exclude_table must be a plain table name (letters, digits, underscore), got {exclude_table!r}"
            )
        exclusion = _EXCLUSION_SQL.format(table=f'"{exclude_table}"')
    try:
        con.execute(_OBSERVATIONS_SQL.format(exclusion=exclusion))
    except duckdb.CatalogException as exc:
        raise LatencyModelError(
            f"cannot read the requests to fit latency models ({exc}); load the request logs first"
            + (
                f" and check that table {exclude_table!r} exists with a request_id column"
                if exclude_table
                else ""
            )
        ) from exc
    try:
        fits: dict[str, LatencyFit] = {}
        for model, usable_points, unusable_points in con.execute(_MODEL_COUNTS_SQL).fetchall():
            notes = []
            if unusable_points:
                notes.append(f"{unusable_points} requests not used: no uncached tokens or TTFT <= 0")
            con.execute(_POINTS_SQL, {"model": model})
            sample = _DuckDBSample(con, int(usable_points))
            fits[str(model)] = _fit_envelope(sample, settings, notes)
    finally:
        con.execute("DROP TABLE IF EXISTS temp.latency_points")
        con.execute("DROP VIEW IF EXISTS temp.latency_observation")
    _write_latency_model(con, fits)
    return fits


def _write_latency_model(con: duckdb.DuckDBPyConnection, fits: dict[str, LatencyFit]) -> None:
    con.execute(LATENCY_MODEL_DDL)
    rows = [
        (
            model,
            fit.usable,
            fit.reason,
            fit.curve.a_ms if fit.curve else None,
            fit.curve.b_ms_per_token if fit.curve else None,
            fit.curve.c_ms_per_token2 if fit.curve else None,
            fit.quantile,
            fit.n_points,
            fit.n_bins,
            fit.min_tokens,
            fit.max_tokens,
            _json_float(fit.r2),
            _json_float(fit.mean_rel_err),
            fit.method,
        )
        for model, fit in sorted(fits.items())
    ]
    if rows:
        con.executemany("INSERT INTO latency_model VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


# --------------------------------------------------------------------------------------------
# Physical lower bound
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Presentation helpers for the dataclasses above
# --------------------------------------------------------------------------------------------


def _json_float(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _html_table(title: str, row: dict[str, Any]) -> str:
    """A two-column key/value HTML table, every value escaped."""
    cells: Iterable[str] = (
        f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(_format_cell(v))}</td></tr>"
        for k, v in row.items()
    )
    return f"<table><caption>{html.escape(title)}</caption>{''.join(cells)}</table>"


def _format_cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "; ".join(str(v) for v in value)
    return str(value)
