"""Increments of request logs, KV events, content and changes into the evidence database, through the loaders a
batch run uses, under the same contract: every record loaded or quarantined with its reason.

An increment (whole lines a file gained, :mod:`kvforensics.watch.follow`) is written as a file of its own, a
*piece*, under the output folder's ``.kvforensics-watch/``, in a folder named as the followed file's folder and
under the followed file's name less its compression suffix (the instance template reads ``{stem}`` and
``{parent}`` as for the file itself); a CSV piece repeats the file's header line. The loader reads the piece as
it reads any file, and the rows it wrote are then moved to the followed file: its name and its line numbers. For
requests this happens inside the transaction that merges them, with the file's offset (``watch_files``), so an
increment lands whole or not at all and a restart never loads it twice. Duplicates and conflicting duplicates
are judged against everything loaded before, as ``--append`` judges a new file.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import duckdb

from kvforensics.config import Incident, Source
from kvforensics.core.canonical import REQUIRED_REQUEST_FIELDS
from kvforensics.core.fingerprint import key_for
from kvforensics.sources.changes.load import load_changes
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.content.load import load_content
from kvforensics.sources.content.prefix_blocks import block_size
from kvforensics.sources.kv_events.load import Chains, load_kv_events
from kvforensics.sources.requests.load import load_requests_files
from kvforensics.watch import state as watch_state
from kvforensics.watch.follow import FileState, Follower, Increment, compression, split

PIECES = ".kvforensics-watch"  # under the output folder: the pieces being loaded (removed once loaded)
TYPING_PIECES = 2  # an increment of a plain request file is typed in this many pieces side by side ...
SPLIT_BYTES = 4 << 20  # ... each of at least this many bytes


@dataclass
class Counts:
    """Records read and quarantined of one source while watch runs (its quarantine share)."""

    read: int = 0
    quarantined: int = 0


@dataclass
class Pieces:
    """The piece files of one load, and the increment each stands for."""

    root: Path
    of: dict[str, Increment] = field(default_factory=dict)  # piece path -> increment
    led: set[str] = field(default_factory=set)  # pieces written after the followed file's first line
    n: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def write(self, inc: Increment, lead: bytes = b"") -> Path:
        with self.lock:  # engine log pieces are written from the threads that parse them
            self.n += 1
            n = self.n
        real = inc.path
        name = real.name[: -len(real.suffix)] if compression(real.name) != "none" else real.name
        folder = self.root / f"{n:06d}" / (real.parent.name or "_")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        with path.open("wb") as fh:
            fh.write(lead)
            fh.write(inc.data)
        self.of[str(path)] = inc
        if lead:
            self.led.add(str(path))
        return path

    def shift(self, piece: str) -> int:
        """What to add to a line number of *piece* to get the followed file's."""
        return self.of[piece].first_line - 1 - (1 if piece in self.led else 0)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


Rows = tuple[tuple[str, str, tuple[str, ...]], ...]  # (table, its file column, its line columns)


def _move_rows(con: duckdb.DuckDBPyConnection, source: str, pieces: Pieces, piece: str, tables: Rows) -> None:
    """The rows *piece* left in *tables* moved to its followed file: its name, its line numbers."""
    params = {"s": source, "piece": piece, "real": str(pieces.of[piece].path), "shift": pieces.shift(piece)}
    for table, file_col, line_cols in tables:
        lines = ", ".join(f"{c} = {c} + $shift" for c in line_cols)
        con.execute(
            f"UPDATE {table} SET {file_col} = $real, {lines} WHERE source = $s AND {file_col} = $piece", params
        ).fetchall()


def _fix_kept_at(con: duckdb.DuckDBPyConnection, source: str, pieces: Pieces) -> None:
    """A conflicting duplicate names where the record kept lies (``kept the record at FILE:LINE``): a piece of
    this load there is its followed file and line."""
    pattern = re.compile("(" + "|".join(re.escape(p) for p in sorted(pieces.of, key=len, reverse=True)) + r"):(\d+)")

    def fixed(text: str) -> str:
        return pattern.sub(lambda m: f"{pieces.of[m[1]].path}:{int(m[2]) + pieces.shift(m[1])}", text)

    like = {"s": source, "root": f"%{pieces.root}%"}
    for table, column in (("quarantine", "reason"), ("request_conflicts", "kept_at")):
        rows = con.execute(
            f"SELECT rowid, {column} FROM {table} WHERE source = $s AND {column} LIKE $root", like
        ).fetchall()
        if rows:
            con.executemany(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", [(fixed(t), r) for r, t in rows])


_REQUEST_ROWS: Rows = (
    ("requests", "source_file", ("source_line",)),
    ("quarantine", "file", ("line",)),
    ("request_conflicts", "source_file", ("source_line",)),
)
_KV_EVENT_ROWS: Rows = (
    ("kv_events", "source_file", ("source_line", "batch")),
    ("kv_event_messages", "source_file", ("source_line",)),
    ("quarantine", "file", ("line",)),
)


def load_requests(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    increments: list[Increment],
    root: Path,
    aliases: Mapping[str, str],
    counts: Counts,
) -> None:
    """The increments of one requests source, merged as one load (files typed side by side); each file's
    record in ``watch_files`` written in the transaction of its records."""
    pieces = Pieces(root / "requests")
    paths: list[Path] = []
    whole: dict[str, Increment] = {}
    for inc in (part for whole_inc in increments for part in split(whole_inc, TYPING_PIECES, SPLIT_BYTES)):
        if inc.whole_file:
            paths.append(inc.path)
            whole[str(inc.path)] = inc
        else:
            paths.append(pieces.write(inc, _lead(source, inc)))
    # what each file's record becomes, piece by piece, written with the pieces' records
    pending: dict[tuple[int, int], FileState] = {}
    stored: list[FileLoad] = []

    def merged(load: FileLoad) -> None:  # inside the transaction of the batch
        piece = str(load.file)
        inc = whole.get(piece) or pieces.of[piece]
        if piece in pieces.led and source.format != "csv":
            _drop_lead_record(con, source.name, piece, load)
        if piece in pieces.of:
            _move_rows(con, source.name, pieces, piece, _REQUEST_ROWS)
            _fix_kept_at(con, source.name, pieces)
        after = pending.setdefault(inc.state.key, replace(inc.state))
        Follower.commit(inc, after)
        _counted(after, inc, load)
        watch_state.save(con, [after])
        stored.append(load)

    try:
        load_requests_files(con, source, paths, on_merged=merged, model_aliases=aliases, growing=True)
    finally:
        pieces.remove()
    for inc in increments:
        if (after := pending.get(inc.state.key)) is not None:
            inc.state.__dict__.update(after.__dict__)
    counts.read += sum(load.records_read for load in stored)
    counts.quarantined += sum(load.quarantined for load in stored)


def _lead(source: Source, inc: Increment) -> bytes:
    """What a piece of a request file starts with: a CSV file's header; the file's first record when the piece
    names none of the keys a required field is mapped to (the loader takes a file whose records all lack one for
    a mapping mistake, where the whole file has it), else nothing."""
    if not inc.header or source.format == "csv":
        return inc.header
    keys = [source.columns[f] for f in REQUIRED_REQUEST_FIELDS if f in source.columns and f not in source.expressions]
    if all(json.dumps(k.split(".")[-1]).encode() in inc.data for k in keys):
        return b""
    return inc.header


def _drop_lead_record(con: duckdb.DuckDBPyConnection, source: str, piece: str, load: FileLoad) -> None:
    """The file's first record, read again at the head of *piece*, taken out of its rows and counts."""
    params = {"s": source, "f": piece}
    quarantined = con.execute(
        "SELECT count(*) FROM quarantine WHERE source = $s AND file = $f AND line = 1", params
    ).fetchall()[0][0]
    inserted = con.execute(
        "SELECT count(*) FROM requests WHERE source = $s AND source_file = $f AND source_line = 1", params
    ).fetchall()[0][0]
    for table, file_col, (line_col,) in _REQUEST_ROWS:
        con.execute(f"DELETE FROM {table} WHERE source = $s AND {file_col} = $f AND {line_col} = 1", params).fetchall()
    load.records_read -= 1
    if quarantined:
        load.quarantined -= 1
    elif inserted:
        load.loaded -= 1
    else:
        load.duplicates -= 1


def _counted(state: FileState, inc: Increment, load: FileLoad) -> FileState:
    """*state* with what the records of *inc* became (a provisional last line's kept apart, to be undone)."""
    state.records_read += load.records_read
    state.loaded += load.loaded
    state.quarantined += load.quarantined
    state.duplicates += load.duplicates
    state.notes = (*state.notes, *load.notes)
    if inc.provisional:
        state.provisional = (inc.first_line, load.records_read, load.loaded, load.quarantined, load.duplicates)
    return state


def resolved_instance(source: Source, path: Path) -> Source:
    """*source* with its instance template resolved for the followed file *path* (a loader reading a piece
    would resolve it for the piece), unless the template reads the records' envelope labels."""
    if "{label" in source.instance:
        return source
    return replace(source, instance=source.instance_for(path).replace("{", "{{").replace("}", "}}"))


class SideSources:
    """KV events, content and changes as they grow. KV-event messages are numbered across pieces in the order
    read (``Chains``), as across the files of a batch run, so that a sequence gap is found between pieces too."""

    def __init__(self, con: duckdb.DuckDBPyConnection, incident: Incident, root: Path) -> None:
        self.con, self.incident, self.root = con, incident, root
        self.key = key_for(incident.id)
        self.chains = Chains()

    def kv_events(self, source: Source, increments: list[Increment], counts: Counts) -> None:
        self._pieces(
            source,
            increments,
            counts,
            lambda s, p: load_kv_events(self.con, s, p, self.key, self.chains),
            _KV_EVENT_ROWS,
        )

    def content(self, source: Source, increments: list[Increment], counts: Counts) -> None:
        size = block_size(self.con, self.incident.prefix_block_size)
        self._pieces(
            source,
            increments,
            counts,
            lambda s, p: load_content(self.con, s, p, self.key, size, self.incident.prefix_word_blocks),
            (("quarantine", "file", ("line",)),),
        )

    def _pieces(self, source: Source, increments: list[Increment], counts: Counts, loader, tables: Rows) -> None:
        pieces = Pieces(self.root / source.kind)
        try:
            for inc in increments:
                piece = pieces.write(inc, inc.header)  # a CSV header (the only first line kept here)
                load = loader(resolved_instance(source, inc.path), piece)
                _move_rows(self.con, source.name, pieces, str(piece), tables)
                Follower.commit(inc)
                counts.read += load.records_read
                counts.quarantined += load.quarantined
        finally:
            pieces.remove()

    def changes(self, source: Source, path: Path) -> None:
        """A changes file read again whole (it is small; no rule reads it): its earlier rows replaced."""
        params = {"s": source.name, "f": str(path)}
        self.con.execute("DELETE FROM changes WHERE source = $s AND source_file = $f", params).fetchall()
        self.con.execute("DELETE FROM quarantine WHERE source = $s AND file = $f", params).fetchall()
        load_changes(self.con, source, path)
