"""The Jinja environment of the report and the notices: filters that print every value as the outputs write it."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from kvforensics.escaping import markdown_text, visible_controls
from kvforensics.timestamps import iso

TEMPLATES = Path(__file__).parent / "templates"


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


def template_env(autoescape: bool) -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined,
                      autoescape=select_autoescape(["html", "j2"]) if autoescape else False,
                      trim_blocks=True, lstrip_blocks=True, finalize=_printable)
    env.filters["ts"] = _fmt_ts
    env.filters["num"] = _fmt_num
    env.filters["fixed"] = _fmt_fixed
    env.filters["md"] = markdown_text
    return env
