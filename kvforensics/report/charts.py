"""Charts: pure functions from small, pre-aggregated frames to Altair charts.

Aggregation happens in DuckDB (``report/data.py``); these functions only draw. Each returns an
``alt.Chart`` (or layer) that notebooks show interactively and the report embeds as SVG.
"""

from __future__ import annotations

import sys
import zlib
from typing import Any

import duckdb
import pandas as pd

from kvforensics.config import Incident
from kvforensics.core.escaping import visible_controls
from kvforensics.report.views import (
    MAX_ACCOUNTS,
    MAX_POINTS,
    AccountFrames,
    TimelineFrames,
    account_frames,
    timeline_frames,
)


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

CONFIDENCE_COLOURS = alt.Scale(
    domain=["confirmed", "probable", "possible", "not flagged"], range=["#c0392b", "#e67e22", "#f1c40f", "#95a5a6"]
)
CLASS_COLOURS = alt.Scale(domain=["customer", "internal", "reporter"], range=["#2c3e50", "#95a5a6", "#16a085"])
# the timeline's lanes of events, top to bottom, and their colours
EVENT_LANES = {
    "incident file": "incident file (reports, fixes)",
    "config change": "config changes",
    "start-up": "engine start-ups and restarts",
    "restart": "engine start-ups and restarts",
}
EVENT_COLOURS = alt.Scale(
    domain=["incident file", "config change", "start-up", "restart"], range=["#c0392b", "#2980b9", "#27ae60", "#d35400"]
)
AFFECTED_LANE = "affected responses"
MAX_POOL_RULES = 200  # KV pool sizes drawn as rules in the prompt-vs-TTFT chart


# Channels are built as Altair objects, never as shorthand strings or dicts: Altair turns each string or dict into
# its channel class by matching it against the Vega-Lite schema (5 to 15 ms each), which made building the report's
# charts cost more than drawing them. The specs are the same.
def _tips(*fields: Any) -> list[Any]:
    """Tooltip channels: a shorthand ``"field:type"`` becomes ``alt.Tooltip``; an object stays as it is."""
    return [alt.Tooltip(f) if isinstance(f, str) else f for f in fields]


def _opacity_when(param: Any, on: float, off: float) -> Any:
    """Opacity *on* where *param* selects, *off* elsewhere (what ``alt.condition`` gives, built directly)."""
    return alt.OpacityValue(off, condition=alt.ConditionalParameterValueDefnumberExprRef(param=param.name, value=on))


def money_chart(
    points: pd.DataFrame, pools: pd.DataFrame, curve: pd.DataFrame, *, title: str, interactive: bool = False
) -> alt.LayerChart | alt.FacetChart:
    """Prompt tokens vs time to first token per request, with the pool limit and the prefill curve.

    ``points``: prompt_tokens, observed_ms, confidence, request_id, account_id, measure.
    ``pools``: kv_pool_tokens, label. ``curve``: prompt_tokens, expected_ms.
    """
    x = alt.X("prompt_tokens:Q", title="prompt tokens", scale=alt.Scale(zero=True), axis=alt.Axis(format="~s"))
    y = alt.Y("observed_ms:Q", title="time to first token (ms, log)", scale=alt.Scale(type="log"))
    dots = (
        alt.Chart(points)
        .mark_circle(size=28)
        .encode(
            x=x,
            y=y,
            color=alt.Color("confidence:N", scale=CONFIDENCE_COLOURS, title="finding"),
            tooltip=_tips(
                "request_id:N", "account_id:N", "prompt_tokens:Q", "observed_ms:Q", "measure:N", "confidence:N"
            ),
            opacity=alt.OpacityValue(0.75),
        )
    )
    if interactive:  # click a legend entry to highlight one tier
        pick = alt.selection_point(fields=["confidence"], bind="legend")
        dots = dots.add_params(pick).encode(opacity=_opacity_when(pick, 0.85, 0.08))
    layers: list[alt.Chart] = []
    if not curve.empty:
        layers.append(
            alt.Chart(curve)
            .mark_line(color="#2c3e50", strokeDash=[6, 3])
            .encode(
                x=alt.X("prompt_tokens:Q"),
                y=alt.Y("expected_ms:Q"),
                tooltip=_tips("prompt_tokens:Q", "expected_ms:Q"),
            )
        )
    pools_total = len(pools)
    if pools_total > MAX_POOL_RULES:  # one rule per distinct pool size: many restarts with many sizes, bounded
        pools = pools.iloc[sorted({round(i * (pools_total - 1) / (MAX_POOL_RULES - 1)) for i in range(MAX_POOL_RULES)})]
        title = f"{title} ({len(pools):,} of {pools_total:,} KV pool sizes drawn, evenly from the smallest)"
    if not pools.empty:
        layers.append(
            alt.Chart(pools)
            .mark_rule(color="#8e44ad", strokeWidth=2)
            .encode(x=alt.X("kv_pool_tokens:Q"), tooltip=_tips("label:N", "kv_pool_tokens:Q"))
        )
        layers.append(
            alt.Chart(pools)
            .mark_text(align="left", dx=4, dy=-6, color="#8e44ad", fontSize=11)
            .encode(x=alt.X("kv_pool_tokens:Q"), y=alt.YValue(12), text=alt.Text("label:N"))
        )
    drawn = int((points["confidence"] != "not flagged").sum()) if "confidence" in points else 0
    total = int(points.attrs.get("flagged_total", drawn))
    if total > drawn:  # more flagged requests than a chart can hold: say that the dots are a sample
        title = f"{title} ({drawn:,} of {total:,} flagged requests drawn: confirmed first, then probable)"
    chart = alt.layer(dots, *layers).properties(title=title, width=640, height=340)
    return chart.interactive() if interactive else chart


def timeline_chart(
    source: duckdb.DuckDBPyConnection | TimelineFrames,
    incident: Incident | None = None,
    *,
    interactive: bool = True,
    period: tuple[Any, Any] | None = None,
    max_points: int = MAX_POINTS,
) -> alt.VConcatChart:
    """The incident on one UTC time axis: the incident file's events (reports, fixes), config changes, engine
    start-ups and restarts, each exposure window and each affected response (top); affected responses per hour
    (bottom).

    ``source``: the investigation's database connection (``inv.con``; ``incident`` adds its ``[[events]]``), or
    :func:`~kvforensics.report.views.timeline_frames`. ``interactive``: scroll or drag the top to zoom and pan
    (double-click resets), drag across the hourly bars to brush a period (its responses and events stand out
    above), hover for details. ``period``: (start, end) shown first, e.g.
    :func:`~kvforensics.report.views.exposure_period` (default: everything).
    """
    f = source if isinstance(source, TimelineFrames) else timeline_frames(source, incident, max_points=max_points)
    events = f.events.assign(lane=[EVENT_LANES.get(k, k) for k in f.events["kind"]])
    # a fixed vertical offset per response (from its id) keeps responses of the same minute apart
    affected = f.affected.assign(
        lane=AFFECTED_LANE, jitter=[zlib.crc32(str(r).encode()) % 201 / 100 - 1 for r in f.affected["request_id"]]
    )
    lanes = [
        lane
        for lane in (*dict.fromkeys(EVENT_LANES.values()), *f.windows["lane"], AFFECTED_LANE)
        if lane in set(events["lane"]) | set(f.windows["lane"]) | set(affected["lane"])
    ]
    # zoom: scroll or drag the top (both parts share the time axis); brush: drag across the hourly bars to
    # highlight that period's affected responses and events above
    zoom = alt.selection_interval(encodings=["x"], bind="scales", name="zoom") if interactive else None
    brush = alt.selection_interval(encodings=["x"], name="period") if interactive and not f.hourly.empty else None
    axis = alt.Axis(title="time (UTC)", format="%Y-%m-%d %H:%M", labelAngle=0, labelOverlap=True)
    x = alt.X("ts:T", scale=alt.Scale(type="utc"), axis=axis)
    # the period shown first, set on the hourly bars only (Vega-Lite warns when the zoomed layers set the domain)
    first_x = (
        x
        if period is None
        else alt.X(
            "ts:T", axis=axis, scale=alt.Scale(type="utc", domain=[pd.Timestamp(t).timestamp() * 1000 for t in period])
        )
    )
    y = alt.Y("lane:N", sort=lanes, title=None, axis=alt.Axis(labelLimit=280))
    spans = (
        alt.Chart(f.windows.rename(columns={"start": "ts"}))
        .mark_bar(height=12, color="#8e44ad", clip=True, opacity=0.55)
        .encode(
            x=x,
            x2=alt.X2("end:T"),
            y=y,
            tooltip=_tips(
                alt.Tooltip("lane:N", title="exposure window"),
                "model:N",
                "from:N",
                "to:N",
                alt.Tooltip("pool_tokens:Q", title="KV pool", format=","),
                alt.Tooltip("context_length:Q", title="context", format=","),
            ),
        )
    )
    ticks = (
        alt.Chart(events)
        .mark_tick(thickness=2, size=14, clip=True)
        .encode(
            x=x,
            y=y,
            color=alt.Color("kind:N", title="event", scale=EVENT_COLOURS),
            tooltip=_tips(alt.Tooltip("time:N", title="time (UTC)"), "kind:N", "title:N", "detail:N"),
        )
    )
    dots = (
        alt.Chart(affected)
        .mark_circle(size=36, clip=True)
        .encode(
            x=x,
            y=y,
            yOffset=alt.YOffset("jitter:Q", scale=alt.Scale(domain=[-1, 1], range=[-7, 7])),
            color=alt.Color("confidence:N", scale=CONFIDENCE_COLOURS, title="finding"),
            tooltip=_tips(
                alt.Tooltip("time:N", title="time (UTC)"),
                "request_id:N",
                "account_id:N",
                "account_class:N",
                "model:N",
                "instance:N",
                alt.Tooltip("prompt_tokens:Q", format=","),
                "confidence:N",
            ),
        )
    )
    if brush is not None:  # outside the brushed period: faint
        ticks = ticks.encode(opacity=_opacity_when(brush, 1.0, 0.25))
        dots = dots.encode(opacity=_opacity_when(brush, 0.85, 0.12))
    drawn = len(f.affected)
    title = f"{f.affected_total:,} affected responses" + (
        f" ({drawn:,} drawn, a sample by request id)" if drawn < f.affected_total else ""
    )
    if f.bounds_note():  # a long change log, many restarts: what is not drawn is said
        title = [title, f"({f.bounds_note()})"]
    detail = (
        alt.layer(spans, ticks, dots)
        .resolve_scale(color="independent")
        .properties(width=640, height=max(60, 24 * len(lanes)), title=title)
    )
    if zoom is not None:
        detail = detail.add_params(zoom)
    unit = f.bar_unit
    hourly = (
        alt.Chart(f.hourly.rename(columns={"hour": "ts"}))
        .mark_bar(clip=True)
        .encode(
            x=first_x,
            y=alt.Y("responses:Q", title=f"affected / {unit}"),
            color=alt.Color("model:N", title="model"),
            tooltip=_tips(alt.Tooltip("time:N", title=f"{unit} (UTC)"), "model:N", "responses:Q"),
        )
        .properties(
            width=640,
            height=90,
            title=f"affected responses per {unit}"
            + (": drag across the bars to highlight a period above" if brush is not None else ""),
        )
    )
    if brush is not None:
        hourly = hourly.add_params(brush)
    return alt.vconcat(detail, hourly).resolve_scale(x="shared", color="independent")


def account_chart(
    source: duckdb.DuckDBPyConnection | AccountFrames,
    *,
    account: str | None = None,
    interactive: bool = True,
    max_accounts: int = MAX_ACCOUNTS,
    max_points: int = MAX_POINTS,
) -> alt.HConcatChart:
    """Per account: the accounts that received affected responses, most first (left), and their affected responses
    over time by prompt size (right).

    ``source``: the investigation's database connection (``inv.con``) or
    :func:`~kvforensics.report.views.account_frames`; ``account``: that account only. ``interactive``: pick an
    account in the list below the chart or click its bar to show only its responses (click again or pick
    "all" to clear).
    """
    f = (
        source
        if isinstance(source, AccountFrames)
        else account_frames(source, account=account, max_accounts=max_accounts, max_points=max_points)
    )
    ids = f.accounts["account_id"].tolist()
    pick = None
    if interactive and account is None and ids:
        pick = alt.selection_point(
            fields=["account_id"],
            name="account",
            bind=alt.binding_select(options=[None, *ids], labels=["all listed accounts", *ids], name="account "),
        )
    listed = (
        f"{len(ids):,} of {f.accounts_total:,} accounts" if len(ids) < f.accounts_total else f"{len(ids):,} accounts"
    )
    bars = (
        alt.Chart(f.accounts)
        .mark_bar()
        .encode(
            y=alt.Y("account_id:N", sort="-x", title=None, axis=alt.Axis(labelLimit=160)),
            x=alt.X("responses:Q", title="affected responses received"),
            color=alt.Color("account_class:N", title="account class", scale=CLASS_COLOURS),
            tooltip=_tips(
                "account_id:N",
                "account_class:N",
                "responses:Q",
                alt.Tooltip("first_time:N", title="first (UTC)"),
                alt.Tooltip("last_time:N", title="last (UTC)"),
                "models:N",
            ),
        )
        .properties(width=200, height=max(40, 16 * len(ids)), title=listed)
    )
    dots = (
        alt.Chart(f.affected)
        .mark_circle(size=40, opacity=0.8)
        .encode(
            x=alt.X(
                "ts:T",
                scale=alt.Scale(type="utc"),
                axis=alt.Axis(title="time (UTC)", format="%m-%d %H:%M", labelAngle=0, labelOverlap=True),
            ),
            y=alt.Y("prompt_tokens:Q", title="prompt tokens", axis=alt.Axis(format="~s")),
            color=alt.Color("confidence:N", scale=CONFIDENCE_COLOURS, title="finding"),
            tooltip=_tips(
                alt.Tooltip("time:N", title="time (UTC)"),
                "request_id:N",
                "account_id:N",
                "model:N",
                "instance:N",
                alt.Tooltip("prompt_tokens:Q", format=","),
                "confidence:N",
            ),
        )
        .properties(
            width=420,
            height=max(160, min(16 * len(ids), 400)),
            title="affected responses" + (f" of {visible_controls(account)}" if account is not None else ""),
        )
    )
    if pick is not None:
        bars = bars.add_params(pick).encode(opacity=_opacity_when(pick, 1.0, 0.35))
        dots = dots.transform_filter(pick)
    return alt.hconcat(bars, dots).resolve_scale(color="independent")


def quarantine_chart(counts: pd.DataFrame) -> alt.Chart:
    """Records quarantined per source and reason (``source, reason, records``)."""
    return (
        alt.Chart(counts)
        .mark_bar()
        .encode(
            y=alt.Y("reason:N", title=None, sort="-x"),
            x=alt.X("records:Q"),
            color=alt.Color("source:N"),
            tooltip=_tips("source:N", "reason:N", "records:Q"),
        )
        .properties(width=520, height=max(40, 18 * len(counts)))
    )
