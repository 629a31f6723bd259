"""Read-only, streaming access to input files, compressed or not.

Inputs are evidence: they are opened read-only and never loaded whole into memory. A truncated
gzip or zstd stream yields every complete line it can and then says where it stopped.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping

import duckdb

from kvforensics.core.db import size_bytes
from kvforensics.sources.engine_logs.contract import LongLine

CHUNK = 1 << 20
# The reason of the partial last record of a truncated stream (quarantined, never loaded).
INCOMPLETE_RECORD = "incomplete last record: the input ends inside it (truncated file)"


def open_binary(path: Path, *, fast_gzip: bool = False) -> BinaryIO:
    """Open a file read-only, decompressing ``.gz`` and ``.zst`` transparently. ``fast_gzip``
    decompresses gzip with ISA-L (python-isal, 2-3x faster than zlib) where it is installed; its
    readers raise on a truncated or corrupt stream like :mod:`gzip`'s, so it suits callers that
    only need to know whether the whole stream reads (the JSONL line count), not where it stops."""
    raw = open(path, "rb")  # noqa: SIM115 - the caller closes the wrapper, which closes this
    name = path.name.lower()
    if name.endswith(".gz"):
        if fast_gzip:
            try:
                from isal import igzip
            except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
                pass
            else:
                return igzip.IGzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if name.endswith(".zst") or name.endswith(".zstd"):
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, CHUNK)  # type: ignore[arg-type]
    return raw


class Recovering(io.RawIOBase):
    """A readable decompressed stream that, unlike :mod:`gzip`'s reader, hands over every byte of a
    truncated gzip or zstd stream before it raises (EOFError, zlib.error, ...): what a text or CSV
    reader has read when it stops is all there was. ``tail`` holds the bytes after the last line end
    (CR or LF) handed over, i.e. the incomplete last line when the stream stops early."""

    def __init__(self, path: Path) -> None:
        from kvforensics.sources.engine_logs.lines import open_lines

        self._lines = open_lines(path)
        self._chunks = self._lines._chunks()
        self._buffer = b""
        self.tail = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        while not self._buffer:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
            self.tail = chunk[end + 1 :] if end >= 0 else self.tail + chunk
            self._buffer = chunk
        n = min(len(target), len(self._buffer))
        target[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n

    def close(self) -> None:
        self._lines.close()
        super().close()


def file_digest(path: Path) -> tuple[str, int]:
    """SHA-256 and size in bytes of the file as stored (compressed bytes, not content)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


@dataclass
class LineStream:
    """Iterates ``(line_number, bytes)`` over a file; ``stopped`` explains an early end.

    Built on :func:`kvforensics.sources.engine_logs.parse.open_lines`, which recognises gzip and zstd by
    their magic bytes and notices a truncated stream of either. The incomplete last line of a
    truncated stream is not yielded (half a record must not pass for a record): ``partial`` holds
    its number and bytes, for the caller to quarantine. A file whose first MiB holds a CR and no LF
    has old Mac line ends: it is read as lines split at each CR.
    """

    path: Path
    stopped: str | None = None
    lines: int = 0
    partial: tuple[int, bytes] | None = None
    cr_only: bool = False
    # the longest line held whole (None: engine_lines.MAX_LINE_BYTES); a longer one is yielded as a LongLine
    max_line: int | None = None

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        from kvforensics.sources.engine_logs.lines import open_lines

        self.cr_only = _cr_only(self.path)
        if self.cr_only:
            yield from self._cr_lines()
            return
        stream = open_lines(self.path)
        if self.max_line is not None:
            stream.max_line = self.max_line
        for n, _text, raw in stream:
            self.lines = n
            yield n, raw
        if stream.truncated is not None:
            t = stream.truncated
            self.stopped = (
                f"input ends early after line {t.after_line} ({t.describe()}); later records, if any, are lost"
            )
            if t.partial_tail:
                self.partial = (t.after_line + 1, t.partial_tail)

    def _cr_lines(self) -> Iterator[tuple[int, bytes]]:
        """Lines split at CR, streamed (a truncated gzip stream yields every byte it decompressed); a line longer
        than ``max_line`` is read on without being held and yielded as a LongLine, as the LF reader does."""
        from kvforensics.sources.engine_logs.lines import LONG_LINE_KEPT, MAX_LINE_BYTES

        limit = self.max_line or MAX_LINE_BYTES
        pending = bytearray()
        digest: Any = None  # the current line's hash once it is too long to hold
        size = n = 0

        def line() -> bytes:
            return bytes(pending) if digest is None else LongLine(bytes(pending), size, digest.hexdigest(), limit)

        try:
            with open_binary(self.path) as fh:
                while chunk := fh.read(CHUNK):
                    pieces = chunk.split(b"\r")
                    for i, piece in enumerate(pieces):
                        size += len(piece)
                        if digest is not None:
                            digest.update(piece)
                        else:
                            pending += piece
                            if len(pending) > limit:
                                digest = hashlib.sha256(pending)
                                del pending[LONG_LINE_KEPT:]
                        if i < len(pieces) - 1:  # a CR ends the line
                            n += 1
                            self.lines = n
                            yield n, line()
                            pending, digest, size = bytearray(), None, 0
        except (EOFError, OSError, zlib.error) as e:
            self.stopped = f"input ends early after line {n} ({type(e).__name__}: {e}); later records, if any, are lost"
            if pending:
                self.partial = (n + 1, line())
            return
        if pending:
            self.lines = n + 1
            yield n + 1, line()


def _cr_only(path: Path) -> bool:
    """Whether the file's first MiB (decompressed) holds a CR and no LF: old Mac line ends."""
    try:
        with open_binary(path) as fh:
            head = fh.read(CHUNK)
    except (EOFError, OSError, zlib.error):
        return False
    return b"\r" in head and b"\n" not in head


def line_limit(con: duckdb.DuckDBPyConnection) -> int:
    """The longest line a reader typing records on *con* holds whole: a 32nd of DuckDB's memory limit (typing a
    JSON record of n bytes takes some 17 n in DuckDB: a 34 MB record loads under a 1 GB limit, 60 MB do not), and
    at most ``engine_lines.MAX_LINE_BYTES``. A longer line is quarantined with its size and SHA-256."""
    from kvforensics.sources.engine_logs.lines import MAX_LINE_BYTES

    setting = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
    try:
        return min(MAX_LINE_BYTES, max(1 << 20, size_bytes(str(setting).replace(" ", "")) // 32))
    except ValueError:  # a setting this version writes otherwise
        return MAX_LINE_BYTES


def decode_line(raw: bytes) -> str | None:
    """UTF-8 text of a line, or None when it is not valid UTF-8 or was too long to read whole (a
    :class:`~kvforensics.sources.engine_logs.contract.LongLine`, quarantined with ``unreadable_reason``)."""
    if isinstance(raw, LongLine):
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def printable_raw(raw: bytes | str, limit: int = 500) -> str:
    """A record as it can be shown in the quarantine: truncated, undecodable bytes escaped."""
    text = raw.decode("utf-8", errors="backslashreplace") if isinstance(raw, bytes) else raw
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


NEEDLE_EVERY = 8  # scan_file looks for late field names in every 8th chunk (1 MiB each) and in the last
# The longest line DuckDB's line reader is given: its max_line_size default (2 MiB). It refuses a longer line in
# the middle of a file, but drops a last line of some 30 MB without a word (DuckDB 1.x-2.0): a file with a longer
# line goes to the Python reader.
DUCKDB_MAX_LINE = 2 << 20


def scan_file(path: Path, needles: Mapping[str, set[bytes]]) -> tuple[int | None, list[str]]:
    """One pass over the decompressed file at memchr speed: its physical lines, and the fields of
    *needles* one of whose names occurs in it (looked for in every ``NEEDLE_EVERY``-th chunk and in the
    last one, where a field logged from some record on is sure to be). The line count is None when a
    byte in the file is a CR or the 0x01 that DuckDB's line reader uses as its delimiter (either would
    make DuckDB split or cut a physical line, shifting line numbers or dropping the text after the
    0x01), when a line is longer than DuckDB's line reader holds (``DUCKDB_MAX_LINE``: it refuses such a
    line, or drops it without a word when it is the last), or when the stream cannot be read to its
    end: such a file goes to the Python reader, which keeps every byte (or quarantines a line too long
    to read whole) and says why. A last line without a newline counts, as it does for the Python
    reader."""
    count: int | None = 0
    last = b"\n"
    run = 0  # bytes since the last newline: the line being read (lines inside one chunk are shorter)
    found: set[str] = set()
    longest = max((len(n) for names in needles.values() for n in names), default=0)
    before = b""  # the end of the chunk before: a name cut between two chunks
    unseen: tuple[bytes, bytes] | None = None  # the last chunk read, while not looked at

    def look(text: bytes) -> None:
        found.update(f for f, names in needles.items() if f not in found and any(n in text for n in names))

    try:
        with open_binary(path, fast_gzip=True) as fh:
            for i, chunk in enumerate(iter(lambda: fh.read(CHUNK), b"")):
                if count is not None and (b"\r" in chunk or b"\x01" in chunk):
                    count = None
                    if not needles:
                        break
                if count is not None:
                    count += chunk.count(b"\n")
                    last = chunk[-1:]
                    first = chunk.find(b"\n")
                    if (run + (len(chunk) if first < 0 else first)) > DUCKDB_MAX_LINE:
                        count = None
                        if not needles:
                            break
                    run = run + len(chunk) if first < 0 else len(chunk) - chunk.rfind(b"\n") - 1
                if len(found) < len(needles):
                    if i % NEEDLE_EVERY == 0:
                        look(before + chunk)
                        unseen = None
                    else:
                        unseen = (before, chunk)
                    before = chunk[-longest:]
        if unseen is not None and len(found) < len(needles):
            look(unseen[0] + unseen[1])  # the last chunk
    except Exception:  # noqa: BLE001 - truncated or corrupt: the Python reader says why, record by record
        count = None
    return (None if count is None else count + (last != b"\n")), sorted(found)
