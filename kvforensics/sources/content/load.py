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

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.core.db import MemoryGovernor, run_script, sql
from kvforensics.core.fingerprint import (
    SHINGLE_WORDS,
    WINNOW_WINDOW,
    fingerprint_key,
    rendered_text,
    shingle_words,
)
from kvforensics.sources.common.bulk_lines import CheckedLines
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import QuarantineRows, lone_surrogate, read_records
from kvforensics.sources.content.bulk import BULK_MIN_LINES, bulk_refusal, read_bulk
from kvforensics.sources.content.prefix_blocks import (
    TOKEN_IDS_NOTE,
    WORDS_NOTE,
    BlockRows,
    prefix_blocks,
    token_ids,
)

PARTS = ("prompt", "output")
BATCH_CHARS = 4 << 20  # text characters per DuckDB batch: enough to amortise; small, so reading overlaps early
NOTE = "text fingerprinted (keyed SHA-256 of the word shingles winnowing keeps, window {window}); no text stored"
BLOCK_ROWS = 500_000  # request_blocks rows per insert
EXPLICIT_WINDOW = 8  # windows up to this many shingles have their least value taken by least() of them written out
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
    bulk_from: int = BULK_MIN_LINES,
    checked: Future[CheckedLines | str] | None = None,
) -> FileLoad:
    """Fingerprint the prompts and outputs of one content file into ``content_fingerprints`` and
    ``content_stats`` under *key*, the shingles winnowing with *window* keeps (core/fingerprint.py); refused
    records (without their text) into ``quarantine``. With a *block_size*, each prompt's
    ``prompt_token_ids`` (or, with *word_blocks*, its words when it has none) are cut into prefix-cache
    blocks in ``request_blocks`` (sources/content/prefix_blocks.py). A JSONL file of *bulk_from* lines or more
    is read in bulk by DuckDB where it can be (sources/content/bulk.py), else by the Python reader here; *checked*: the
    check of its lines the bulk reader makes, begun before (sources/common/bulk_lines.py, LineChecks)."""
    load = FileLoad(file=path, reader="python")
    params = {"key": fingerprint_key(key), "width": SHINGLE_WORDS, "window": window}
    records = _Records(con, source, path, load, key, block_size, word_blocks)
    refusal = bulk_refusal(source, word_blocks)
    if refusal is None:
        refusal = read_bulk(
            con,
            source,
            path,
            load,
            records.take,
            records.add_text,
            lambda: fingerprint_texts(con, params),
            lambda: records.flush(params),
            bulk_from,
            checked,
        )
    if refusal is not None:
        fingerprinter = _Fingerprinter(con, params)
        try:
            _read(source, path, load, fingerprinter, records)
        except BaseException:
            fingerprinter.close(failed=True)
            raise
        fingerprinter.close()
        load.notes.insert(0, f"read by the Python reader: {refusal}")
    records.quarantine.flush()
    records.blocks.flush(con)
    load.notes.append(NOTE.format(window=window))
    if records.cut["ids"]:
        load.notes.append(TOKEN_IDS_NOTE.format(size=block_size))
    if records.cut["words"]:
        load.notes.append(WORDS_NOTE.format(size=block_size))
    return load


class _Records:
    """What each record of a content file gives, as the Python reader reads it: its texts to :attr:`batch`, its
    prompt cut into :attr:`blocks`, or the record (without its text) to :attr:`quarantine`."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        source: Source,
        path: Path,
        load: FileLoad,
        key: bytes,
        block_size: int | None,
        word_blocks: bool,
    ) -> None:
        self.con = con
        self.load = load
        self.key = key
        self.block_size = block_size
        self.word_blocks = word_blocks
        self.quarantine = QuarantineRows(con, source, path)
        self.batch = _TextBatch()
        self.blocks = BlockRows()
        self.cut = {"ids": 0, "words": 0}
        self.ids_column = source.column("prompt_token_ids")
        self.id_column = source.column("request_id")
        self.columns = [(part, source.column(part)) for part in PARTS]

    def take(self, line: int, rec: dict | None, problem: str | None) -> None:
        """One record (or the reason there is none) of the file."""
        self.load.records_read += 1
        rid = rec.get(self.id_column) if rec else None
        ids = token_ids(rec.get(self.ids_column)) if rec else []
        if problem is None and not rid:
            problem = "missing required field 'request_id'"
        elif problem is None and ids is None:
            problem = f"{self.ids_column} is not a list of non-negative integer token ids"
        elif problem is None and lone_surrogate(str(rid)):
            problem = "request_id is not valid Unicode (a lone surrogate escape)"
        if problem or rec is None:
            self.load.quarantined += 1
            self.quarantine.add(line, problem or "unreadable record", None)  # never the content's text
            return
        self.load.loaded += 1
        for part, column in self.columns:
            text = rendered_text(rec.get(column))  # a chat-messages array as its texts
            if text:
                self.add_text(str(rid), part, text)
        if self.block_size:
            words = rendered_text(rec.get(self.columns[0][1])) if self.word_blocks and not ids else None
            _cut(self.blocks, str(rid), ids or [], words, self.block_size, self.key, self.cut)
            if len(self.blocks) >= BLOCK_ROWS:
                self.blocks.flush(self.con)

    def add_text(self, request_id: str, part: str, text: str) -> None:
        self.batch.add(request_id, part, text)

    def flush(self, params: dict[str, object]) -> None:
        """Fingerprint the texts gathered so far, here and now (the bulk reader's own thread)."""
        if self.batch.texts:
            _fingerprint(self.con, self.batch.table(), params)
        self.batch = _TextBatch()


def _read(source: Source, path: Path, load: FileLoad, fingerprinter: _Fingerprinter, records: _Records) -> None:
    """Read the file's records in Python: texts to *fingerprinter* batch by batch."""
    for line, _raw, rec, problem in read_records(source, path, load):
        records.take(line, rec, problem)
        if records.batch.chars >= BATCH_CHARS:
            fingerprinter.submit(records.batch)
            records.batch = _TextBatch()
    fingerprinter.submit(records.batch)
    records.batch = _TextBatch()


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
        fingerprint_texts(con, params)
    finally:
        con.unregister("content_batch")


def fingerprint_texts(con: duckdb.DuckDBPyConnection, params: dict[str, object]) -> None:
    """Run sql/content_fingerprints.sql on ``content_batch`` with *params* (``width`` and ``window`` among them)."""
    run_script(
        con, "content_fingerprints", params, text=fingerprint_script(int(params["width"]), int(params["window"]))
    )


@functools.cache
def fingerprint_script(width: int, window: int) -> str:
    """sql/content_fingerprints.sql with its shingle of *width* words and the least value of a window of *window*
    written out (``least`` of the window's values, which DuckDB runs faster than a list slice; the same values)."""
    shingle = "concat_ws(' ', " + ", ".join(f"w[i + {k}]" for k in range(width)) + ")"
    window_min = "least(" + ", ".join(f"h[i + {j}]" for j in range(window)) + ")"
    if window > EXPLICIT_WINDOW:  # a long argument list: a list slice beyond
        window_min = "list_min(h[i:i + $window - 1])"
    return sql("content_fingerprints").replace("{shingle}", shingle).replace("{window_min}", window_min)
