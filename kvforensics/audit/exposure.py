"""The exposure windows of the ``stale_pages`` mechanism: table ``exposure_windows``.

A start-up is exposed to stale KV pages when its audit check 1 fails: a KV pool below the context length on
a role that hands a prompt beyond the pool to pages it did not write (a prefill or decode role, or one the
log does not show; :mod:`kvforensics.audit.checks.pool_vs_context`). The windows are written from that check
itself, at the end of ingest, so the audit table, ``scope.json``'s ``exposure_windows``, the conclusiveness
gate and the report cannot disagree about which start-ups were exposed: a unified server whose pool is below
its context (its engine refuses the prompt) is in none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvforensics.audit.checks.pool_vs_context import check_pool_vs_context
from kvforensics.audit.startups import from_capacity_row

if TYPE_CHECKING:
    import duckdb

_COLUMNS = (
    "instance",
    "role",
    "model",
    "engine",
    "engine_version",
    "valid_from",
    "valid_to",
    "end_reason",
    "kv_pool_tokens",
    "context_length",
    "sentence",
    "source_file",
    "source_line",
)


def write_exposure_windows(con: duckdb.DuckDBPyConnection) -> int:
    """Rebuild ``exposure_windows`` from the ``capacity`` start-ups; the number of exposed start-ups."""
    from kvforensics.core.db import sql

    rows = []
    for s in (from_capacity_row(r) for r in con.execute(sql("audit_capacity")).fetchall()):
        _status, sentence, _file, _line, exposed = check_pool_vs_context(s)
        if exposed:
            rows.append(
                (
                    s.instance,
                    s.role if s.role_certain else "unknown",
                    s.model,
                    s.engine,
                    s.version,
                    s.ts,
                    s.to,
                    s.end_reason,
                    s.pool,
                    s.context,
                    sentence,
                    s.file,
                    s.line,
                )
            )
    con.execute("DELETE FROM exposure_windows").fetchall()
    if rows:
        con.executemany(
            f"INSERT INTO exposure_windows ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", rows
        )
    return len(rows)
