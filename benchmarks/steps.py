"""One measured step, run by ``benchmarks/run.py`` in its own process (so peak RSS is per step).

    python benchmarks/steps.py <step> --report R.json [options]

Steps: the DuckDB floors (``floor-count``, ``floor-scan``, ``floor-load``, ``floor-oversize`` over the
gateway files; ``floor-engine`` over the engine logs, ``floor-content`` over the content files), the
kvforensics stages (``ingest``, optionally of some source kinds only, ``audit``, ``detect``, ``scope``,
``outputs``, ``report``, each on the evidence database the previous one left in ``--out``) and
``pandas`` / ``pandas-sources`` (the baseline in ``pandas_baseline.py``, whole or the engine-lines
and content phases alone). Each
writes a JSON report: ``seconds`` is the timed work only (imports, connection set-up and the
floor's capacity preparation are outside it), ``rows`` what the step went through, plus counts
the harness checks (rows loaded, affected responses, ...). ``--profile FILE`` runs the timed work
under cProfile and dumps the stats there.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import dataclasses
import json
import re
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

BENCH_DIR = Path(__file__).resolve().parent
SQL_DIR = BENCH_DIR / "sql"


@contextmanager
def timed(result: dict[str, Any], key: str, profile: Path | None) -> Iterator[None]:
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    try:
        yield
    finally:
        if prof:
            prof.disable()
        result[key] = round(time.perf_counter() - start, 3)
        if prof and profile:
            prof.dump_stats(str(profile))


def _wrap_connect(wrap: Callable[[Any], Any]) -> None:
    """Every connection the stages open (``kvforensics.core.db.connect``, also as investigation imports it)
    passes through *wrap*; wrappers installed one after the other chain."""
    import kvforensics.core.db
    import kvforensics.investigation

    real = kvforensics.core.db.connect

    def connect(*args: Any, **kwargs: Any) -> Any:
        return wrap(real(*args, **kwargs))

    kvforensics.core.db.connect = connect
    kvforensics.investigation.connect = connect


class MemoryTrace:
    """Every few seconds, one JSON line: the process's RSS, what DuckDB's buffer manager holds by tag
    (``duckdb_memory()``, which counts its own buffers only) and the input files open, so that memory
    outside DuckDB's limit can be told from its buffers and placed in a phase of the step."""

    def __init__(self, path: Path, every_s: float = 5.0) -> None:
        self.path, self.every_s = path, every_s
        self.con: Any = None
        self.stop = threading.Event()

    def install(self) -> None:
        def first(con: Any) -> Any:
            if self.con is None:
                self.con = con.cursor()  # the same database instance, its own cursor
            return con

        _wrap_connect(first)
        threading.Thread(target=self._run, daemon=True, name="kvf-memory-trace").start()

    def _run(self) -> None:
        import os

        with self.path.open("w", encoding="utf-8") as fh:
            start = time.perf_counter()
            while not self.stop.wait(self.every_s):
                status = Path("/proc/self/status").read_text()
                rss = next(
                    (int(line.split()[1]) // 1024 for line in status.splitlines() if line.startswith("VmRSS")), None
                )
                tags: dict[str, int] = {}
                if self.con is not None:
                    try:
                        tags = {
                            t: round(m / 2**20)
                            for t, m in self.con.execute(
                                "SELECT tag, memory_usage_bytes FROM duckdb_memory() WHERE memory_usage_bytes > 0"
                            ).fetchall()
                        }
                    except Exception as e:  # noqa: BLE001 - a sample is skipped, the step goes on
                        tags = {"error": str(e)[:80]}
                try:
                    limit = (
                        self.con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
                        if self.con
                        else None
                    )
                except Exception:  # noqa: BLE001 - as above
                    limit = None
                files = []
                for fd in os.listdir("/proc/self/fd"):
                    try:
                        target = os.readlink(f"/proc/self/fd/{fd}")
                    except OSError:
                        continue
                    if (
                        target.startswith("/")
                        and not target.startswith(("/dev", "/proc"))
                        and ".duckdb" not in target
                        and target != str(self.path.absolute())
                    ):
                        files.append(Path(target).name)
                fh.write(
                    json.dumps(
                        {
                            "s": round(time.perf_counter() - start, 1),
                            "rss_mb": rss,
                            "duckdb_mb": sum(v for v in tags.values() if isinstance(v, int)),
                            "tags": tags,
                            "limit": limit,
                            **_outside_duckdb(),
                            "files": sorted(files),
                        }
                    )
                    + "\n"
                )
                fh.flush()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _outside_duckdb() -> dict[str, int]:
    """Memory the process holds outside DuckDB's buffers, MiB: Arrow's pool, and glibc malloc's heap
    (Python's objects and strings) as in use, free but kept, and mapped (mallinfo2)."""
    import pyarrow as pa

    found = {"arrow_mb": pa.total_allocated_bytes() // 2**20}
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):  # not glibc 2.33 or later
        return found
    return {
        **found,
        "malloc_used_mb": (info.uordblks + info.hblkhd) // 2**20,
        "malloc_free_mb": info.fordblks // 2**20,
        "malloc_mapped_mb": info.hblkhd // 2**20,
    }


class SqlTrace:
    """Wraps DuckDB connections so every ``execute`` is timed, keyed by its statement's first line."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self.lock = threading.Lock()  # statements on concurrent cursors overlap: totals can exceed the wall time

    def install(self) -> None:
        trace = self

        class Traced:
            def __init__(self, con: Any) -> None:
                self._con = con

            def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return self._con.execute(query, *args, **kwargs)
                finally:
                    key = " ".join(query.split())[:140]
                    with trace.lock:
                        slot = trace.totals.setdefault(key, [0, 0.0])
                        slot[0] += 1
                        slot[1] += time.perf_counter() - start

            def cursor(self) -> Traced:  # the loader types files on cursors, side by side
                return Traced(self._con.cursor())

            def __getattr__(self, name: str) -> Any:
                return getattr(self._con, name)

        _wrap_connect(Traced)

    def dump(self, path: Path) -> None:
        rows = sorted(([k, n, round(t, 3)] for k, (n, t) in self.totals.items()), key=lambda r: -r[2])
        path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def bench_sql(name: str) -> str:
    return (SQL_DIR / f"{name}.sql").read_text(encoding="utf-8")


def duckdb_connection(memory_limit: str | None, threads: int | None, temp_dir: Path | None):
    import duckdb

    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    if memory_limit:
        con.execute(f"SET memory_limit = '{memory_limit}'")
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    if temp_dir:
        con.execute(f"SET temp_directory = '{temp_dir}'")
    return con


def gateway_source(incident_path: Path):
    from kvforensics.config import load_incident

    incident = load_incident(incident_path)
    sources = incident.sources_of("requests")
    if len(sources) != 1:
        raise SystemExit(f"expected one requests source in {incident_path}, found {len(sources)}")
    return incident, sources[0]


def reader_sql(fmt: str) -> str:
    return "read_json($files, format = 'newline_delimited')" if fmt == "jsonl" else "read_parquet($files)"


# --- floors ------------------------------------------------------------------------------------------


def step_floor_count(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """``SELECT count(*)`` over the gateway files: what issue 3 calls the floor."""
    _, source = gateway_source(args.incident)
    files = [str(p) for p in source.files()]
    con = duckdb_connection(args.memory_limit, args.threads, args.temp_dir)
    with timed(result, "seconds", args.profile):
        result["rows"] = con.execute(f"SELECT count(*) FROM {reader_sql(source.format)}", {"files": files}).fetchone()[
            0
        ]


def step_floor_scan(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Every column decoded (``bit_xor(hash(col))`` of each, which no statistics can answer): a
    count(*) of Parquet reads only the footers."""
    _, source = gateway_source(args.incident)
    files = [str(p) for p in source.files()]
    con = duckdb_connection(args.memory_limit, args.threads, args.temp_dir)
    cols = [
        r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {reader_sql(source.format)}", {"files": files}).fetchall()
    ]
    exprs = ", ".join(f'bit_xor(hash("{c}"))' for c in cols)
    with timed(result, "seconds", args.profile):
        row = con.execute(f"SELECT count(*), {exprs} FROM {reader_sql(source.format)}", {"files": files}).fetchone()
    result["rows"] = row[0]
    result["columns"] = len(cols)


def step_floor_load(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The mapped columns cast and written to a persistent DuckDB file in one CREATE TABLE AS
    (sql/floor_load.sql), checkpoint included: what landing the rows costs without any checking."""
    import duckdb

    from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS

    _, source = gateway_source(args.incident)
    files = [str(p) for p in source.files()]
    path = args.out / "floor_load.duckdb"
    for stale in (path, path.with_suffix(".duckdb.wal")):
        stale.unlink(missing_ok=True)
    con = duckdb.connect(str(path))
    con.execute("SET TimeZone = 'UTC'")
    if args.memory_limit:
        con.execute(f"SET memory_limit = '{args.memory_limit}'")
    if args.threads:
        con.execute(f"SET threads = {int(args.threads)}")
    text = bench_sql("floor_load").format(
        reader=reader_sql(source.format),
        **{f: '"' + source.column(f).replace('"', '""') + '"' for f in CANONICAL_REQUEST_FIELDS},
    )
    with timed(result, "seconds", args.profile):
        con.execute(text, {"files": files})
        con.execute("CHECKPOINT")
    result["rows"] = con.execute("SELECT count(*) FROM requests").fetchone()[0]
    result["database_bytes"] = path.stat().st_size
    con.close()
    path.unlink(missing_ok=True)


def step_floor_oversize(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The bare oversize scan of issue 8: one query over the gateway files joined to the capacity
    intervals (built from the engine logs by our parser, outside the timed part)."""
    import pandas_baseline

    from kvforensics.core.db import connect

    incident, source = gateway_source(args.incident)
    con = duckdb_connection(args.memory_limit, args.threads, args.temp_dir)
    if args.temp_dir:
        args.temp_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.temp_dir) as scratch_dir:  # the engine logs' per-request rows
        scratch = connect(Path(scratch_dir) / "capacity.duckdb", memory_limit=args.memory_limit or "2GB")
        capacity = pandas_baseline.load_capacity(incident, gateway_models=None, scratch=scratch)
        scratch.close()
    files = [str(p) for p in source.files()]
    con.register("capacity", capacity)
    col = {c: source.column(c) for c in ("request_id", "ts", "status", "prompt_tokens", "prefill_instance")}
    text = bench_sql("floor_oversize").format(reader=reader_sql(source.format), **{k: f'"{v}"' for k, v in col.items()})
    with timed(result, "seconds", args.profile):
        rows, served, oversize = con.execute(text, {"files": files, "reject_margin": 6}).fetchone()
    result.update(rows=rows, served_2xx=served, oversize=oversize)


def files_of(incident_path: Path, kind: str) -> tuple[Any, list[Any]]:
    from kvforensics.config import load_incident

    incident = load_incident(incident_path)
    sources = incident.sources_of(kind)
    return incident, [(source, [str(p) for p in source.files()]) for source in sources]


def step_floor_engine(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The engine logs read as lines by DuckDB, one regular expression per line (sql/floor_engine_lines.sql)."""
    _, sources = files_of(args.incident, "engine_log")
    files = [f for _, fs in sources for f in fs]
    if not files:
        raise SystemExit(f"no engine_log files in {args.incident}")
    con = duckdb_connection(args.memory_limit, args.threads, args.temp_dir)
    with timed(result, "seconds", args.profile):
        cur = con.execute(bench_sql("floor_engine_lines"), {"files": files})
        row = cur.fetchone()
    names = [d[0] for d in cur.description]
    result.update(dict(zip(names, row, strict=True)), rows=row[0], files=len(files))


def step_floor_content(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The same shingles hashed by DuckDB over the content files (sql/floor_content.sql): with a keyed
    SHA-256 (``seconds``) and, as a lower bound, DuckDB's own hash (``noncrypto_seconds``)."""
    import secrets

    _, sources = files_of(args.incident, "content")
    if not sources or not sources[0][1]:
        raise SystemExit(f"no content files in {args.incident}")
    con = duckdb_connection(args.memory_limit, args.threads, args.temp_dir)
    key = secrets.token_bytes(32)
    variants = {
        "seconds": ("(('0x' || left(sha256($key || shingle), 16))::UBIGINT >> 1)", {"key": key.hex()}),
        "noncrypto_seconds": ("hash(shingle, $key_int)", {"key_int": int.from_bytes(key[:8], "big")}),
    }
    for label, (fingerprint, keyed) in variants.items():
        records = shingles = 0
        with timed(result, label, args.profile if label == "seconds" else None):
            for source, files in sources:
                cols = {f: '"' + source.column(f).replace('"', '""') + '"' for f in ("request_id", "prompt", "output")}
                reader = (
                    "read_json($files, format = 'newline_delimited', columns = {"
                    + ", ".join(f"{c}: 'VARCHAR'" for c in cols.values())
                    + "})"
                )
                text = bench_sql("floor_content").format(reader=reader, fingerprint=fingerprint, **cols)
                n, k, _ = con.execute(text, {"files": files, **keyed}).fetchone()
                records += n
                shingles += k
        result.update(rows=records, shingles=shingles)


# --- kvforensics stages -------------------------------------------------------------------------------


def investigation(args: argparse.Namespace, *, kinds: tuple[str, ...] = ()):
    from kvforensics.config import load_incident
    from kvforensics.investigation import Investigation

    incident = load_incident(args.incident)
    if kinds:
        incident = dataclasses.replace(incident, sources=tuple(s for s in incident.sources if s.kind in kinds))
    if args.winnow_window:  # the content fingerprinted with another window than the incident file's
        incident = dataclasses.replace(incident, winnow_window=args.winnow_window)
    inv = Investigation.open(incident, args.out, memory_limit=args.memory_limit, progress=False, pdf=False)
    if args.threads:
        inv.con.execute(f"SET threads = {int(args.threads)}")
    if args.temp_dir:
        inv.con.execute(f"SET temp_directory = '{args.temp_dir}'")
    return inv


def _request_count(inv) -> int:
    return int(inv.con.execute("SELECT count(*) FROM requests").fetchone()[0])


def step_ingest(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Every source, or those of ``--kinds`` only; ``rows`` are the records read of the first kind."""
    kinds = tuple(k for k in args.kinds.split(",") if k) if args.kinds else ()
    inv = investigation(args, kinds=kinds)
    try:
        with timed(result, "seconds", args.profile):
            r = inv.ingest()
        requests_files = [f for f in r.files if f.kind == "requests"]
        counted = [f for f in r.files if f.kind == (kinds[0] if kinds else "requests")]
        result.update(
            rows=sum(f.records_read for f in counted),
            loaded=sum(f.loaded for f in requests_files),
            duplicates=sum(f.duplicates for f in requests_files),
            quarantined=sum(f.quarantined for f in requests_files),
            other_records=sum(f.records_read for f in r.files if f.kind != "requests"),
            warnings=r.warnings,
        )
        if any(f.kind == "content" for f in r.files):
            result.update(
                winnow_window=inv.incident.winnow_window,
                content_fingerprints=inv.con.execute("SELECT count(*) FROM content_fingerprints").fetchone()[0],
                content_texts=inv.con.execute("SELECT count(*) FROM content_stats").fetchone()[0],
            )
        with timed(result, "checkpoint_seconds", None):
            inv.con.execute("CHECKPOINT").fetchall()
    finally:
        inv.close()


def step_audit(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from kvforensics.audit import audit_database

    inv = investigation(args)
    try:
        with timed(result, "seconds", args.profile):
            report = audit_database(inv.con)
        result.update(rows=_request_count(inv), exit_code=report.exit_code, headline=report.headline())
    finally:
        inv.close()


def step_detect(args: argparse.Namespace, result: dict[str, Any]) -> None:
    inv = investigation(args)
    try:
        with timed(result, "seconds", args.profile):
            found = inv.detect()
        result["rows"] = _request_count(inv)
        result["findings"] = len(found)
        result["tiers"] = dict(
            inv.con.execute("SELECT confidence, count(*) FROM request_tiers GROUP BY 1 ORDER BY 1").fetchall()
        )
        result["latency_models"] = [
            list(r) for r in inv.con.execute("SELECT model, usable, n_points FROM latency_model ORDER BY 1").fetchall()
        ]
        inv.con.execute("CHECKPOINT").fetchall()
    finally:
        inv.close()


def step_scope(args: argparse.Namespace, result: dict[str, Any]) -> None:
    inv = investigation(args)
    try:
        with timed(result, "seconds", args.profile):
            s = inv.scope().summary
        result["rows"] = _request_count(inv)
        result["affected_responses"] = s["affected_responses"]
        result["affected_accounts"] = s["affected_accounts"]
        result["source_accounts"] = s["source_accounts"]
        result["possible_source_pairs"] = int(inv.con.execute("SELECT count(*) FROM possible_sources").fetchone()[0])
        inv.con.execute("CHECKPOINT").fetchall()
        _write_answers(inv, args.out / "kvforensics_answers.json")
    finally:
        inv.close()


def _write_answers(inv, path: Path) -> None:
    """The answers the pandas baseline is checked against (affected set, recipients, sources)."""
    import hashlib

    con = inv.con
    affected = [r[0] for r in con.execute("SELECT request_id FROM affected_responses ORDER BY 1").fetchall()]
    recipients = dict(
        con.execute("SELECT account_id, count(*) FROM affected_responses GROUP BY 1 ORDER BY 1").fetchall()
    )
    classes = dict(
        con.execute("SELECT account_class, count(*) FROM affected_responses GROUP BY 1 ORDER BY 1").fetchall()
    )
    digest = hashlib.sha256()
    pairs = 0
    cur = con.execute("SELECT affected_request_id, source_request_id FROM possible_sources ORDER BY 1, 2")
    while batch := cur.fetchmany(100_000):
        for a, s in batch:
            digest.update(f"{a}|{s}\n".encode())
        pairs += len(batch)
    sources = int(con.execute("SELECT count(DISTINCT source_account_id) FROM possible_sources").fetchone()[0])
    aborted = [
        r[0]
        for r in con.execute(
            "SELECT DISTINCT request_id FROM engine_events WHERE kind = 'abort_input_too_long' ORDER BY 1"
        ).fetchall()
    ]
    path.write_text(
        json.dumps(
            {
                "affected": affected,
                "recipients": recipients,
                "by_class": classes,
                "possible_source_pairs": pairs,
                "possible_source_pairs_sha256": digest.hexdigest(),
                "possible_source_accounts": sources,
                "engine_req_time_stats": con.execute(
                    "SELECT count(*) FROM engine_events WHERE kind = 'req_time_stats'"
                ).fetchone()[0],
                "engine_aborted_requests": len(aborted),
                "engine_aborted_sha256": hashlib.sha256("\n".join(aborted).encode()).hexdigest(),
                "content_fingerprints": con.execute("SELECT count(*) FROM content_fingerprints").fetchone()[0],
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )


def step_outputs(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from kvforensics.stages.scope import SCOPE_PARAMETERS, ScopeResult, summarise

    inv = investigation(args)
    try:
        # the scope stage's result, re-read from the database (cheap), as `kvforensics report` would need
        inv.scope_result = ScopeResult(summary=summarise(inv.con, inv.incident), parameters=dict(SCOPE_PARAMETERS))
        with timed(result, "seconds", args.profile):
            inv.write_outputs()
        result["rows"] = _request_count(inv)
    finally:
        inv.close()


def step_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    inv = investigation(args)
    try:
        with timed(result, "seconds", args.profile):
            path = inv.report()
        result["rows"] = _request_count(inv)
        result["html_bytes"] = path.stat().st_size
    finally:
        inv.close()


def step_proto_sources(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """PROTOTYPE, not kvforensics: on a database the scope step has run on, rebuild kv_writes and
    group_pools with the package's scope.sql, then time the package's kv_timeline + possible_sources
    and sql/proto_possible_sources.sql, and compare their pairs."""
    from kvforensics.core.db import sql, statements
    from kvforensics.engines.portable import render
    from kvforensics.stages.scope import SCOPE_PARAMETERS

    inv = investigation(args)
    con = inv.con
    script = {}
    for stmt in statements(render(sql("scope"), "duckdb")):
        m = re.search(r"CREATE OR REPLACE (?:TEMP )?TABLE (\w+) AS", stmt)
        if m:
            script[m.group(1)] = stmt
    h = {"horizon_factor": SCOPE_PARAMETERS["horizon_factor"]}
    try:
        for name in ("kv_writes", "group_pools"):
            con.execute(script[name])
        with timed(result, "package_seconds", None):
            con.execute(script["kv_timeline"])
            con.execute(script["possible_sources"], h)
        with timed(result, "seconds", args.profile):
            for stmt in statements(bench_sql("proto_possible_sources")):
                uses = "$horizon_factor" in re.sub(r"--[^\n]*", "", stmt)
                con.execute(stmt, h if uses else None)
        cols = (
            "affected_request_id, recipient_account_id, source_request_id, source_account_id, kv_group, "
            "tokens_written_since, pool_tokens"
        )
        result["rows"] = int(con.execute("SELECT count(*) FROM requests").fetchone()[0])
        result["pairs"] = int(con.execute("SELECT count(*) FROM possible_sources").fetchone()[0])
        result["proto_pairs"] = int(con.execute("SELECT count(*) FROM proto_possible_sources").fetchone()[0])
        result["differences"] = int(
            con.execute(
                f"SELECT count(*) FROM ((SELECT {cols} FROM possible_sources EXCEPT ALL SELECT {cols} FROM proto_possible_sources)"
                f" UNION ALL (SELECT {cols} FROM proto_possible_sources EXCEPT ALL SELECT {cols} FROM possible_sources))"
            ).fetchone()[0]
        )
        result["timeline_events"] = int(con.execute("SELECT count(*) FROM proto_timeline").fetchone()[0])
        con.execute("DROP TABLE proto_possible_sources")
    finally:
        inv.close()


def step_pandas(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import pandas_baseline

    with timed(result, "seconds", args.profile):
        answers = pandas_baseline.investigate(args.incident, phases=result.setdefault("phases", {}))
    result["rows"] = answers.pop("rows_read")
    result.update({k: v for k, v in answers.items() if k != "affected" and k != "recipients"})
    (args.out / "pandas_answers.json").write_text(json.dumps(answers, indent=1) + "\n", encoding="utf-8")


def step_pandas_sources(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import pandas_baseline

    with timed(result, "seconds", args.profile):
        answers = pandas_baseline.sources_only(args.incident, phases=result.setdefault("phases", {}))
    result["rows"] = answers["engine_lines_read"]
    result.update(answers)


STEPS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], None]] = {
    "floor-count": step_floor_count,
    "floor-scan": step_floor_scan,
    "floor-load": step_floor_load,
    "floor-oversize": step_floor_oversize,
    "floor-engine": step_floor_engine,
    "floor-content": step_floor_content,
    "pandas-sources": step_pandas_sources,
    "ingest": step_ingest,
    "audit": step_audit,
    "detect": step_detect,
    "scope": step_scope,
    "outputs": step_outputs,
    "report": step_report,
    "pandas": step_pandas,
    "proto-sources": step_proto_sources,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--incident", type=Path, required=True)
    p.add_argument("--out", type=Path, help="evidence/output folder of the kvforensics stages")
    p.add_argument("--report", type=Path, required=True, help="JSON written on success")
    p.add_argument("--memory-limit", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--temp-dir", type=Path, default=None)
    p.add_argument("--kinds", default="", help="ingest: only the sources of these kinds (comma list, e.g. requests)")
    p.add_argument(
        "--winnow-window",
        type=int,
        default=None,
        help="the content's winnowing window instead of the incident file's (1: every shingle)",
    )
    p.add_argument("--profile", type=Path, default=None)
    p.add_argument("--trace-sql", type=Path, default=None, help="time every DuckDB execute; JSON written here")
    p.add_argument(
        "--memory-trace",
        type=Path,
        default=None,
        help="RSS, DuckDB's memory by tag and the open input files every 5 s, as JSON lines written here",
    )
    args = p.parse_args(argv)
    trace = SqlTrace() if args.trace_sql else None
    if trace:
        trace.install()
    if args.memory_trace:
        MemoryTrace(args.memory_trace).install()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(BENCH_DIR))
    from measure import package_sha256

    result: dict[str, Any] = {"step": args.step, "package_sha256": package_sha256()}
    try:
        STEPS[args.step](args, result)
    finally:
        if trace:
            trace.dump(args.trace_sql)
    result["rows_per_s"] = round(result["rows"] / result["seconds"]) if result.get("seconds") else None
    args.report.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
