"""Generate notebooks/*.ipynb (stored without outputs). Run: python tools/make_notebooks.py"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent / "notebooks"
PARAMS = 'incident = "../data/sample/incident.toml"\nout_dir = "../reports/sample"'
OPEN = ("from kvforensics.investigation import Investigation\n\n"
        "inv = Investigation.open(incident, out_dir, progress=False)\ninv")

NOTEBOOKS = {
    "01-ingest.ipynb": [
        ("md", "# 1. Ingest\nLoad every source of the incident file into `evidence.duckdb`: requests, engine logs, "
               "config changes and (fingerprinted) content. Every record is loaded or quarantined with a reason."),
        ("params", PARAMS),
        ("code", OPEN),
        ("code", "result = inv.ingest()\nprint(f'{result.records_read:,} records read, {result.quarantined:,} quarantined')"),
        ("md", "Records read, loaded, quarantined and duplicated, per input file, with its SHA-256:"),
        ("code", "inv.query('SELECT source, file, records_read, loaded, quarantined, duplicates, sha256 FROM load_report ORDER BY source, file')"),
        ("code", "inv.query('SELECT source, reason, count(*) AS records FROM quarantine GROUP BY ALL ORDER BY records DESC')"),
        ("md", "KV pool per engine instance and start-up: the capacity intervals every rule joins against."),
        ("code", "inv.query('SELECT instance, role, model, valid_from, valid_to, kv_pool_tokens, context_length, engine_version, source_line FROM capacity ORDER BY model, instance, valid_from')"),
        ("code", "inv.query(\"SELECT kind, note FROM ingest_notes ORDER BY kind, note\")"),
        ("md", "## Is any deployment exposed?\nThe five operator checks per instance and start-up "
               "(pass / fail / unknown, each with its evidence line)."),
        ("code", "from kvforensics.audit import audit_database\n\naudit = audit_database(inv.con)\nprint(audit.headline())\naudit"),
        ("code", "inv.close()"),
    ],
    "02-detect.ipynb": [
        ("md", "# 2. Detect\nRun every rule in `kvforensics/rules/` (SQL + YAML with test cases), fit the prefill-latency "
               "model, and combine findings into confidence tiers."),
        ("params", PARAMS),
        ("code", OPEN),
        ("code", "from kvforensics.detect import load_rules\n\nload_rules()[0]"),
        ("code", "findings = inv.detect()\ninv.query('SELECT confidence, count(*) AS requests FROM request_tiers GROUP BY 1 ORDER BY 1')"),
        ("code", "inv.query('SELECT rule_id, strength, count(*) AS findings FROM findings GROUP BY 1, 2 ORDER BY 1')"),
        ("md", "The latency model: lower envelope of TTFT against uncached prompt tokens, per model."),
        ("code", "inv.query('SELECT * FROM latency_model ORDER BY model')"),
        ("code", "inv.query(\"SELECT request_id, rule_id, confidence, evidence FROM findings ORDER BY request_id LIMIT 20\")"),
        ("code", "inv.close()"),
    ],
    "03-scope.ipynb": [
        ("md", "# 3. Scope\nAffected responses, who received foreign data, whose data was exposed, time windows and an "
               "exploitation assessment."),
        ("params", PARAMS),
        ("code", OPEN),
        ("code", "result = inv.scope()\nresult"),
        ("code", "result.summary['windows'], result.summary['exposure_windows']"),
        ("code", "inv.query('SELECT account_class, role, count(*) AS accounts FROM notifications GROUP BY ALL ORDER BY role DESC, account_class')"),
        ("md", "Candidate sources per affected response (turnover horizon on its decode instance):"),
        ("code", "inv.query('SELECT affected_request_id, count(*) AS candidate_requests, count(DISTINCT source_account_id) AS candidate_accounts FROM possible_sources GROUP BY 1 ORDER BY 2 DESC LIMIT 10')"),
        ("code", "inv.query('SELECT * FROM account_behaviour ORDER BY looks_deliberate DESC, oversize_requests DESC LIMIT 15')"),
        ("md", "Interactive timeline: drag to zoom the time axis; hover for details."),
        ("code", "from kvforensics.report import charts, data\n\n"
                 "events = data.timeline_events(inv.con, inv.incident)\n"
                 "charts.timeline_chart(data.hourly_affected(inv.con), data.exposure_spans(inv.con), events[['ts', 'title']], interactive=True)"),
        ("code", "inv.close()"),
    ],
    "04-report.ipynb": [
        ("md", "# 4. Report\nThe money chart (prompt tokens vs time to first token, with the pool and the prefill curve), "
               "then the outputs: `scope.json`, CSVs, `manifest.json`, `report.html`, `report.md` and notices."),
        ("params", PARAMS),
        ("code", OPEN),
        ("code", "from kvforensics.report import charts, data\n\n"
                 "inv.scope()\nframes = data.money_frames(inv.con)\nlist(frames)"),
        ("code", "[charts.money_chart(*frames[m], title=m, interactive=True) for m in frames][0] if frames else 'no affected model'"),
        ("code", "manifest = inv.write_outputs()\nreport = inv.report()\nreport"),
        ("code", "from IPython.display import Markdown\n\nMarkdown((inv.out_dir / 'report.md').read_text()[:3000])"),
        ("code", "inv.close()"),
    ],
}


def build() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        for kind, text in cells:
            if kind == "md":
                nb.cells.append(new_markdown_cell(text))
            else:
                cell = new_code_cell(text)
                if kind == "params":
                    cell.metadata["tags"] = ["parameters"]
                nb.cells.append(cell)
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"{Path(name).stem}-{i:02d}"
        nbformat.write(nb, ROOT / name)


if __name__ == "__main__":
    build()
