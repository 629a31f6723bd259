"""Interactive charts in one offline HTML file: Vega, Vega-Lite and Vega-Embed inlined, specs as JSON data.

The JavaScript comes from the installed ``vl-convert-python`` (the same Vega-Lite that draws the report's
SVG charts), never from a CDN. Each chart keeps its static SVG beside the live view: it shows where
scripts do not run and in print (report.pdf); the live view replaces it once drawn. Scripts are allowed
by their SHA-256 in the page's Content-Security-Policy, which refuses every other script and every
network request; Vega compiles its expressions with ``Function`` (``'unsafe-eval'``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from markupsafe import Markup

_SCRIPT_END = re.compile(r"</(script)", re.IGNORECASE)
EMBED_OPTIONS = {"actions": False, "renderer": "svg", "tooltip": {"theme": "light"}}


@cache
def vega_javascript() -> str:
    """Vega, Vega-Lite (the version Altair writes) and Vega-Embed as one script that defines ``vegaEmbed``
    (about 0.9 MB). vl-convert takes seconds to build it, so it is kept in the user's cache folder
    (``$XDG_CACHE_HOME/kvforensics``), per vl-convert and Vega-Lite version; without a writable cache it is
    built once per process."""
    import vl_convert as vlc

    from kvforensics.report.charts import alt

    vl_version = "_".join(alt.SCHEMA_VERSION.split(".")[:2])  # "v6_4" for schema "v6.4.1"
    path = _cache_dir() / f"vega-bundle-{vlc.__version__}-{vl_version}.js"
    try:
        return _script_safe(path.read_text(encoding="utf-8"))
    except OSError:
        pass
    bundle = vlc.javascript_bundle(vl_version=vl_version)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(bundle, encoding="utf-8")
        partial.replace(path)
    except OSError:
        pass
    return _script_safe(bundle)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvforensics"


def _script_safe(js: str) -> str:
    """JavaScript that cannot end its ``<script>`` element early: ``</script`` (which valid JavaScript holds only
    inside a string, regular expression or comment) written as ``<\\/script``, which means the same there."""
    return _SCRIPT_END.sub(r"<\\/\1", js)


def script_json(value: Any) -> str:
    """JSON to place inside ``<script>``: ``<``, ``>``, ``&`` and the JavaScript line separators escaped, so
    no text from the inputs can close the element or start markup."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def csp_source(script: str) -> str:
    """The Content-Security-Policy source that allows exactly this inline script."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode() + "'"


@dataclass(frozen=True)
class LiveCharts:
    """The page's scripts: the libraries, then one that draws every chart into its element."""

    library: str
    loader: str

    @property
    def csp(self) -> str:
        return f"script-src {csp_source(self.library)} {csp_source(self.loader)} 'unsafe-eval'"


def live_charts(specs: dict[str, dict[str, Any]]) -> LiveCharts:
    """Scripts that draw each Vega-Lite spec (``chart.to_dict()``) into the element of its id: the element's
    ``.live`` child receives the chart, and the element gets the class ``live`` once it is drawn."""
    loader = (
        "(function () {\n"
        f"  const specs = {script_json(specs)};\n"
        f"  const options = {script_json(EMBED_OPTIONS)};\n"
        "  for (const [id, spec] of Object.entries(specs)) {\n"
        "    const box = document.getElementById(id);\n"
        "    if (!box) continue;\n"
        "    vegaEmbed(box.querySelector('.live-view'), spec, options)\n"
        "      .then(() => box.classList.add('live'))\n"
        "      .catch((e) => console.error('chart ' + id + ': ' + e));\n"
        "  }\n"
        "})();\n"
    )
    return LiveCharts(library=vega_javascript(), loader=loader)


def chart_box(svg: str) -> Markup:
    """The inside of an element a live chart is drawn into: its static SVG (``svg``, markup the renderer made),
    shown until the live view is drawn and in print."""
    return Markup(f'<div class="static-view">{svg}</div><div class="live-view"></div>')
