"""Per-model lower envelopes from the ``requests`` table, aggregated in DuckDB, into ``latency_model``.

The same algorithm as for arrays (``latency/envelope.py``); only a few dozen numbers per model
reach Python: each step's per-bin and per-point aggregates are queries over one model's points.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import duckdb

from kvforensics.latency.curve import LatencyModelError, PrefillCurve, json_float
from kvforensics.latency.envelope import (
    ON_ENVELOPE,
    BinStat,
    EnvelopeSettings,
    LatencyFit,
    RatioSummary,
    fit_envelope,
)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

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

    def bin_quantiles(self, q: float, per_decade: int, curve: PrefillCurve | None, far: float) -> list[BinStat]:
        if curve is None:
            rows = self.con.execute(_BIN_TTFT_SQL, {"per_decade": per_decade, "q": q}).fetchall()
        else:
            params = {**self._curve_params(curve), "per_decade": per_decade, "q": q, "far": far}
            rows = self.con.execute(_BIN_RATIO_SQL, params).fetchall()
        return [BinStat(int(b), int(p), float(m), float(v)) for b, p, m, v in rows]

    def token_range(self, per_decade: int, bins: Sequence[int]) -> tuple[int, int]:
        params = {"per_decade": per_decade, "bins": [int(b) for b in bins]}
        lo, hi = self.con.execute(_TOKEN_RANGE_SQL, params).fetchone() or (0, 0)
        return int(lo), int(hi)

    def ratio_summary(self, curve: PrefillCurve, far: float, quantile: float) -> RatioSummary:
        params = {**self._curve_params(curve), "far": far, "quantile": quantile}
        far_below, kept, scale = self.con.execute(_RATIO_SUMMARY_SQL, params).fetchone() or (0, 0, None)
        return RatioSummary(int(far_below), int(kept), None if scale is None else float(scale) * ON_ENVELOPE)

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
    settings = EnvelopeSettings(
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
            + (f" and check that table {exclude_table!r} exists with a request_id column" if exclude_table else "")
        ) from exc
    try:
        fits: dict[str, LatencyFit] = {}
        for model, usable_points, unusable_points in con.execute(_MODEL_COUNTS_SQL).fetchall():
            notes = []
            if unusable_points:
                notes.append(f"{unusable_points} requests not used: no uncached tokens or TTFT <= 0")
            con.execute(_POINTS_SQL, {"model": model})
            sample = _DuckDBSample(con, int(usable_points))
            fits[str(model)] = fit_envelope(sample, settings, notes)
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
            json_float(fit.r2),
            json_float(fit.mean_rel_err),
            fit.method,
        )
        for model, fit in sorted(fits.items())
    ]
    if rows:
        con.executemany("INSERT INTO latency_model VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
