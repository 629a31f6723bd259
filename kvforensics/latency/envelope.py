"""The empirical lower envelope of TTFT vs uncached prompt tokens, fitted to healthy traffic.

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

The algorithm reads its aggregates through :class:`EnvelopeSample`: numpy arrays here
(:func:`fit_lower_envelope`), a DuckDB table in ``latency/from_requests.py`` (:func:`fit_models`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from kvforensics.latency.curve import (
    ArrayLike,
    FloatArray,
    LatencyModelError,
    PrefillCurve,
    fit_curve,
    html_table,
    json_float,
)

#: Name of the envelope method, stored in ``latency_model.method``.
ENVELOPE_METHOD: Final = "log-binned quantile lower envelope, NNLS relative fit, scaled to quantile (v1)"
#: Two bins are inconsistent when one is this factor off what a non-negative curve allows.
_BIN_CONSISTENCY_FACTOR: Final = 2.0
_REFINE_ITERATIONS: Final = 8
_REFINE_TOLERANCE: Final = 1e-4
#: The point at the envelope quantile lies on the envelope; shaving the scale by this factor keeps
#: floating-point rounding from counting it as below.
ON_ENVELOPE: Final = 1.0 - 1e-9


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
        curve = self.curve.to_dict() if self.curve else dict.fromkeys(("a_ms", "b_ms_per_token", "c_ms_per_token2"))
        return {
            "usable": self.usable,
            "reason": self.reason,
            **curve,
            "quantile": self.quantile,
            "bin_quantile": self.bin_quantile,
            "bins_per_decade": self.bins_per_decade,
            "envelope_scale": json_float(self.envelope_scale),
            "n_points": self.n_points,
            "n_far_below": self.n_far_below,
            "n_bins": self.n_bins,
            "n_bins_rejected": self.n_bins_rejected,
            "min_tokens": self.min_tokens,
            "max_tokens": self.max_tokens,
            "r2": json_float(self.r2),
            "mean_rel_err": json_float(self.mean_rel_err),
            "max_rel_err": json_float(self.max_rel_err),
            "fraction_below": json_float(self.fraction_below),
            "notes": list(self.notes),
            "method": self.method,
        }

    def _repr_html_(self) -> str:
        row = self.to_dict()
        row["notes"] = "; ".join(self.notes)
        return html_table("Prefill-latency lower envelope", row)


@dataclass(frozen=True)
class EnvelopeSettings:
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
class BinStat:
    """One log bin: point count, median tokens and a quantile (of TTFT, or of TTFT/curve)."""

    bin: int
    points: int
    n_median: float
    value: float


@dataclass(frozen=True)
class RatioSummary:
    n_far_below: int
    n_kept: int
    scale: float | None


class EnvelopeSample(Protocol):
    """Where the envelope algorithm reads its aggregates from: numpy arrays or a DuckDB table."""

    def point_count(self) -> int: ...

    def bin_quantiles(self, q: float, per_decade: int, curve: PrefillCurve | None, far: float) -> list[BinStat]:
        """Per bin: quantile ``q`` of TTFT (``curve`` None) or of TTFT/curve over ratios >= far."""
        ...

    def token_range(self, per_decade: int, bins: Sequence[int]) -> tuple[int, int]: ...

    def ratio_summary(self, curve: PrefillCurve, far: float, quantile: float) -> RatioSummary: ...

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

    def bin_quantiles(self, q: float, per_decade: int, curve: PrefillCurve | None, far: float) -> list[BinStat]:
        bins = self._bins(per_decade)
        values = self.t if curve is None else self.t / curve.predict(self.n)
        keep = np.ones_like(values, dtype=bool) if curve is None else values >= far
        out = []
        for b in np.unique(bins[keep]):
            sel = keep & (bins == b)
            out.append(
                BinStat(int(b), int(sel.sum()), float(np.median(self.n[sel])), float(np.quantile(values[sel], q)))
            )
        return out

    def token_range(self, per_decade: int, bins: Sequence[int]) -> tuple[int, int]:
        sel = np.isin(self._bins(per_decade), np.asarray(bins, dtype=np.int64))
        return int(self.n[sel].min()), int(self.n[sel].max())

    def ratio_summary(self, curve: PrefillCurve, far: float, quantile: float) -> RatioSummary:
        ratio = self.t / curve.predict(self.n)
        kept = ratio[ratio >= far]
        scale = float(np.quantile(kept, quantile, method="inverted_cdf")) * ON_ENVELOPE if kept.size else None
        return RatioSummary(int((ratio < far).sum()), int(kept.size), scale)

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
    settings = EnvelopeSettings(
        quantile, bin_quantile, bins_per_decade, min_points, min_bin_points, far_below_ratio, min_token_span
    )
    n = np.asarray(uncached_tokens, dtype=np.float64).ravel()
    t = np.asarray(ttft_ms, dtype=np.float64).ravel()
    if n.shape != t.shape:
        raise LatencyModelError(f"uncached_tokens and ttft_ms differ in length ({n.size} vs {t.size})")
    valid = np.isfinite(n) & np.isfinite(t) & (n >= 1) & (t > 0)
    notes = []
    if (~valid).any():
        notes.append(f"{int((~valid).sum())} points not used: missing values, no uncached tokens or TTFT <= 0")
    return fit_envelope(_ArraySample(n[valid], t[valid]), settings, notes)


def fit_envelope(sample: EnvelopeSample, s: EnvelopeSettings, notes: list[str]) -> LatencyFit:
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
        b for b in sample.bin_quantiles(s.bin_quantile, s.bins_per_decade, None, 0.0) if b.points >= s.min_bin_points
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


def _consistent_bins(bins: list[BinStat]) -> tuple[list[BinStat], list[BinStat]]:
    """Drop bins that no curve ``a + b*n + c*n**2`` with ``a, b, c >= 0`` could pass near.

    Such a curve satisfies ``t(n_i) <= t(n_j) <= (n_j / n_i)**2 * t(n_i)`` for ``n_i < n_j``.
    A pair violates it when off by more than ``_BIN_CONSISTENCY_FACTOR``; the bin in most
    violations (ties: the one with the lower quantile) goes first, until none remain.
    """
    kept = sorted(bins, key=lambda b: b.n_median)
    rejected: list[BinStat] = []
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
