"""Charts that render without network: in JupyterLab, in a notebook exported to HTML, and in a notebook
opened from disk.

Altair's default HTML renderer loads Vega from cdn.jsdelivr.net, so an exported notebook viewed offline
shows "Error loading script". :func:`offline_charts` makes Altair draw each chart with a small script that
waits for ``window.vegaEmbed``; the object it returns, displayed in a notebook's first cell, embeds the
Vega, Vega-Lite and vega-embed JavaScript the report inlines too
(:func:`kvforensics.report.embed.vega_javascript`, bundled by vl-convert), once per notebook.
:func:`export_html` exports an executed notebook to one HTML file whose only scripts are inline (nbconvert's
own page loads require.js, MathJax and mermaid from a CDN; the notebooks need none of them).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from kvforensics.report.charts import alt
from kvforensics.report.embed import script_json, vega_javascript

RENDERER = "kvforensics-offline"
# vega-embed's menu: save as SVG/PNG; no "open in the Vega editor" (a web site) nor source views
EMBED_OPTIONS = {"actions": {"export": True, "source": False, "compiled": False, "editor": False}}
WAIT_SECONDS = 20  # a chart whose page lacks the bundle says so after this long


def chart_html(spec: dict[str, Any]) -> str:
    """A chart as an HTML fragment: a div and a script that draws the spec once ``window.vegaEmbed`` exists."""
    div = f"kvf-chart-{uuid.uuid4().hex}"
    return f"""<div id="{div}"></div>
<script type="text/javascript">
(function () {{
  var spec = {script_json(spec)}, options = {script_json(EMBED_OPTIONS)}, waited = 0;
  function draw() {{
    var el = document.getElementById("{div}");
    if (!el) return;
    if (window.vegaEmbed) {{ window.vegaEmbed(el, spec, options).catch(console.error); return; }}
    if (waited++ < {WAIT_SECONDS * 10}) {{ setTimeout(draw, 100); return; }}
    el.textContent = "This chart needs the Vega code the notebook's first cell embeds: run the first cell.";
  }}
  draw();
}})();
</script>"""


def _render(spec: dict[str, Any], **metadata: Any) -> dict[str, str]:
    return {"text/html": chart_html(spec), "text/plain": "<chart: drawn with the Vega code of the first cell>"}


class OfflineCharts:
    """Displayed (a notebook cell's last value), it embeds the Vega code the charts below it draw with."""

    def _repr_html_(self) -> str:
        script = f"if (!window.vegaEmbed) {{ (function () {{\n{vega_javascript()}\n}})(); }}"
        return (
            f'<script type="text/javascript">{script}</script><p><small>Charts: Vega-Lite {html_version()} '
            f"embedded in this notebook (no network needed); drag or scroll a chart to zoom, hover for "
            f"details.</small></p>"
        )

    def __repr__(self) -> str:
        return f"charts: Vega-Lite {html_version()}, embedded (offline)"


def html_version() -> str:
    return alt.SCHEMA_VERSION.lstrip("v")


def offline_charts() -> OfflineCharts:
    """Make Altair draw charts without network (see the module docstring); display the result in the
    notebook's first cell."""
    if RENDERER not in alt.renderers.names():
        alt.renderers.register(RENDERER, _render)
    alt.renderers.enable(RENDERER)
    return OfflineCharts()


# nbconvert's JupyterLab page without the scripts it loads from a CDN (require.js, MathJax, mermaid)
_EXPORT_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def export_html(notebook: str | Path, html: str | Path | None = None) -> Path:
    """An executed notebook as one HTML file that needs no network (``jupyter nbconvert --to html`` with the
    JupyterLab look, without the scripts nbconvert loads from a CDN). Returns the HTML file's path
    (default: the notebook's, with ``.html``)."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    source = Path(notebook)
    target = Path(html) if html is not None else source.with_suffix(".html")
    exporter = HTMLExporter(
        template_name="lab",
        template_file="kvf_offline.html.j2",
        extra_loaders=[DictLoader({"kvf_offline.html.j2": _EXPORT_TEMPLATE})],
    )
    body, _ = exporter.from_notebook_node(nbformat.read(source, as_version=4))
    target.write_text(body, encoding="utf-8")
    return target
