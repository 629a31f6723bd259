"""Records of a CSV or JSONL file read in Python (the change log and the content file), the
quarantine rows they give, written in batches, and a record's timestamp as every kind reads one.

Every record is yielded, good or not: a line that is not UTF-8, not JSON or not a JSON object, a CSV
row with the wrong number of fields and the partial last record of a truncated gzip/zstd stream come
with the reason they cannot be loaded, for the caller to quarantine.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.textio import (
    INCOMPLETE_RECORD,
    LineStream,
    decode_line,
    open_binary,
    printable_raw,
)
from kvforensics.sources.engine_logs.contract import unreadable_reason

# (line, raw text, the record or None, the reason it cannot be loaded or None)
Record = tuple[int, str, dict[str, Any] | None, str | None]


def read_records(source: Source, path: Path, load: FileLoad) -> Iterator[Record]:
    """Each record of a CSV (header row first) or JSONL file, with the line it starts on."""
    if source.format == "csv":
        yield from _csv_records(path, load)
    else:
        yield from _jsonl_records(path, load)


def _csv_records(path: Path, load: FileLoad) -> Iterator[Record]:
    with open_binary(path) as fh:
        reader = csv.reader(io.TextIOWrapper(fh, encoding="utf-8", errors="replace", newline=""))
        header = next(reader, None)
        if header is None:
            load.notes.append("empty file")
            return
        header = [h.strip() for h in header]
        last = 1
        for row in reader:
            start, last = last + 1, reader.line_num
            if not row:
                continue
            raw = ",".join(row)
            if len(row) != len(header):
                yield start, raw, None, f"expected {len(header)} fields, found {len(row)}"
            else:
                yield start, raw, dict(zip(header, row, strict=True)), None


def _jsonl_records(path: Path, load: FileLoad) -> Iterator[Record]:
    stream = LineStream(path)
    last: tuple[int, str, str | None] | None = None
    for n, rawb in stream:
        if not rawb.strip():
            continue
        text = decode_line(rawb)
        if text is None:
            yield n, printable_raw(rawb), None, unreadable_reason(rawb)
            last = None
            continue
        obj, problem = jsonl_record(text)
        yield n, text, obj, problem
        last = (n, text, problem)
    if stream.partial is not None:
        yield stream.partial[0], printable_raw(stream.partial[1]), None, INCOMPLETE_RECORD
    if stream.stopped:
        load.notes.append(stream.stopped)
    elif last is not None and last[0] == stream.lines and last[2] is not None and cut_short(last[1]):
        load.notes.append(cut_note(last[0]))


def json_error(text: str) -> tuple[str, json.JSONDecodeError | None]:
    """A line that starts a JSON object or array, stripped, and why it does not parse (None: it does, or it is
    not one: then the text is empty)."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return "", None
    try:
        json.loads(stripped)
    except json.JSONDecodeError as e:
        return stripped, e
    except (ValueError, RecursionError):
        return "", None
    return stripped, None


def opens_document(text: str) -> bool:
    """Whether a line is the start of a JSON value that goes on past the line's end (a pretty-printed
    document), rather than a complete value or a malformed line."""
    stripped, e = json_error(text)
    return e is not None and e.pos >= len(stripped)


def cut_short(text: str) -> bool:
    """Whether a line that is not JSON stops inside a JSON object or array: the parser ran out of text wanting
    more (a missing value, delimiter or bracket at the end, an unterminated string, a literal's beginning).
    The last line of a file that is cut short (a copy interrupted, a file recompressed after it was cut) is such
    a line; a complete line with a mistake in it is not."""
    stripped, e = json_error(text)
    if e is None:
        return False
    if e.msg.startswith("Unterminated string") or e.pos >= len(stripped):
        return True
    rest = stripped[e.pos :]
    return e.msg == "Expecting value" and any(word.startswith(rest) for word in ("true", "false", "null"))


def cut_note(line: int) -> str:
    """The load note of a file whose last line is a record cut short (the conclusiveness gate's truncated_file)."""
    return (
        f"input ends early after line {line - 1} (its last line, {line}, is a record cut short: its JSON stops "
        "before the record does, so the file was cut there); later records, if any, are lost"
    )


def jsonl_record(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """One JSONL line's record, or the reason it is none (the line is not blank)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None, "malformed JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    return obj, None


def lone_surrogate(value: str) -> bool:
    """Whether a string holds a lone surrogate (JSON allows the escape ``"\\ud800"``), which no
    UTF-8 column can store: such a record is quarantined rather than loaded."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class QuarantineRows:
    """The refused records of one file, written to ``quarantine`` in batches (one insert per
    ``BATCH`` records and one at :meth:`flush`, not one per record). ``raw`` is None for sources
    whose text must not be kept."""

    BATCH = 100_000

    def __init__(self, con: duckdb.DuckDBPyConnection, source: Source, path: Path) -> None:
        self._con = con
        self._params = {"s": source.name, "f": str(path)}
        self._lines: list[int] = []
        self._reasons: list[str] = []
        self._raws: list[str | None] = []

    def add(self, line: int, reason: str, raw: str | None) -> None:
        self._lines.append(line)
        self._reasons.append(reason)
        self._raws.append(raw)
        if len(self._lines) >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        self._con.register(
            "quarantine_batch",
            pa.table(
                {
                    "line": pa.array(self._lines, type=pa.int64()),
                    "reason": pa.array(self._reasons, type=pa.string()),
                    "raw": pa.array(self._raws, type=pa.string()),
                }
            ),
        )
        try:
            self._con.execute(
                "INSERT INTO quarantine SELECT $s, $f, line, reason, raw FROM quarantine_batch", self._params
            ).fetchall()
        finally:
            self._con.unregister("quarantine_batch")
        self._lines.clear()
        self._reasons.clear()
        self._raws.clear()


def parse_ts(value: str | None, source: Source) -> datetime | None:
    """A change's timestamp in UTC: epoch seconds/ms/us/ns by magnitude, or ISO 8601 (read in the
    source's timezone when it has no offset); the source's clock offset (real seconds) applied to
    either, as the requests loader does. None if unreadable."""
    if value is None or not value.strip():
        return None
    v = value.strip()
    try:
        num = float(v)
    except ValueError:
        num = None
    offset = timedelta(seconds=source.clock_offset_s)
    if num is not None:
        scale = 1e9 if abs(num) >= 1e17 else 1e6 if abs(num) >= 1e14 else 1e3 if abs(num) >= 1e11 else 1.0
        try:
            return datetime.fromtimestamp(num / scale, tz=timezone.utc) + offset
        except (OverflowError, OSError, ValueError):  # inf, nan, beyond year 9999
            return None
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=source.tz)
    try:  # in UTC first: an offset added to a zone's local time would move across a daylight-saving change
        return dt.astimezone(timezone.utc) + offset
    except OverflowError:  # an offset carrying a time beyond year 1 or 9999
        return None
