"""How ``kvforensics watch`` keeps up (issue 32): a generated incident appended at a set rate while watch follows it.

    .venv/bin/python benchmarks/watch.py --requests 3000000 --rate 50000 [--interval 1] [--tick 0.1]
                                         [--seed 7] [--workdir /tmp/kvf-bench] [--catch-up 300]

The data set is ``kvforensics simulate`` (benchmarks/datasets.py, cached like run.py's). Its evidence is put in
time order (kvforensics/watch/replay.py, plain text: gateway records at their time, engine log lines at their
stamps, content records spread evenly beside them) and appended, from a fresh folder, in parts of
``rate x tick`` gateway records every ``tick`` seconds, the engine logs and the content growing beside them;
``kvforensics watch --interval I`` follows the folder in a process of its own. The harness records when each
part was written; an alert's delay is its ``detected_at`` less the time the part holding its record was
written. After the last part, it waits (``--catch-up`` seconds at most) for every response the simulator
affected to be alerted, then sends SIGTERM and times the stop (the folder settled as a batch run leaves it:
engine logs and content ingested whole, detect on everything).

Reported (``results/<date>-<N>-watch.json`` and a table): the rate achieved by the appender, watch's CPU and
peak RSS while following, the delay of every affected response's alert (median, 95th percentile, max) and of
the exposed start-ups', the responses alerted that the simulator did not affect (none expected), the stop's
wall time, and the requests and quarantined records in the settled database. The two cores are shared by the
appender (reading nothing, writing the parts) and watch; other processes on the machine are reported as
``other_cpu_s`` as in run.py. It never asserts a timing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from datasets import ensure_dataset  # noqa: E402
from measure import BENCH_DIR, _busy_cpu_s  # noqa: E402
from run import code_state, machine  # noqa: E402

RESULTS_DIR = BENCH_DIR / "results"


def _proc_cpu_rss(pid: int) -> tuple[float, float]:
    """CPU seconds and RSS (MB) of process *pid* now, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return cpu, rss


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """The exit code of *proc* and the CPU seconds it used in all (os.wait4: that child's own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"watch did not stop within {timeout} s")


def _part_of_line(parts: list, dest: Path, file: str, line: int) -> int:
    """The index of the part that wrote line *line* of *file*."""
    rel = Path(file).relative_to(dest).as_posix()
    seen = 0
    for i, part in enumerate(parts):
        seen += len(part.lines.get(rel, ()))
        if seen >= line:
            return i
    return len(parts) - 1


def _alerts(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _epoch(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _spread(delays: list[float]) -> dict[str, float | None]:
    if not delays:
        return {"n": 0, "median_s": None, "p95_s": None, "max_s": None}
    ordered = sorted(delays)
    return {
        "n": len(ordered),
        "median_s": round(statistics.median(ordered), 2),
        "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2),
        "max_s": round(ordered[-1], 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvforensics.watch.replay import timeline

    workdir: Path = args.workdir
    ds = ensure_dataset(workdir, args.requests, "jsonl", args.seed, log_path=workdir / "logs" / "watch-generate.log")
    truth = json.loads((ds.root / "ground_truth.json").read_text())
    affected = {a["request_id"] for a in truth["affected"]}
    began = time.monotonic()
    line = timeline(ds.incident_toml, plain=True)
    per_part = max(1, int(args.rate * args.tick))
    parts = list(line.parts(per_part))
    prepare_s = time.monotonic() - began
    root = workdir / "watch" / f"n{args.requests}-seed{args.seed}"
    if root.exists():
        subprocess.run(["rm", "-rf", str(root)], check=True)
    dest, out = root / "incident", root / "out"
    line.start(ds.root, dest)
    parts[0].write(dest)
    written = [time.time()]
    log = (root / "watch.log").open("wb")
    argv = [
        sys.executable,
        "-m",
        "kvforensics",
        "watch",
        str(dest / "incident.toml"),
        "--out",
        str(out),
        "--interval",
        str(args.interval),
        "--silence",
        "86400",
    ]
    if args.memory_limit:
        argv += ["--memory-limit", args.memory_limit]
    busy_before, own_before = _busy_cpu_s(), _own_cpu_s()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    samples: list[tuple[float, float, float]] = []  # (time, watch CPU s, watch RSS MB)
    start = time.monotonic()
    next_sample = start
    for k, part in enumerate(parts[1:], 1):
        due = start + k * args.tick
        while (now := time.monotonic()) < due:
            time.sleep(min(due - now, 0.05))
        part.write(dest)
        written.append(time.time())
        if now >= next_sample:
            samples.append((time.time(), *_proc_cpu_rss(proc.pid)))
            next_sample = now + 1.0
    appended_s = time.monotonic() - start
    alerts_path = out / "alerts.jsonl"
    deadline = time.monotonic() + args.catch_up
    while time.monotonic() < deadline and proc.poll() is None:
        got = {a["request_id"] for a in _alerts(alerts_path) if a["kind"] == "affected_response"}
        samples.append((time.time(), *_proc_cpu_rss(proc.pid)))
        if affected <= got:
            break
        time.sleep(1.0)
    caught_up_s = time.monotonic() - start - appended_s
    follow_cpu_s, _ = _proc_cpu_rss(proc.pid)
    stop_began, sigterm_at = time.monotonic(), time.time()
    proc.send_signal(signal.SIGTERM)
    code, watch_cpu_s = _wait(proc, args.stop_timeout)
    stop_s = time.monotonic() - stop_began
    other_cpu_s = _busy_cpu_s() - busy_before - watch_cpu_s - (_own_cpu_s() - own_before)
    log.close()
    part_of = {rid: i for i, part in enumerate(parts) for rid in part.request_ids if rid in affected}
    raised = _alerts(alerts_path)
    responses = [a for a in raised if a["kind"] == "affected_response"]
    live = [a for a in responses if _epoch(a["detected_at"]) < sigterm_at]  # not raised by the stop's settle
    delays = [_epoch(a["detected_at"]) - written[part_of[a["request_id"]]] for a in live if a["request_id"] in part_of]
    exposed = [a for a in raised if a["kind"] == "exposed_startup"]
    exposed_delays = [
        _epoch(a["detected_at"]) - written[_part_of_line(parts, dest, a["file"], a["line"])] for a in exposed
    ]
    import duckdb

    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    try:
        loaded, quarantined = con.execute(
            "SELECT (SELECT count(*) FROM requests), (SELECT count(*) FROM quarantine)"
        ).fetchall()[0]
    finally:
        con.close()
    gateway = sum(len(p.request_ids) for p in parts)
    return {
        "requests": args.requests,
        "rate_target": args.rate,
        "tick_s": args.tick,
        "interval_s": args.interval,
        "dataset": ds.info,
        "prepare_s": round(prepare_s, 1),
        "appended": {
            "gateway_records": gateway,
            "parts": len(parts),
            "seconds": round(appended_s, 2),
            "records_per_s": round(gateway / appended_s) if appended_s else None,
            "lines": sum(len(v) for p in parts for v in p.lines.values()),
        },
        "watch": {
            "exit_code": code,
            "follow_cpu_s": round(follow_cpu_s, 1),
            "follow_cpu_share": round(follow_cpu_s / (appended_s + caught_up_s), 2),
            # what following costs, whatever else ran: CPU seconds per 50,000 gateway records (and the
            # lines beside them), i.e. the share of a core that 50,000 records/s take
            "cpu_s_per_50k_records": round(follow_cpu_s / gateway * 50_000, 3),
            "peak_rss_mb": round(max((r for _, _, r in samples), default=0.0), 1),
            "caught_up_s_after_last_append": round(caught_up_s, 2),
            "stop_s": round(stop_s, 1),
            "requests_loaded": loaded,
            "quarantined": quarantined,
        },
        "alerts": {
            "affected_responses": len(responses),
            "expected": len(affected),
            "alerted_while_following": len(live),
            "not_affected_by_the_simulator": len({a["request_id"] for a in responses} - affected),
            "delay": _spread(delays),
            "exposed_startups": len(exposed),
            "exposed_delay": _spread(exposed_delays),
        },
        "watch_cpu_s_total": round(watch_cpu_s, 1),
        "other_cpu_s": round(max(0.0, other_cpu_s), 1),
        "machine": machine(),
        "code": code_state(),
        "date": dt.date.today().isoformat(),
    }


def table(result: dict[str, Any]) -> str:
    a, w, d = result["appended"], result["watch"], result["alerts"]["delay"]
    rows = [
        (
            "gateway records appended",
            f"{a['gateway_records']:,} in {a['seconds']} s = {a['records_per_s']:,}/s "
            f"(target {result['rate_target']:,}/s)",
        ),
        ("lines appended (all sources)", f"{a['lines']:,}"),
        (
            "watch CPU while following",
            f"{w['follow_cpu_s']} s ({w['follow_cpu_share']} of a core), peak RSS {w['peak_rss_mb']} MB",
        ),
        ("watch CPU per 50,000 records", f"{w['cpu_s_per_50k_records']} s"),
        ("caught up after the last append", f"{w['caught_up_s_after_last_append']} s"),
        (
            "affected responses alerted",
            f"{result['alerts']['affected_responses']} of "
            f"{result['alerts']['expected']}, "
            f"{result['alerts']['not_affected_by_the_simulator']} not affected",
        ),
        ("append -> alert delay", f"median {d['median_s']} s, p95 {d['p95_s']} s, max {d['max_s']} s"),
        (
            "exposed start-ups alerted",
            f"{result['alerts']['exposed_startups']}, "
            f"max {result['alerts']['exposed_delay']['max_s']} s after the append of "
            "their start-up's lines",
        ),
        ("stop (settle: ingest of engine logs and content, detect)", f"{w['stop_s']} s, exit {w['exit_code']}"),
        ("settled database", f"{w['requests_loaded']:,} requests, {w['quarantined']:,} quarantined"),
        ("watch CPU in all (with the stop)", f"{result['watch_cpu_s_total']} s"),
        ("other processes' CPU meanwhile", f"{result['other_cpu_s']} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3_000_000)
    p.add_argument("--rate", type=int, default=50_000, help="gateway records appended per second")
    p.add_argument("--tick", type=float, default=0.1, help="seconds between two appends")
    p.add_argument("--interval", type=float, default=1.0, help="watch --interval")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--memory-limit", help="watch --memory-limit")
    p.add_argument("--catch-up", type=float, default=300.0, help="seconds to wait for the alerts after the last append")
    p.add_argument("--stop-timeout", type=float, default=1800.0)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-bench"))
    p.add_argument("--name", help="results file suffix (default: watch)")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    result = run(args)
    print(table(result))
    if not args.no_save:
        RESULTS_DIR.mkdir(exist_ok=True)
        path = RESULTS_DIR / f"{result['date']}-{args.requests}-{args.name or 'watch'}.json"
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
