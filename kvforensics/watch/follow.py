"""The files of one source followed as they grow, as ``tail -F`` follows them.

At every poll a :class:`Follower` is handed the files its source's path names now and returns what each gained
since the last poll as :class:`Increment` items: whole lines only (a line still being written waits for its
newline), decompressed. A file is known by its device and inode, not its name, so that

* a file renamed (log rotation: ``app.log`` -> ``app.log.1``) keeps its place: it is read on from where it was,
  under its new name, and the new ``app.log`` is read from its start;
* a file gone from the source's path (deleted, or rotated to a name the path does not match) is read to its end
  through the descriptor held open, then dropped;
* a file truncated in place (``copytruncate``) is read again from its start;
* a file that is gzip (``.gz``) or zstd (``.zst``) is read member by member (frame by frame): ``gzip -c part >>
  log.gz`` appends a member, and only complete members are decompressed; where the text read so far ends inside
  a member, the next poll starts again at that member's first byte and skips what it already gave.

Holding every followed file open also keeps its inode from being reused while it is followed. After a restart
the files are found again by inode, and a SHA-256 of their first bytes tells a reused inode from the same file.
Parquet files, which have no lines, are read whole once their size has held still for one poll.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Callable

HEAD_BYTES = 1024  # the start of a file whose SHA-256 tells it from another file on a reused inode
READ_BYTES = 256 << 20  # at most this many bytes of one file are taken per poll (the rest at the next one)
WHOLE_FILE_FORMATS = ("parquet",)  # no lines: such a file is read once, whole, when its size has held still


def compression(path: str) -> str:
    """``gzip``, ``zstd`` or ``none``, from the file's name (as the loaders decide it)."""
    name = path.lower()
    if name.endswith(".gz"):
        return "gzip"
    if name.endswith((".zst", ".zstd")):
        return "zstd"
    return "none"


def _decompressor(kind: str):
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


@dataclass
class FileState:
    """Where reading one followed file stands: its identity, how far it was read, what its records became."""

    source: str
    path: str
    dev: int
    ino: int
    head_sha256: str = ""  # SHA-256 of the file's first head_bytes bytes when it was first read
    head_bytes: int = 0
    offset: int = 0  # plain: bytes read (whole lines); compressed: the first byte of the member read on from
    skip: int = 0  # compressed: bytes of that member's text already read
    lines: int = 0  # physical lines read
    size: int = 0  # the size last seen
    header: bytes = b""  # the file's first line: a CSV header, or a record that gives a piece the file's keys
    gone: bool = False  # left the source's path and read to its end
    broken: str | None = None  # why the rest of the file cannot be read (a corrupt compressed member)
    records_read: int = 0  # requests: what its records became, summed over its increments
    loaded: int = 0
    quarantined: int = 0
    duplicates: int = 0
    notes: tuple[str, ...] = ()
    # a last line without its newline read when watch stopped, undone when it starts again (the line may grow):
    # (its line, records read, loaded, quarantined, duplicates)
    provisional: tuple[int, ...] | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


@dataclass(frozen=True)
class Increment:
    """What one file gained: whole lines (``data``, decompressed), the number of the first, and where reading the
    file stands once they are stored (:meth:`Follower.commit`)."""

    state: FileState
    data: bytes
    first_line: int
    lines: int
    offset: int
    skip: int
    whole_file: bool = False  # a Parquet file: read the file itself
    header: bytes = b""  # the file's first line (a CSV header), to put before a piece that does not start with it
    provisional: bool = False  # a last line without its newline, read as watch stops: its offset is not passed

    @property
    def path(self) -> Path:
        return Path(self.state.path)


@dataclass
class Poll:
    """What one poll of a source found."""

    increments: list[Increment] = field(default_factory=list)
    renamed: list[tuple[FileState, str]] = field(default_factory=list)  # (file, the name it had)
    changed: list[FileState] = field(default_factory=list)  # files that grew or appeared (whole-file sources)
    problems: list[str] = field(default_factory=list)  # files that cannot be read on, said once each
    grew: bool = False


class Follower:
    """The files of one source. ``read=False`` follows their growth only (a source loaded when watch stops)."""

    def __init__(
        self,
        source: str,
        fmt: str,
        states: list[FileState] | None = None,
        *,
        keep_first_line: bool = False,
        read: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source, self.fmt, self.read, self.keep_first_line = source, fmt, read, keep_first_line
        self.files: dict[tuple[int, int], FileState] = {}
        self.handles: dict[tuple[int, int], BinaryIO] = {}
        self.restored = [s for s in states or [] if not s.gone]
        self.clock = clock
        self.grew_at = clock()
        self.stable: dict[tuple[int, int], int] = {}  # whole-file sources: the size seen at the last poll

    def close(self) -> None:
        for fh in self.handles.values():
            fh.close()
        self.handles.clear()

    # --- finding the files -------------------------------------------------------------------------
    def poll(self, paths: list[Path], *, final: bool = False) -> Poll:
        """The files *paths* names now, and what they gained. With ``final`` (watch stops), a last line without
        its newline is read too, as a batch run reads it, as a provisional increment (the line may grow)."""
        found = Poll()
        looked = self.clock()
        seen: set[tuple[int, int]] = set()
        for path in paths:
            try:
                st = os.stat(path)
            except FileNotFoundError:  # gone between the listing and now: the next poll sees where it went
                continue
            key = (st.st_dev, st.st_ino)
            seen.add(key)
            state = self.files.get(key) or self._restore(key, path) or self._new(key, path)
            if state is None:
                continue
            if state.path != str(path):
                found.renamed.append((state, state.path))
                state.path = str(path)
            self._read(state, st.st_size, final, found)
        for key, state in list(self.files.items()):
            if key not in seen and not state.gone:  # deleted, or renamed where the path does not reach
                fh = self.handles.get(key)
                if fh is not None:  # its last line is its last: no provisional increment
                    self._read(state, os.fstat(fh.fileno()).st_size, final, found, ended=True)
                state.gone = True
                self._drop_handle(key)
        if final:
            for state in self.restored:  # a file followed before a restart, not found since
                found.problems.append(
                    f"{state.path}: followed before watch restarted, no longer found (read up to line {state.lines:,})"
                )
        if found.grew:
            self.grew_at = looked
        return found

    def _restore(self, key: tuple[int, int], path: Path) -> FileState | None:
        """The state recorded for this inode before a restart, if its first bytes are still the same."""
        for state in self.restored:
            if state.key == key:
                self.restored.remove(state)
                if state.head_bytes and _head(path, state.head_bytes) != state.head_sha256:
                    return None  # the inode of a file since deleted, reused by another one
                self.files[key] = state
                return state
        return None

    def _new(self, key: tuple[int, int], path: Path) -> FileState:
        state = FileState(source=self.source, path=str(path), dev=key[0], ino=key[1])
        self.files[key] = state
        return state

    def _handle(self, state: FileState) -> BinaryIO:
        fh = self.handles.get(state.key)
        if fh is None:
            fh = open(state.path, "rb")  # noqa: SIM115 - held while the file is followed, closed by close()
            self.handles[state.key] = fh
        return fh

    def _drop_handle(self, key: tuple[int, int]) -> None:
        fh = self.handles.pop(key, None)
        if fh is not None:
            fh.close()

    # --- reading -----------------------------------------------------------------------------------
    def _read(self, state: FileState, size: int, final: bool, found: Poll, ended: bool = False) -> None:
        grew = size != state.size
        if grew:
            found.grew = True
        state.size = size
        if state.broken:
            return
        if not self.read:
            if grew:
                found.changed.append(state)
            return
        if self.fmt in WHOLE_FILE_FORMATS:
            self._whole(state, size, final, found)
            return
        if size < state.offset:  # truncated in place (copytruncate): its new text from the start
            state.offset = state.skip = state.lines = 0
            state.head_bytes = 0
            found.problems.append(f"{state.path}: truncated in place; read again from its start")
        if size == state.offset and not state.skip and not (final or ended):
            return
        fh = self._handle(state)
        if not state.head_bytes and size:
            fh.seek(0)
            head = fh.read(HEAD_BYTES)
            state.head_bytes, state.head_sha256 = len(head), hashlib.sha256(head).hexdigest()
        kind = compression(state.path)
        if kind == "none":
            piece = self._plain(fh, state, final or ended)
        else:
            piece = self._members(fh, state, kind, final or ended, found)
        if piece is None:
            return
        data, tail, offset, skip = piece
        if ended:
            data, tail, offset = data + tail, b"", offset + (len(tail) if kind == "none" else 0)
        if not data:
            if (offset, skip) != (state.offset, state.skip):
                state.offset, state.skip = offset, skip  # members without text (an empty member)
        else:
            self._increment(state, data, state.lines + 1, offset, skip, found)
        if tail:
            self._increment(state, tail, state.lines + 1 + data.count(b"\n"), offset, skip, found, provisional=True)

    def _increment(
        self, state: FileState, data: bytes, first: int, offset: int, skip: int, found: Poll, provisional: bool = False
    ) -> None:
        header = b""
        if self.keep_first_line:
            if first == 1:  # the piece starts the file: its first line is kept for the pieces after it
                state.header = data[: data.find(b"\n") + 1] if b"\n" in data else data
            else:
                header = state.header
        lines = data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
        found.increments.append(
            Increment(state, data, first, lines, offset, skip, header=header, provisional=provisional)
        )

    def _whole(self, state: FileState, size: int, final: bool, found: Poll) -> None:
        if state.offset:
            if size != state.offset and state.key not in self.stable:
                found.problems.append(
                    f"{state.path}: changed after it was read whole; a batch run reads it as it is now"
                )
                self.stable[state.key] = size
            return
        if size and (final or self.stable.get(state.key) == size):
            found.increments.append(Increment(state, b"", 1, 0, size, 0, whole_file=True))
        self.stable[state.key] = size

    def _plain(self, fh: BinaryIO, state: FileState, final: bool) -> tuple[bytes, bytes, int, int] | None:
        """The whole lines from ``state.offset``, the rest after them when *final* (else nothing), and where the
        next poll starts."""
        fh.seek(state.offset)
        data = fh.read(READ_BYTES)
        if not final and len(data) == READ_BYTES and b"\n" not in data:
            parts = [data]  # a line longer than one read: read on to its end (the loaders quarantine it)
            while (more := fh.read(READ_BYTES)) and b"\n" not in more:
                parts.append(more)
            data = b"".join([*parts, more])
        cut = data.rfind(b"\n") + 1
        return data[:cut], data[cut:] if final else b"", state.offset + cut, 0

    def _members(
        self, fh: BinaryIO, state: FileState, kind: str, final: bool, found: Poll
    ) -> tuple[bytes, bytes, int, int] | None:
        """The text of the complete members from ``state.offset``, less the ``state.skip`` bytes already read, cut
        after its last newline; and where the next poll starts (the member that holds the rest, what of it to
        skip)."""
        fh.seek(state.offset)
        raw = fh.read()
        members: list[tuple[int, bytes]] = []  # (offset of the member, its text)
        at = 0
        while at < len(raw):
            d = _decompressor(kind)
            try:
                text = d.decompress(raw[at:])
            except Exception as e:  # noqa: BLE001 - zlib.error / zstd.ZstdError: the member is corrupt
                state.broken = (
                    f"the {kind} member at byte {state.offset + at:,} cannot be decompressed "
                    f"({' '.join(str(e).split())[:120]}): the rest of the file is not read"
                )
                found.problems.append(f"{state.path}: {state.broken}")
                break
            if not d.eof:
                break  # a member still being written
            members.append((state.offset + at, text))
            at = len(raw) - len(d.unused_data)
            if sum(len(t) for _, t in members) >= READ_BYTES:
                break  # the rest at the next poll
        if not members:
            return None
        text = b"".join(t for _, t in members)[state.skip :]
        cut = text.rfind(b"\n") + 1
        # where the text not yet read starts: the member that holds it and how far into its text
        left = cut + state.skip
        offset, skip = state.offset + at, 0
        for start, member in members:
            if left < len(member):
                offset, skip = start, left
                break
            left -= len(member)
        return text[:cut], text[cut:] if final else b"", offset, skip

    # --- after an increment is stored --------------------------------------------------------------
    @staticmethod
    def commit(increment: Increment, state: FileState | None = None) -> None:
        """Reading the file stands after *increment* (called once its records are stored); on *state* (a copy
        being written with them) when given."""
        s = state or increment.state
        if not increment.provisional:
            s.offset, s.skip, s.lines = increment.offset, increment.skip, increment.first_line - 1 + increment.lines


def split(increment: Increment, parts: int, at_least: int) -> list[Increment]:
    """*increment* as up to *parts* increments of consecutive whole lines, each of *at_least* bytes or more, for
    the loaders to read side by side: a plain file's (a compressed file's place inside a member is not a byte
    of the file), never a provisional one."""
    data = increment.data
    if (
        parts < 2
        or increment.provisional
        or increment.whole_file
        or compression(increment.state.path) != "none"
        or len(data) < 2 * at_least
    ):
        return [increment]
    out, start, line = [], 0, increment.first_line
    begin = increment.offset - len(data)  # the byte of the file the increment starts at
    for k in range(1, parts + 1):
        end = len(data) if k == parts else data.find(b"\n", max(start, len(data) * k // parts - 1)) + 1
        if end <= start:
            continue
        chunk = data[start:end]
        lines = chunk.count(b"\n") + (0 if chunk.endswith(b"\n") else 1)
        out.append(replace(increment, data=chunk, first_line=line, lines=lines, offset=begin + end, skip=0))
        start, line = end, line + lines
    return out


def _head(path: Path, n: int) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(n)).hexdigest()
