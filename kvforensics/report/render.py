"""Render the disclosure report (HTML, Markdown) and per-account notices from the evidence database.

report.html is one offline file: static SVG charts, and the timeline and per-account view also live
(zoom, brush, pick an account) through the Vega libraries inlined by :mod:`kvforensics.report.embed`.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
from markupsafe import Markup

from kvforensics import __version__
from kvforensics.config import Incident
from kvforensics.core.escaping import visible_controls_in
from kvforensics.core.timestamps import iso
from kvforensics.mechanisms import load_mechanisms
from kvforensics.report import charts
from kvforensics.report.data import ReportData, build, money_frames, version_notes
from kvforensics.report.embed import chart_box, live_charts
from kvforensics.report.missing import missing_inputs
from kvforensics.report.notices import start_notices
from kvforensics.report.story import incident_story
from kvforensics.report.templating import template_env
from kvforensics.report.views import account_frames, exposure_period, timeline_frames


def scope_parameter_rows(parameters: Any, prefix: str = "") -> list[tuple[str, str]]:
    """The scope's parameters as (name, value) rows for a table: nested ones named ``group.name``."""
    rows: list[tuple[str, str]] = []
    for key, value in sorted((parameters or {}).items()):
        if isinstance(value, dict):
            rows += scope_parameter_rows(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", json.dumps(value) if not isinstance(value, str) else value))
    return rows


def chart_svg(chart: Any, key: str) -> str:
    """A chart as inline SVG (no JavaScript, no network), its element ids (clip paths) prefixed with ``key``:
    ids are page-wide, and the live charts Vega draws name theirs ``clip1``, ``clip2``... too."""
    # untrusted text (ids, model names) with characters XML forbids would abort the process inside vl-convert
    svg = _drawn(json.dumps(visible_controls_in(chart.to_dict(validate=False))))
    prefix = "svg-" + re.sub(r"[^A-Za-z0-9_-]+", "-", key) + "-"
    # Vega numbers its ids with a counter that lives as long as the process: renumbered in order of first
    # appearance, so the same inputs give the same bytes whatever was drawn before
    renamed = {old: re.sub(r"\d+$", "", old) + str(n) for n, old in enumerate(dict.fromkeys(_SVG_ID.findall(svg)), 1)}
    return _SVG_REF.sub(lambda m: f"{m.group(1)}{prefix}{renamed.get(m.group(2), m.group(2))}", svg)


@functools.lru_cache(maxsize=16)
def _drawn(spec: str) -> str:
    """The SVG vl-convert draws of a Vega-Lite spec (JSON): a function of the spec alone, so a spec drawn again in the
    same process (a verify after the run that wrote the report, the same evidence reported again) is drawn once."""
    import vl_convert as vlc

    return vlc.vegalite_to_svg(spec)


_SVG_ID = re.compile(r'\bid="([^"]+)"')
_SVG_REF = re.compile(r'(\bid="|url\(#|href="#)([^")]+)')


def build_context(
    con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path, *, svg: bool = True, generated: str | None = None
) -> dict[str, Any]:
    """What the report's templates show. ``generated``: the time the report says it was generated (default now;
    ``kvforensics verify`` re-renders a report with the time it states)."""
    data: ReportData = build(con, incident, out_dir)
    # a model whose requests carry no timing has nothing to plot: the report says what is missing instead
    money = {model: frames for model, frames in money_frames(con).items() if not frames[0].empty}
    chart_svgs: dict[str, str] = {}
    live_specs: dict[str, dict[str, Any]] = {}
    if svg:
        for model, (points, pools, curve) in money.items():
            chart_svgs[f"money:{model}"] = chart_svg(
                charts.money_chart(points, pools, curve, title=f"{model}: prompt tokens vs time to first token"),
                f"money-{len(chart_svgs)}",
            )
        # the live charts (zoom, brush, pick an account) over their static SVG, which print and no-script readers see
        timeline, accounts = timeline_frames(con, incident), account_frames(con)
        period = exposure_period(timeline)
        views = []
        if not (timeline.events.empty and timeline.windows.empty and timeline.affected.empty):
            views.append(
                (
                    "timeline",
                    charts.timeline_chart(timeline, interactive=False, period=period),
                    charts.timeline_chart(timeline, period=period),
                )
            )
        if not accounts.accounts.empty:
            views.append(
                ("accounts", charts.account_chart(accounts, interactive=False), charts.account_chart(accounts))
            )
        for key, static, live in views:
            chart_svgs[key] = chart_box(chart_svg(static, key))
            live_specs[f"chart-{key}"] = visible_controls_in(live.to_dict(validate=False))
    scripts = live_charts(live_specs) if live_specs else None
    from kvforensics.audit import audit_database
    from kvforensics.audit.isolation import incident_manifest

    # the incident file's [prefix_cache] facts are the audit's as they are the prefix-cache windows' (check 6)
    audit = audit_database(con, manifest=incident_manifest(incident))
    from kvforensics.config.hardware import physical_bounds, spec_from_config

    specs = {m: spec_from_config(m, raw) for m, raw in incident.hardware.items()}
    physical = (
        physical_bounds(
            specs,
            con.execute("SELECT model, prompt_tokens, cached_tokens, ttft_ms, latency_ms FROM affected_responses").df(),
        )
        if specs
        else []
    )
    s = data.scope
    known = {m.id: m for m in load_mechanisms()}
    first = min((w["first"] for w in s["windows"]), default=None)
    last = max((w["last"] for w in s["windows"]), default=None)
    return {
        "incident": incident,
        "data": data,
        "s": s,
        "charts": {k: Markup(v) for k, v in chart_svgs.items()},
        "money_models": list(money),
        "first_affected": first,
        "last_affected": last,
        "generated": generated or iso(datetime.now(timezone.utc)),
        "version": __version__,
        "live_scripts": [Markup(scripts.library), Markup(scripts.loader)] if scripts else [],
        "csp_scripts": Markup(scripts.csp if scripts else "script-src 'none'"),
        "physical": physical,
        "hardware": incident.hardware,
        "audit_headline": audit.headline(),
        "audit_html": Markup(audit.to_html()),
        "audit_md": audit.to_markdown(),
        "audited": audit.exit_code != 2,  # 2: no start-up to audit
        "missing": missing_inputs(con, incident, {m["id"] for m in s.get("mechanisms", [])}, audit),
        # the mechanisms investigated, with their report wording (kvforensics/mechanisms/<id>/mechanism.yml)
        "mechanisms": [known[m["id"]] for m in s.get("mechanisms", []) if m["id"] in known],
        "not_investigated": s.get("mechanisms_not_investigated", []),
        "parameters_json": json.dumps(data.manifest.get("scope_parameters", {}), sort_keys=True),
        # the sentences about the deployment, the breach and the measures: derived or declared, never constants
        "story": incident_story(
            con, incident, s, [known[m["id"]] for m in s.get("mechanisms", []) if m["id"] in known], data.rules, audit
        ),
        "version_notes": version_notes(data.capacity),
        "parameters": scope_parameter_rows(data.manifest.get("scope_parameters", {})),
    }


def render_report(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> Path:
    """Write report.html, report.md and notices/; returns the HTML path. The notices come first: with many of them
    a worker process writes their HTML pages while this one draws the report's."""
    notices = start_notices(con, incident, out_dir)
    try:
        render_pages(con, incident, out_dir)
    finally:
        notices.wait()
    return out_dir / "report.html"


def render_pages(
    con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path, *, generated: str | None = None
) -> None:
    """Write report.html and report.md (``generated``: see :func:`build_context`)."""
    ctx = build_context(con, incident, out_dir, generated=generated)
    html = template_env(True).get_template("report.html.j2").render(**ctx)
    (out_dir / "report.html").write_text(html, encoding="utf-8")
    md = template_env(False).get_template("report.md.j2").render(**ctx)
    (out_dir / "report.md").write_text(md, encoding="utf-8")


def report_files(*, pdf: bool = True) -> list[str]:
    """The files and folders the report stage writes (report.pdf only when asked for)."""
    return ["report.html", "report.md", *(["report.pdf"] if pdf else []), "notices"]


def render_pdf(out_dir: Path) -> str | None:
    """report.pdf from report.html; None when written, else why not."""
    from kvforensics.report.pdf import html_to_pdf

    return html_to_pdf(out_dir / "report.html", out_dir / "report.pdf")
