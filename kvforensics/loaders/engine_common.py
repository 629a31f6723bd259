"""What every engine-log parser shares: the parse contract, line streaming and clock handling.

The contract (see ``docs/architecture.md``, "Engine-log parser contract"):

* :class:`StartupRecord`  one start-up of one engine instance (KV pool, context length, role ...),
* :class:`EngineEvent`    one per-request engine line (aborts, transfer failures, timing stats ...),
* :class:`QuarantinedLine` a line that looks like a log line but could not be read, with the reason,
* :class:`EngineLogParse` all of the above for one instance, plus ``lines_read`` and ``notes``,
* :class:`EngineFileParse` one file: an :class:`EngineLogParse` per instance it holds (an export of
  interleaved pods holds several), its physical line count and what belongs to the file.

Only this module touches the file system: :func:`open_lines` streams a plain, gzip or zstd file
line by line (never the whole file in memory) and records where a truncated compressed stream
stopped. :func:`parse_engine_file` is the entry point the ingest stage calls; logs in a
collection envelope (kubectl, CRI, Docker, Loki, CloudWatch, journald) go through
:mod:`kvforensics.loaders.envelopes`. :func:`parse_engine_log` gives one file as one parse.
"""

from __future__ import annotations

import ast
import itertools
import re
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal
from zoneinfo import ZoneInfo

import zstandard

from kvforensics.errors import InputError

__all__ = [
    "EngineEvent",
    "EngineFileParse",
    "EngineLine",
    "EngineLogParse",
    "LineStream",
    "LocalClock",
    "OuterPrefix",
    "PoolReports",
    "QuarantinedLine",
    "StartupRecord",
    "TruncatedInput",
    "flag_value",
    "open_lines",
    "parse_engine_file",
    "parse_engine_log",
    "parse_repr_fields",
    "sniff_format",
    "split_outer_prefixes",
]

# --------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------

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
    shutdown lines, or the end of its log (``kvforensics/instances.py`` decides which)."""

    instance: str
    ts: datetime | None  # UTC, tz-aware: first line of the start-up (first stamped line if it has none)
    line: int  # 1-based line of the first line of the start-up
    engine: str  # "sglang" | "vllm"
    engine_version: str | None  # "0.5.21" (logged) or ">0.5.9,<0.5.20 (inferred: ...)"
    version_source: str | None  # "log" | "inferred from format" | None
    role: str  # "prefill" | "decode" | "unified"
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
    shutdown_line: int | None = None  # first line saying the server stops (loaders/shutdown.py)
    shutdown_ts: datetime | None = None  # its time (a line without a stamp: the last stamped line before it)
    shutdown_reason: str | None = None  # e.g. "SIGTERM received", "HTTP server shutting down"


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


EngineLine = tuple[int, str | None, bytes]
"""(1-based line number, decoded text or None if the bytes are not UTF-8, raw bytes)."""

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


# --------------------------------------------------------------------------------------------
# Streaming lines from plain, gzip and zstd files
# --------------------------------------------------------------------------------------------

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 18


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
            for chunk in self._chunks():
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
                    yield _decode(number, raw)
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
            yield _decode(number, bytes(pending))


def _decode(number: int, raw: bytes) -> EngineLine:
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    try:
        text: str | None = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if number == 1 and text is not None and text.startswith("\ufeff"):
        text = text[1:]
    return number, text, raw


def open_lines(path: Path) -> LineStream:
    """Stream ``(1-based line number, text or None if not UTF-8, raw bytes)`` from *path*.

    Plain, gzip and zstd files are read transparently. See :class:`LineStream` for truncation.
    Raises :class:`~kvforensics.errors.InputError` if the file cannot be opened.
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


# --------------------------------------------------------------------------------------------
# Clocks: naive local engine stamps -> UTC
# --------------------------------------------------------------------------------------------


class LocalClock:
    """Turn naive local engine timestamps into tz-aware UTC datetimes.

    A stamp is read as wall-clock time in *tz*, converted to UTC, then shifted by
    ``clock_offset_s`` (a correction for a skewed host clock, in real seconds). Wall-clock times
    that are ambiguous (the repeated hour when DST ends) or do not exist (the skipped hour when
    DST starts) are read with ``fold=0`` and counted; :meth:`notes` describes them.
    """

    def __init__(self, tz: ZoneInfo, clock_offset_s: float = 0.0) -> None:
        self.tz = tz
        self.offset = timedelta(seconds=clock_offset_s)
        self._hour_cache: dict[tuple[int, int, int, int], tuple[timedelta, str | None]] = {}
        self._dst: dict[str, list[Any]] = {}  # kind -> [count, first line, first stamp]

    def to_utc(self, local: datetime, line: int) -> datetime:
        """The UTC instant of a naive local stamp; ValueError if it falls outside datetime's range."""
        try:
            return self._to_utc(local, line)
        except OverflowError as e:
            raise ValueError(f"out of range: {e}") from e

    def shift(self, instant: datetime | None) -> datetime | None:
        """Apply the clock offset to an instant that is already UTC (e.g. Docker's prefix)."""
        if instant is None:
            return None
        try:
            return instant + self.offset
        except OverflowError:
            return None

    def _to_utc(self, local: datetime, line: int) -> datetime:
        hour = (local.year, local.month, local.day, local.hour)
        cached = self._hour_cache.get(hour)
        if cached is None:
            cached = self._classify(local)
            if len(self._hour_cache) > 100_000:
                self._hour_cache.clear()
            self._hour_cache[hour] = cached
        utcoffset, dst_kind = cached
        if dst_kind is not None:
            # the transition may fall inside this hour: classify the exact minute
            utcoffset, dst_kind = self._classify(local)
            if dst_kind is not None:
                entry = self._dst.setdefault(dst_kind, [0, line, local])
                entry[0] += 1
        return (local - utcoffset).replace(tzinfo=UTC) + self.offset

    def _classify(self, local: datetime) -> tuple[timedelta, str | None]:
        early = local.replace(tzinfo=self.tz, fold=0)
        late = local.replace(tzinfo=self.tz, fold=1)
        off = early.utcoffset() or timedelta(0)
        if off == (late.utcoffset() or timedelta(0)):
            return off, None
        back = early.astimezone(UTC).astimezone(self.tz).replace(tzinfo=None)
        return off, ("nonexistent" if back != local else "ambiguous")

    def notes(self) -> list[str]:
        out = []
        for kind, (count, line, stamp) in sorted(self._dst.items()):
            what = (
                "fall in the repeated hour when daylight saving time ends"
                if kind == "ambiguous"
                else "fall in the hour skipped when daylight saving time starts (they cannot exist)"
            )
            out.append(
                f"{count} line(s) {what} in {self.tz.key} (first at line {line}: {stamp:%Y-%m-%d %H:%M:%S}); "
                "read with fold=0, i.e. with the UTC offset in force before the change"
            )
        if self.offset:
            out.append(f"clock offset of {self.offset.total_seconds():+g} s added to every engine timestamp")
        return out


class DockerSkewCheck:
    """Compare engine stamps with Docker's UTC prefix, to catch a wrong ``timezone`` setting."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None

    def observe(self, line: int, engine_ts: datetime | None, docker_ts: datetime | None) -> None:
        if self.first is None and engine_ts is not None and docker_ts is not None:
            self.first = (line, (docker_ts - engine_ts).total_seconds())

    def notes(self) -> list[str]:
        if self.first is None:
            return []
        line, skew = self.first
        if abs(skew) < 300:
            return []
        return [
            (
                f"engine timestamps differ from the Docker --timestamps prefix (UTC) by {skew / 3600:+.2f} h "
                f"(first compared at line {line}): check the source's timezone or clock offset"
            )
        ]


# --------------------------------------------------------------------------------------------
# Python repr dumps: ServerArgs(...), Namespace(...), {'k': v}, "k=v, k=v" config strings
# --------------------------------------------------------------------------------------------

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {")", "]", "}"}


def _split_top_level(text: str, start: int) -> tuple[list[str], int | None]:
    """Split ``text[start:]`` at top-level commas until an unmatched closing bracket.

    Returns the items and the index of the closing bracket (None if the text ended first).
    Quotes (with backslash escapes) and nested brackets are respected.
    """
    items: list[str] = []
    stack: list[str] = []
    quote: str | None = None
    item_start = start
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in ("'", '"'):
            quote = c
        elif c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if not stack:
                items.append(text[item_start:i])
                return [s for s in (x.strip() for x in items) if s], i
            if stack[-1] == c:
                stack.pop()
            # a mismatched closer inside an unquoted value: ignore it rather than fail
        elif c == "," and not stack:
            items.append(text[item_start:i])
            item_start = i + 1
        i += 1
    items.append(text[item_start:])
    return [s for s in (x.strip() for x in items) if s], None


def _literal(value: str) -> object:
    if not value or len(value) > 100_000:
        return value
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for "1x"
            return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def parse_repr_fields(text: str) -> tuple[dict[str, object], bool]:
    """Read the fields of a Python repr dump, robustly.

    *text* starts at the dump: ``ServerArgs(a=1, b='x')``, ``Namespace(...)``, ``{'a': 1}`` or a
    bare ``a=1, b=x`` list (vLLM's config string). Values are Python literals where they can be
    read as such, otherwise their source text. Returns ``(fields, complete)``; ``complete`` is
    False when the dump was cut off (a wrapped or truncated line): the fields read so far are kept.
    """
    text = text.strip()
    fields: dict[str, object] = {}
    if text.startswith("{"):
        whole = _literal(text) if text.endswith("}") else text
        if isinstance(whole, dict):
            return {str(k): v for k, v in whole.items()}, True
        items, close = _split_top_level(text, 1)
        for item in items:
            key, sep, value = item.partition(":")
            if not sep:
                continue
            k = _literal(key.strip())
            fields[str(k)] = _literal(value.strip())
        return fields, close is not None
    m = re.match(r"[A-Za-z_][\w.]*\(", text)
    if m:
        items, close = _split_top_level(text, m.end())
        complete = close is not None
    else:
        items, close = _split_top_level(text, 0)
        complete = True
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", key):
            continue
        fields[key] = _literal(value.strip())
    return fields, complete


def flag_value(value: object) -> str:
    """A server-arg value as a flag string: booleans as true/false, None as none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?[\d,_]+\s*", value):
        try:
            return int(value.replace(",", "").replace("_", ""))
        except ValueError:
            return None
    return None


# --------------------------------------------------------------------------------------------
# KV pool reports: last value per reporter wins, the effective pool is the minimum
# --------------------------------------------------------------------------------------------


@dataclass
class PoolReport:
    line: int
    reporter: str  # rank or process that printed it ("TP0", "DP1 TP1", "VllmWorker rank=1" ...)
    tokens: int
    source: str  # which log line kind ("max_total_num_tokens", "KV Cache is allocated" ...)


class PoolReports:
    """Collect KV-pool sizes printed by several ranks/processes during one start-up.

    Within one ``(reporter, source group)`` the last value wins (post-capture resizes, repeated
    profiling); the effective pool is the smallest value any reporter holds at the end. Several
    reporters printing the same count are one value.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], PoolReport] = {}

    def add(self, report: PoolReport, group: str | None = None) -> None:
        self._last[(report.reporter, group or report.source)] = report

    def __bool__(self) -> bool:
        return bool(self._last)

    def reports(self) -> list[PoolReport]:
        return sorted(self._last.values(), key=lambda r: r.line)

    def effective(self, prefer_source: str | None = None) -> PoolReport | None:
        reports = self.reports()
        if not reports:
            return None
        low = min(r.tokens for r in reports)
        at_low = [r for r in reports if r.tokens == low]
        preferred = [r for r in at_low if r.source == prefer_source]
        return (preferred or at_low)[0]

    def summary(self) -> str:
        """E.g. ``681280 (TP0..TP7: KV Cache is allocated; TP0: max_total_num_tokens)``."""
        by_value: dict[int, dict[str, list[str]]] = {}
        for r in self.reports():
            by_value.setdefault(r.tokens, {}).setdefault(r.source, []).append(r.reporter or "-")
        parts = []
        for tokens in sorted(by_value):
            srcs = "; ".join(f"{_ranks_label(who)}: {src}" for src, who in by_value[tokens].items())
            parts.append(f"{tokens} ({srcs})")
        return ", ".join(parts)


def _ranks_label(who: list[str]) -> str:
    uniq = list(dict.fromkeys(who))
    if len(uniq) > 3:
        return f"{uniq[0]}..{uniq[-1]} ({len(uniq)} reporters)"
    return ",".join(uniq)


# --------------------------------------------------------------------------------------------
# Format sniffing and the entry point
# --------------------------------------------------------------------------------------------

_SGLANG_SNIFF = re.compile(
    r"^\[(?:\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}|\d{2}:\d{2}:\d{2} TP\d+|gpu=\d+)"
    r"|server_args=(?:ServerArgs\(|\{)|max_total_num_tokens=|sglang"
)
_VLLM_SNIFF = re.compile(
    r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{2}-\d{2} \d{2}:\d{2}:\d{2}"
    r"|vLLM (?:API )?server version|LLM engine \(v|non-default args: \{|vllm"
)

SNIFF_LINES = 200


def sniff_format(first_lines: Iterable[str | None]) -> str | None:
    """Tell an SGLang log from a vLLM log by its first lines; None when neither is recognised."""
    score = {"sglang": 0, "vllm": 0}
    for text in itertools.islice(first_lines, SNIFF_LINES):
        if not text:
            continue
        rest = split_outer_prefixes(text).rest
        if _SGLANG_SNIFF.search(rest):
            score["sglang"] += 2 if rest.startswith("[") else 1
        if _VLLM_SNIFF.search(rest):
            score["vllm"] += 2 if rest[:1].isupper() and not rest.startswith("[") else 1
    best = max(score, key=lambda k: score[k])
    if score[best] == 0 or score["sglang"] == score["vllm"]:
        return None
    return best


def _parsers() -> dict[str, LineParser]:
    from kvforensics.loaders import sglang, vllm

    return {"sglang": sglang.parse_lines, "vllm": vllm.parse_lines}


InstanceNamer = Callable[[Mapping[str, str] | None], str]
"""Names the instance of a record from its envelope labels (None: the file's own name). Raises
KeyError when the template names a label the record does not carry."""


@dataclass
class EngineFileParse:
    """One engine log file: a parse per engine instance it holds, and what belongs to the file."""

    envelope: str  # "none" or one of kvforensics.loaders.envelopes.ENVELOPES
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
        return [e for parse in self.instances.values() for e in parse.events]

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
        return EngineLogParse(startups=self.startups, events=self.events, quarantined=self.all_quarantined(),
                              lines_read=self.lines_read, notes=self.all_notes())


def parse_engine_log(
    path: Path,
    *,
    fmt: Literal["sglang", "vllm", "auto"] | str,
    instance: str | InstanceNamer,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
    envelope: str = "none",
) -> EngineLogParse:
    """Parse one engine log file (plain, .gz or .zst) into start-ups, events and quarantined lines.

    ``fmt`` is ``"sglang"``, ``"vllm"`` or ``"auto"`` (decided from the first 200 lines).
    ``tz`` is the zone the engine's naive timestamps are in; ``year`` is needed for vLLM stamps
    (``MM-DD HH:MM:SS``); ``clock_offset_s`` corrects a skewed host clock. ``envelope`` as in
    :func:`parse_engine_file`; the instances of a file in an envelope are merged into one parse
    (each record keeps its instance).
    """
    return parse_engine_file(path, fmt=fmt, instance=instance, tz=tz, year=year, clock_offset_s=clock_offset_s,
                             envelope=envelope).merged()


def parse_engine_file(
    path: Path,
    *,
    fmt: Literal["sglang", "vllm", "auto"] | str,
    instance: str | InstanceNamer,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
    envelope: str = "auto",
) -> EngineFileParse:
    """Parse one engine log file into one :class:`EngineLogParse` per engine instance it holds.

    ``envelope`` is ``"none"`` (the engine's own lines, streamed), ``"auto"`` (recognised from the
    first lines) or one of :data:`kvforensics.loaders.envelopes.ENVELOPES`. In an envelope, the
    envelope's clock is the time of each line (the engine's stamp is compared with it and a
    disagreement reported), records are sorted by it per instance (stably, whatever the export's
    order), and every line number in the result is the file's physical line. ``instance`` is the
    instance's name, or a function naming it from a record's labels (:data:`InstanceNamer`).
    """
    parsers = _parsers()
    if fmt not in (*parsers, "auto"):
        raise InputError(
            f"unknown engine log format {fmt!r}; use one of: {', '.join(parsers)} or auto",
            location=str(path),
        )
    from kvforensics.loaders.envelopes import ENVELOPES, sniff_envelope

    if envelope not in ("auto", "none", *ENVELOPES):
        raise InputError(
            f"unknown engine log envelope {envelope!r}; use one of: auto, none, {', '.join(ENVELOPES)}",
            location=str(path),
        )
    namer: InstanceNamer = (lambda _labels: instance) if isinstance(instance, str) else instance
    stream = open_lines(path)
    try:
        head = list(itertools.islice(stream, SNIFF_LINES))
        if not head:
            result = EngineFileParse(envelope="none", notes=["empty file: no lines to read"])
        else:
            found = sniff_envelope(head) if envelope == "auto" else envelope
            lines = itertools.chain(head, stream)
            if found == "none":
                name = namer(None)
                parse = parsers[_engine_format(fmt, [t for _, t, _ in head], path)](
                    lines, instance=name, tz=tz, year=year, clock_offset_s=clock_offset_s
                )
                result = EngineFileParse(envelope="none", instances={name: parse}, lines_read=parse.lines_read)
            else:
                from kvforensics.loaders.envelopes import parse_enveloped

                result = parse_enveloped(
                    found, lines, fmt=lambda texts: _engine_format(fmt, texts, path), parsers=parsers,
                    namer=namer, tz=tz, year=year, clock_offset_s=clock_offset_s,
                )
                result.lines_read = stream.lines_yielded
                if envelope != "auto" and not result.instances and result.quarantined:
                    looks = sniff_envelope(head)
                    raise InputError(
                        f"no record of this file could be read as a {envelope} export"
                        + (f" (its first lines look like {looks})" if looks != envelope else "")
                        + ": check the source's envelope setting, or set envelope = \"auto\"",
                        location=str(path),
                    )
                if envelope == "auto":
                    result.notes.insert(0, f"read as a {found} export (recognised from its first lines)")
    finally:
        stream.close()
    _add_truncation(result, stream)
    return result


def _engine_format(fmt: str, texts: Iterable[str | None], path: Path) -> str:
    if fmt != "auto":
        return fmt
    head = list(itertools.islice(texts, SNIFF_LINES))
    sniffed = sniff_format(head)
    if sniffed is None:
        raise InputError(
            "cannot tell whether this is an SGLang or a vLLM log from its first "
            f'{len(head)} lines; set format = "sglang" or "vllm" for this source',
            location=str(path),
        )
    return sniffed


def _add_truncation(parse: EngineFileParse, stream: LineStream) -> None:
    t = stream.truncated
    if t is None:
        return
    add_note(parse.notes, t.describe())
    if t.partial_tail:
        parse.lines_read += 1
        parse.quarantined.append(
            QuarantinedLine(
                line=t.after_line + 1,
                reason=f"incomplete last line: {t.compression} stream truncated",
                raw=raw_for_quarantine(t.partial_tail),
            )
        )
