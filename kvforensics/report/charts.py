"""Charts: pure functions from small, pre-aggregated frames to Altair charts.

Aggregation happens in DuckDB (``report/data.py``); these functions only draw. Each returns an
``alt.Chart`` (or layer) that notebooks show interactively and the report embeds as SVG.
"""

from __future__ import annotations

import sys

import pandas as pd


def _import_altair():  # noqa: ANN202 - returns the altair module
    """Import Altair without letting jsonschema load rfc3987_syntax, when jsonschema is not loaded
    yet: that optional package compiles ~40 Lark grammars on import (1.5-3 s on 2 cores, more than
    the whole report takes at 10M requests), for IRI format checks Altair never uses. It is only
    hidden during this import; importing it later works as usual."""
    hide = "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules
    if hide:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment] - makes `import` raise ImportError
    try:
        import altair
    finally:
        if hide and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]
    return altair


alt = _import_altair()

CONFIDENCE_COLOURS = alt.Scale(domain=["confirmed", "probable", "possible", "not flagged"],
                               range=["#c0392b", "#e67e22", "#f1c40f", "#95a5a6"])


def money_chart(points: pd.DataFrame, pools: pd.DataFrame, curve: pd.DataFrame, *, title: str,
                interactive: bool = False) -> alt.LayerChart | alt.FacetChart:
    """Prompt tokens vs time to first token per request, with the pool limit and the prefill curve.

    ``points``: prompt_tokens, observed_ms, confidence, request_id, account_id, measure.
    ``pools``: kv_pool_tokens, label. ``curve``: prompt_tokens, expected_ms.
    """
    x = alt.X("prompt_tokens:Q", title="prompt tokens", scale=alt.Scale(zero=True),
              axis=alt.Axis(format="~s"))
    y = alt.Y("observed_ms:Q", title="time to first token (ms, log)", scale=alt.Scale(type="log"))
    dots = alt.Chart(points).mark_circle(size=28).encode(
        x=x, y=y, color=alt.Color("confidence:N", scale=CONFIDENCE_COLOURS, title="finding"),
        tooltip=["request_id:N", "account_id:N", "prompt_tokens:Q", "observed_ms:Q", "measure:N", "confidence:N"],
        opacity=alt.value(0.75),
    )
    if interactive:  # click a legend entry to highlight one tier
        pick = alt.selection_point(fields=["confidence"], bind="legend")
        dots = dots.add_params(pick).encode(opacity=alt.condition(pick, alt.value(0.85), alt.value(0.08)))
    layers: list[alt.Chart] = []
    if not curve.empty:
        layers.append(alt.Chart(curve).mark_line(color="#2c3e50", strokeDash=[6, 3]).encode(
            x="prompt_tokens:Q", y="expected_ms:Q", tooltip=["prompt_tokens:Q", "expected_ms:Q"]))
    if not pools.empty:
        layers.append(alt.Chart(pools).mark_rule(color="#8e44ad", strokeWidth=2).encode(
            x="kv_pool_tokens:Q", tooltip=["label:N", "kv_pool_tokens:Q"]))
        layers.append(alt.Chart(pools).mark_text(align="left", dx=4, dy=-6, color="#8e44ad", fontSize=11).encode(
            x="kv_pool_tokens:Q", y=alt.value(12), text="label:N"))
    chart = alt.layer(dots, *layers).properties(title=title, width=640, height=340)
    return chart.interactive() if interactive else chart


def timeline_chart(hourly: pd.DataFrame, windows: pd.DataFrame, events: pd.DataFrame, *,
                   interactive: bool = False) -> alt.VConcatChart:
    """Exposure windows, affected responses per hour and events on one UTC time axis.

    ``hourly``: hour, responses, model. ``windows``: start, end, label. ``events``: ts, title.
    """
    zoom = alt.selection_interval(encodings=["x"], bind="scales") if interactive else None
    x_title = "time (UTC)"
    bars = alt.Chart(hourly).mark_bar(color="#c0392b").encode(
        x=alt.X("hour:T", title=x_title), y=alt.Y("responses:Q", title="affected responses / hour"),
        tooltip=["hour:T", "model:N", "responses:Q"])
    if zoom is not None:
        bars = bars.add_params(zoom)
    spans = alt.Chart(windows).mark_bar(height=14, color="#8e44ad", opacity=0.6).encode(
        x=alt.X("start:T", title=x_title), x2="end:T", y=alt.Y("label:N", title=None),
        tooltip=["label:N", "start:T", "end:T"])
    marks = alt.Chart(events).mark_rule(color="#2c3e50", strokeDash=[3, 3]).encode(
        x="ts:T", tooltip=["ts:T", "title:N"])
    top = alt.layer(spans, marks).properties(width=640, height=max(40, 22 * max(1, windows["label"].nunique()))
                                             if not windows.empty else 40, title="exposure windows and events")
    bottom = alt.layer(bars, marks).properties(width=640, height=160)
    return alt.vconcat(top, bottom).resolve_scale(x="shared")


def quarantine_chart(counts: pd.DataFrame) -> alt.Chart:
    """Records quarantined per source and reason (``source, reason, records``)."""
    return alt.Chart(counts).mark_bar().encode(
        y=alt.Y("reason:N", title=None, sort="-x"), x=alt.X("records:Q"), color="source:N",
        tooltip=["source:N", "reason:N", "records:Q"]).properties(width=520, height=max(40, 18 * len(counts)))
