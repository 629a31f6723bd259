"""The evidence tables' digests at scale: rows-v4 (the sorted table, column-wise), rows-v2 (sorted row hashes), rows-v3.

``kvforensics verify`` and the manifest hash every table (kvforensics/evidence/digests.py): rows-v4 as the table's
canonical values sorted by DuckDB and hashed column by column (what runs write); rows-v2 as the SHA-256 of
its sorted row hashes, kvforensics's bucket sort; rows-v3 as the LtHash16 sum of the same row hashes
expanded by MGF1-SHA-256, in one streaming pass. The baseline is rows-v2's row hashes sorted by DuckDB
(``ORDER BY``, one pass), which spills when the hashes outgrow ``memory_limit``. Each method runs in its
own process, on a table shaped like ``content_fingerprints`` (the largest table of a big incident) or on
every table of an evidence database a run left (``--evidence``); the database sort and rows-v2 must
give the same digest.

    .venv/bin/python benchmarks/digest.py --rows 100000000 [--memory-limit 2GB] [--workdir /tmp/kvf-bench]
    .venv/bin/python benchmarks/digest.py --evidence OUT/evidence.duckdb --label 1000000-every-source

Reported per method: wall seconds, rows digested, peak RSS, and the most disk it used at once (DuckDB's
temp directory, where the bucket files also go, sampled every 0.5 s).
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

METHODS = ("database-sort", "rows-v2", "rows-v3", "rows-v4")


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
    from kvforensics.core.db import connect
    from kvforensics.evidence.digests import table_digests

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
    tables = {"content_fingerprints": _database_sort(con)} if method == "database-sort" else table_digests(con, method)
    seconds = time.perf_counter() - start
    stop.set()
    digest = hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()  # every table's at once
    report.write_text(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "spill_peak_gb": round(peak["bytes"] / 1e9, 2),
                "rows": sum(t["rows"] for t in tables.values()),
                "tables": len(tables),
                "sha256": digest,
            }
        ),
        encoding="utf-8",
    )


def _database_sort(con: Any) -> dict[str, Any]:
    """rows-v2 of ``content_fingerprints`` with its row hashes sorted by DuckDB in one pass."""
    from kvforensics.evidence.digests import _hex_lines, _row_hashes, _rows_of

    columns, hashed = _row_hashes(con, "content_fingerprints")
    h = hashlib.sha256(json.dumps([c for c, _ in columns]).encode() + b"\n")
    n = 0
    for batch in con.sql(f"{hashed} ORDER BY h").to_arrow_reader(1_000_000):
        h.update(_hex_lines(_rows_of(batch.column(0))))
        n += batch.num_rows
    return {"rows": n, "sha256": h.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30_000_000)
    p.add_argument("--evidence", type=Path, help="digest every table of this evidence database instead")
    p.add_argument("--label", default=None, help="with --evidence: names the results file (default: the rows)")
    p.add_argument("--memory-limit", default="2GB")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/kvf-bench"))
    p.add_argument(
        "--methods",
        default=None,
        help=f"comma list of {', '.join(METHODS)} (default: every one "
        "that applies; the database sort only without --evidence)",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--db", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    folder = args.workdir / "digest"
    db = args.evidence.resolve() if args.evidence else folder / f"fingerprints-n{args.rows}.duckdb"
    if args.child:
        child(args.child, args.db, args.memory_limit, args.db.with_suffix(".spill"), args.report)
        return 0
    methods = [m for m in (args.methods or ",".join(METHODS)).split(",") if m]
    if args.evidence and "database-sort" in methods:
        if args.methods:
            p.error("the database sort digests the generated table only: leave it out of --methods with --evidence")
        methods.remove("database-sort")
    if args.evidence and not db.is_file():
        p.error(f"{db} is not a file: name the evidence.duckdb of an output folder")
    folder.mkdir(parents=True, exist_ok=True)
    info, code = machine(), code_state()
    print(header(info, code))
    start = time.perf_counter()
    if not args.evidence:
        build(db, args.rows)
    print(f"database: {db} ({db.stat().st_size / 1e9:.2f} GB; ready in {time.perf_counter() - start:.0f} s)")
    runs: dict[str, Any] = {}
    for method in methods:
        report = folder / f"{method}.json"
        m = run_measured(
            python_argv(
                "digest.py",
                "--child",
                method,
                "--db",
                str(db),
                "--memory-limit",
                args.memory_limit,
                "--workdir",
                str(args.workdir),
                "--report",
                str(report),
            ),
            log_path=folder / "digest.log",
            report_path=report,
        )
        runs[method] = {
            "ok": m.ok,
            "exit_code": m.returncode,
            "peak_rss_mb": round(m.peak_rss_mb, 1),
            "cpu_seconds": round(m.cpu_s, 2),
            "other_cpu_seconds": m.other_cpu_s,
            **m.report,
        }
        r = runs[method]
        print(
            f"  {method:<14} "
            + (
                f"{r['rows']:>13,} rows {r['seconds']:>9.2f} s  {r['peak_rss_mb']:>7.0f} MB  "
                f"spill {r['spill_peak_gb']:.2f} GB"
                if m.ok
                else f"FAILED (exit {m.returncode}): {m.stderr_tail[-300:]}"
            )
        )
    done = {k: r for k, r in runs.items() if r["ok"]}
    if {"database-sort", "rows-v2"} <= set(done):
        print(
            f"  same digest, database sort and rows-v2: {done['database-sort']['sha256'] == done['rows-v2']['sha256']}"
        )
    for method in (m for m in ("rows-v3", "rows-v4") if m in done and "rows-v2" in done):
        print(
            f"  {method} / rows-v2: {done[method]['seconds'] / done['rows-v2']['seconds']:.2f}x time, "
            f"{done[method]['peak_rss_mb'] / done['rows-v2']['peak_rss_mb']:.2f}x peak RSS"
        )
    label = args.label or (db.parent.name if args.evidence else str(args.rows))
    out = args.results_dir / f"{dt.date.today():%Y-%m-%d}-{label}-table-digest.json"
    out.write_text(
        json.dumps(
            {
                "rows": args.rows if not args.evidence else None,
                "evidence": str(db) if args.evidence else None,
                "memory_limit": args.memory_limit,
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "machine": info,
                "code": code,
                "runs": runs,
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"results: {out}")
    return 0 if all(r["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
