"""KV-event files read by the Python reference and by the bulk reader: events per second, each in its own process.

    .venv/bin/python benchmarks/kv_events.py [--messages 1000000] [--shapes vllm-array,sglang-archive,vllm-map]
                                            [--threads 1,2] [--readers reference,bulk,floor] [--memory-limit 2GB]
                                            [--workdir /tmp/kvf-bench]

Each shape's archive is one instance's file written by ``kvforensics.simulate.sources.kv_event_streams`` (seed 7, reused
from ``<workdir>/data/kv-events/``). Every (reader, threads) is a process of its own (``--step``): the file loaded
by ``kvforensics.sources.kv_events.load`` into an in-memory evidence database with DuckDB's ``threads`` and
``memory_limit`` set, the reference by ``kv_event_reference.read_reference``. Reported: wall seconds (the load
only), the process's CPU seconds, its peak RSS, the CPU other processes used meanwhile (a figure above 10% of
the wall marks the step ``*``: noise), events and block rows, and events per second. The two readers' tables
are compared (a digest of kv_events, kv_event_messages, kv_event_gaps and the quarantine each). The ``floor``
reader (vllm-array only, ``sql/floor_kv_events.sql``) does the least work any reader of such a file must do to
load what kvforensics loads: parse, cut the blocks, fingerprint each block and its chain link with the keyed HMAC,
write the rows; no checks, no chain followed. Its events per second bound what a reader on this stack can reach.
Results: ``benchmarks/results/<date>-<messages>-kv-events.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from measure import python_argv, run_measured  # noqa: E402
from run import code_state, header, machine  # noqa: E402

TABLES = ("kv_events", "kv_event_messages", "kv_event_gaps", "quarantine")


def dataset(workdir: Path, shape: str, messages: int, seed: int) -> Path:
    """The incident file of one shape's archive, written when it is not there yet."""
    from kvforensics.simulate.sources.kv_event_streams import COLUMNS, Stream, lines

    root = workdir / "data" / "kv-events" / f"{shape}-n{messages}-seed{seed}"
    incident = root / "incident.toml"
    if incident.exists():
        return incident
    (root / "events").mkdir(parents=True, exist_ok=True)
    tmp = root / "events" / "engine-0.jsonl.part"
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines(Stream(shape, messages, seed=seed, capacity=20_000)):
            fh.write(line + "\n")
    tmp.rename(root / "events" / "engine-0.jsonl")
    columns = ", ".join(f'{k} = "{v}"' for k, v in COLUMNS[shape].items())
    incident.write_text(
        f"""[incident]
id = "kv-events-bench"
title = "KV events, {shape}"

[[sources]]
name = "kv"
kind = "kv_events"
path = "events/*.jsonl"
instance = "engine-0"
{f'columns = {{ {columns} }}' if columns else ''}

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"
""",
        encoding="utf-8",
    )
    return incident


def step(args: argparse.Namespace) -> int:
    """One reader over one archive, in this process: the load timed, the tables digested."""
    if args.step == "floor":
        return floor(args)
    from kvforensics.config import load_incident
    from kvforensics.core.db import connect, run_script
    from kvforensics.sources.kv_events.chains import Chains
    from kvforensics.sources.kv_events.load import load_kv_events
    from kvforensics.sources.kv_events.reference import read_reference

    source = next(s for s in load_incident(args.incident).sources if s.kind == "kv_events")
    con = connect(memory_limit=args.memory_limit, threads=args.threads)
    chains = Chains()
    cpu, start = time.process_time(), time.perf_counter()
    loads = [
        read_reference(con, source, path, b"k" * 32, chains)
        if args.step == "reference"
        else load_kv_events(con, source, path, b"k" * 32, chains)
        for path in source.files()
    ]
    run_script(con, "kv_event_gaps")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    digest = hashlib.sha256()
    for table in TABLES:
        for row in sorted(
            map(
                repr,
                con.execute(
                    f"SELECT * EXCLUDE (source_file) FROM {table}"
                    if table != "quarantine"
                    else "SELECT * EXCLUDE (file) FROM quarantine"
                ).fetchall(),
            )
        ):
            digest.update(row.encode())
    rows, stored = con.execute("SELECT count(*), count(*) FILTER (kind = 'stored') FROM kv_events").fetchall()[0]
    args.report.write_text(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "cpu_s_inside": round(cpu, 3),
                "events": sum(x.records_read for x in loads),
                "loaded": sum(x.loaded for x in loads),
                "quarantined": sum(x.quarantined for x in loads),
                "rows": rows,
                "stored_blocks": stored,
                "reader_notes": [x.notes[0] for x in loads],
                "tables_sha256": digest.hexdigest(),
                "peak_rss_mb_inside": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )
    return 0


def floor(args: argparse.Namespace) -> int:
    """The floor (``sql/floor_kv_events.sql``) over one vllm-array archive, in this process: no checks, no reference,
    no chains followed; its rows are not the evidence's, so no digest is compared."""
    import duckdb

    from kvforensics.core.db import run_script
    from kvforensics.sources.kv_events.chains import Fingerprints

    (path,) = sorted((args.incident.parent / "events").glob("*.jsonl"))
    con = duckdb.connect(config={"memory_limit": args.memory_limit, "threads": args.threads})
    text = (Path(__file__).parent / "sql" / "floor_kv_events.sql").read_text(encoding="utf-8")
    cpu, start = time.process_time(), time.perf_counter()
    run_script(con, "floor_kv_events", {"file": str(path), **Fingerprints(b"k" * 32).params}, text=text)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    events = con.execute(
        "SELECT sum(json_array_length(raw, '$[1]')) FROM read_csv($f, columns = {'raw': 'VARCHAR'}, header = false, "
        "delim = chr(1), quote = '', escape = '', auto_detect = false)",
        {"f": str(path)},
    ).fetchall()[0][0]
    rows, stored = con.execute("SELECT count(*), count(block_fp) FROM floor_kv_rows").fetchall()[0]
    args.report.write_text(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "cpu_s_inside": round(cpu, 3),
                "events": int(events),
                "loaded": int(events),
                "quarantined": 0,
                "rows": rows,
                "stored_blocks": stored,
                "reader_notes": ["the floor: parse, cut, fingerprint and write, no checks (sql/floor_kv_events.sql)"],
                "tables_sha256": None,
                "peak_rss_mb_inside": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000, help="messages (lines) per archive")
    ap.add_argument("--shapes", default="vllm-array,sglang-archive,vllm-map")
    ap.add_argument("--threads", default="1,2", help="DuckDB threads, a comma list")
    ap.add_argument("--readers", default="reference,bulk,floor")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--memory-limit", default="2GB")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-bench"))
    ap.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--step", choices=("reference", "bulk", "floor"), help=argparse.SUPPRESS)
    ap.add_argument("--incident", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step:
        args.threads = int(args.threads)
        return step(args)
    info, code = machine(), code_state()
    print(header(info, code))
    runs: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        start = time.perf_counter()
        incident = dataset(args.workdir, shape, args.messages, args.seed)
        size = sum(p.stat().st_size for p in (incident.parent / "events").glob("*.jsonl"))
        entry: dict[str, Any] = {"bytes": size, "generate_s": round(time.perf_counter() - start, 1), "steps": []}
        for reader in args.readers.split(","):
            if reader == "floor" and shape != "vllm-array":
                continue  # the floor's SQL reads the array form only
            for threads in args.threads.split(",") if reader != "reference" else args.threads.split(",")[-1:]:
                report = args.workdir / "reports" / f"kv-events-{shape}-{reader}-t{threads}.json"
                report.parent.mkdir(parents=True, exist_ok=True)
                m = run_measured(
                    python_argv(
                        "kv_events.py",
                        "--step",
                        reader,
                        "--threads",
                        threads,
                        "--incident",
                        str(incident),
                        "--report",
                        str(report),
                        "--memory-limit",
                        args.memory_limit,
                        "--messages",
                        str(args.messages),
                    ),
                    log_path=args.workdir / "logs" / "kv-events.log",
                    report_path=report,
                )
                if not m.ok:
                    print(m.stderr_tail, file=sys.stderr)
                    return 1
                r = m.report
                entry["steps"].append(
                    {
                        "reader": reader,
                        "threads": int(threads),
                        **r,
                        "process_seconds": round(m.wall_s, 2),
                        "cpu_s": round(m.cpu_s, 2),
                        "peak_rss_mb": round(m.peak_rss_mb, 1),
                        "other_cpu_s": m.other_cpu_s,
                        "events_per_s": round(r["events"] / r["seconds"]),
                        "noisy": m.other_cpu_s is not None and m.other_cpu_s > max(1.0, 0.1 * m.wall_s),
                    }
                )
        if not entry["steps"]:
            print(f"\n{shape}: no reader measured (the floor reads vllm-array only)")
            continue
        digests = {s["tables_sha256"] for s in entry["steps"] if s["reader"] != "floor"}
        entry["readers_agree"] = len(digests) <= 1
        runs[shape] = entry
        print_shape(shape, entry)
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"{dt.date.today().isoformat()}-{args.messages}-kv-events.json"
    path.write_text(
        json.dumps(
            {
                "messages": args.messages,
                "machine": info,
                "code": code,
                "memory_limit": args.memory_limit,
                "seed": args.seed,
                "runs": runs,
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"results: {path}")
    return 0


def print_shape(shape: str, entry: dict[str, Any]) -> None:
    steps = entry["steps"]
    first = steps[0]
    print(
        f"\n{shape}: {first['events']:,} events in {entry['bytes'] / 1e6:,.0f} MB, {first['rows']:,} block rows "
        f"({first['stored_blocks']:,} stored); readers agree: {entry['readers_agree']}"
    )
    print(f"{'reader':10} {'threads':>7} {'wall s':>8} {'cpu s':>8} {'events/s':>10} {'peak MB':>8} {'x ref':>6}")
    ref = next((s["seconds"] for s in steps if s["reader"] == "reference"), None)
    for s in steps:
        ratio = f"{ref / s['seconds']:.1f}" if ref else "-"
        print(
            f"{s['reader']:10} {s['threads']:>7} {s['seconds']:>8.2f} {s['cpu_s']:>8.2f} {s['events_per_s']:>10,} "
            f"{s['peak_rss_mb']:>8.0f} {ratio:>6}{' *' if s['noisy'] else ''}"
        )


if __name__ == "__main__":
    sys.exit(main())
