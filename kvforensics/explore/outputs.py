"""The output folder as notebook 04 shows it: the money chart of every model, the report itself, and the
files a run writes (what each is, its size and SHA-256 as the manifest records it)."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from kvforensics.explore.view import View
from kvforensics.report.charts import alt, money_chart
from kvforensics.report.data import money_frames

# what each output is (docs/incident-config.md, "Outputs")
OUTPUTS = {
    "scope.json": "the headline numbers",
    "affected_requests.csv": "one row per affected response",
    "notifications.csv": "one row per (account, role) to notify",
    "report.html": "the disclosure report, one file that needs no network",
    "report.md": "the disclosure report in Markdown",
    "report.pdf": "the HTML report printed by a local headless Chromium",
    "notices": "one Markdown notice per account to notify (customers/, internal/, reporter/)",
    "manifest.json": "every input and output with its SHA-256, tool and rule versions, run time",
    "manifest.json.sig": "the manifest's SSH signature (run --sign-key)",
    "quarantine.csv": "every input record that was not loaded, with file, line and reason",
    "evidence.duckdb": "the database the numbers came from",
}


def model_charts(con: duckdb.DuckDBPyConnection) -> Any:
    """The money chart (prompt tokens vs time to first token, with the KV pool and the prefill curve) of every
    model with affected responses, one above the other; a View saying so when there is none."""
    frames = money_frames(con)
    if not frames:
        return View("Money chart", pd.DataFrame(), "No model has affected responses: nothing to draw.")
    return alt.vconcat(*[money_chart(*parts, title=model, interactive=True) for model, parts in frames.items()])


def output_files(out_dir: str | Path) -> View:
    """Every file the run wrote into the output folder (notices/ counted as one entry), with what it is and
    the SHA-256 the manifest records."""
    out = Path(out_dir)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
    recorded = manifest.get("outputs")
    hashes = recorded if isinstance(recorded, dict) else {}  # output path -> SHA-256
    rows = []
    for name, what in OUTPUTS.items():
        path = out / name
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file()]
            rows.append(
                {
                    "file": f"{name}/",
                    "what": what,
                    "files": len(files),
                    "bytes": sum(p.stat().st_size for p in files),
                    "sha256": None,
                }
            )
        elif path.is_file():
            rows.append(
                {"file": name, "what": what, "files": 1, "bytes": path.stat().st_size, "sha256": hashes.get(name)}
            )
    frame = pd.DataFrame(rows, columns=["file", "what", "files", "bytes", "sha256"])
    missing = [n for n in ("scope.json", "manifest.json", "report.html", "report.md") if not (out / n).exists()]
    note = f"{len(frame)} outputs in {out}." + (f" Missing: {', '.join(missing)}." if missing else "")
    return View("The output folder", frame, note)


class ReportPreview:
    """report.html shown inside the notebook (an inline frame holding the whole file: offline, and kept when
    the notebook is exported to HTML)."""

    def __init__(self, out_dir: str | Path, height: int = 900) -> None:
        self.path = Path(out_dir) / "report.html"
        self.height = height

    def _repr_html_(self) -> str:
        if not self.path.is_file():
            return f"<p>No report in {escape(str(self.path.parent))} yet: run notebook 04 or `kvforensics report`.</p>"
        page = self.path.read_text(encoding="utf-8")
        return (
            f'<iframe title="report.html" style="width: 100%; height: {int(self.height)}px; border: 1px solid '
            f'#ccc" srcdoc="{escape(page, quote=True)}"></iframe>'
        )

    def __repr__(self) -> str:
        return f"report: {self.path}"


def report_preview(out_dir: str | Path, height: int = 900) -> ReportPreview:
    return ReportPreview(out_dir, height)
