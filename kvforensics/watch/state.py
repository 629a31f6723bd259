"""What ``watch`` keeps about itself in the evidence database: table ``watch_files``, where reading each followed
request file stands (its inode, the offset read to, its lines, what its records became).

A file's row is written in the same transaction as the records of the increment that moved it on, so a watch
stopped at any point (killed, the machine down) resumes from the last increment it stored, never storing one
twice. The request sources are the only ones resumed from their offsets: the sources a batch run re-reads whole
(engine logs, KV events, changes, content) are re-read whole when watch starts again, as a batch run would.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import duckdb
import pyarrow as pa

from kvforensics.watch.follow import FileState

TABLE = "watch_files"
_COLUMNS = (
    "source",
    "path",
    "dev",
    "ino",
    "head_sha256",
    "head_bytes",
    "offset",
    "skip",
    "lines",
    "size",
    "header",
    "gone",
    "broken",
    "records_read",
    "loaded",
    "quarantined",
    "duplicates",
    "notes",
    "provisional",
)
_TYPES = (
    pa.string(),
    pa.string(),
    pa.uint64(),
    pa.uint64(),
    pa.string(),
    pa.int64(),
    pa.int64(),
    pa.int64(),
    pa.int64(),
    pa.int64(),
    pa.binary(),
    pa.bool_(),
    pa.string(),
    pa.int64(),
    pa.int64(),
    pa.int64(),
    pa.int64(),
    pa.list_(pa.string()),
    pa.list_(pa.int64()),
)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    source VARCHAR NOT NULL, path VARCHAR NOT NULL, dev UBIGINT NOT NULL, ino UBIGINT NOT NULL,
    head_sha256 VARCHAR, head_bytes BIGINT, "offset" BIGINT, skip BIGINT, lines BIGINT, size BIGINT, header BLOB,
    gone BOOLEAN, broken VARCHAR, records_read BIGINT, loaded BIGINT, quarantined BIGINT, duplicates BIGINT,
    notes VARCHAR[], provisional BIGINT[]
)"""


def create(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_SCHEMA).fetchall()


def exists(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(
        con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = $t AND schema_name = 'main'", {"t": TABLE}
        ).fetchall()[0][0]
    )


def load(con: duckdb.DuckDBPyConnection) -> list[FileState]:
    """Every file recorded, as it stood when last stored."""
    if not exists(con):
        return []
    cols = ", ".join(f'"{c}"' for c in _COLUMNS)
    rows = con.execute(f"SELECT {cols} FROM {TABLE} ORDER BY source, path").fetchall()
    return [
        FileState(
            **{
                **dict(zip(_COLUMNS, r, strict=True)),
                "header": bytes(r[10] or b""),
                "notes": tuple(r[17] or ()),
                "provisional": None if r[18] is None else tuple(r[18]),
            }
        )
        for r in rows
    ]


def save(con: duckdb.DuckDBPyConnection, states: Iterable[FileState]) -> None:
    """Write the rows of *states* (replacing their earlier rows), inside the caller's transaction if one is open."""
    rows = [
        tuple(getattr(s, c) for c in _COLUMNS[:-2])
        + (list(s.notes), None if s.provisional is None else list(s.provisional))
        for s in states
    ]
    if not rows:
        return
    table = pa.table(
        {c: pa.array([r[i] for r in rows], type=t) for i, (c, t) in enumerate(zip(_COLUMNS, _TYPES, strict=True))}
    )
    con.register("watch_files_rows", table)
    try:
        con.execute(
            f"DELETE FROM {TABLE} t USING watch_files_rows r "
            "WHERE t.source = r.source AND t.dev = r.dev AND t.ino = r.ino"
        ).fetchall()
        con.execute(f"INSERT INTO {TABLE} SELECT * FROM watch_files_rows").fetchall()
    finally:
        con.unregister("watch_files_rows")


def undo_provisional(con: duckdb.DuckDBPyConnection, states: Iterable[FileState]) -> None:
    """The last lines without their newline read when watch last stopped, taken out again (rows and counts),
    so that each is read once it is whole: in one transaction with the files' records."""
    undone = [s for s in states if s.provisional is not None]
    if not undone:
        return
    con.begin()
    try:
        for s in undone:
            line, read, loaded, quarantined, duplicates = s.provisional or ()
            params = {"s": s.source, "f": s.path, "l": line}
            for table, file_col, line_col in (
                ("requests", "source_file", "source_line"),
                ("quarantine", "file", "line"),
                ("request_conflicts", "source_file", "source_line"),
            ):
                con.execute(
                    f"DELETE FROM {table} WHERE source = $s AND {file_col} = $f AND {line_col} = $l", params
                ).fetchall()
            s.records_read -= read
            s.loaded -= loaded
            s.quarantined -= quarantined
            s.duplicates -= duplicates
            s.provisional = None
        save(con, undone)
        con.commit()
    except BaseException:
        con.rollback()
        raise


_COUNTED = re.compile(r"^(\d[\d,]*) (.+)$")


def merged_notes(notes: Iterable[str]) -> list[str]:
    """The notes of a file's increments as one file's: each once, in the order first seen; notes that count
    something (``"3 timestamp(s) without offset ..."``) summed."""
    out: dict[str, int | None] = {}
    for note in notes:
        m = _COUNTED.match(note)
        if m:
            rest = m[2]
            out[rest] = (out.get(rest) or 0) + int(m[1].replace(",", ""))
        else:
            out.setdefault(note, None)
    return [note if n is None else f"{n} {note}" for note, n in out.items()]
