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
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from markupsafe import Markup

_SCRIPT_END = re.compile(r"</(script)", re.IGNORECASE)
EMBED_OPTIONS = {"actions": False, "renderer": "svg", "tooltip": {"theme": "light"}}


@cache
def vega_javascript() -> str:
    """Vega, Vega-Lite and Vega-Embed as one script that defines ``vegaEmbed`` (about 0.9 MB)."""
    import vl_convert as vlc

    return _script_safe(vlc.javascript_bundle())


def _script_safe(js: str) -> str:
    """JavaScript that cannot end its ``<script>`` element early: ``</script`` (which valid JavaScript holds only
    inside a string, regular expression or comment) written as ``<\\/script``, which means the same there."""
    return _SCRIPT_END.sub(r"<\\/\1", js)


def script_json(value: Any) -> str:
    """JSON to place inside ``<script>``: ``<``, ``>``, ``&`` and the JavaScript line separators escaped, so
    no text from the inputs can close the element or start markup."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
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
