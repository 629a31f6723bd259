"""Time to build and draw the report's charts from an output folder's evidence database.

The report draws each chart twice: built with Altair (the live spec, ``to_dict``) and drawn as static SVG by
vl-convert. This measures both, per chart, as the median of ``--repeat`` rounds after one warm-up, so that two
checkouts can be compared on the same machine (run it from each with the same folder, one after the other):

    .venv/bin/python benchmarks/report_charts.py reports/sample/evidence.duckdb data/sample/incident.toml
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import duckdb


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evidence", type=Path, help="an output folder's evidence.duckdb")
    ap.add_argument("incident", type=Path, help="the incident file of that run")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    import vl_convert as vlc

    from kvforensics.config import load_incident
    from kvforensics.report import charts
    from kvforensics.report.data import money_frames
    from kvforensics.report.views import account_frames, exposure_period, timeline_frames

    con = duckdb.connect(str(args.evidence), read_only=True)
    incident = load_incident(args.incident)
    timeline, accounts = timeline_frames(con, incident), account_frames(con)
    period = exposure_period(timeline)
    builders = {
        f"money:{model}": (lambda p=points, q=pools, c=curve: charts.money_chart(p, q, c, title="t"))
        for model, (points, pools, curve) in money_frames(con).items()
        if not points.empty
    }
    builders["timeline"] = lambda: charts.timeline_chart(timeline, interactive=False, period=period)
    builders["timeline live"] = lambda: charts.timeline_chart(timeline, period=period)
    builders["accounts"] = lambda: charts.account_chart(accounts, interactive=False)
    builders["accounts live"] = lambda: charts.account_chart(accounts)
    result = {}
    for name, build in builders.items():
        spec = build().to_dict(validate=False)
        vlc.vegalite_to_svg(spec)  # warm-up
        built, drawn = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            spec = build().to_dict(validate=False)
            built.append(time.perf_counter() - t)
            if not name.endswith(" live"):  # the live charts are drawn by the reader's browser
                t = time.perf_counter()
                vlc.vegalite_to_svg(spec)
                drawn.append(time.perf_counter() - t)
        result[name] = {
            "build_s": round(statistics.median(built), 4),
            "svg_s": round(statistics.median(drawn), 4) if drawn else None,
        }
    result["total_build_s"] = round(sum(v["build_s"] for v in result.values()), 4)
    result["total_svg_s"] = round(sum(v["svg_s"] or 0 for v in result.values() if isinstance(v, dict)), 4)
    result["machine"] = f"{_cpu()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
