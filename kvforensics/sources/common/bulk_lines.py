"""A file's lines as DuckDB reads them, numbered as the Python readers number them: what the bulk readers
(KV events, content) take their lines from, a chunk at a time.

DuckDB's CSV reader, told that a line is one field delimited by 0x01 with no quoting, gives each physical line
as it is. It numbers them as :class:`~kvforensics.sources.common.textio.LineStream` does only when nothing in
the file makes the two disagree, which :func:`numbered_lines` checks before any row is kept: no CR or 0x01 byte
and no line over DuckDB's line size (:func:`~kvforensics.sources.common.textio.scan_file`), a stream that reads
to its end, bytes that are UTF-8 (DuckDB refuses others), no byte-order mark (DuckDB drops it, Python keeps it)
and as many lines read by DuckDB as the file has. A file that fails any of these is the Python reader's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import duckdb
import pyarrow as pa

from kvforensics.sources.common.textio import open_binary, scan_file

if TYPE_CHECKING:
    from kvforensics.config import Source
    from kvforensics.sources.common.load_report import IngestRun

# lines are read a chunk at a time (CHUNK_LINES lines or CHUNK_BYTES of text), in slices DuckDB's threads read
# side by side
CHUNK_LINES, CHUNK_BYTES, SLICE_LINES = 500_000, 128 << 20, 16_384
_BOM = b"\xef\xbb\xbf"
_LINES_SQL = (
    "SELECT ordinality AS line, raw FROM read_csv($file, columns = {'raw': 'VARCHAR'}, header = false, "
    "delim = chr(1), quote = '', escape = '', auto_detect = false, strict_mode = false, "
    "compression = '{compression}') WITH ORDINALITY"
)


class NumberedLines:
    """The lines of one file DuckDB can number (from :func:`numbered_lines`): :meth:`chunks` reads them."""

    def __init__(
        self, con: duckdb.DuckDBPyConnection, path: Path, lines: int, query: str, first: pa.Table | None = None
    ) -> None:
        self.path = path
        self.lines = lines
        self._con = con
        self._query = query
        self._first = first  # the first chunk, read ahead by the checks (LineChecks)

    def chunks(self) -> Iterator[pa.Table]:
        """The file's ``(line, raw)`` rows a chunk at a time, each chunk in slices of ``SLICE_LINES`` (Arrow record
        batches) that DuckDB's threads read side by side; read on a cursor of its own. A first chunk read ahead
        comes first; the rest is read from the line after it."""
        after = 0
        if self._first is not None:
            first, self._first = self._first, None
            after = first.num_rows  # lines 1 to after
            yield first
            if after >= self.lines:
                return
        query = self._query if not after else f"SELECT * FROM ({self._query}) WHERE line > {int(after)}"
        stream = self._con.cursor()
        try:
            yield from _chunked(stream.sql(query, params={"file": str(self.path)}).to_arrow_reader(SLICE_LINES))
        finally:
            stream.close()


def _chunked(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.Table]:
    """Record batches of ``(line, raw)`` gathered into chunks of ``CHUNK_LINES`` lines or ``CHUNK_BYTES`` of text."""
    held: list[pa.RecordBatch] = []
    size = count = 0
    for b in batches:
        held.append(b)
        count += b.num_rows
        size += b.column(1).nbytes
        if count >= CHUNK_LINES or size >= CHUNK_BYTES:
            yield pa.Table.from_batches(held)
            held, size, count = [], 0, 0
    if held:
        yield pa.Table.from_batches(held)


class CheckedLines(NamedTuple):
    """What :func:`check_lines` found in a file DuckDB can number: its lines, their query, and the first chunk when
    it was read ahead."""

    lines: int
    query: str
    first: pa.Table | None = None


def numbered_lines(
    con: duckdb.DuckDBPyConnection, path: Path, min_lines: int, checked: Future[CheckedLines | str] | None = None
) -> NumberedLines | str:
    """The file's lines as DuckDB numbers them, or why they are the Python reader's: something in the file
    DuckDB would number or read differently, or fewer lines than *min_lines* (below which DuckDB's fixed cost per
    file is more than Python's). *checked*: :func:`check_lines` of the file begun before (:class:`LineChecks`)."""
    found = checked.result() if checked is not None else check_lines(con, path, min_lines)
    if isinstance(found, str):
        return found
    return NumberedLines(con, path, found.lines, found.query, found.first)


def check_lines(
    con: duckdb.DuckDBPyConnection, path: Path, min_lines: int, read_first: bool = False
) -> CheckedLines | str:
    """What :func:`numbered_lines` checks before any row is kept: the file's line count and the query of its lines,
    or why the Python reader must read it. Reads the whole file twice (Python's scan, DuckDB's count), one core each;
    with *read_first*, the first chunk of its lines is read too and kept."""
    lines, _ = scan_file(path, {})
    if lines is None:
        return (
            "DuckDB cannot number its lines as the reference does (a CR or 0x01 byte, a line over 2 MiB, or a "
            "stream that does not read to its end)"
        )
    if lines < min_lines:
        return f"{lines:,} lines, fewer than the {min_lines:,} from which the bulk reader is faster"
    with open_binary(path) as fh:
        if fh.read(len(_BOM)) == _BOM:
            return "the file starts with a byte-order mark, which DuckDB's line reader drops"
    query = _LINES_SQL.replace("{compression}", compression(path))
    first = None
    try:  # the whole stream read once before any row is kept: a line DuckDB refuses sends the file to the reference
        numbered = con.execute(f"SELECT count(*) FROM ({query})", {"file": str(path)}).fetchall()[0][0]
        if read_first and numbered == lines:
            reader = con.sql(query, params={"file": str(path)}).to_arrow_reader(SLICE_LINES)
            try:
                first = next(_chunked(reader), None)
            finally:
                reader.close()
    except duckdb.Error as e:
        return f"DuckDB's line reader refused it ({str(e).splitlines()[0][:120]})"
    if numbered != lines:
        return f"DuckDB's line reader numbered {numbered:,} lines where the file has {lines:,}"
    return CheckedLines(lines, query, first)


class LineChecks:
    """:func:`check_lines` of files a bulk reader will read, begun on a thread of their own while other sources load
    (their passes over a compressed file use one core each, which those sources leave free at times), the first
    file's first chunk of lines read ahead too; a file's bulk read then waits for its check only. Leaving the block
    waits for the checks begun."""

    def __init__(self, con: duckdb.DuckDBPyConnection, paths: list[Path], min_lines: int) -> None:
        self._cursor = con.cursor()  # the checks' own connection to the database, made here on the caller's thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvf-line-checks")
        self._checks = {
            path: self._pool.submit(check_lines, self._cursor, path, min_lines, at == 0)
            for at, path in enumerate(paths)
        }

    def __enter__(self) -> LineChecks:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:  # the ingest failed: a count under way is stopped, those not begun are not
            self._cursor.interrupt()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._cursor.close()

    def get(self, path: Path) -> Future[CheckedLines | str] | None:
        """The check of *path*, or None when none was begun."""
        return self._checks.get(path)


@contextmanager
def checks_begun(
    run: IngestRun, source: Source, files: list[Path], min_lines: int, refusal: str | None
) -> Iterator[None]:
    """A bulk reader's source kind's ``begin``: the checks of the source's files' lines begun on a thread of their
    own for the length of the ingest (none when *refusal* says why its files are not read in bulk);
    :func:`begun_check` gives each file's at its read."""
    if refusal is not None:
        yield
        return
    with LineChecks(run.con, files, min_lines) as checks:
        run.state[f"{__name__}:{source.name}"] = checks
        yield


def begun_check(run: IngestRun, source: Source, path: Path) -> Future[CheckedLines | str] | None:
    """The check of *path* :func:`checks_begun` began, or None."""
    checks: LineChecks | None = run.state.get(f"{__name__}:{source.name}")
    return checks.get(path) if checks is not None else None


def compression(path: Path) -> str:
    """DuckDB's name for the file's compression, from its magic bytes."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    return "gzip" if magic[:2] == b"\x1f\x8b" else "zstd" if magic == b"\x28\xb5\x2f\xfd" else "none"
