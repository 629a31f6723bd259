"""A JSONL content file read in bulk: DuckDB reads the lines, parses the records and tokenises and fingerprints
their ASCII texts column-wise (sql/content_bulk.sql, sql/content_fingerprints.sql), and every line it does not
take is read by the Python reader (kvforensics/sources/content/load.py), which stays the reference: the two give
the same rows of ``content_fingerprints``, ``content_stats`` and ``quarantine``, and the same counts.

The bulk reader takes a line only when its text leaves nothing to judge (sql/content_bulk.sql says what that
is); a text that is not ASCII is tokenised by Python (:func:`kvforensics.core.fingerprint.shingle_words`, since
DuckDB's lower-casing and word characters are not Python's beyond ASCII) and fingerprinted with the rest. A file
goes to the reference whole when DuckDB cannot number its lines as the reference does
(:func:`kvforensics.sources.common.bulk_lines.numbered_lines`), when it is small (``BULK_MIN_LINES``), when every
prompt is cut into prefix-cache blocks of words (that is Python's; a record with token ids, whose prompt is cut from
them, is the reference's line by line), or when a key it reads holds a quote or a backslash. The load notes say which reader read the file, and how many of its lines the reference read.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import duckdb

from kvforensics.config import Source
from kvforensics.core.db import run_script, sql
from kvforensics.sources.common.bulk_lines import CheckedLines, numbered_lines
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import cut_note, cut_short, jsonl_record

BULK_MIN_LINES = 2_000  # smaller files are read by the reference
READER = "duckdb-bulk"
# what DuckDB's JSON reader accepts and Python's does not, or Python refuses for its size (ints over 4300 digits)
LENIENT = r",\s*[\]}]|[\[:,]\s*[-+]?(?i:nan|inf)|[0-9]{400}"
_BLANK = " \t\n\r\x0b\x0c"  # what bytes.strip() strips: a line of only these is blank to the reference

# the reference's handling of one record: (line, record or None, the reason it cannot be loaded or None)
TakeRecord = Callable[[int, "dict | None", "str | None"], None]


def bulk_refusal(source: Source, word_blocks: bool) -> str | None:
    """Why a content source's files cannot be read in bulk at all, or None. A record with token ids is the
    reference's (its prompt is cut into prefix-cache blocks from them); with *word_blocks* every prompt is cut."""
    if source.format != "jsonl":
        return f"format {source.format!r}"
    if word_blocks:
        return "every prompt is cut into prefix-cache blocks of words ([prefix_cache] word_blocks)"
    for part in ("request_id", "prompt", "output", "prompt_token_ids"):
        name = source.column(part)
        if '"' in name or "\\" in name:
            return f"key {name!r} (columns.{part}) holds a quote or a backslash"
    return None


def read_bulk(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    take: TakeRecord,
    add_text: Callable[[str, str, str], None],
    fingerprint: Callable[[], None],
    flush: Callable[[], None],
    min_lines: int = BULK_MIN_LINES,
    checked: Future[CheckedLines | str] | None = None,
) -> str | None:
    """Read one content file in bulk into *load*, or say why the reference must read it whole (nothing read
    then). The records DuckDB takes are fingerprinted by sql/content_fingerprints.sql on the view
    ``content_batch`` (*fingerprint* runs it); their texts that are not ASCII go to *add_text*; every other
    line to *take*, as the reference reads it; *flush* fingerprints what those two gathered, chunk by chunk.
    *checked*: the check of the file's lines begun before (:class:`~kvforensics.sources.common.bulk_lines.LineChecks`)."""
    lines = numbered_lines(con, path, min_lines, checked)
    if isinstance(lines, str):
        return lines
    keys = {part: source.column(part) for part in ("request_id", "prompt", "output")}
    once = " AND ".join(
        f"strpos(substr(raw, strpos(raw, '\"' || $k_{p} || '\"') + 1), '\"' || $k_{p} || '\"') = 0" for p in keys
    )
    params = {
        "lenient": LENIENT,
        "ids_key": source.column("prompt_token_ids"),
        **{f"k_{p}": k for p, k in keys.items()},
        "id_path": f'$."{keys["request_id"]}"',
        "prompt_path": f'$."{keys["prompt"]}"',
        "output_path": f'$."{keys["output"]}"',
    }
    text = sql("content_bulk").replace("{once}", once)
    load.reader = READER
    fallback = 0
    last: tuple[int, str, str | None] | None = None  # the last line the reference read
    for chunk in lines.chunks():
        con.register("content_bulk_lines", chunk)
        try:
            run_script(con, "content_bulk", params, text=text)
            taken = con.execute("SELECT count(*) FROM content_bulk").fetchall()[0][0]
            load.records_read += taken
            load.loaded += taken
            fingerprint()
            con.execute("DROP VIEW content_batch").fetchall()  # the name the reference's batches are registered as
            for request_id, part, value in con.execute(
                "SELECT request_id, part, text FROM content_bulk_texts WHERE NOT ascii"
            ).fetchall():
                add_text(request_id, part, value)
            for line, raw in con.execute(
                "SELECT line, raw FROM content_bulk_lines WHERE line NOT IN (SELECT line FROM content_bulk) "
                "ORDER BY line"
            ).fetchall():
                if raw is None or not raw.strip(_BLANK):
                    continue
                fallback += 1
                record, problem = jsonl_record(raw)
                take(line, record, problem)
                last = (line, raw, problem)
            flush()
        finally:
            con.unregister("content_bulk_lines")
            con.execute("DROP VIEW IF EXISTS content_batch").fetchall()
            for table in ("content_bulk", "content_bulk_texts"):
                con.execute(f"DROP TABLE IF EXISTS {table}").fetchall()
    if last is not None and last[0] == lines.lines and last[2] is not None and cut_short(last[1]):
        load.notes.append(cut_note(last[0]))
    load.notes.insert(
        0,
        "read in bulk by DuckDB"
        + (f"; {fallback:,} line(s) outside its shapes read by the Python reference" if fallback else ""),
    )
    return None
