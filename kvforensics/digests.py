"""The digests a manifest records and ``kvforensics verify`` takes again: every output file, every table.

Output files are hashed byte for byte; the evidence database is hashed per table (its column names and
its rows in a canonical order), because the file's bytes change whenever it is opened.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from kvforensics.loaders.textio import file_digest

CSV_OUTPUTS = ("affected_requests.csv", "notifications.csv", "quarantine.csv")
# written by the report stage only (`kvforensics report` or `run`); a folder `kvforensics scope` wrote has none
REPORT_OUTPUTS = ("report.html", "report.md", "report.pdf", "notices")
# the outputs the manifest hashes (folders: every file below); the database is hashed per table instead
HASHED_OUTPUTS = ("scope.json", *CSV_OUTPUTS, *REPORT_OUTPUTS)
_FLOAT_DIGITS = 12  # floats are hashed to 12 significant digits: parallel sums may differ in the last bits


# How `tables` digests are taken (recorded in the manifest as `table_digest`): "rows-v2" hashes each row
# in DuckDB (a JSON array of its values: timestamps as epoch microseconds, floats to 12 significant
# digits) and the table as the SHA-256 of its column names and its rows' hashes in sorted order, so the
# database does the work on every core; "rows-v1" (manifests without `table_digest`) renders every row
# in Python, in the table's sorted order.
TABLE_DIGEST = "rows-v2"
TABLE_DIGESTS = ("rows-v1", TABLE_DIGEST)
_HASH_BATCH = 1_000_000
_SPILL_BYTES_PER_ROW = 24  # measured: a sort of 30M 32-byte row hashes spilled 19 bytes a row at memory_limit 2GB
_MIN_ROWS_PER_PASS = 10_000_000
_PREFIXES = 16 ** 4


def table_digests(con: duckdb.DuckDBPyConnection, method: str = TABLE_DIGEST,
                  rows_per_pass: int | None = None) -> dict[str, dict[str, Any]]:
    """Every table of the database: its row count and the SHA-256 of its column names and rows, sorted
    (rows-v2 sorts at most ``rows_per_pass`` rows at a time; the digests do not depend on it)."""
    if method not in TABLE_DIGESTS:
        raise ValueError(f"unknown table digest {method!r}; known: {', '.join(TABLE_DIGESTS)}")
    names = [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database() "
        "AND table_schema = 'main' AND table_type = 'BASE TABLE' ORDER BY table_name").fetchall()]
    if method == TABLE_DIGEST:
        return {name: _table_digest_v2(con, name, rows_per_pass) for name in names}
    return {name: _table_digest_v1(con, name) for name in names}


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'  # a name from the catalog, quoted


def _table_digest_v2(con: duckdb.DuckDBPyConnection, name: str, rows_per_pass: int | None = None) -> dict[str, Any]:
    """rows-v2 of one table. A table of more than ``rows_per_pass`` rows (by default as many as half
    the free disk of the spill folder holds) is sorted in several passes, each over one range of the
    row hashes (by their first four hex digits), so that no sort spills more than a pass's rows; the
    passes' rows, in order, are the whole sorted list, so the digest is the same however many passes
    it took. Each pass hashes every row again: time for disk."""
    columns = con.execute(
        """SELECT column_name, data_type FROM information_schema.columns
           WHERE table_catalog = current_database() AND table_schema = 'main' AND table_name = $t
           ORDER BY ordinal_position""", {"t": name}).fetchall()
    values = ", ".join(_canonical_sql(_quoted(c), t) for c, t in columns) or "NULL"
    # the hashes are sorted as 32-byte blobs (the order of their hex texts, a third of the sort's spill)
    hashed = f"SELECT unhex(sha256(json_array({values}))) AS h FROM {_quoted(name)}"
    total = con.execute(f"SELECT count(*) FROM {_quoted(name)}").fetchall()[0][0]
    passes = max(1, min(_PREFIXES, -(-total // (rows_per_pass or _rows_per_pass(con)))))
    bounds = [f"{_PREFIXES * i // passes:04x}" for i in range(passes)] + [None]
    h = hashlib.sha256(json.dumps([c for c, _ in columns]).encode() + b"\n")
    rows = 0
    for lo, hi in zip(bounds, bounds[1:]):
        ranged = hashed if passes == 1 else f"SELECT h FROM ({hashed}) AS r WHERE h >= unhex('{lo}')" + (
            f" AND h < unhex('{hi}')" if hi else "")
        # streamed as Arrow: each batch's digests are one buffer of 32-byte values, written as hex lines
        # by numpy (a Python object per row made this half the time of a 10M-request pipeline)
        for batch in con.sql(f"{ranged} ORDER BY h").to_arrow_reader(_HASH_BATCH):
            h.update(_hex_lines(batch.column(0)))
            rows += batch.num_rows
    return {"rows": rows, "sha256": h.hexdigest()}


def _rows_per_pass(con: duckdb.DuckDBPyConnection) -> int:
    """How many row hashes one sort may spill: half the free disk of DuckDB's temp directory."""
    temp = Path(con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0] or ".").absolute()
    folder = next((p for p in (temp, *temp.parents) if p.exists()), Path.cwd())
    return max(_MIN_ROWS_PER_PASS, shutil.disk_usage(folder).free // 2 // _SPILL_BYTES_PER_ROW)


def _hex_lines(column: pa.Array) -> bytes:
    """The 32-byte digests of a binary column as 64 hex digits each, each followed by a newline."""
    n = len(column)
    if n == 0:
        return b""
    offsets_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    _, offsets, data = column.buffers()
    ends = np.frombuffer(offsets, dtype=offsets_type, count=column.offset + n + 1)[column.offset:]
    if ends[-1] - ends[0] != 32 * n:
        raise ValueError("a row hash is not 32 bytes")
    digests = bytes(memoryview(data)[int(ends[0]):int(ends[-1])])
    lines = np.empty((n, 65), dtype=np.uint8)
    lines[:, :64] = np.frombuffer(digests.hex().encode("ascii"), dtype=np.uint8).reshape(n, 64)
    lines[:, 64] = ord("\n")
    return lines.tobytes()


def _canonical_sql(column: str, data_type: str) -> str:
    """A column's value as the row hash renders it: floats to 12 significant digits (parallel sums may
    differ in the last bits), timestamps as epoch microseconds (whatever the session's time zone)."""
    if data_type in ("DOUBLE", "FLOAT", "REAL"):
        return (f"CASE WHEN {column} IS NULL THEN NULL WHEN isfinite({column}) "
                f"THEN printf('%.{_FLOAT_DIGITS}g', {column}) ELSE CAST({column} AS VARCHAR) END")
    if data_type.startswith("TIMESTAMP") or data_type == "DATE":
        return f"epoch_us({column})"
    return column


def _table_digest_v1(con: duckdb.DuckDBPyConnection, name: str) -> dict[str, Any]:
    cur = con.execute(f"SELECT * FROM {_quoted(name)} ORDER BY ALL")
    h = hashlib.sha256(json.dumps([d[0] for d in cur.description]).encode() + b"\n")
    rows = 0
    while batch := cur.fetchmany(10_000):
        for row in batch:
            h.update(_canonical_row(row))
        rows += len(batch)
    return {"rows": rows, "sha256": h.hexdigest()}


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
