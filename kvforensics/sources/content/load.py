"""The content file (``kind = "content"``): prompts and outputs by request id, kept only as keyed
fingerprints of the word shingles winnowing keeps (kvforensics/core/fingerprint.py); the text itself is
never stored.

Records are read in Python (kvforensics/sources/common/records.py: malformed lines, a truncated stream's
partial last record and missing request ids quarantined, without their text), and the fingerprints
of a batch of texts are computed in bulk by DuckDB (sql/content_fingerprints.sql), the same values
:func:`kvforensics.core.fingerprint.fingerprints` gives one text at a time. An ASCII text goes to DuckDB
as it is, to be tokenised there; any other text as its words (:func:`fingerprint.shingle_words`),
since DuckDB's regular expressions and lower-casing are not Python's beyond ASCII.

A batch is handed to DuckDB as many small Arrow record batches, which its threads fingerprint in
parallel, on a cursor of the connection in a background thread while Python reads the next batch
(DuckDB works without the GIL): at most one batch is fingerprinted and one filled at a time. The
cursor's inserts are committed on their own, so the connection must not be inside a transaction.
Between batches, DuckDB's memory limit is lowered by what the process holds outside it
(:class:`kvforensics.core.db.MemoryGovernor`), which grows over a file of a billion shingles.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.core.db import MemoryGovernor, run_script
from kvforensics.core.fingerprint import (
    SHINGLE_WORDS,
    WINNOW_WINDOW,
    hmac_blocks,
    rendered_text,
    selection_key,
    shingle_words,
)
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import QuarantineRows, lone_surrogate, read_records
from kvforensics.sources.content.prefix_blocks import (
    TOKEN_IDS_NOTE,
    WORDS_NOTE,
    BlockRows,
    prefix_blocks,
    token_ids,
)

PARTS = ("prompt", "output")
BATCH_CHARS = 4 << 20  # text characters per DuckDB batch: enough to amortise; small, so reading overlaps early
NOTE = "text fingerprinted (keyed HMAC of the word shingles winnowing keeps, window {window}); no text stored"
BLOCK_ROWS = 500_000  # request_blocks rows per insert
ARROW_ROWS = 2048  # texts per Arrow record batch: the unit DuckDB's threads take in parallel


class _TextBatch:
    """Texts waiting to be fingerprinted, as the columns of ``content_batch``."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.parts: list[str] = []
        self.texts: list[str | None] = []
        self.words: list[str | None] = []
        self.chars = 0

    def add(self, request_id: str, part: str, text: str) -> None:
        self.request_ids.append(request_id)
        self.parts.append(part)
        if text.isascii():
            self.texts.append(text)
            self.words.append(None)
        else:
            self.texts.append(None)
            self.words.append(shingle_words(text))
        self.chars += len(text)

    def table(self) -> pa.Table:
        table = pa.table(
            {
                "request_id": pa.array(self.request_ids, type=pa.string()),
                "part": pa.array(self.parts, type=pa.string()),
                "text": pa.array(self.texts, type=pa.string()),
                "words": pa.array(self.words, type=pa.string()),
            }
        )
        return pa.Table.from_batches(table.to_batches(max_chunksize=ARROW_ROWS), table.schema)


class _Fingerprinter:
    """Fingerprints batches of texts on a cursor of the connection in a background thread, one at a
    time: :meth:`submit` waits for the previous batch, so at most one is in flight."""

    def __init__(self, con: duckdb.DuckDBPyConnection, params: dict[str, object]) -> None:
        self._governor = MemoryGovernor(con)  # between batches, on the reading thread's connection
        self._cursor = con.cursor()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvf-content")
        self._params = params
        self._pending: Future[None] | None = None

    def submit(self, batch: _TextBatch) -> None:
        self.wait()
        self._governor.tick()
        if batch.texts:
            self._pending = self._pool.submit(_fingerprint, self._cursor, batch.table(), self._params)

    def wait(self) -> None:
        """Wait for the batch in flight; its error, if any, is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self, *, failed: bool = False) -> None:
        """Wait for the batch in flight and release the thread and cursor. When the reading *failed*,
        that error is the one to report: the batch's own error, if any, is not raised over it."""
        try:
            self.wait()
        except duckdb.Error:
            if not failed:
                raise
        finally:
            self._pool.shutdown()
            self._cursor.close()
            self._governor.close()


def load_content(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    key: bytes,
    block_size: int | None = None,
    word_blocks: bool = False,
    window: int = WINNOW_WINDOW,
) -> FileLoad:
    """Fingerprint the prompts and outputs of one content file into ``content_fingerprints`` and
    ``content_stats`` under *key*, the shingles winnowing with *window* keeps (core/fingerprint.py); refused
    records (without their text) into ``quarantine``. With a *block_size*, each prompt's
    ``prompt_token_ids`` (or, with *word_blocks*, its words when it has none) are cut into prefix-cache
    blocks in ``request_blocks`` (sources/content/prefix_blocks.py)."""
    load = FileLoad(file=path)
    blocks = BlockRows()
    cut = {"ids": 0, "words": 0}
    inner, outer = hmac_blocks(key)
    params = {"inner": inner, "outer": outer, "select": selection_key(key), "width": SHINGLE_WORDS, "window": window}
    fingerprinter = _Fingerprinter(con, params)
    try:
        _read(con, source, path, load, key, block_size, word_blocks, fingerprinter, blocks, cut)
    except BaseException:
        fingerprinter.close(failed=True)
        raise
    fingerprinter.close()
    blocks.flush(con)
    load.notes.append(NOTE.format(window=window))
    if cut["ids"]:
        load.notes.append(TOKEN_IDS_NOTE.format(size=block_size))
    if cut["words"]:
        load.notes.append(WORDS_NOTE.format(size=block_size))
    return load


def _read(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    key: bytes,
    block_size: int | None,
    word_blocks: bool,
    fingerprinter: _Fingerprinter,
    blocks: BlockRows,
    cut: dict[str, int],
) -> None:
    """Read the file's records: texts to *fingerprinter* batch by batch, refused records to the
    quarantine, prompts cut into *blocks*."""
    ids_column = source.column("prompt_token_ids")
    quarantine = QuarantineRows(con, source, path)
    batch = _TextBatch()
    id_column = source.column("request_id")
    columns = [(part, source.column(part)) for part in PARTS]
    for line, _raw, rec, problem in read_records(source, path, load):
        load.records_read += 1
        rid = rec.get(id_column) if rec else None
        ids = token_ids(rec.get(ids_column)) if rec else []
        if problem is None and not rid:
            problem = "missing required field 'request_id'"
        elif problem is None and ids is None:
            problem = f"{ids_column} is not a list of non-negative integer token ids"
        elif problem is None and lone_surrogate(str(rid)):
            problem = "request_id is not valid Unicode (a lone surrogate escape)"
        if problem or rec is None:
            load.quarantined += 1
            quarantine.add(line, problem or "unreadable record", None)  # never the content's text
            continue
        load.loaded += 1
        for part, column in columns:
            text = rendered_text(rec.get(column))  # a chat-messages array as its texts
            if text:
                batch.add(str(rid), part, text)
        if block_size:
            words = rendered_text(rec.get(columns[0][1])) if word_blocks and not ids else None
            _cut(blocks, str(rid), ids or [], words, block_size, key, cut)
            if len(blocks) >= BLOCK_ROWS:
                blocks.flush(con)
        if batch.chars >= BATCH_CHARS:
            fingerprinter.submit(batch)
            batch = _TextBatch()
    fingerprinter.submit(batch)
    quarantine.flush()


def _cut(
    blocks: BlockRows,
    request_id: str,
    ids: list[int],
    prompt: str | None,
    block_size: int,
    key: bytes,
    cut: dict[str, int],
) -> None:
    """One prompt's prefix blocks: from its token ids, else (when given) from its words."""
    if ids:
        blocks.add(request_id, prefix_blocks(ids, block_size, key))
        cut["ids"] += 1
    elif prompt:
        blocks.add(request_id, prefix_blocks(shingle_words(prompt).split(), block_size, key))
        cut["words"] += 1


def _fingerprint(con: duckdb.DuckDBPyConnection, table: pa.Table, params: dict[str, object]) -> None:
    con.register("content_batch", table)
    try:
        run_script(con, "content_fingerprints", params)
    finally:
        con.unregister("content_batch")
