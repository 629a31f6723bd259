"""The evidence tables' rows-v2 digest at scale: kvforensics's bucket sort against a database sort.

``kvforensics verify`` and the manifest hash every table as the SHA-256 of its sorted row hashes
(kvforensics/digests.py). The baseline is the same row hashes sorted by DuckDB (``ORDER BY``, one pass),
which spills when the hashes outgrow ``memory_limit``; kvforensics writes them to bucket files by their
leading bytes and sorts each bucket in memory. Both run in their own process on one database, a table
shaped like ``content_fingerprints`` (the largest table of a big incident), and must give the same digest.

    .venv/bin/python benchmarks/digest.py --rows 100000000 [--memory-limit 2GB] [--workdir /tmp/kvf-bench]

Reported per method: wall seconds, peak RSS, and the most disk its sort used at once (DuckDB's temp
directory, where the bucket files also go, sampled every 0.5 s).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import python_argv, run_measured  # noqa: E402
from run import RESULTS_DIR, code_state, header, machine  # noqa: E402

METHODS = ("database-sort", "kvforensics")


def build(db: Path, rows: int) -> None:
    """request_id, part, fp: 30 fingerprints a text, a prompt and an output a request."""
    import duckdb

    if db.exists():
        return
    con = duckdb.connect(str(db))
    con.execute(f"""CREATE TABLE content_fingerprints AS
                    SELECT 'req-' || lpad(CAST(i // 60 AS VARCHAR), 12, '0') AS request_id,
                           CASE WHEN i % 60 < 30 THEN 'prompt' ELSE 'output' END AS part,
                           CAST(hash(i) >> 1 AS BIGINT) AS fp
                    FROM range({int(rows)}) AS t(i)""")
    con.close()


def child(method: str, db: Path, memory_limit: str, spill: Path, report: Path) -> None:
    from kvforensics.db import connect
    from kvforensics.digests import _canonical_sql, _hex_lines, _quoted, _rows_of, table_digests

    con = connect(db, read_only=True, memory_limit=memory_limit)  # spills to <db>.spill
    peak = {"bytes": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            # DuckDB's spill files and kvforensics's bucket files (kvf-digest-* inside it) alike
            used = sum(p.stat().st_size for p in spill.rglob("*") if p.is_file()) if spill.exists() else 0
            peak["bytes"] = max(peak["bytes"], used)

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    if method == "kvforensics":
        digest = table_digests(con)["content_fingerprints"]
    else:  # the same row hashes, sorted by DuckDB in one pass
        columns = con.execute("SELECT column_name, data_type FROM information_schema.columns "
                              "WHERE table_name = 'content_fingerprints' ORDER BY ordinal_position").fetchall()
        values = ", ".join(_canonical_sql(_quoted(c), t) for c, t in columns)
        h = hashlib.sha256(json.dumps([c for c, _ in columns]).encode() + b"\n")
        n = 0
        for batch in con.sql(f"SELECT unhex(sha256(json_array({values}))) AS h FROM content_fingerprints "
                             "ORDER BY h").to_arrow_reader(1_000_000):
            h.update(_hex_lines(_rows_of(batch.column(0))))
            n += batch.num_rows
        digest = {"rows": n, "sha256": h.hexdigest()}
    seconds = time.perf_counter() - start
    stop.set()
    report.write_text(json.dumps({"seconds": round(seconds, 3), "spill_peak_gb": round(peak["bytes"] / 1e9, 2),
                                  **digest}), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30_000_000)
    p.add_argument("--memory-limit", default="2GB")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-bench"))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    folder = args.workdir / "digest"
    db = folder / f"fingerprints-n{args.rows}.duckdb"
    spill = db.with_suffix(".spill")
    if args.child:
        child(args.child, db, args.memory_limit, spill, args.report)
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    info, code = machine(), code_state()
    print(header(info, code))
    start = time.perf_counter()
    build(db, args.rows)
    print(f"table: {args.rows:,} rows in {db} ({db.stat().st_size / 1e9:.2f} GB; ready in "
          f"{time.perf_counter() - start:.0f} s)")
    runs: dict[str, Any] = {}
    for method in [m for m in args.methods.split(",") if m]:
        report = folder / f"{method}.json"
        m = run_measured(python_argv("digest.py", "--child", method, "--rows", str(args.rows), "--memory-limit",
                                     args.memory_limit, "--workdir", str(args.workdir), "--report", str(report)),
                         log_path=folder / "digest.log", report_path=report)
        runs[method] = {"ok": m.ok, "exit_code": m.returncode, "peak_rss_mb": round(m.peak_rss_mb, 1),
                        "cpu_seconds": round(m.cpu_s, 2), "other_cpu_seconds": m.other_cpu_s, **m.report}
        r = runs[method]
        print(f"  {method:<14} " + (f"{r['seconds']:>9.2f} s  {r['peak_rss_mb']:>7.0f} MB  spill {r['spill_peak_gb']:.2f} GB"
                                    if m.ok else f"FAILED (exit {m.returncode}): {m.stderr_tail[-300:]}"))
    done = [r for r in runs.values() if r["ok"]]
    if len(done) == 2:
        base, ours = runs["database-sort"], runs["kvforensics"]
        print(f"  same digest: {base['sha256'] == ours['sha256']}; kvforensics / database sort: "
              f"{ours['seconds'] / base['seconds']:.2f}x time")
    out = args.results_dir / f"{dt.date.today():%Y-%m-%d}-{args.rows}-table-digest.json"
    out.write_text(json.dumps({"rows": args.rows, "memory_limit": args.memory_limit, "date": dt.datetime.now()
                               .isoformat(timespec="seconds"), "machine": info, "code": code, "runs": runs},
                              indent=1) + "\n", encoding="utf-8")
    print(f"results: {out}")
    return 0 if all(r["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
