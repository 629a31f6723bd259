"""The prefill curve ``t(n) = a + b*n + c*n**2`` (ms) and its non-negative least-squares fit.

A fixed cost per forward pass, the weight matmuls (linear in ``n`` uncached prompt tokens) and
causal attention (quadratic in ``n``), with ``a, b, c >= 0``. :func:`fit_curve` fits it on relative
error (weights ``1/t``); ``tests/test_latency.py`` checks it against public GPU measurements.
The envelope (``latency/envelope.py``) and the physical bound (``latency/physical.py``) build on it.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvforensics.core.errors import KvForensicsError

ArrayLike = npt.ArrayLike
FloatArray = npt.NDArray[np.float64]


class LatencyModelError(KvForensicsError):
    """A latency model cannot be fitted or used as asked."""


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
            "r2": json_float(self.r2),
            "mean_rel_err": json_float(self.mean_rel_err),
            "max_rel_err": json_float(self.max_rel_err),
        }

    def _repr_html_(self) -> str:
        return html_table("Prefill curve fit", self.to_dict())


def fit_curve(n: ArrayLike, t_ms: ArrayLike, *, weights: Literal["relative", "absolute"] = "relative") -> CurveFit:
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


def json_float(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def html_table(title: str, row: dict[str, Any]) -> str:
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
