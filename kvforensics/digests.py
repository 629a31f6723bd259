"""The digests a manifest records and ``kvforensics verify`` takes again: every output file, every table.

Output files are hashed byte for byte; the evidence database is hashed per table (its column names and
its rows in a canonical order), because the file's bytes change whenever it is opened.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import duckdb

from kvforensics.loaders.textio import file_digest

CSV_OUTPUTS = ("affected_requests.csv", "notifications.csv", "quarantine.csv")
# written by the report stage only (`kvforensics report` or `run`); a folder `kvforensics scope` wrote has none
REPORT_OUTPUTS = ("report.html", "report.md", "report.pdf", "notices")
# the outputs the manifest hashes (folders: every file below); the database is hashed per table instead
HASHED_OUTPUTS = ("scope.json", *CSV_OUTPUTS, *REPORT_OUTPUTS)
_FLOAT_DIGITS = 12  # floats are hashed to 12 significant digits: parallel sums may differ in the last bits


def table_digests(con: duckdb.DuckDBPyConnection) -> dict[str, dict[str, Any]]:
    """Every table of the database: its row count and the SHA-256 of its column names and rows, sorted."""
    names = [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database() "
        "AND table_schema = 'main' AND table_type = 'BASE TABLE' ORDER BY table_name").fetchall()]
    digests = {}
    for name in names:
        ident = '"' + name.replace('"', '""') + '"'  # a name from the catalog, quoted
        cur = con.execute(f"SELECT * FROM {ident} ORDER BY ALL")
        h = hashlib.sha256(json.dumps([d[0] for d in cur.description]).encode() + b"\n")
        rows = 0
        while batch := cur.fetchmany(10_000):
            for row in batch:
                h.update(_canonical_row(row))
            rows += len(batch)
        digests[name] = {"rows": rows, "sha256": h.hexdigest()}
    return digests


def _canonical_row(row: tuple) -> bytes:
    return json.dumps([_canonical(v) for v in row], default=str, ensure_ascii=False).encode("utf-8") + b"\n"


def _canonical(value: Any) -> Any:
    if isinstance(value, float):
        return value if not math.isfinite(value) else float(f"{value:.{_FLOAT_DIGITS}g}")
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    return value


def output_digests(out_dir: Path) -> dict[str, str]:
    """SHA-256 of every output file (``HASHED_OUTPUTS``) by its path relative to the folder."""
    return {rel: file_digest(out_dir / rel)[0] for rel in output_files(out_dir)}


def output_files(out_dir: Path) -> list[str]:
    """The output files present in ``out_dir`` (``HASHED_OUTPUTS``, folders walked), relative, sorted."""
    found = []
    for name in HASHED_OUTPUTS:
        path = out_dir / name
        found += [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path] if path.is_file() else []
    return sorted(p.relative_to(out_dir).as_posix() for p in found)


def report_written(outputs: dict[str, str]) -> bool:
    """Whether the manifest's ``outputs`` say the report stage wrote into the folder (its report or a notice)."""
    return any(Path(rel).parts[:1] in [(name,) for name in REPORT_OUTPUTS] for rel in outputs)
