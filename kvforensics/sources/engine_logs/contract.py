"""The engine-log parse contract: what every parser returns and the ingest stage stores.

* :class:`StartupRecord`  one start-up of one engine instance (KV pool, context length, role ...),
* :class:`EngineEvent`    one per-request engine line (aborts, transfer failures, timing stats ...),
* :class:`PrefillBatch`   one prefill batch line (``#new-seq``, ``#new-token``, ``#cached-token`` ...),
* :class:`QuarantinedLine` a line that looks like a log line but could not be read, with the reason,
* :class:`EngineLogParse` all of the above for one instance, plus ``lines_read`` and ``notes``,
* :class:`EngineFileParse` one file: an :class:`EngineLogParse` per instance it holds (an export of
  interleaved pods holds several), its physical line count and what belongs to the file.

This module is the bottom floor of the engine-log loaders: it imports none of them (see
``docs/architecture.md``, "Engine-log parser contract").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

EVENT_KINDS = (
    "abort_input_too_long",  # prompt longer than what the engine accepts (N tokens vs limit M)
    "req_time_stats",  # per-request timing line (prompt_tokens = input_len as the engine saw it)
    "transfer_failure",  # PD KV hand-off failed (bootstrap, handshake, transfer, Mooncake session)
    "checksum_mismatch",  # --disaggregation-enable-kv-checksum caught a corrupted hand-off
    "context_corruption",  # metadata buffer index collision between two requests
    "canary_violation",  # --kv-canary found a KV slot holding unexpected token ids
    "input_truncated",  # the engine silently truncated a prompt (allow_auto_truncate / old builds)
    "abort_other",  # any other abort naming a request
)

DETAIL_LIMIT = 300
RAW_LIMIT = 500
INHERITED_TS_NOTE = (
    "{n} event line(s) without a timestamp of their own (tracebacks, continuation lines) were given the "
    "time of the last stamped line before them"
)


@dataclass(frozen=True)
class StartupRecord:
    """One start-up of one engine instance; it holds until the instance's next start-up, its own
    shutdown lines, or the end of its log (``kvforensics/stages/instances.py`` decides which)."""

    instance: str
    ts: datetime | None  # UTC, tz-aware: first line of the start-up (first stamped line if it has none)
    line: int  # 1-based line of the first line of the start-up
    engine: str  # "sglang" | "vllm"
    engine_version: str | None  # "0.5.21" (logged) or ">0.5.9,<0.5.20 (inferred: ...)"
    version_source: str | None  # "log" | "inferred from format" | None
    role: str  # "prefill" | "decode" | "unified" | "unknown" (no line of its log says)
    model: str | None  # served_model_name, else model_path
    kv_pool_tokens: int | None  # effective pool: min over ranks, last value per rank wins
    pool_source_line: int | None
    context_length: int | None
    page_size: int | None
    tp_size: int | None
    dp_size: int | None
    flags: dict[str, str]  # selected server args and derived facts (disaggregation_*, kv_pool_* ...)
    evidence: dict[str, int]  # field -> line number it came from
    last_line: int | None = None  # the last line of the log that belongs to this start-up
    last_ts: datetime | None = None  # UTC time of its last stamped line: the last sign of life in the log
    shutdown_line: int | None = None  # first line saying the server stops (sources/engine_logs/shutdown.py)
    shutdown_ts: datetime | None = None  # its time (a line without a stamp: the last stamped line before it)
    shutdown_reason: str | None = None  # e.g. "SIGTERM received", "HTTP server shutting down"


def log_end_fields(
    last_line: int | None, last_ts: datetime | None, shutdown: tuple[int, datetime | None, str] | None
) -> dict[str, Any]:
    """The :class:`StartupRecord` fields saying how far a start-up's log goes and where it says it stops,
    from a parser's running state (``shutdown``: line, time, what it says)."""
    line, ts, reason = shutdown if shutdown else (None, None, None)
    return {
        "last_line": last_line,
        "last_ts": last_ts,
        "shutdown_line": line,
        "shutdown_ts": ts,
        "shutdown_reason": reason,
    }


@dataclass(frozen=True)
class EngineEvent:
    """One per-request engine line."""

    instance: str
    ts: datetime | None
    line: int
    kind: str  # one of EVENT_KINDS
    request_id: str | None
    prompt_tokens: int | None  # N from "Input length (N tokens)", input_len= from ReqTimeStats ...
    limit_tokens: int | None  # M from "maximum allowed length (M tokens)" ...
    detail: str  # the message, truncated to 300 characters
    cached_tokens: int | None = None  # req_time_stats: prompt tokens the engine's prefix cache served


@dataclass(frozen=True)
class PrefillBatch:
    """One prefill batch line: what the scheduler put into one prefill step of one replica."""

    instance: str
    ts: datetime | None
    line: int
    new_seq: int  # requests (or chunks of one) in the batch
    new_token: int  # prompt tokens computed
    cached_token: int  # prompt tokens served from the prefix cache
    running_req: int | None
    queue_req: int | None
    token_usage: float | None  # KV pool in use (hybrid pools: the full-attention layers')
    role: str | None  # "prefill" / "decode" when the line's own fields say (PD queue counts), else None
    ranks: str  # the rank prefix ("DP1 TP0"), "" without one


@dataclass(frozen=True)
class QuarantinedLine:
    line: int
    reason: str
    raw: str


@dataclass
class EngineLogParse:
    startups: list[StartupRecord] = field(default_factory=list)
    events: list[EngineEvent] = field(default_factory=list)
    quarantined: list[QuarantinedLine] = field(default_factory=list)
    lines_read: int = 0
    notes: list[str] = field(default_factory=list)
    # events read column-wise (sources/engine_logs/columnar.py), Arrow tables with EVENT_COLUMNS; they are
    # part of the parse like ``events`` (see all_events), kept as columns so that ingest stores them
    # without a Python object per line
    event_tables: list[pa.Table] = field(default_factory=list)
    prefill_batches: list[PrefillBatch] = field(default_factory=list)
    batch_tables: list[pa.Table] = field(default_factory=list)  # prefill batches read column-wise (BATCH_COLUMNS)

    def all_batches(self) -> list[PrefillBatch]:
        """``prefill_batches`` and the rows of ``batch_tables``, in line order."""
        if not self.batch_tables:
            return list(self.prefill_batches)
        return sorted(
            [*self.prefill_batches, *(b for t in self.batch_tables for b in batches_from_table(t))],
            key=lambda b: b.line,
        )

    def all_events(self) -> list[EngineEvent]:
        """``events`` and the events of ``event_tables``, in line order."""
        if not self.event_tables:
            return list(self.events)
        return sorted(
            [*self.events, *(e for t in self.event_tables for e in events_from_table(t))], key=lambda e: e.line
        )


EVENT_COLUMNS = pa.schema(
    [
        ("instance", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("kind", pa.string()),
        ("request_id", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("limit_tokens", pa.int64()),
        ("detail", pa.string()),
        ("line", pa.int64()),
        ("cached_tokens", pa.int64()),
    ]
)
"""The columns of an event table: :class:`EngineEvent`'s fields."""

BATCH_COLUMNS = pa.schema(
    [
        ("instance", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("line", pa.int64()),
        ("new_seq", pa.int64()),
        ("new_token", pa.int64()),
        ("cached_token", pa.int64()),
        ("running_req", pa.int64()),
        ("queue_req", pa.int64()),
        ("token_usage", pa.float64()),
        ("role", pa.string()),
        ("ranks", pa.string()),
    ]
)
"""The columns of a prefill batch table: :class:`PrefillBatch`'s fields, in its order."""


_INT64 = range(-(1 << 63), 1 << 63)


def events_table(events: list[EngineEvent]) -> pa.Table:
    """*events* as a table with :data:`EVENT_COLUMNS`. A token count too large for a 64-bit integer
    (a corrupted line) is left empty; the detail text still shows it."""
    columns = []
    for name, f in zip(EVENT_COLUMNS.names, EVENT_COLUMNS, strict=True):
        values = [getattr(e, name) for e in events]
        if f.type == pa.int64():
            values = [v if v is None or v in _INT64 else None for v in values]
        columns.append(pa.array(values, type=f.type))
    return pa.table(columns, schema=EVENT_COLUMNS)


def events_from_table(table: pa.Table) -> list[EngineEvent]:
    """The rows of an event table as :class:`EngineEvent` items (times as UTC datetimes)."""
    columns = [table.column(name).to_pylist() for name in EVENT_COLUMNS.names]
    columns[1] = [None if ts is None else ts.astimezone(UTC) for ts in columns[1]]
    return [
        EngineEvent(i, ts, line, kind, rid, prompt, limit, detail, cached)
        for i, ts, kind, rid, prompt, limit, detail, line, cached in zip(*columns, strict=True)
    ]


def batches_table(batches: list[PrefillBatch]) -> pa.Table:
    """*batches* as a table with :data:`BATCH_COLUMNS`."""
    return pa.table(
        [pa.array([getattr(b, f.name) for b in batches], type=f.type) for f in BATCH_COLUMNS], schema=BATCH_COLUMNS
    )


def batches_from_table(table: pa.Table) -> list[PrefillBatch]:
    """The rows of a prefill batch table as :class:`PrefillBatch` items (times as UTC datetimes)."""
    rows = table.to_pylist()
    return [PrefillBatch(**{**r, "ts": None if r["ts"] is None else r["ts"].astimezone(UTC)}) for r in rows]


EngineLine = tuple[int, str | None, bytes]
"""(1-based line number, decoded text or None if the bytes are not UTF-8 or the line is a :class:`LongLine`,
raw bytes)."""


class LongLine(bytes):
    """A line too long to read whole, as the line readers yield it in place of its bytes (with text None): what
    the quarantine keeps of it, its size in bytes and the SHA-256 of the whole line, then its first bytes
    (``[line of 35,651,584 bytes, SHA-256 9f86d0...] {"rid": ...``). ``reason`` is the quarantine's reason."""

    reason: str

    def __new__(cls, head: bytes, size: int, sha256: str, limit: int) -> LongLine:
        line = super().__new__(cls, f"[line of {size:,} bytes, SHA-256 {sha256}] ".encode() + head)
        line.reason = f"line too long to read whole (over {limit:,} bytes): its size and SHA-256 lead the raw text"
        return line


def unreadable_reason(raw: bytes, reason: str = "not UTF-8") -> str:
    """Why a line the readers give without text (None) is quarantined: a :class:`LongLine`'s reason, else ``reason``
    (bytes that are not UTF-8)."""
    return raw.reason if isinstance(raw, LongLine) else reason


LineParser = Callable[..., EngineLogParse]


def truncate_detail(message: str, limit: int = DETAIL_LIMIT) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "\u2026"


def raw_for_quarantine(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    return truncate_detail(text, RAW_LIMIT)


def add_note(notes: list[str], note: str) -> None:
    if note not in notes:
        notes.append(note)


def add_reading_notes(notes: list[str], *, inherited_ts: int, nul_lines: int, clock: Any, skew: Any) -> None:
    """The notes every engine-log parser ends with: timestamps inherited by continuation lines, NUL
    bytes removed, and what the clock (time zone / offset) and the skew check assumed."""
    if inherited_ts:
        add_note(notes, INHERITED_TS_NOTE.format(n=inherited_ts))
    if nul_lines:
        add_note(notes, f"{nul_lines} line(s) contained NUL bytes, which were removed before reading")
    for n in clock.notes() + skew.notes():
        add_note(notes, n)


InstanceNamer = Callable[[Mapping[str, str] | None], str]
"""Names the instance of a record from its envelope labels (None: the file's own name). Raises
KeyError when the template names a label the record does not carry."""


@dataclass
class EngineFileParse:
    """One engine log file: a parse per engine instance it holds, and what belongs to the file."""

    envelope: str  # "none" or one of kvforensics.sources.engine_logs.envelopes.parse.ENVELOPES
    instances: dict[str, EngineLogParse] = field(default_factory=dict)
    lines_read: int = 0  # physical lines of the file
    quarantined: list[QuarantinedLine] = field(default_factory=list)  # envelope records that could not be read
    notes: list[str] = field(default_factory=list)  # about the file as a whole
    warnings: list[str] = field(default_factory=list)  # notes a responder must see (e.g. a clock disagreement)

    @property
    def startups(self) -> list[StartupRecord]:
        return [s for parse in self.instances.values() for s in parse.startups]

    @property
    def events(self) -> list[EngineEvent]:
        return [e for parse in self.instances.values() for e in parse.all_events()]

    def event_table(self) -> pa.Table:
        """Every event of the file as one table with :data:`EVENT_COLUMNS`, in the order of :attr:`events`
        (the column-wise events are never turned into Python objects)."""
        tables = []
        for parse in self.instances.values():
            table = pa.concat_tables([events_table(parse.events), *parse.event_tables])
            tables.append(table.sort_by([("line", "ascending")]) if parse.event_tables else table)
        return pa.concat_tables(tables) if tables else events_table([])

    @property
    def batches(self) -> list[PrefillBatch]:
        return [b for parse in self.instances.values() for b in parse.all_batches()]

    def batch_table(self) -> pa.Table:
        """Every prefill batch of the file as one table with :data:`BATCH_COLUMNS`, in the order of :attr:`batches`."""
        tables = []
        for parse in self.instances.values():
            table = pa.concat_tables([batches_table(parse.prefill_batches), *parse.batch_tables])
            tables.append(table.sort_by([("line", "ascending")]) if parse.batch_tables else table)
        return pa.concat_tables(tables) if tables else batches_table([])

    def all_quarantined(self) -> list[QuarantinedLine]:
        """Every quarantined physical line once (the reasons of one line's pieces joined), by line."""
        by_line: dict[int, QuarantinedLine] = {}
        for q in itertools.chain(self.quarantined, *(p.quarantined for p in self.instances.values())):
            held = by_line.get(q.line)
            if held is None:
                by_line[q.line] = q
            elif q.reason not in held.reason:
                by_line[q.line] = QuarantinedLine(q.line, f"{held.reason}; {q.reason}", held.raw)
        return [by_line[k] for k in sorted(by_line)]

    def all_notes(self) -> list[str]:
        """The file's notes, then each instance's (named when the file holds several)."""
        notes = list(self.notes)
        several = len(self.instances) > 1
        for name, parse in self.instances.items():
            for n in parse.notes:
                add_note(notes, f"instance '{name}': {n}" if several else n)
        return notes

    def merged(self) -> EngineLogParse:
        """All instances as one :class:`EngineLogParse` (each record still names its instance)."""
        return EngineLogParse(
            startups=self.startups,
            events=self.events,
            quarantined=self.all_quarantined(),
            lines_read=self.lines_read,
            notes=self.all_notes(),
            prefill_batches=self.batches,
        )
