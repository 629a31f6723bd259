"""The evidence database: connection settings and SQL loaded by name from the package."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TypeVar

import duckdb

# Without --memory-limit or [settings] memory_limit, a connection's limit is the smaller of this and half the
# memory the process may use (DuckDB's own default, 80% of the machine, let a run grow to 20 GB of RSS)
DEFAULT_MEMORY_CAP = "4GB"

T = TypeVar("T")


def connect(
    path: str | Path = ":memory:",
    *,
    memory_limit: str | None = None,
    threads: int | None = None,
    read_only: bool = False,
) -> duckdb.DuckDBPyConnection:
    """Open (or create) an evidence database with the session settings every stage relies on. Its memory
    limit is *memory_limit*, else :func:`default_memory_limit`; :class:`MemoryGovernor` holds the process to it."""
    con = duckdb.connect(str(path), read_only=read_only)
    con.execute("SET TimeZone = 'UTC'")
    # memory DuckDB frees goes back to the system within seconds; otherwise its allocator keeps it, and
    # the process stays at the most DuckDB ever held, above memory_limit once Python holds memory too
    con.execute("SET allocator_background_threads = true").fetchall()
    # Validated against a strict pattern, so it is safe to inline (SET takes no parameters).
    limit = _checked_size(memory_limit) if memory_limit else default_memory_limit()
    con.execute(f"SET memory_limit = '{limit}'").fetchall()
    con.execute(
        f"SET VARIABLE kvf_memory_limit = {size_bytes(limit)}"
    ).fetchall()  # for memory_set_aside, MemoryGovernor
    if str(path) != ":memory:":  # spill next to the database rather than in the system temp dir
        con.execute("SET temp_directory = $d", {"d": str(Path(path).with_suffix(".spill"))}).fetchall()
    con.execute("SET preserve_insertion_order = false").fetchall()
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    if not read_only:
        run_script(con, "schema")
    return con


def default_memory_limit() -> str:
    """The memory_limit of a connection opened without one: the smaller of ``DEFAULT_MEMORY_CAP`` and half the
    memory this process may use (the machine's, or its cgroup's limit in a container), in MiB."""
    cap = size_bytes(DEFAULT_MEMORY_CAP)
    usable = usable_memory_bytes()
    return f"{(cap if usable is None else min(cap, usable // 2)) // 2**20}MiB"


def usable_memory_bytes() -> int | None:
    """The machine's physical memory, or less where a cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)
    limits this process; None where neither can be read."""
    found = []
    try:
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        pass
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) is no limit; v1 says none with a number near 2**63
            found.append(int(text))
    found = [n for n in found if n > 0]
    return min(found) if found else None


@contextmanager
def memory_set_aside(con: duckdb.DuckDBPyConnection, nbytes: int) -> Iterator[None]:
    """DuckDB's memory_limit lowered by *nbytes* while the block runs: memory the caller's own readers
    hold outside DuckDB (Python and Arrow buffers), so that the process as a whole stays near the limit
    set by :func:`connect` (DuckDB's limit counts its own buffers only). Without such a limit, or on
    another connection, nothing changes. DuckDB keeps at least half the limit. While it is in force,
    :class:`MemoryGovernor` on the same connection leaves the limit alone."""
    limit = configured_limit(con)
    if limit is None or nbytes <= 0:
        yield
        return
    con.execute(f"SET memory_limit = '{max(limit - int(nbytes), limit // 2)}B'").fetchall()
    con.execute(f"SET VARIABLE kvf_memory_set_aside = {int(nbytes)}").fetchall()
    try:
        yield
    finally:
        con.execute("SET VARIABLE kvf_memory_set_aside = 0").fetchall()
        con.execute(f"SET memory_limit = '{limit}B'").fetchall()


def configured_limit(con: duckdb.DuckDBPyConnection) -> int | None:
    """The memory_limit :func:`connect` set, in bytes (from a validated size: safe to inline), or None."""
    limit = con.execute("SELECT getvariable('kvf_memory_limit')").fetchall()[0][0]
    return int(limit) if limit else None


class MemoryGovernor:
    """Keeps the whole process near the memory_limit :func:`connect` set, through a long load or a long
    script. DuckDB's limit counts its own buffers only; what the process holds besides them (Python's
    objects, Arrow buffers, DuckDB's bookkeeping outside its buffer pool, allocator slack) grows as the
    work goes on. :meth:`tick`, called between batches or statements, measures that at most every
    *every_s* seconds (the RSS, from /proc/self/statm, less ``duckdb_memory()``) and sets DuckDB's limit
    to the configured one less it, never below half; the configured limit is restored on exit. Without a
    configured limit, without /proc, or while :func:`memory_set_aside` is in force on the connection,
    nothing changes.

    The measure cannot tell what the process holds from what its allocators keep of memory DuckDB freed (a
    large sort or join leaves it in the RSS for a while), so a lowered limit can be too low for a statement that
    runs within the configured one: :meth:`run` runs a statement again under the configured limit when it ran out
    of memory under a lowered one."""

    def __init__(self, con: duckdb.DuckDBPyConnection, every_s: float = 5.0) -> None:
        self.con, self.every_s = con, every_s
        self.limit = configured_limit(con)
        self.outside = 0  # bytes outside DuckDB's buffers at the last measurement
        self._next = 0.0
        self._changed = False
        self._lowered = False  # DuckDB's limit is below the configured one now

    def __enter__(self) -> MemoryGovernor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._changed:
            self._changed = self._lowered = False
            self._set(self.limit)

    def tick(self) -> None:
        if self.limit is None or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        rss = _rss_bytes()
        if rss is None:
            self.limit = None
            return
        if self.con.execute("SELECT getvariable('kvf_memory_set_aside')").fetchall()[0][0]:
            return  # the caller's own measure is in force
        held = self.con.execute("SELECT coalesce(sum(memory_usage_bytes), 0) FROM duckdb_memory()").fetchall()[0][0]
        self.outside = max(0, rss - int(held))
        target = max(self.limit - self.outside, self.limit // 2)
        if self._set(target):
            self._changed, self._lowered = True, target < self.limit

    def run(self, statement: Callable[[], T]) -> T:
        """``statement()`` (one statement that leaves nothing behind when it fails: a query, or a DDL statement
        DuckDB rolls back) after a :meth:`tick`; when it runs out of memory under a lowered limit, the configured
        limit is set again (until the next measurement) and it runs once more."""
        self.tick()
        try:
            return statement()
        except duckdb.OutOfMemoryException:
            if not self._lowered or self.limit is None or not self._set(self.limit):
                raise
        self._lowered = False
        self._next = time.monotonic() + self.every_s
        return statement()

    def _set(self, nbytes: int | None) -> bool:
        try:
            self.con.execute(f"SET memory_limit = '{nbytes}B'").fetchall()
        except duckdb.OutOfMemoryException:  # DuckDB could not free enough for it: the limit stays
            return False
        return True


def _rss_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


_UNITS = {
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}  # as DuckDB reads them
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(" + "|".join(_UNITS) + ")")


def size_bytes(value: str) -> int:
    """The bytes of a size such as '2GB' (10**9 bytes a GB) or '512MiB' (2**20 a MiB), as DuckDB reads it."""
    number, unit = _SIZE.fullmatch(_checked_size(value)).groups()  # type: ignore[union-attr]
    return int(float(number) * _UNITS[unit])


def _checked_size(value: str) -> str:
    if not _SIZE.fullmatch(value.strip()):
        from kvforensics.core.errors import ConfigError

        raise ConfigError(f"memory_limit {value!r} must look like '2GB' or '512MiB'")
    return value.strip()


@cache
def sql(name: str) -> str:
    """The text of ``kvforensics/sql/<name>.sql``."""
    return (Path(__file__).parent.parent / "sql" / f"{name}.sql").read_text(encoding="utf-8")


def statements(text: str) -> list[str]:
    """Split a SQL script into statements (a statement ends with ';' at the end of a line)."""
    parts = re.split(r";[ \t]*(?:--[^\n]*)?\n", text + "\n")
    return [
        p.strip()
        for p in parts
        if p.strip() and not all(line.strip().startswith("--") or not line.strip() for line in p.strip().splitlines())
    ]


def run_script(
    con: duckdb.DuckDBPyConnection, name: str, params: dict | None = None, *, text: str | None = None
) -> None:
    """Run ``sql/<name>.sql`` (or ``text``, a script built from it) statement by statement, giving
    each the named parameters it uses, under a :class:`MemoryGovernor`."""

    params = params or {}
    with MemoryGovernor(con) as governor:
        for stmt in statements(sql(name) if text is None else text):
            used = parameters_used(stmt)
            missing = used - set(params)
            if missing:
                raise KeyError(f"sql/{name}.sql needs parameter(s) {sorted(missing)}")
            governor.tick()
            con.execute(stmt, {k: v for k, v in params.items() if k in used} or None)


def parameters_used(statement: str) -> set[str]:
    """The ``$name`` parameters a statement uses (outside comments and string literals): DuckDB
    refuses named parameters a statement does not use."""
    code = re.sub(r"--[^\n]*", "", statement)
    code = re.sub(r"'(?:[^']|'')*'", "''", code)
    return set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", code))


def has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether a table (or view) of that name exists: a stage's output, absent from a database that stage has not run
    on."""
    return bool(one(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = $n", {"n": name})[0])


def one(con: duckdb.DuckDBPyConnection, query: str, params: dict | list | None = None) -> tuple:
    """The single row a query returns (fetching it completely, as DuckDB 2 requires)."""
    rows = con.execute(query, params).fetchall() if params is not None else con.execute(query).fetchall()
    if len(rows) != 1:
        raise LookupError(f"expected one row, got {len(rows)}: {query[:80]}")
    return rows[0]
