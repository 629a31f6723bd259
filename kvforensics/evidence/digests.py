"""The digests a manifest records and ``kvforensics verify`` takes again: every output file, every table.

Output files are hashed byte for byte; the evidence database is hashed per table (its column names and
its rows as a multiset: in a canonical order, or summed order-independently), because the file's bytes
change whenever it is opened.

Size: four digest methods that verify must keep checking, each beside the canonical forms it shares.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import itertools
import json
import math
import queue
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvforensics.core.db import configured_limit, memory_set_aside
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
# every row in Python, in the table's sorted order; "rows-v4" sorts the rows themselves in the database
# (their canonical values, column by column) and hashes the sorted table column-wise with the CPU's
# SHA-256, no hash per row (``_table_digest_v4``). `kvforensics run` writes rows-v4: about a third of
# rows-v2's time at 1M requests, where rows-v3 takes about 30 times rows-v2's (benchmarks/README.md);
# verify checks all four.
TABLE_DIGEST = "rows-v4"
TABLE_DIGESTS = ("rows-v1", "rows-v2", "rows-v3", TABLE_DIGEST)
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
    "rows-v4": "SHA-256 of the column names, their canonical types, the row count and, per column, the SHA-256 "
    "of its values and of its lengths and nulls, the rows in ascending order of their canonical values: "
    "128-bit collision resistance (SHA-256)",
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
    catalog = _catalog(con)
    names = sorted(catalog)
    if method == "rows-v1":
        return {name: _table_digest_v1(con, name) for name in names}
    if method == "rows-v3":
        with memory_set_aside(con, V3_MEMORY):
            return {name: _table_digest_v3(con, name) for name in names}
    if method == "rows-v4":
        return _digests_v4(con, catalog)
    with (
        memory_set_aside(con, DIGEST_MEMORY),
        _Buckets(_spill_folder(con), rows_per_bucket or _BUCKET_BYTES // _HASH_BYTES) as buckets,
    ):
        return {name: _table_digest_v2(con, name, buckets, rows_per_pass) for name in names}


def run_method(con: duckdb.DuckDBPyConnection) -> str:
    """The digest a run records: rows-v4, unless sorting the largest table could need more disk than two
    thirds of what is free where DuckDB spills (its sort holds the table again, about twice its canonical
    values, when they outgrow the memory limit); then rows-v2, whose bucket files take 32 bytes a row and
    which hashes a table in passes when even those do not fit."""
    limit = configured_limit(con)
    room = _spill_disk_free(con) * 2 // 3
    for name, rows in sorted(_table_sizes(con).items(), key=lambda t: -t[1])[:3]:
        needed = 2 * rows * _v4_row_bytes(con, name)
        if needed > room and (limit is None or needed > limit):
            return "rows-v2"
    return TABLE_DIGEST


def _v4_row_bytes(con: duckdb.DuckDBPyConnection, name: str, canonical: list[_Canonical] | None = None) -> int:
    """About how many bytes a row's canonical values take (text lengths from a sample of 10,000 rows)."""
    if canonical is None:
        canonical = [_canonical_v4(_quoted(c), t) for c, t in _columns(con, name)]
    widths = _widths_sql(canonical)
    mean = (
        con.execute(f"SELECT avg({widths}) FROM {_quoted(name)} USING SAMPLE 10000 ROWS").fetchall()[0][0]
        if widths
        else 0
    )
    return _V4_FIXED_WIDTH * len(canonical) + int(mean or 0)


def _columns(con: duckdb.DuckDBPyConnection, name: str) -> list[tuple[str, str]]:
    """A table's columns (name, type), in their order."""
    return _catalog(con, name).get(name, [])


def _catalog(con: duckdb.DuckDBPyConnection, table: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """Every table of the database's main schema (no view), or the one named *table*, and its columns (name, type)
    in their order, read from the catalog at once (the same names and types as information_schema gives, a query a
    table slower)."""
    catalog: dict[str, list[tuple[str, str]]] = {}
    for name, column, data_type in con.execute(
        """SELECT c.table_name, c.column_name, c.data_type FROM duckdb_columns() AS c JOIN duckdb_tables() AS t
           ON c.database_name = t.database_name AND c.schema_name = t.schema_name AND c.table_name = t.table_name
           WHERE c.database_name = current_database() AND c.schema_name = 'main' AND ($t IS NULL OR c.table_name = $t)
           ORDER BY c.table_name, c.column_index""",
        {"t": table},
    ).fetchall():
        catalog.setdefault(name, []).append((column, data_type))
    return catalog


def _table_sizes(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Every table's row count as DuckDB estimates it (its catalog, no scan)."""
    return {
        name: rows or 0
        for name, rows in con.execute(
            "SELECT table_name, estimated_size FROM duckdb_tables() "
            "WHERE database_name = current_database() AND schema_name = 'main'"
        ).fetchall()
    }


def _spill_disk_free(con: duckdb.DuckDBPyConnection) -> int:
    """Free bytes on the disk of DuckDB's temp directory (or of its nearest existing parent)."""
    spill = _spill_folder(con)
    folder = next((p for p in (spill, *spill.parents) if p.exists()), Path.cwd())
    return shutil.disk_usage(folder).free


def _widths_sql(canonical: list[_Canonical]) -> str:
    """SQL of the bytes a row's measured (text) canonical values take; empty when none is measured."""
    return " + ".join(f"coalesce({c.width}, 0)" for c in canonical if c.width is not None)


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
    columns = _columns(con, name)
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


# rows-v4: the table sorted by the database, hashed column by column. Each column is read as a canonical
# value (``_canonical_v4``): an integer (booleans, integers up to 64 bits signed or 32 unsigned, timestamps
# and dates as epoch microseconds) or a byte string (text, blobs, floats to 12 significant digits, JSON,
# anything else as its JSON text). The rows are sorted by those values, column by column in the table's
# order, ascending, nulls last (a total order of the values alone: equal keys are equal rows). Each column
# has two SHA-256 streams: its values (an integer as 8 little-endian bytes, 0 for a null; a string's bytes)
# and its shape (a null flag a row for integers; a string's length as 8 bytes, -1 for a null). The two
# streams give back the column's values, the values give back the sorted rows, and the sorted rows are
# the table as a multiset: a collision of the digest is a collision of SHA-256.
_V4_DOMAIN = b"kvforensics rows-v4 sorted columns SHA-256\n"
_V4_BATCH_BYTES = 32 * 2**20  # the canonical values an Arrow batch holds at most (its longest row assumed)
_V4_MAX_ROWS = 1 << 20
_V4_MIN_ROWS = 16  # rows above a 32nd of the memory limit are quarantined as their hash: half the limit at most
V4_MEMORY = 3 * _V4_BATCH_BYTES  # the batch, a null-filled copy of a column and its lengths
_V4_INTEGERS = frozenset(("BOOLEAN", "TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER"))


_V4_WORKERS = 2  # tables digested at once (at most DuckDB's threads): one sorts while another is hashed


def _digests_v4(con: duckdb.DuckDBPyConnection, catalog: dict[str, list[tuple[str, str]]]) -> dict[str, dict[str, Any]]:
    """rows-v4 of every table of *catalog* (its columns), the largest first, two at a time on cursors of the
    connection: while DuckDB sorts one table on its threads, Python hashes another's columns (hashlib and DuckDB
    both work without the GIL). The digests do not depend on it."""
    names = sorted(catalog)
    threads = int(con.execute("SELECT current_setting('threads')").fetchall()[0][0])
    workers = max(1, min(_V4_WORKERS, threads, len(names)))
    with memory_set_aside(con, V4_MEMORY * workers):
        if workers == 1:
            return {name: _table_digest_v4(con, name, catalog[name]) for name in names}
        sizes = _table_sizes(con)
        cursors: queue.SimpleQueue[duckdb.DuckDBPyConnection] = queue.SimpleQueue()
        opened = [con.cursor() for _ in range(workers)]
        for cursor in opened:
            cursors.put(cursor)

        def digest(name: str) -> dict[str, Any]:
            cursor = cursors.get()
            try:
                return _table_digest_v4(cursor, name, catalog[name])
            finally:
                cursors.put(cursor)

        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                done = {n: pool.submit(digest, n) for n in sorted(names, key=lambda n: -(sizes.get(n) or 0))}
                return {name: done[name].result() for name in names}
        finally:
            for cursor in opened:
                cursor.close()


class _Canonical(NamedTuple):
    """A column as rows-v4 reads it: its canonical value (SQL), ``"int"`` (BIGINT) or ``"bytes"``, and the
    SQL of the value's length in bytes (None: at most ``_V4_FIXED_WIDTH``)."""

    sql: str
    kind: str
    width: str | None


_V4_FIXED_WIDTH = 32  # an integer's 8 bytes and null flag; a float's text (%.12g, inf, nan) and its length


def _canonical_v4(column: str, data_type: str) -> _Canonical:
    """A column's canonical value for rows-v4 (see above)."""
    if data_type in _V4_INTEGERS:
        return _Canonical(f"CAST({column} AS BIGINT)", "int", None)
    if data_type.startswith("TIMESTAMP") or data_type == "DATE":
        return _Canonical(f"epoch_us({column})", "int", None)
    if data_type in ("DOUBLE", "FLOAT", "REAL"):
        return _Canonical(_canonical_sql(column, data_type), "bytes", None)
    if data_type == "BLOB":
        return _Canonical(column, "bytes", f"octet_length({column})")
    text = column if data_type == "VARCHAR" else f"CAST({column} AS VARCHAR)" if data_type == "JSON" else None
    text = text or f"CAST(to_json({column}) AS VARCHAR)"
    return _Canonical(text, "bytes", f"strlen({text})")


def _table_digest_v4(
    con: duckdb.DuckDBPyConnection, name: str, columns: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """rows-v4 of one table (its *columns*, name and type, when the caller read them): its canonical values sorted
    by the database (which spills to disk beyond its memory limit), read in Arrow batches of bounded size and hashed
    column-wise. When the first column looks unique (its approximate distinct count), the database sorts by it
    alone, which is the same order as long as no two rows tie on it; the first tie read starts the table again with
    every column."""
    columns = _columns(con, name) if columns is None else columns
    canonical = [_canonical_v4(_quoted(c), t) for c, t in columns]
    kinds = [c.kind for c in canonical]
    h = hashlib.sha256(_V4_DOMAIN + json.dumps([c for c, _ in columns]).encode() + b"\n")
    if not canonical:
        rows = con.execute(f"SELECT count(*) FROM {_quoted(name)}").fetchall()[0][0]
        h.update(json.dumps(kinds).encode() + b"\n" + rows.to_bytes(8, "little"))
        return {"rows": rows, "sha256": h.hexdigest()}
    profile = _profile(con, name, canonical)
    batch_rows = _v4_batch_rows(canonical, profile)
    values = ", ".join(f"{c.sql} AS c{j}" for j, c in enumerate(canonical))
    every = ", ".join(f"c{j} ASC NULLS LAST" for j in range(len(canonical)))
    streams: list[tuple[Any, Any]] = []
    rows = 0
    groups = _grouped(con, name, canonical, profile)
    if groups is not None:
        streams, rows = _hash_grouped(con, name, values, kinds, batch_rows, groups)
    for order in (
        [] if groups is not None else (["c0 ASC NULLS LAST"] if _first_column_unique(profile) else []) + [every]
    ):
        streams = [(hashlib.sha256(), hashlib.sha256()) for _ in canonical]
        rows, ties, last = 0, order == every, _NOTHING
        for batch in con.sql(f"SELECT {values} FROM {_quoted(name)} ORDER BY {order}").to_arrow_reader(batch_rows):
            if not ties:
                tied, last = _ties(batch.column(0), last)
                if tied:
                    break
            for (values_hash, shape_hash), kind, column in zip(streams, kinds, batch.columns, strict=True):
                _hash_column(column, kind, values_hash, shape_hash)
            rows += batch.num_rows
        else:
            break
    h.update(json.dumps(kinds).encode() + b"\n" + rows.to_bytes(8, "little"))
    for values_hash, shape_hash in streams:
        h.update(values_hash.digest() + shape_hash.digest())
    return {"rows": rows, "sha256": h.hexdigest()}


_NOTHING = object()  # no row read yet
_GROUPED_MIN_ROWS = 100_000  # a smaller table is sorted row by row: cheap either way
_GROUPED_SHARE = 0.5  # groups per row at most (their approximate count) for a table to be sorted as groups


class _Profile(NamedTuple):
    """What rows-v4 needs to know of a table before it sorts it, from one scan (``_profile``)."""

    rows: int
    widest: int  # bytes of the widest row's measured (text) canonical values
    first_distinct: int  # the first canonical column's approximate distinct count (HyperLogLog)
    groups: int | None  # approximate distinct keys (every column but the last), when the last is an integer


def _profile(con: duckdb.DuckDBPyConnection, name: str, canonical: list[_Canonical]) -> _Profile:
    """A table's row count, widest row, and approximate distinct counts, in one scan."""
    widths = _widths_sql(canonical)
    grouping = len(canonical) >= 2 and canonical[-1].kind == "int"
    keys = ", ".join(c.sql for c in canonical[:-1])
    rows, widest, first, groups = con.execute(
        f"SELECT count(*), {f'max({widths})' if widths else '0'}, approx_count_distinct({canonical[0].sql}), "
        f"{f'approx_count_distinct(hash({keys}))' if grouping else 'NULL'} FROM {_quoted(name)}"
    ).fetchall()[0]
    return _Profile(rows, int(widest or 0), first, groups)


def _grouped(con: duckdb.DuckDBPyConnection, name: str, canonical: list[_Canonical], profile: _Profile) -> float | None:
    """Groups per row when a table is sorted faster as groups than row by row, else None: its last column an integer
    and its other columns' values repeated (``content_fingerprints``: a text's request and part, then each of its
    fingerprints), and the table small enough to be grouped in memory (twice its canonical values within DuckDB's
    memory limit; a larger table is sorted row by row, which spills). The rows come out in the same order, so the
    digest is the same either way."""
    total, groups = profile.rows, profile.groups
    if groups is None or total < _GROUPED_MIN_ROWS or groups > total * _GROUPED_SHARE:
        return None
    limit = configured_limit(con)
    if limit is not None and 2 * total * _v4_row_bytes(con, name, canonical) > limit:
        return None
    return max(groups, 1) / total


def _hash_grouped(
    con: duckdb.DuckDBPyConnection, name: str, values: str, kinds: list[str], batch_rows: int, share: float
) -> tuple[list[tuple[Any, Any]], int]:
    """rows-v4's streams of a table read as groups: the database groups the rows by every column but the last, sorts
    the groups by those columns and each group's last column (a list), ascending, nulls last: the order of the rows
    sorted column by column. Each group is repeated once a row when it is hashed, at most ``_V4_MAX_ROWS`` rows at
    once."""
    k = len(kinds) - 1
    keys = ", ".join(f"c{j}" for j in range(k))
    order = ", ".join(f"c{j} ASC NULLS LAST" for j in range(k))
    query = (
        f"SELECT {keys}, list_sort(list(c{k}), 'ASC', 'NULLS LAST') AS g FROM (SELECT {values} FROM {_quoted(name)}) "
        f"GROUP BY {keys} ORDER BY {order}"
    )
    streams = [(hashlib.sha256(), hashlib.sha256()) for _ in kinds]
    rows = 0
    for batch in con.sql(query).to_arrow_reader(max(_V4_MIN_ROWS, int(batch_rows * share))):
        lists = batch.column(k)
        lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
        ends = np.cumsum(lengths)
        flat = pc.list_flatten(lists)
        first = 0
        while first < len(lengths):
            base = int(ends[first - 1]) if first else 0
            stop = max(first + 1, int(np.searchsorted(ends, base + _V4_MAX_ROWS, side="right")))
            repeat = pa.array(np.repeat(np.arange(first, stop), lengths[first:stop]))
            for j in range(k):
                _hash_column(batch.column(j).take(repeat), kinds[j], *streams[j])
            _hash_column(flat.slice(base, int(ends[stop - 1]) - base), kinds[k], *streams[k])
            rows += int(ends[stop - 1]) - base
            first = stop
    return streams, rows


def _first_column_unique(profile: _Profile) -> bool:
    """Whether a table's first canonical column looks unique: its approximate distinct count (HyperLogLog,
    a hash of every value) at least 90% of its rows. Only a guess: the rows read are checked for ties."""
    return profile.rows > 1 and profile.first_distinct >= profile.rows * 0.9


def _ties(column: pa.Array | pa.ChunkedArray, before: Any) -> tuple[bool, Any]:
    """Whether two neighbouring values of a sorted column are equal (two nulls too), the value before the
    column (``_NOTHING`` at the start) included; and the column's last value."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if n == 0:
        return False, before
    first, last = column[0].as_py(), column[n - 1].as_py()
    if before is not _NOTHING and before == first:
        return True, last
    if n > 1:
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        if (~valid[1:] & ~valid[:-1]).any() or pc.any(pc.equal(column.slice(1), column.slice(0, n - 1))).as_py():
            return True, last
    return False, last


def _v4_batch_rows(canonical: list[_Canonical], profile: _Profile) -> int:
    """Rows an Arrow batch of rows-v4 may hold: ``_V4_BATCH_BYTES`` over the table's widest row."""
    per_row = _V4_FIXED_WIDTH * len(canonical) + profile.widest
    return max(_V4_MIN_ROWS, min(_V4_MAX_ROWS, _V4_BATCH_BYTES // per_row))


def _hash_column(column: pa.Array, kind: str, values_hash: Any, shape_hash: Any) -> None:
    """One batch of a column into its two rows-v4 streams (see above)."""
    if isinstance(column, pa.ChunkedArray):
        for chunk in column.chunks:
            _hash_column(chunk, kind, values_hash, shape_hash)
        return
    n = len(column)
    if n == 0:
        return
    valid = np.ones(n, dtype=bool) if column.null_count == 0 else column.is_valid().to_numpy(zero_copy_only=False)
    if kind == "int":
        filled = column if column.null_count == 0 else column.fill_null(0)
        values_hash.update(np.ascontiguousarray(filled.to_numpy(zero_copy_only=False), dtype="<i8").tobytes())
        shape_hash.update(valid.view(np.uint8).tobytes())
        return
    if pa.types.is_string_view(column.type) or pa.types.is_binary_view(column.type):
        column = column.cast(pa.large_binary())
    large = pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
    _, offsets, data = column.buffers()[:3]
    ends = np.frombuffer(offsets, dtype=np.int64 if large else np.int32, count=column.offset + n + 1)[column.offset :]
    lengths = np.diff(ends).astype("<i8")
    if not valid.all():
        if lengths[~valid].any():  # a null slot that holds bytes: hash the valid values only
            binary = pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)
            column = column.fill_null(b"" if binary else "")
            _hash_column(column, kind, values_hash, _Discard())
        else:
            values_hash.update(memoryview(data)[int(ends[0]) : int(ends[-1])] if data is not None else b"")
        lengths[~valid] = -1
    elif data is not None:
        values_hash.update(memoryview(data)[int(ends[0]) : int(ends[-1])])
    shape_hash.update(lengths.tobytes())


class _Discard:
    """A hash stream that takes nothing (the shape of a column hashed again with its nulls filled)."""

    def update(self, data: bytes) -> None:
        pass


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
    return max(_MIN_ROWS_PER_PASS, _spill_disk_free(con) * 2 // 3 // _HASH_BYTES)


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
