"""Cost and accuracy of the prefix_reuse mechanism on the HiCache reference incident.

The incident is written by tests/hicache_reference/generate.py (SGLang 0.5.18 HiCache, a salt-blind shared
L3 store added and removed by rolling restarts, from the engines' documented behaviour); each stage runs as
its own ``kvforensics`` process under ``--memory-limit``, timed with its peak RSS, and the output is scored
against the generator's truth (tests/hicache_reference/score.py)::

    .venv/bin/python benchmarks/hicache_reference.py --requests 60000 [--memory-limit 2GB] [--workdir DIR]

Writes ``benchmarks/results/<date>-<N>-hicache-reference.json`` with the machine it ran on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from run import machine  # noqa: E402  (benchmarks/run.py: the machine every result states)

STAGES = ("ingest", "detect", "scope", "report")


def _module(name: str) -> Any:
    path = ROOT / "tests" / "hicache_reference" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"hicache_reference_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _stage(stage: str, incident: Path, out: Path, memory_limit: str) -> dict[str, Any]:
    """One stage in a process of its own: wall seconds, exit code, its peak RSS (ru_maxrss of the child)."""
    cmd = [
        str(ROOT / ".venv" / "bin" / "kvforensics"),
        stage,
        str(incident),
        "--out",
        str(out),
        "--memory-limit",
        memory_limit,
        "--quiet",
    ] + (["--no-pdf"] if stage == "report" else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    code = done.returncode
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of the children is the largest of them so far: a stage's own peak only when it is the largest
    return {
        "stage": stage,
        "exit_code": code,
        "seconds": round(seconds, 2),
        "peak_rss_mb": round(peak / 1024, 1),
        "peak_is_this_stage": peak > before,
        # a failed stage's one-line message (what the CLI says to do), so a result shows why it stopped
        **({"error": (done.stderr.strip().splitlines() or [""])[-1]} if code not in (0, 3) else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60_000)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--memory-limit", default="2GB")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-hicache-bench"))
    args = ap.parse_args(argv)
    generate, score = _module("generate"), _module("score")
    data = args.workdir / f"n{args.requests}-seed{args.seed}"
    out = args.workdir / f"out-n{args.requests}-seed{args.seed}"
    start = time.perf_counter()
    reused = (data / "truth.json").exists()  # an incident generated before (same size and seed) is read again
    if not reused:
        generate.generate(data, seed=args.seed, requests=args.requests)
    generated = round(time.perf_counter() - start, 1) if not reused else None
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    steps = [_stage(s, data / "incident.toml", out, args.memory_limit) for s in STAGES]
    result = score.score(out, data / "truth.json")
    ingest = steps[0]["seconds"]
    after = sum(s["seconds"] for s in steps[1:])
    import duckdb

    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    try:
        events, requests = con.execute(
            "SELECT (SELECT count(*) FROM kv_events), (SELECT count(*) FROM requests)"
        ).fetchall()[0]
    finally:
        con.close()
    doc = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "incident": {
            "generator": "tests/hicache_reference/generate.py",
            "requests": requests,
            "kv_event_rows": events,
            "seed": args.seed,
            "generate_seconds": generated,
        },
        "memory_limit": args.memory_limit,
        "steps": steps,
        "detect_scope_report_over_ingest": round(after / ingest, 2) if ingest else None,
        "peak_rss_mb": max(s["peak_rss_mb"] for s in steps),
        "score": {
            k: result[k]
            for k in ("run", "affected", "recipients", "source_accounts", "sources", "exploitation", "seq_gaps")
            if k in result
        },
        "windows": result.get("windows"),
    }
    target = ROOT / "benchmarks" / "results" / f"{dt.date.today().isoformat()}-{args.requests}-hicache-reference.json"
    target.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("steps", "detect_scope_report_over_ingest", "peak_rss_mb")}, indent=1))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
