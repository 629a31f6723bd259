"""kvforensics benchmarks: ingest (issue 3) and the whole pipeline (issue 8) on generated data.

    python benchmarks/run.py --requests 10000000 [--format jsonl|parquet|both] [--memory-limit 1GB]
                             [--stages ingest,pipeline] [--workdir /tmp/kvf-bench] [--pandas-baseline]
    python benchmarks/run.py --requests 20000,100000 --prefix-scenario prefix-l3-unsalted

Generates the data with ``kvforensics simulate`` (cached in the work directory by request count,
format and seed), runs every measured step in its own process (``steps.py``; peak RSS is that
process's own high-water mark from ``wait4``), prints one table per stage and writes the results to
``benchmarks/results/<date>-<N>.json``. Timings are measured, never asserted. See README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from datasets import Dataset, dataset_dir, ensure_dataset  # noqa: E402
from measure import BENCH_DIR, Measured, package_sha256, python_argv, run_measured  # noqa: E402

REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_LIMITS = {"ingest": "1GB", "sources": "2GB", "pipeline": "2GB"}  # issue 3 / issue 16 / issue 8
STAGES = ("ingest", "sources", "pipeline")
PIPELINE = ["ingest", "audit", "detect", "scope", "outputs", "report"]
PANDAS_PHASES = {
    "ingest": ("read", "capacity", "engine_lines", "content"),
    "detect": ("detect",),
    "scope": ("scope",),
    "ingest-engine": ("engine_lines",),
    "ingest-content": ("content",),
}
#: The sources stage (issue 16): each source's ingest against its own floor.
SOURCE_STEPS = {"engine_log": ("floor-engine", "ingest-engine"), "content": ("floor-content", "ingest-content")}


# --- the machine and the code measured ---------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gb": mem_gb,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "duckdb": version("duckdb"),
        "pandas": version("pandas"),
        "pyarrow": version("pyarrow"),
        "kvforensics": version("kvforensics"),
    }


def code_state() -> dict[str, Any]:
    """The commit, whether the package had local changes, and a hash of its sources as measured."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    dirty = git("status", "--porcelain", "--", "kvforensics")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "package_locally_modified": bool(dirty),
        "package_sha256": package_sha256(),
    }


# --- running steps -----------------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir: Path = args.workdir
        self.log = self.workdir / "logs" / f"run-{dt.datetime.now():%Y%m%d-%H%M%S}.log"

    def step(
        self,
        name: str,
        ds: Dataset,
        *,
        out: Path | None = None,
        memory_limit: str | None = None,
        extra: tuple[str, ...] = (),
        label: str | None = None,
    ) -> dict[str, Any]:
        label = label or name
        report = self.workdir / "reports" / f"{ds.label}-n{ds.requests}-{label}.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        argv = python_argv("steps.py", name, "--incident", str(ds.incident_toml), "--report", str(report), *extra)
        if out is not None:
            argv += ["--out", str(out)]
        if memory_limit:
            argv += ["--memory-limit", memory_limit]
        if self.args.threads:
            argv += ["--threads", str(self.args.threads)]
        if name.startswith("floor"):
            argv += ["--temp-dir", str(self.workdir / "duckdb-tmp")]
        if label in self.args.profile or name in self.args.profile:
            prof = self.workdir / "profiles" / f"{ds.label}-n{ds.requests}-{label}.prof"
            prof.parent.mkdir(parents=True, exist_ok=True)
            argv += ["--profile", str(prof)]
        if self.args.trace_sql and not name.startswith("floor"):
            trace = self.workdir / "traces" / f"{ds.label}-n{ds.requests}-{label}.sql.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            argv += ["--trace-sql", str(trace)]
        if self.args.memory_trace:
            memory = self.workdir / "traces" / f"{ds.label}-n{ds.requests}-{label}.memory.jsonl"
            memory.parent.mkdir(parents=True, exist_ok=True)
            argv += ["--memory-trace", str(memory)]
        print(f"  {label:<16}", end="", flush=True)
        m = run_measured(argv, report_path=report, log_path=self.log, timeout_s=self.args.timeout)
        entry = summarise_step(label, m, memory_limit)
        if m.ok:
            noisy = noise(entry)
            print(
                f"{entry['seconds']:>9.2f} s  {entry['peak_rss_mb']:>8.0f} MB"
                + (
                    f"  (noise: other processes used {entry['other_cpu_seconds']:.0f} CPU s meanwhile)" if noisy else ""
                ),
                flush=True,
            )
        else:
            print(
                f"  FAILED (exit {m.returncode}, {m.wall_s:.0f} s, {m.peak_rss_mb:.0f} MB): {entry['error']}",
                flush=True,
            )
        return entry

    # issue 3: gateway files only, 1 GB
    def ingest_stage(self, ds: Dataset) -> dict[str, Any]:
        limit = self.args.memory_limit or DEFAULT_LIMITS["ingest"]
        out = self.fresh(ds, "ingest")
        steps = [
            self.step("floor-count", ds, memory_limit=limit),
            self.step("floor-scan", ds, memory_limit=limit),
            self.step("floor-load", ds, out=out, memory_limit=limit),
            self.step(
                "ingest", ds, out=out, memory_limit=limit, extra=("--kinds", "requests"), label="ingest-requests"
            ),
        ]
        if not self.args.keep_evidence:
            shutil.rmtree(out, ignore_errors=True)
        return {"memory_limit": limit, "floors": ["floor-count", "floor-scan", "floor-load"], "steps": steps}

    # issue 16: the engine logs' lines and the content, each ingested alone against its own floor, 2 GB
    def sources_stage(self, ds: Dataset) -> dict[str, Any]:
        limit = self.args.memory_limit or DEFAULT_LIMITS["sources"]
        steps, floors, floor_of = [], [], {}
        wanted = {k for k in self.args.sources.split(",") if k}
        for kind, (floor, label) in SOURCE_STEPS.items():
            if kind not in wanted or (kind == "content" and not ds.has_content):
                continue
            out = self.fresh(ds, label)
            if not self.args.skip_floors:
                steps.append(self.step(floor, ds, memory_limit=limit))
                floors.append(floor)
                floor_of[label] = floor
            steps.append(self.step("ingest", ds, out=out, memory_limit=limit, extra=("--kinds", kind), label=label))
            if not self.args.keep_evidence:
                shutil.rmtree(out, ignore_errors=True)
            # the content ingest again with other winnowing windows (1: every shingle, as before issue 30)
            for window in self.args.winnow_windows if kind == "content" else []:
                other = f"{label}-w{window}"
                out = self.fresh(ds, other)
                steps.append(
                    self.step(
                        "ingest",
                        ds,
                        out=out,
                        memory_limit=limit,
                        label=other,
                        extra=("--kinds", kind, "--winnow-window", str(window)),
                    )
                )
                if floor in floors:
                    floor_of[other] = floor
                if not self.args.keep_evidence:
                    shutil.rmtree(out, ignore_errors=True)
        if self.args.pandas_baseline:
            steps.append(self.step("pandas-sources", ds, out=self.fresh(ds, "pandas-sources")))
        return {"memory_limit": limit, "floors": floors, "floor_of": floor_of, "steps": steps}

    # issue 8: every stage on one evidence database, 2 GB
    def pipeline_stage(self, ds: Dataset) -> dict[str, Any]:
        limit = self.args.memory_limit or DEFAULT_LIMITS["pipeline"]
        wanted = self.args.steps or PIPELINE
        if wanted[0] == "ingest":
            out = self.fresh(ds, "pipeline")
        else:  # later steps only: on the database a run with --keep-evidence left
            out = self.workdir / "runs" / f"{ds.label}-n{ds.requests}-seed{ds.seed}" / "pipeline"
            if not (out / "evidence.duckdb").exists():
                raise SystemExit(
                    f"--steps {','.join(wanted)}: no evidence database in {out}; "
                    "run the steps before them with --keep-evidence first"
                )
        # the floor is the stale-pages investigation's (oversize prompts against the pool): none for a prefix scenario
        skip = self.args.skip_floors or wanted[0] != "ingest" or ds.scenario is not None
        steps = [] if skip else [self.step("floor-oversize", ds, memory_limit=limit)]
        for name in wanted:
            entry = self.step(name, ds, out=out, memory_limit=limit)
            steps.append(entry)
            if not entry["ok"]:
                break
        result: dict[str, Any] = {
            "memory_limit": limit,
            "floors": [] if ds.scenario else ["floor-oversize"],
            "steps": steps,
        }
        if self.args.pandas_baseline:
            steps.append(self.step("pandas", ds, out=out))
            result["agreement"] = agreement(out)
            if result["agreement"] is not None:
                print(f"  agreement with pandas: {result['agreement']['summary']}")
        if not self.args.keep_evidence:
            shutil.rmtree(out, ignore_errors=True)
        return result

    def fresh(self, ds: Dataset, stage: str) -> Path:
        out = self.workdir / "runs" / f"{ds.label}-n{ds.requests}-seed{ds.seed}" / stage
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        return out


def summarise_step(label: str, m: Measured, memory_limit: str | None) -> dict[str, Any]:
    r = dict(m.report)
    entry: dict[str, Any] = {
        "step": label,
        "ok": m.ok,
        "exit_code": m.returncode,
        "memory_limit": memory_limit,
        "seconds": r.pop("seconds", None),
        "process_seconds": round(m.wall_s, 3),
        "cpu_seconds": round(m.cpu_s, 2),
        "other_cpu_seconds": m.other_cpu_s,
        "package_sha256": m.report.get("package_sha256"),
        "peak_rss_mb": round(m.peak_rss_mb, 1),
        "rows": r.pop("rows", None),
        "rows_per_s": r.pop("rows_per_s", None),
    }
    r.pop("step", None)
    r.pop("package_sha256", None)
    entry["details"] = r
    if not m.ok:
        lines = [ln for ln in m.stderr_tail.strip().splitlines() if ln.strip()]
        entry["error"] = ("killed at the timeout" if m.returncode == -9 else lines[-1] if lines else "no output")[:300]
    return entry


def agreement(out: Path) -> dict[str, Any] | None:
    ours, theirs = out / "kvforensics_answers.json", out / "pandas_answers.json"
    if not (ours.exists() and theirs.exists()):
        return None
    a = json.loads(ours.read_text(encoding="utf-8"))
    b = json.loads(theirs.read_text(encoding="utf-8"))
    keys = [
        "affected",
        "recipients",
        "by_class",
        "possible_source_pairs",
        "possible_source_pairs_sha256",
        "possible_source_accounts",
        "engine_req_time_stats",
        "engine_aborted_requests",
        "engine_aborted_sha256",
        "content_fingerprints",
    ]
    same = {k: a.get(k) == b.get(k) for k in keys}
    only_ours = sorted(set(a["affected"]) - set(b["affected"]))
    only_pandas = sorted(set(b["affected"]) - set(a["affected"]))
    summary = (
        "same affected set ({n}), recipients, possible-source pairs ({p})".format(
            n=len(a["affected"]), p=a["possible_source_pairs"]
        )
        if all(same.values())
        else "DIFFERENT: " + ", ".join(k for k, v in same.items() if not v)
    )
    if all(same.values()) and a.get("engine_req_time_stats") is not None:
        summary += (
            f", engine ReqTimeStats ({a['engine_req_time_stats']:,}) and aborted requests "
            f"({a['engine_aborted_requests']:,}), content fingerprints ({a['content_fingerprints']:,})"
        )
    return {
        "same": same,
        "all_same": all(same.values()),
        "summary": summary,
        "affected_only_kvforensics": only_ours[:20],
        "affected_only_pandas": only_pandas[:20],
    }


# --- tables ------------------------------------------------------------------------------------------


def noise(entry: dict[str, Any]) -> bool:
    """Other processes used more than 10% of one core (and over a CPU second) during the step: its
    timing is suspect."""
    other = entry.get("other_cpu_seconds")
    return bool(other and entry.get("process_seconds") and other > max(1.0, 0.1 * entry["process_seconds"]))


def stage_rows(stage: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows with the ratios: x <floor> = seconds / floor seconds; pandas x = pandas / ours."""
    steps = {s["step"]: s for s in result["steps"]}
    floors = {f: steps[f]["seconds"] for f in result["floors"] if f in steps and steps[f]["ok"]}
    own = result.get("floor_of", {})  # a step measured against its own source's floor only
    pandas = steps.get("pandas") or steps.get("pandas-sources")
    phases = pandas["details"].get("phases", {}) if pandas and pandas["ok"] else {}

    def ratios(row: dict[str, Any]) -> dict[str, Any]:
        measured = row["ok"] and not row["step"].startswith("floor")
        row["x"] = {
            f: (row["seconds"] / fs if measured and fs and (not own or own.get(row["step"]) == f) else None)
            for f, fs in floors.items()
        }
        return row

    rows = []
    for s in result["steps"]:
        row = ratios(dict(s))
        names = PANDAS_PHASES.get(s["step"])
        row["pandas_x"] = (
            (sum(phases.get(p, 0) for p in names) / s["seconds"]) if names and phases and s["ok"] else None
        )
        row["noisy"] = noise(s)
        rows.append(row)
    if stage == "pipeline":
        ours = [steps[n] for n in PIPELINE if n in steps]
        if len(ours) == len(PIPELINE) and all(s["ok"] for s in ours):
            like_names = ["ingest", "detect", "scope"]
            like = sum(sum(phases.get(p, 0) for p in PANDAS_PHASES[n]) for n in like_names) if phases else None
            for label, names in (("pipeline total", PIPELINE), ("ingest+detect+scope", like_names)):
                secs = sum(steps[n]["seconds"] for n in names)
                n_rows = steps["ingest"]["rows"]
                rows.append(
                    ratios(
                        {
                            "step": label,
                            "ok": True,
                            "rows": n_rows,
                            "seconds": secs,
                            "rows_per_s": round(n_rows / secs) if secs else None,
                            "peak_rss_mb": max(steps[n]["peak_rss_mb"] for n in names),
                            "pandas_x": (like / secs) if like else None,
                            "noisy": any(noise(steps[n]) for n in names),
                        }
                    )
                )
    return rows


def render_table(title: str, rows: list[dict[str, Any]], floors: list[str], markdown: bool = False) -> str:
    head = [
        "step",
        "rows",
        "wall s",
        "rows/s",
        "peak RSS MB",
        *(f"x {f.removeprefix('floor-')}" for f in floors),
        "pandas x",
    ]

    def fmt(r: dict[str, Any]) -> list[str]:
        if not r["ok"]:
            return [
                r["step"],
                "-",
                f"FAILED: {r.get('error', '')[:70]}",
                "",
                f"{r['peak_rss_mb']:,.0f}",
                *("" for _ in floors),
                "",
            ]
        return [
            r["step"] + (" *" if r.get("noisy") else ""),
            f"{r['rows']:,}" if r.get("rows") is not None else "-",
            f"{r['seconds']:.2f}",
            f"{r['rows_per_s']:,.0f}" if r.get("rows_per_s") else "-",
            f"{r['peak_rss_mb']:,.0f}",
            *(f"{r['x'][f]:.2f}" if r.get("x", {}).get(f) else "-" for f in floors),
            f"{r['pandas_x']:.1f}" if r.get("pandas_x") else "-",
        ]

    body = [fmt(r) for r in rows]
    notes = []
    if any(r.get("noisy") for r in rows):
        notes.append("* other processes used > 10% of a core during this step: its time is suspect")
    versions = {r["package_sha256"] for r in rows if r.get("package_sha256")}
    if len(versions) > 1:
        notes.append(f"note: the kvforensics sources changed between steps ({', '.join(sorted(versions))})")
    if markdown:
        md = [
            f"**{title}**",
            "",
            "| " + " | ".join(head) + " |",
            "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |",
        ]
        md += ["| " + " | ".join(c.replace("*", "\\*") for c in b) + " |" for b in body]
        return "\n".join(md + ([""] + notes if notes else []))
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) for i in range(len(head))]

    def join(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    line = join(head)
    return "\n".join([title, line, "-" * len(line), *(join(b) for b in body), *notes])


def header(info: dict[str, Any], code: dict[str, Any]) -> str:
    return (
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gb']} GB RAM, {info['os']}\n"
        f"software: Python {info['python']}, DuckDB {info['duckdb']}, pandas {info['pandas']}, "
        f"pyarrow {info['pyarrow']}\n"
        f"kvforensics {info['kvforensics']} at {code['commit']}"
        f"{' + local changes' if code['package_locally_modified'] else ''} (sources {code['package_sha256']})"
    )


# --- results file ------------------------------------------------------------------------------------


def write_results(requests: int, run: dict[str, Any], results_dir: Path, name: str | None = None) -> Path:
    """Merge into ``<date>-<N>.json`` (``<date>-<N>-<name>.json`` with *name*, e.g. a prefix scenario): one entry
    per format (or scenario) and stage, the latest run wins."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{dt.date.today().isoformat()}-{requests}{f'-{name}' if name else ''}.json"
    doc = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"requests": requests, "runs": {}}
    doc.update({k: v for k, v in run.items() if k != "runs"})
    for fmt, entry in run["runs"].items():  # stage by stage: a pipeline-only run keeps the ingest stage
        doc["runs"].setdefault(fmt, {}).update(entry)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--requests", default="200000", help="gateway requests to generate; several as a comma list (200000,1000000)"
    )
    p.add_argument("--format", choices=["jsonl", "parquet", "both"], default="both")
    p.add_argument(
        "--memory-limit",
        default=None,
        help="DuckDB memory_limit for every step (default: 1GB for ingest, 2GB for pipeline)",
    )
    p.add_argument(
        "--stages",
        default=None,
        help="ingest, sources and/or pipeline (comma list; default all three, with --prefix-scenario "
        "pipeline, the only one it has)",
    )
    p.add_argument(
        "--prefix-scenario",
        default=None,
        help="measure a prefix-cache incident instead (kvforensics simulate --mechanism prefix_reuse "
        "--prefix-scenario NAME, e.g. prefix-l3-unsalted): the pipeline stage, without floors, "
        "results in <date>-<N>-<NAME>.json",
    )
    p.add_argument(
        "--sources",
        default=",".join(SOURCE_STEPS),
        help="with the sources stage: which sources, comma list (engine_log, content)",
    )
    p.add_argument(
        "--winnow-windows",
        default="",
        help="with the sources stage: the content ingest again with each of these winnowing windows "
        "(comma list; 1 fingerprints every shingle), steps ingest-content-w<N>",
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-bench"))
    p.add_argument("--pandas-baseline", action="store_true", help="also run the pandas implementation")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: all cores)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a step is killed")
    p.add_argument("--profile", default="", help="steps to run under cProfile (comma list, e.g. ingest,scope)")
    p.add_argument("--regenerate", action="store_true", help="generate the data sets again, ignoring the cache")
    p.add_argument(
        "--trace-sql",
        action="store_true",
        help="time every DuckDB statement of the kvforensics steps (<workdir>/traces/*.sql.json)",
    )
    p.add_argument("--keep-evidence", action="store_true", help="keep the evidence databases in the workdir")
    p.add_argument(
        "--memory-trace",
        action="store_true",
        help="each step samples its RSS and DuckDB's memory by tag every 5 s (workdir/traces/*.memory.jsonl)",
    )
    p.add_argument(
        "--skip-floors",
        action="store_true",
        help="no floors in the sources and pipeline stages (at 100M the pipeline floor's capacity "
        "preparation alone parses every engine log)",
    )
    p.add_argument(
        "--steps",
        default="",
        help="pipeline stage: only these steps, in order (comma list; from a later step, on the "
        "database an earlier run kept with --keep-evidence)",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--show", type=Path, help="print the tables of a results JSON file and exit")
    p.add_argument("--markdown", action="store_true", help="with --show: Markdown tables (for README.md)")
    args = p.parse_args(argv)
    args.requests = [int(x.replace("_", "")) for x in args.requests.split(",") if x]
    default_stages = "pipeline" if args.prefix_scenario else ",".join(STAGES)
    args.stages = [s.strip() for s in (args.stages or default_stages).split(",") if s.strip()]
    bad = set(args.stages) - set(STAGES)
    if bad:
        p.error(f"unknown stage(s) {sorted(bad)}; use {', '.join(STAGES)}")
    if args.prefix_scenario:
        if args.stages != ["pipeline"] or args.pandas_baseline:
            p.error(
                "--prefix-scenario measures the pipeline stage only, without the pandas baseline "
                "(both are the stale-pages investigation's)"
            )
        if args.format == "parquet":
            p.error("--prefix-scenario: the prefix simulator writes its gateway log as JSONL; leave --format out")
        args.format = "jsonl"
    bad = {k for k in args.sources.split(",") if k} - set(SOURCE_STEPS)
    if bad:
        p.error(f"unknown source(s) {sorted(bad)}; use {', '.join(SOURCE_STEPS)}")
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    try:
        args.winnow_windows = [int(w) for w in args.winnow_windows.split(",") if w.strip()]
    except ValueError:
        p.error("--winnow-windows: whole numbers, comma separated (e.g. 1,4)")
    if args.steps and [s for s in PIPELINE if s in args.steps] != args.steps:
        p.error(f"--steps: steps of {', '.join(PIPELINE)}, in that order")
    args.profile = {s.strip() for s in args.profile.split(",") if s.strip()}
    args.formats = ["jsonl", "parquet"] if args.format == "both" else [args.format]
    return args


def show(path: Path, markdown: bool = False) -> int:
    """Print the tables of a results file again (ratios recomputed from its steps)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    print(header(doc["machine"], doc["code"]).replace("\n", "  \n" if markdown else "\n"))
    for fmt, entry in doc["runs"].items():
        for stage in STAGES:
            if stage not in entry:
                continue
            result = entry[stage]
            result.setdefault("floors", [result["floor"]] if "floor" in result else [])
            print()
            print(
                render_table(
                    f"{stage} | {doc['requests']:,} requests | {fmt} | memory_limit {result['memory_limit']}",
                    stage_rows(stage, result),
                    result["floors"],
                    markdown,
                )
            )
            if result.get("agreement"):
                print(f"agreement with pandas: {result['agreement']['summary']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show:
        return show(args.show, args.markdown)
    args.workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(args)
    info, code = machine(), code_state()
    free_gb = shutil.disk_usage(args.workdir).free / 1e9
    print(header(info, code))
    print(f"workdir: {args.workdir} ({free_gb:.0f} GB free); log: {runner.log}\n")
    failed = False
    for n in args.requests:
        run: dict[str, Any] = {
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": info,
            "code": code,
            "args": {
                k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
            },
            "runs": {},
        }
        tables = []
        for fmt in args.formats:
            print(f"== {n:,} requests, {args.prefix_scenario or fmt}: data set", end="", flush=True)
            if args.regenerate:
                shutil.rmtree(dataset_dir(args.workdir, n, fmt, args.seed, args.prefix_scenario), ignore_errors=True)
            ds = ensure_dataset(
                args.workdir,
                n,
                fmt,
                args.seed,
                log_path=runner.log,
                timeout_s=args.timeout,
                scenario=args.prefix_scenario,
            )
            print(
                f" {ds.root} ({ds.info['gateway_bytes'] / 1e6:,.0f} MB, {ds.info['gateway_lines']:,} lines; "
                f"engine logs {ds.info.get('engine_bytes', 0) / 1e6:,.0f} MB, "
                f"content {ds.info.get('content_bytes', 0) / 1e6:,.0f} MB; "
                f"generated in {ds.info['generate_wall_s']:,.0f} s)"
            )
            if ds.info.get("simulator_changed_since"):
                print("  note: cached data set made by another simulator version (--regenerate to remake it)")
            entry: dict[str, Any] = {"dataset": ds.info}
            for stage in args.stages:
                result = {
                    "ingest": runner.ingest_stage,
                    "sources": runner.sources_stage,
                    "pipeline": runner.pipeline_stage,
                }[stage](ds)
                result["table"] = stage_rows(stage, result)
                entry[stage] = result
                failed |= not all(s["ok"] for s in result["steps"])
                title = (
                    f"{stage} | {n:,} requests | {ds.label} | memory_limit {result['memory_limit']} | "
                    "x <floor> = wall / floor wall; pandas x = pandas wall / ours"
                )
                tables.append(render_table(title, result["table"], result["floors"]))
                if result.get("agreement"):
                    tables.append(f"agreement with pandas: {result['agreement']['summary']}")
            run["runs"][ds.label] = entry
            path = write_results(n, run, args.results_dir, args.prefix_scenario)
        print()
        print(header(info, code))
        for t in tables:
            print()
            print(t)
        print(f"\nresults: {path}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
