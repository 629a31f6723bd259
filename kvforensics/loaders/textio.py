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
from typing import BinaryIO, Iterator

CHUNK = 1 << 20


def open_binary(path: Path) -> BinaryIO:
    """Open a file read-only, decompressing ``.gz`` and ``.zst`` transparently."""
    raw = open(path, "rb")  # noqa: SIM115 - the caller closes the wrapper, which closes this
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if name.endswith(".zst") or name.endswith(".zstd"):
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, CHUNK)  # type: ignore[arg-type]
    return raw


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
    """Iterates ``(line_number, bytes)`` over a file; ``stopped`` explains an early end."""

    path: Path
    stopped: str | None = None
    lines: int = 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        n = 0
        try:
            with open_binary(self.path) as fh:
                for n, line in enumerate(fh, start=1):
                    self.lines = n
                    yield n, line.rstrip(b"\r\n")
        except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
            self.stopped = f"input ends early after line {n} ({type(e).__name__}: {e}); " \
                           f"later records, if any, are lost"
            self.lines = n
        except Exception as e:  # zstandard raises its own ZstdError
            if type(e).__name__ != "ZstdError":
                raise
            self.stopped = f"input ends early after line {n} (ZstdError: {e}); later records, if any, are lost"
            self.lines = n


def decode_line(raw: bytes) -> str | None:
    """UTF-8 text of a line, or None when it is not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def printable_raw(raw: bytes | str, limit: int = 500) -> str:
    """A record as it can be shown in the quarantine: truncated, undecodable bytes escaped."""
    text = raw.decode("utf-8", errors="backslashreplace") if isinstance(raw, bytes) else raw
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"
