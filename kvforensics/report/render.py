"""Render the disclosure report (HTML, Markdown) and per-account notices from the evidence database."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from kvforensics import __version__
from kvforensics.config import Incident
from kvforensics.escaping import markdown_text, visible_controls
from kvforensics.report import charts
from kvforensics.report.data import ReportData, build, money_frames
from kvforensics.scope import iso

TEMPLATES = Path(__file__).parent / "templates"


def chart_svg(chart: Any) -> str:
    """A chart as inline SVG (no JavaScript, no network)."""
    import vl_convert as vlc

    return vlc.vegalite_to_svg(chart.to_json())


def _missing(value: Any) -> bool:
    """None, pandas' NA and NaT, or a float NaN: a value the evidence does not have."""
    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and value != value)


def _fmt_ts(value: Any) -> str:
    if _missing(value):
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (datetime, pd.Timestamp)):
        return iso(pd.Timestamp(value).to_pydatetime()) or ""
    return str(value)


def _fmt_num(value: Any, digits: int = 0) -> str:
    if _missing(value):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int,)) or (isinstance(value, float) and digits == 0 and float(value).is_integer()):
        return f"{int(value):,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


def _fmt_fixed(value: Any, digits: int = 1) -> str:
    """A number with exactly ``digits`` decimals; empty when missing."""
    if _missing(value):
        return ""
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return str(value)


def _printable(value: Any) -> Any:
    """Every text a template prints, with control characters (NUL...) made visible; markup built by the renderer
    (the SVG charts, the audit table) passes unchanged."""
    return visible_controls(value) if isinstance(value, str) and not isinstance(value, Markup) else value


def _env(autoescape: bool) -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined,
                      autoescape=select_autoescape(["html", "j2"]) if autoescape else False,
                      trim_blocks=True, lstrip_blocks=True, finalize=_printable)
    env.filters["ts"] = _fmt_ts
    env.filters["num"] = _fmt_num
    env.filters["fixed"] = _fmt_fixed
    env.filters["md"] = markdown_text
    return env


def build_context(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path, *, svg: bool = True) -> dict[str, Any]:
    data: ReportData = build(con, incident, out_dir)
    money = money_frames(con)
    chart_svgs: dict[str, str] = {}
    if svg:
        for model, (points, pools, curve) in money.items():
            chart_svgs[f"money:{model}"] = chart_svg(charts.money_chart(
                points, pools, curve, title=f"{model}: prompt tokens vs time to first token"))
        chart_svgs["timeline"] = chart_svg(charts.timeline_chart(con, incident, interactive=False))
    from kvforensics.audit import audit_database

    audit = audit_database(con)
    from kvforensics.hardware import physical_bounds, spec_from_config

    specs = {m: spec_from_config(m, raw) for m, raw in incident.hardware.items()}
    physical = physical_bounds(specs, con.execute(
        "SELECT model, prompt_tokens, cached_tokens, ttft_ms, latency_ms FROM affected_responses").df()) if specs else []
    s = data.scope
    first = min((w["first"] for w in s["windows"]), default=None)
    last = max((w["last"] for w in s["windows"]), default=None)
    return {
        "incident": incident, "data": data, "s": s, "charts": {k: Markup(v) for k, v in chart_svgs.items()},
        "money_models": list(money), "first_affected": first, "last_affected": last,
        "generated": iso(datetime.now(timezone.utc)), "version": __version__,
        "notices": _notice_rows(con),
        "physical": physical, "hardware": incident.hardware,
        "audit_headline": audit.headline(), "audit_html": Markup(audit._repr_html_()),
        "audit_md": audit.to_markdown(),
        "parameters_json": json.dumps(data.manifest.get("scope_parameters", {}), sort_keys=True),
    }


def _notice_rows(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    return con.execute("SELECT account_id, account_class, role, responses, first_ts, last_ts, request_ids "
                       "FROM notifications ORDER BY account_class, account_id, role").df()


def render_report(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> Path:
    """Write report.html, report.md and notices/; returns the HTML path."""
    ctx = build_context(con, incident, out_dir)
    html = _env(True).get_template("report.html.j2").render(**ctx)
    (out_dir / "report.html").write_text(html, encoding="utf-8")
    md = _env(False).get_template("report.md.j2").render(**ctx)
    (out_dir / "report.md").write_text(md, encoding="utf-8")
    write_notices(con, incident, out_dir)
    return out_dir / "report.html"


def render_pdf(out_dir: Path) -> str | None:
    """report.pdf from report.html; None when written, else why not."""
    from kvforensics.report.pdf import html_to_pdf

    return html_to_pdf(out_dir / "report.html", out_dir / "report.pdf")


def write_notices(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> list[Path]:
    """One Markdown notice per account with only that account's facts; internal/reporter kept apart."""
    from kvforensics.outputs import safe_filename

    env = _env(False)
    template = env.get_template("notice.md.j2")
    rows = _notice_rows(con)
    conclusive = not con.execute("SELECT count(*) FROM inconclusive_reasons").fetchall()[0][0]
    # every account's received responses in one query (not one per account), grouped here
    received_by_account: dict[object, list[dict]] = {}
    for rec in con.execute("""SELECT account_id, request_id, ts, model, prompt_tokens, confidence
                              FROM affected_responses ORDER BY account_id, ts, request_id""").df().to_dict("records"):
        received_by_account.setdefault(rec.pop("account_id"), []).append(rec)
    roles_by_account: dict[object, list[dict]] = {}
    for rec in rows.to_dict("records"):
        roles_by_account.setdefault(rec["account_id"], []).append(rec)
    written = []
    for account_id in sorted(roles_by_account):
        roles = roles_by_account[account_id]
        cls = str(roles[0]["account_class"])
        folder = out_dir / "notices" / ("customers" if cls == "customer" else cls)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / safe_filename(str(account_id))
        path.write_text(template.render(incident=incident, conclusive=conclusive, account_id=account_id, account_class=cls,
                                        roles=roles, received=received_by_account.get(account_id, [])),
                        encoding="utf-8")
        written.append(path)
    return written
