"""Reading engine logs as lines: plain, gzip and zstd files streamed, and the outer prefixes every
engine shares (ANSI colour, Docker ``--timestamps``, Ray's ``(Process pid=N)``).

Only this module touches the file system for engine logs: :func:`open_lines` streams a file line
by line (never the whole file in memory) and records where a truncated compressed stream stopped.
"""

from __future__ import annotations

import hashlib
import re
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zstandard

from kvforensics.core.errors import InputError
from kvforensics.sources.engine_logs.contract import EngineLine, LongLine

SNIFF_LINES = 200
"""How many first lines format and envelope recognition look at."""

# --------------------------------------------------------------------------------------------
# Streaming lines from plain, gzip and zstd files
# --------------------------------------------------------------------------------------------

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 18
MAX_LINE_BYTES = 64 << 20
"""The longest line the readers hold whole (64 MiB). A longer one is read on without being held: it is yielded as a
:class:`~kvforensics.sources.engine_logs.contract.LongLine` (its size, the SHA-256 of the whole line and its first
``LONG_LINE_KEPT`` bytes) with text None, which every reader quarantines; the memory a line takes stays bounded."""
LONG_LINE_KEPT = 4096


@dataclass(frozen=True)
class TruncatedInput:
    """Where a compressed (or unreadable) stream stopped before its end."""

    compression: str  # "gzip" | "zstd" | "none"
    after_line: int  # number of complete lines that were read before the stream stopped
    reason: str
    partial_tail: bytes = b""  # bytes of the incomplete line that was being read, if any

    def describe(self) -> str:
        what = f"{self.compression} stream" if self.compression != "none" else "file"
        tail = " (the incomplete line after it was quarantined)" if self.partial_tail else ""
        return f"{what} truncated after line {self.after_line}: {self.reason}{tail}"


class LineStream(Iterator[EngineLine]):
    """Iterate over ``(line number, text or None, raw bytes)`` of a plain, .gz or .zst file.

    The compression is recognised by its magic bytes (so rotated names like ``x.log.1.gz`` and
    misnamed files both work). The file is opened read-only and read in chunks. A compressed stream
    that ends early (or a read error) does not raise: iteration stops after the last complete line
    and :attr:`truncated` says where and why; the incomplete last line, if any, is kept in
    ``truncated.partial_tail`` instead of being yielded (half a number must not pass for a number).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.compression: str = "none"
        self.truncated: TruncatedInput | None = None
        self.lines_yielded = 0
        self.max_line = MAX_LINE_BYTES
        # line number -> (size, SHA-256) of each line longer than max_line (see _bounded_chunks)
        self.long_lines: dict[int, tuple[int, str]] = {}
        try:
            self._fh: IO[bytes] = open(self.path, "rb")  # noqa: SIM115 - closed by the generator
        except OSError as e:
            raise InputError(
                f"cannot open engine log: {e.strerror or e}; check the path and its permissions",
                location=str(path),
            ) from e
        magic = self._fh.read(4)
        self._fh.seek(0)
        if magic.startswith(_GZIP_MAGIC):
            self.compression = "gzip"
        elif magic.startswith(_ZSTD_MAGIC):
            self.compression = "zstd"
        self._lines = self._generate()

    def __iter__(self) -> LineStream:
        return self

    def __next__(self) -> EngineLine:
        return next(self._lines)

    def close(self) -> None:
        self._fh.close()

    def _chunks(self) -> Iterator[bytes]:
        if self.compression == "gzip":
            yield from self._gzip_chunks()
        elif self.compression == "zstd":
            yield from self._zstd_chunks()
        else:
            while chunk := self._fh.read(_CHUNK):
                yield chunk

    def _bounded_chunks(self) -> Iterator[bytes]:
        """The chunks of :meth:`_chunks`, except that a line longer than ``max_line`` passes only its first
        ``max_line`` bytes: the rest is read, hashed and dropped, and its size and SHA-256 go to ``long_lines``
        under its number (the readers then yield it as a :class:`LongLine`). The bytes of the current line
        since its start are referred to (not copied) until it ends or is found too long, so a line costs at
        most ``max_line`` bytes here and as much in the reader's own buffer."""
        newlines = 0  # before the current line
        run: list[bytes] = []  # the current line's bytes passed on so far
        run_size = 0
        digest = None  # the current line's hash once it is too long
        for chunk in self._pieces():
            if digest is not None:  # inside a long line: up to its end, hashed and dropped
                end = chunk.find(b"\n")
                digest.update(chunk if end < 0 else chunk[:end])
                run_size += len(chunk) if end < 0 else end
                if end < 0:
                    continue
                self.long_lines[newlines + 1] = (run_size, digest.hexdigest())
                digest, run, run_size, chunk = None, [], 0, chunk[end:]
            last = chunk.rfind(b"\n")
            if last >= 0:
                newlines += chunk.count(b"\n")
                run, run_size = [chunk[last + 1 :]], len(chunk) - last - 1
            else:
                run.append(chunk)
                run_size += len(chunk)
            if run_size <= self.max_line:
                yield chunk
                continue
            # the current line is too long: pass on its first max_line bytes, hash all of them and read on
            over = run_size - self.max_line
            yield chunk[: len(chunk) - over]
            digest = hashlib.sha256()
            for piece in run:
                digest.update(piece)
            run = []
        if digest is not None:  # a long last line without a newline
            self.long_lines[newlines + 1] = (run_size, digest.hexdigest())

    def _pieces(self) -> Iterator[bytes]:
        """The chunks of :meth:`_chunks` cut to at most ``max_line`` bytes (a decompressed chunk can be far
        larger), so that a line inside one is no longer than the limit."""
        for chunk in self._chunks():
            if len(chunk) <= self.max_line:
                yield chunk
            else:
                for start in range(0, len(chunk), self.max_line):
                    yield chunk[start : start + self.max_line]

    def _long_line(self, number: int, raw: bytes) -> EngineLine:
        """Line *number* as yielded when it was too long to hold: text None, a :class:`LongLine`."""
        size, sha256 = self.long_lines[number]
        return number, None, LongLine(bytes(raw[:LONG_LINE_KEPT]), size, sha256, self.max_line)

    def _with_long_lines(self, batch: LineBatch) -> LineBatch:
        """*batch* with its lines that were too long to hold (if any) as :meth:`_long_line` gives them."""
        long = [n for n in self.long_lines if batch.first <= n < batch.first + len(batch.raws)]
        if not long:
            return batch
        texts, raws = list(batch.texts), list(batch.raws)
        for n in long:
            _, texts[n - batch.first], raws[n - batch.first] = self._long_line(n, raws[n - batch.first])
        return LineBatch(batch.first, texts, raws, pa.array(texts, type=pa.large_string()))

    def _gzip_chunks(self) -> Iterator[bytes]:
        # GzipFile.read() discards what it decompressed when the stream ends early; a raw
        # decompressobj yields every byte it could recover, then we check the member ended.
        dobj = zlib.decompressobj(wbits=31)
        fed = False
        while data := self._fh.read(_CHUNK):
            while data:
                fed = True
                out = dobj.decompress(data)
                if out:
                    yield out
                if dobj.eof:  # end of one gzip member; concatenated members may follow
                    data = dobj.unused_data
                    dobj = zlib.decompressobj(wbits=31)
                    fed = False
                    if data and not data.startswith(_GZIP_MAGIC):
                        break  # trailing garbage after the last member is ignored, as gzip does
                else:
                    data = b""
        if fed and not dobj.eof:
            raise EOFError("gzip stream ended before its end-of-stream marker (file truncated?)")

    def _zstd_chunks(self) -> Iterator[bytes]:
        # stream_reader() silently stops at a truncated frame; decompressobj() lets us check eof.
        dctx = zstandard.ZstdDecompressor()
        dobj = dctx.decompressobj()
        fed = False
        while data := self._fh.read(_CHUNK):
            while data:
                fed = True
                out = dobj.decompress(data)
                if out:
                    yield out
                if dobj.eof:  # end of one frame; the rest may be another frame
                    data = dobj.unused_data
                    dobj = dctx.decompressobj()
                    fed = False
                else:
                    data = b""
        if fed and not dobj.eof:
            raise EOFError("zstd frame ended before its end (file truncated?)")

    def _generate(self) -> Iterator[EngineLine]:
        pending = bytearray()
        number = 0
        try:
            for chunk in self._bounded_chunks():
                start = 0
                while (nl := chunk.find(b"\n", start)) >= 0:
                    if pending:
                        pending += chunk[start:nl]
                        raw = bytes(pending)
                        pending.clear()
                    else:
                        raw = chunk[start:nl]
                    start = nl + 1
                    number += 1
                    self.lines_yielded = number
                    yield self._long_line(number, raw) if number in self.long_lines else _decode(number, raw)
                pending += chunk[start:]
        except (EOFError, OSError, zlib.error, zstandard.ZstdError) as e:
            reason = str(e) or type(e).__name__
            self.truncated = TruncatedInput(self.compression, number, reason, bytes(pending))
            self.close()
            return
        self.close()
        if pending:  # a last line without a newline is an ordinary line in a complete file
            number += 1
            self.lines_yielded = number
            yield self._long_line(number, pending) if number in self.long_lines else _decode(number, bytes(pending))

    def batches(self, max_lines: int, max_bytes: int | None = None) -> Iterator[LineBatch]:
        """The same lines as iterating (numbers, text, bytes, truncation), in batches of up to
        *max_lines* lines and *max_bytes* bytes (but at least one line), each also as one Arrow
        column (:attr:`LineBatch.column`). Use either this or iteration on one stream.

        The bytes of a batch are split at newlines once, by offsets (no Python object per line);
        a line's text and bytes are made only when asked for. A batch is a view of the bytes read,
        not a copy, and newlines are found read by read, so a batch's bytes are held twice (as read,
        and as Arrow text without the newlines), not four times."""
        # the bytes read since the last batch, in one buffer that a batch's lines then refer to (never
        # changed once a batch is cut from it: the next bytes go to a new one)
        limit = max_bytes or sys.maxsize
        data = bytearray()
        piece_ends: list[np.ndarray] = []  # offsets of the newlines in data
        count = number = 0
        error: Exception | None = None
        try:
            for chunk in self._bounded_chunks():
                piece_ends.append(_newlines(chunk) + len(data))
                data += chunk
                count += len(piece_ends[-1])
                if count >= max_lines or (count and len(data) >= limit):
                    ends = np.concatenate(piece_ends)
                    done = start = 0
                    # whole batches only: max_lines lines, or lines up to max_bytes with more bytes after them
                    while (take := _take(ends, done, start, max_lines, limit)) and (
                        take == max_lines or len(data) - start >= limit
                    ):
                        yield self._with_long_lines(_line_batch(number + 1, data, start, ends[done : done + take]))
                        number += take
                        self.lines_yielded = number
                        done += take
                        start = int(ends[done - 1]) + 1
                    data = bytearray(memoryview(data)[start:])
                    piece_ends = [ends[done:] - start]
                    count = len(piece_ends[0])
        except (EOFError, OSError, zlib.error, zstandard.ZstdError) as e:
            error = e
        self.close()
        ends = np.concatenate(piece_ends) if piece_ends else np.empty(0, dtype=np.int64)
        pending = bytes(data[int(ends[-1]) + 1 :] if len(ends) else data)
        if error is None and pending:  # a last line without a newline is an ordinary line in a complete file
            ends = np.append(ends, len(data))
            data += b"\n"
            pending = b""
        done = start = 0
        while take := _take(ends, done, start, max_lines, limit):
            yield self._with_long_lines(_line_batch(number + 1, data, start, ends[done : done + take]))
            number += take
            self.lines_yielded = number
            done += take
            start = int(ends[done - 1]) + 1
        if error is not None:
            self.truncated = TruncatedInput(self.compression, number, str(error) or type(error).__name__, pending)


@dataclass(frozen=True)
class LineBatch:
    """Consecutive lines of a file: ``texts[i]`` and ``raws[i]`` are line ``first + i`` as
    :class:`LineStream` gives it (text None when the bytes are not UTF-8); ``column`` holds the
    texts as one Arrow string column (null where the text is None)."""

    first: int
    texts: Sequence[str | None]
    raws: Sequence[bytes]
    column: pa.Array


class _Slices(Sequence):
    """The lines of *data* (each ending in a newline, which is left out), as bytes or text, made
    one at a time when asked for: line *i* is ``data[starts[i]:starts[i + 1] - 1]``."""

    def __init__(self, data: bytes | bytearray, starts: list[int], text: bool) -> None:
        self._data, self._starts, self._text = data, starts, text

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        raw = self._data[self._starts[i] : self._starts[i + 1] - 1]
        return raw.decode("utf-8") if self._text else bytes(raw)


def _take(ends: np.ndarray, done: int, start: int, max_lines: int, max_bytes: int) -> int:
    """How many of the lines after the first *done* (which end at *ends*; the next begins at
    *start*) the next batch takes: up to *max_lines*, and up to *max_bytes* bytes but at least one."""
    fit = int(np.searchsorted(ends, start + max_bytes - 1, side="right")) - done  # lines ending within max_bytes
    return min(max_lines, len(ends) - done, max(1, fit))


def _newlines(data: bytes) -> np.ndarray:
    return np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)


def _line_batch(first: int, data: bytes | bytearray, start: int, ends: np.ndarray) -> LineBatch:
    """The lines of ``data[start:ends[-1] + 1]`` (*ends*: the offsets of their newlines in *data*),
    without copying them. Lines of valid UTF-8 without a carriage return or (at the start of the
    file) a byte order mark are cut by offsets; any other batch is read line by line, as iterating
    reads it."""
    stop = int(ends[-1]) + 1
    if data.find(b"\r", start, stop) < 0 and not (first == 1 and data.startswith(b"\xef\xbb\xbf", start)):
        starts = np.empty(len(ends) + 1, dtype=np.int64)
        starts[0] = start
        starts[1:] = ends + 1
        whole = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), len(ends), [None, pa.py_buffer(starts), pa.py_buffer(data)]
        )
        column = pc.binary_slice(whole, 0, -1).view(pa.large_string())
        try:
            column.validate(full=True)  # UTF-8
        except pa.ArrowInvalid:
            pass
        else:
            offsets = starts.tolist()
            return LineBatch(first, _Slices(data, offsets, True), _Slices(data, offsets, False), column)
    raws = bytes(data[start : stop - 1]).split(b"\n")
    decoded = _decode_batch(first, raws)
    return LineBatch(first, decoded.texts, decoded.raws, pa.array(decoded.texts, type=pa.large_string()))


@dataclass(frozen=True)
class _Decoded:
    texts: list[str | None]
    raws: list[bytes]


def _decode_batch(first: int, raws: list[bytes]) -> _Decoded:
    joined = b"\n".join(raws)
    if b"\r" in joined:
        raws = [r[:-1] if r.endswith(b"\r") else r for r in raws]
        joined = b"\n".join(raws)
    try:
        texts: list[str | None] = list(joined.decode("utf-8").split("\n"))
    except UnicodeDecodeError:
        texts = [_utf8(raw) for raw in raws]
    if first == 1 and texts[0] is not None and texts[0].startswith("\ufeff"):
        texts[0] = texts[0][1:]
    return _Decoded(texts, raws)


def _utf8(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _decode(number: int, raw: bytes) -> EngineLine:
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    text = _utf8(raw)
    if number == 1 and text is not None and text.startswith("\ufeff"):
        text = text[1:]
    return number, text, raw


def open_lines(path: Path) -> LineStream:
    """Stream ``(1-based line number, text or None if not UTF-8, raw bytes)`` from *path*.

    Plain, gzip and zstd files are read transparently. See :class:`LineStream` for truncation.
    Raises :class:`~kvforensics.core.errors.InputError` if the file cannot be opened.
    """
    return LineStream(path)


# --------------------------------------------------------------------------------------------
# Outer prefixes every engine shares: ANSI colour, Docker --timestamps, (Process pid=N)
# --------------------------------------------------------------------------------------------

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_DOCKER_TS_RE = re.compile(
    r"^(?P<ts>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,9}))?(?P<tz>Z|[+-]\d{2}:?\d{2})\s"
)
_PROCESS_RE = re.compile(r"^\((?P<name>[A-Za-z_][\w.\-]*)(?P<attrs>[^()]*?\bpid=(?P<pid>\d+)[^()]*)\)\s?")


def contains_any(text: str, needles: tuple[str, ...]) -> bool:
    """True if any needle occurs in *text*: a cheap filter before running regular expressions."""
    for needle in needles:  # a plain loop: ~2x faster than any() over a generator
        if needle in text:
            return True
    return False


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text) if "\x1b" in text else text


@dataclass(frozen=True)
class OuterPrefix:
    docker_ts: datetime | None  # UTC instant from a Docker --timestamps prefix
    process: str | None  # e.g. "SGLangWorker", "VllmWorker rank=1", "EngineCore_DP0"
    rest: str


def split_outer_prefixes(text: str) -> OuterPrefix:
    """Remove ANSI colours, a Docker RFC3339 prefix and ``(Name [rank=N] pid=N[, ip=..])`` prefixes."""
    if "\x1b" not in text and (not text or text[0] not in "(0123456789"):
        return OuterPrefix(None, None, text)  # the common case: nothing to remove
    text = strip_ansi(text)
    docker_ts = None
    m = _DOCKER_TS_RE.match(text)
    if m:
        try:
            base = datetime.fromisoformat(m["ts"])
            frac = (m["frac"] or "0")[:6].ljust(6, "0")
            tzs = m["tz"]
            if tzs == "Z":
                offset = timedelta(0)
            else:
                sign = -1 if tzs[0] == "-" else 1
                digits = tzs[1:].replace(":", "")
                offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
            docker_ts = (base.replace(microsecond=int(frac)) - offset).replace(tzinfo=UTC)
            text = text[m.end() :]
        except ValueError:
            docker_ts = None
    process = None
    while (p := _PROCESS_RE.match(text)) is not None:
        attrs = re.sub(r",?\s*\b(?:pid|ip)=[^,\s)]*", "", p["attrs"]).strip(" ,")
        name = p["name"] + (f" {attrs}" if attrs else "")
        process = name if process is None else f"{process}/{name}"
        text = text[p.end() :]
    return OuterPrefix(docker_ts, process, text)
