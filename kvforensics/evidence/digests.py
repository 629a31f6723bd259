"""The digests a manifest records and ``kvforensics verify`` takes again: every output file, every table.

Output files are hashed byte for byte; the evidence database is hashed per table (its column names and
its rows as a multiset: in a canonical order, or summed order-independently), because the file's bytes
change whenever it is opened.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import itertools
import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from kvforensics.core.db import memory_set_aside
from kvforensics.sources.common.textio import file_digest

CSV_OUTPUTS = ("affected_requests.csv", "notifications.csv", "possible_responses.csv", "quarantine.csv")
# written by the report stage only (`kvforensics report` or `run`); a folder `kvforensics scope` wrote has none
REPORT_OUTPUTS = ("report.html", "report.md", "report.pdf", "notices")
# the outputs the manifest hashes (folders: every file below); the database is hashed per table instead
HASHED_OUTPUTS = ("scope.json", *CSV_OUTPUTS, *REPORT_OUTPUTS)
_FLOAT_DIGITS = 12  # floats are hashed to 12 significant digits: parallel sums may differ in the last bits


# How `tables` digests are taken (recorded in the manifest as `table_digest`): "rows-v2" hashes each row
# in DuckDB (a JSON array of its values: timestamps as epoch microseconds, floats to 12 significant
# digits) and the table as the SHA-256 of its column names and its rows' hashes in sorted order, so the
# database does the work on every core; "rows-v3" sums the same row hashes, expanded to LtHash lanes, in
# one pass without a sort (``_table_digest_v3``); "rows-v1" (manifests without `table_digest`) renders
# every row in Python, in the table's sorted order. `kvforensics run` writes rows-v2: rows-v3 takes about
# 30 times as long on two cores (benchmarks/README.md, 2026-12-05); verify checks all three.
TABLE_DIGEST = "rows-v2"
TABLE_DIGESTS = ("rows-v1", TABLE_DIGEST, "rows-v3")
# what each method is and what it resists, as the manifest states it (`table_digest_construction`)
TABLE_DIGEST_CONSTRUCTIONS = {
    "rows-v1": "SHA-256 of the column names and of every row rendered as JSON, in sorted order: "
    "128-bit collision resistance (SHA-256)",
    "rows-v2": "SHA-256 of the column names and of the rows' SHA-256 hashes in sorted order: "
    "128-bit collision resistance (SHA-256)",
    "rows-v3": "LtHash16 (Lewi, Kim, Maykov, Weis 2019; Bellare-Micciancio): 1024 16-bit lanes of MGF1-SHA-256 "
    "of each row's SHA-256, summed exactly in 64 bits, then SHA-256 with the column names; at least "
    "200 bits against multiset collisions by its authors' estimate (random oracle model), 128 bits "
    "overall (the rows' SHA-256)",
}
_HASH_BATCH = 1_000_000
_HASH_BYTES = 32  # a row hash, as sorted and as written to the bucket files
_BUCKET_BYTES = 32 * 2**20  # a bucket's row hashes are sorted in memory when they are at most this
_MAX_BUCKETS = 256  # bucket files written at once
_HEX_ROWS = 1 << 18  # rows rendered as hex lines at once
# what the digest holds outside DuckDB at most: an Arrow batch, a bucket, its sorted copy and keys, hex lines
DIGEST_MEMORY = 3 * _BUCKET_BYTES + _HASH_BATCH * _HASH_BYTES + _HEX_ROWS * 4 * 65
_MIN_ROWS_PER_PASS = 10_000_000
_PREFIXES = 16**4


def table_digests(
    con: duckdb.DuckDBPyConnection,
    method: str = TABLE_DIGEST,
    rows_per_pass: int | None = None,
    rows_per_bucket: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Every table of the database: its row count and the SHA-256 of its column names and rows, sorted
    (rows-v2 hashes the rows again for every ``rows_per_pass`` of them and sorts ``rows_per_bucket`` at
    a time; the digests depend on neither)."""
    if method not in TABLE_DIGESTS:
        raise ValueError(f"unknown table digest {method!r}; known: {', '.join(TABLE_DIGESTS)}")
    names = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database() "
            "AND table_schema = 'main' AND table_type = 'BASE TABLE' ORDER BY table_name"
        ).fetchall()
    ]
    if method == "rows-v1":
        return {name: _table_digest_v1(con, name) for name in names}
    if method == "rows-v3":
        with memory_set_aside(con, V3_MEMORY):
            return {name: _table_digest_v3(con, name) for name in names}
    with (
        memory_set_aside(con, DIGEST_MEMORY),
        _Buckets(_spill_folder(con), rows_per_bucket or _BUCKET_BYTES // _HASH_BYTES) as buckets,
    ):
        return {name: _table_digest_v2(con, name, buckets, rows_per_pass) for name in names}


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'  # a name from the catalog, quoted


def _table_digest_v2(
    con: duckdb.DuckDBPyConnection, name: str, buckets: _Buckets, rows_per_pass: int | None = None
) -> dict[str, Any]:
    """rows-v2 of one table, without a database sort: the row hashes are uniform, so they are written
    to bucket files by their leading bytes (ranges in order), and each bucket is sorted in memory and
    hashed in turn. A table of more than ``rows_per_pass`` rows (by default as many as two thirds of
    the free disk of the spill folder hold) is read in several passes, each over one range of the row
    hashes' first four hex digits, so that the disk holds one pass's hashes (32 bytes a row, exactly);
    each pass hashes every row again: time for disk."""
    columns, hashed = _row_hashes(con, name)
    total = con.execute(f"SELECT count(*) FROM {_quoted(name)}").fetchall()[0][0]
    passes = max(1, min(_PREFIXES, -(-total // (rows_per_pass or _rows_per_pass(con)))))
    bounds = [_PREFIXES * i // passes for i in range(passes + 1)]
    h = hashlib.sha256(json.dumps([c for c, _ in columns]).encode() + b"\n")
    rows = 0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        ranged = (
            hashed
            if passes == 1
            else (
                f"SELECT h FROM ({hashed}) AS r WHERE h >= unhex('{lo:04x}')"
                + (f" AND h < unhex('{hi:04x}')" if hi < _PREFIXES else "")
            )
        )
        batches = (_rows_of(b.column(0)) for b in con.sql(ranged).to_arrow_reader(_HASH_BATCH))
        for sorted_rows in buckets.sorted(batches, -(-total // passes), lo, hi):
            for at in range(0, len(sorted_rows), _HEX_ROWS):
                h.update(_hex_lines(sorted_rows[at : at + _HEX_ROWS]))
            rows += len(sorted_rows)
    return {"rows": rows, "sha256": h.hexdigest()}


def _row_hashes(con: duckdb.DuckDBPyConnection, name: str) -> tuple[list[tuple[str, str]], str]:
    """A table's columns (name, type) and the query of its rows' hashes (``h``: the SHA-256 of the row as
    a JSON array of its canonical values, 32 bytes), which rows-v2 sorts and rows-v3 sums."""
    columns = con.execute(
        """SELECT column_name, data_type FROM information_schema.columns
           WHERE table_catalog = current_database() AND table_schema = 'main' AND table_name = $t
           ORDER BY ordinal_position""",
        {"t": name},
    ).fetchall()
    values = ", ".join(_canonical_sql(_quoted(c), t) for c, t in columns) or "NULL"
    return columns, f"SELECT unhex(sha256(json_array({values}))) AS h FROM {_quoted(name)}"


# rows-v3: LtHash16 with the parameters of Lewi, Kim, Maykov and Weis, "Securing update propagation with
# homomorphic hashing" (2019, https://eprint.iacr.org/2019/227): 1024 lanes of 16 bits, each row's lanes
# the output of an extendable-output hash. Here that is MGF1 with SHA-256 (RFC 8017, B.2.1) of the row's
# SHA-256: 64 blocks SHA-256(h || 4-byte big-endian counter), computed by DuckDB on every core, read as
# little-endian 16-bit lanes. The lanes are summed exactly in 64 bits rather than modulo 2^16, so every
# collision here is one of LtHash16 too, and a row repeated 2^16 times does not wrap to none.
_LTHASH_LANES = 1024
_XOF_BLOCKS = _LTHASH_LANES * 2 // _HASH_BYTES  # SHA-256 blocks a row's lanes take
_V3_BATCH = 8192  # rows a batch: 64 hex digests of 64 characters each, 32 MB
V3_MEMORY = _V3_BATCH * _XOF_BLOCKS * 64 * 2  # an Arrow batch of hex digests and one column decoded
_V3_DOMAIN = b"kvforensics rows-v3 LtHash16 1024 MGF1-SHA-256\n"


def _table_digest_v3(con: duckdb.DuckDBPyConnection, name: str) -> dict[str, Any]:
    """rows-v3 of one table, in one streaming pass: the sum of its rows' LtHash lanes, which depends on
    the rows as a multiset (a duplicated row counts twice) and never on their order; the digest is the
    SHA-256 of the column names and the 1024 sums."""
    columns, hashed = _row_hashes(con, name)
    blocks = ", ".join(f"sha256(h || '\\x00\\x00\\x00\\x{j:02x}'::BLOB) AS x{j}" for j in range(_XOF_BLOCKS))
    lanes = np.zeros(_LTHASH_LANES, dtype=np.uint64)
    per_block = _LTHASH_LANES // _XOF_BLOCKS
    rows = 0
    for batch in con.sql(f"SELECT {blocks} FROM ({hashed}) AS r").to_arrow_reader(_V3_BATCH):
        for j, column in enumerate(batch.columns):  # block j of every row of the batch: lanes 16j to 16j+15
            decoded = np.frombuffer(binascii.unhexlify(_fixed_width(column, 2 * _HASH_BYTES)), dtype="<u2")
            lanes[j * per_block : (j + 1) * per_block] += decoded.reshape(-1, per_block).sum(axis=0, dtype=np.uint64)
        rows += batch.num_rows
    h = hashlib.sha256(_V3_DOMAIN + json.dumps([c for c, _ in columns]).encode() + b"\n")
    h.update(lanes.astype("<u8").tobytes())
    return {"rows": rows, "sha256": h.hexdigest()}


class _Buckets:
    """Row hashes ((n, 32) uint8 arrays) in sorted order, through bucket files in a temporary folder
    under *parent* (DuckDB's spill folder; both made when first needed, removed on exit). A bucket
    holds the hashes whose 16-bit chunk at ``depth`` (bytes 2*depth and 2*depth+1) is in ``[lo, hi)``
    and whose earlier chunks are the same; a bucket of more than ``per_bucket`` rows is split again,
    finer or by its next chunk (a bucket of identical hashes is already sorted)."""

    def __init__(self, parent: Path, per_bucket: int) -> None:
        self.parent, self.per_bucket = parent, per_bucket
        self._folder: Path | None = None
        self._made, self._made_parent = 0, False

    def __enter__(self) -> _Buckets:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        if self._made_parent:
            with contextlib.suppress(OSError):  # unless DuckDB spilled there meanwhile
                self.parent.rmdir()

    def sorted(
        self, batches: Iterator[np.ndarray], expected: int, lo: int, hi: int, depth: int = 0
    ) -> Iterator[np.ndarray]:
        """The hashes of *batches* (each chunk at *depth* in ``[lo, hi)``; about *expected* of them),
        sorted, a bucket at a time."""
        if expected <= self.per_bucket:  # small: in memory, unless it turns out larger
            together, held = [], 0
            for batch in batches:
                together.append(batch)
                held += len(batch)
                if held > self.per_bucket:
                    yield from self.sorted(itertools.chain(together, batches), held, lo, hi, depth)
                    return
            if held:
                yield _sort(np.concatenate(together))
            return
        if hi - lo == 1:  # one value of this chunk: split by the next
            if depth == _HASH_BYTES // 2 - 1:  # every byte the same: sorted as they are
                yield from batches
                return
            depth, lo, hi = depth + 1, 0, _PREFIXES
        # buckets of 3/4 the size on average: one that comes out larger than a bucket is split again
        parts = min(_MAX_BUCKETS, hi - lo, -(-expected * 4 // (self.per_bucket * 3)))
        paths = [self._path() for _ in range(parts)]
        counts = [0] * parts
        files = [p.open("wb") for p in paths]
        try:
            for batch in batches:
                chunk = batch[:, 2 * depth].astype(np.int64) << 8 | batch[:, 2 * depth + 1]
                part = ((chunk - lo) * parts // (hi - lo)).astype(np.uint8)  # parts <= 256: a radix sort
                ends = np.cumsum(np.bincount(part, minlength=parts))
                grouped = _taken(batch, np.argsort(part, kind="stable"))
                for j, (start, end) in enumerate(zip((0, *ends[:-1]), ends, strict=True)):
                    if end > start:
                        files[j].write(grouped[start:end].tobytes())
                        counts[j] += int(end - start)
        finally:
            for f in files:
                f.close()
        try:
            for j, path in enumerate(paths):
                sub_lo, sub_hi = lo + -(-j * (hi - lo) // parts), lo + -(-(j + 1) * (hi - lo) // parts)
                yield from self.sorted(self._read(path), counts[j], sub_lo, sub_hi, depth)
                path.unlink()
        finally:
            for path in paths:
                path.unlink(missing_ok=True)

    def _read(self, path: Path) -> Iterator[np.ndarray]:
        with path.open("rb") as f:
            while chunk := f.read(self.per_bucket * _HASH_BYTES):
                yield np.frombuffer(chunk, dtype=np.uint8).reshape(-1, _HASH_BYTES)

    def _path(self) -> Path:
        if self._folder is None:
            self._made_parent = not self.parent.exists()
            self.parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix="kvf-digest-", dir=self.parent))
        self._made += 1
        return self._folder / f"{self._made}.bin"


def _sort(rows: np.ndarray) -> np.ndarray:
    """(n, 32) uint8 rows in byte order: by their first 8 bytes, then all 32 if any of those tie."""
    first = rows.view(">u8")[:, 0].astype(np.uint64)  # big-endian words as numbers: byte order
    order = np.argsort(first)
    ranked = first[order]
    if len(ranked) > 1 and (ranked[1:] == ranked[:-1]).any():
        order = np.lexsort(rows.view(">u8").astype(np.uint64)[:, ::-1].T)
    return _taken(rows, order)


def _taken(rows: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``rows[order]``, four times faster: the rows as four 8-byte words each."""
    return np.take(rows.view(np.uint64), order, axis=0).view(np.uint8)


def _spill_folder(con: duckdb.DuckDBPyConnection) -> Path:
    """DuckDB's temp directory (next to the database: evidence.spill, which a new run clears), or the
    system's for a database in memory."""
    database = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchall()
    temp = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
    return Path(temp).absolute() if database and database[0][0] and temp else Path(tempfile.gettempdir())


def _rows_per_pass(con: duckdb.DuckDBPyConnection) -> int:
    """How many row hashes one pass may write: two thirds of the free disk of DuckDB's temp directory
    (a bucket split again holds its hashes twice for a while; nothing else of the digest spills)."""
    spill = _spill_folder(con)
    folder = next((p for p in (spill, *spill.parents) if p.exists()), Path.cwd())
    return max(_MIN_ROWS_PER_PASS, shutil.disk_usage(folder).free * 2 // 3 // _HASH_BYTES)


def _rows_of(column: pa.Array) -> np.ndarray:
    """A binary column of 32-byte digests as an (n, 32) uint8 array."""
    return _fixed_width(column, _HASH_BYTES)


def _fixed_width(column: pa.Array, width: int) -> np.ndarray:
    """A binary or string column whose values are all ``width`` bytes as an (n, width) uint8 array."""
    n = len(column)
    if n == 0:
        return np.empty((0, width), dtype=np.uint8)
    if column.null_count or not (
        pa.types.is_binary(column.type)
        or pa.types.is_large_binary(column.type)
        or pa.types.is_string(column.type)
        or pa.types.is_large_string(column.type)
    ):
        raise ValueError(f"a digest column of {column.type} with {column.null_count} nulls")
    offsets_type = (
        np.int64 if pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type) else np.int32
    )
    _, offsets, data = column.buffers()
    ends = np.frombuffer(offsets, dtype=offsets_type, count=column.offset + n + 1)[column.offset :]
    if ends[-1] - ends[0] != width * n:
        raise ValueError(f"a digest is not {width} bytes")
    return np.frombuffer(data, dtype=np.uint8, count=int(ends[-1] - ends[0]), offset=int(ends[0])).reshape(n, width)


def _hex_lines(rows: np.ndarray) -> bytes:
    """(n, 32) digests as 64 hex digits each, each followed by a newline."""
    n = len(rows)
    lines = np.empty((n, 65), dtype=np.uint8)
    lines[:, :64] = np.frombuffer(rows.tobytes().hex().encode("ascii"), dtype=np.uint8).reshape(n, 64)
    lines[:, 64] = ord("\n")
    return lines.tobytes()


def _canonical_sql(column: str, data_type: str) -> str:
    """A column's value as the row hash renders it: floats to 12 significant digits (parallel sums may
    differ in the last bits), timestamps as epoch microseconds (whatever the session's time zone)."""
    if data_type in ("DOUBLE", "FLOAT", "REAL"):
        return (
            f"CASE WHEN {column} IS NULL THEN NULL WHEN isfinite({column}) "
            f"THEN printf('%.{_FLOAT_DIGITS}g', {column}) ELSE CAST({column} AS VARCHAR) END"
        )
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
