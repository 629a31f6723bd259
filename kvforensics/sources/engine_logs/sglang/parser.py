"""SGLang engine logs -> start-ups (KV pool, context length, role, version, flags) and request events.

Every envelope SGLang has used is read (``docs``: /work/shared/reference/engine-log-formats.md §1):

* ``[gpu=0] msg``                          <= 0.2.x, no timestamp at all
* ``[HH:MM:SS TP0] msg``                   0.2.15, a time but no date
* ``[YYYY-MM-DD HH:MM:SS TP0] msg``        0.3.x - 0.4.6 (TP0 even when tp=1)
* ``[YYYY-MM-DD HH:MM:SS DP1 PP0 TP1] msg``   rank suffixes only when the size is > 1 (>= 0.4.10)
* ``[YYYY-MM-DD HH:MM:SS.mmm ...] msg``    with SGLANG_LOG_MS
* no prefix (prints, tracebacks), Ray's ``(SGLangWorker pid=N) `` and Docker's RFC3339 prefix,
  ANSI colour codes.

A start-up begins at a ``server_args=`` line, or, when there is none, at the first start-up line
(weights, KV pool, CUDA graph ...) after the previous start-up's "fired up" line or the start of
the file. SGLang never logs its version at start-up: it is read from ``sglang version:`` lines and
install paths when present, and otherwise inferred from format features (§1.7).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from kvforensics.sources.engine_logs.clock import DockerSkewCheck, LocalClock
from kvforensics.sources.engine_logs.contract import (
    EngineEvent,
    EngineLine,
    EngineLogParse,
    PrefillBatch,
    QuarantinedLine,
    add_note,
    add_reading_notes,
    raw_for_quarantine,
    truncate_detail,
    unreadable_reason,
)
from kvforensics.sources.engine_logs.fields import parse_repr_fields
from kvforensics.sources.engine_logs.lines import contains_any, split_outer_prefixes
from kvforensics.sources.engine_logs.sglang.batches import BATCH_NEEDLE, BatchRefusal, match_prefill_batch
from kvforensics.sources.engine_logs.sglang.events import OTHER_EVENT_NEEDLES, match_event
from kvforensics.sources.engine_logs.sglang.startup import ENGINE, SglangStartup, startup_record
from kvforensics.sources.engine_logs.sglang.versions import VERSION_LINES
from kvforensics.sources.engine_logs.shutdown import SHUTDOWN_NEEDLES, shutdown_reason

__all__ = [
    "BATCH_LINE_EXCLUDES",
    "ENGINE",
    "LINE_SIGNATURE",
    "ROLE_HINTS",
    "ROLE_HINT_NEEDLES",
    "SELF_CONTAINED_EXCLUDES",
    "RequestRun",
    "SglangParser",
    "parse_lines",
    "rank_tags",
]

# ---------------------------------------------------------------------------------------------
# Envelopes
# ---------------------------------------------------------------------------------------------

_STAMP_ENV = re.compile(
    r"^\[(?:(?P<date>\d{4}-\d{2}-\d{2}) )?(?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,6}))?"
    r"(?P<extra>(?: +[^\]\s]+)*) *\] ?"
)
_GPU_ENV = re.compile(r"^\[gpu=(?P<gpu>\d+)\] ?")
# looks like a stamped line ("[2026-08-2x ...", "[12:3x:00 TP0]") but is not one of the envelopes
_LOOSE_ENV = re.compile(r"^\[\s*(?:\d{2,4}[-/.]\w{1,3}[-/.]\w{1,3}|\d{1,2}:\w{1,2}(?::\w{1,2})?)[^\]]{0,60}\]?")
_RANK_TAG = re.compile(r"\b(DP|PP|ATTN_CP|MOE_DP|TP|EP)(\d+)\b")
# lines that start a record of their own, so cannot continue a wrapped server_args dump
_NOT_A_CONTINUATION = re.compile(r"^(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[: ]|Traceback |\[|sglang version)")


@functools.lru_cache(maxsize=1024)
def rank_tags(extra: str | None) -> tuple[str, int | None, int | None, int | None]:
    """The rank prefix of a stamped line (`` DP1 TP3``) as (``"DP1 TP3"``, tp, dp, pp)."""
    found = _RANK_TAG.findall(extra) if extra else []
    tags = {k: int(v) for k, v in found}
    return " ".join(f"{k}{v}" for k, v in found), tags.get("TP"), tags.get("DP"), tags.get("PP")


@dataclass
class _Line:
    number: int
    ts: datetime | None
    rank: str  # "TP0", "DP1 TP1", "gpu=0" or "" (no rank prefix)
    tp: int | None
    dp: int | None
    pp: int | None
    msg: str
    envelope: str  # "datetime" | "time" | "gpu" | "none"


# ---------------------------------------------------------------------------------------------
# Start-up lines
# ---------------------------------------------------------------------------------------------

_SERVER_ARGS = re.compile(r"\bserver_args=(?=ServerArgs\(|\{)")
_FIRED_UP = re.compile(r"The server is fired up and ready to roll")
_STARTUP_MARKER = re.compile(
    r"Load weight begin|Init torch distributed begin|Load weight end|Using KV cache dtype"
    r"|KV Cache (?:is allocated|VA upper bound)|Memory pool end|max_total_num_tokens="
    r"|Use sliding window memory pool|Capture (?:cuda graph|.*CUDA graph) begin|Post-capture KV sizing"
    r"|KV pool holds \d+ tokens"
)
_STARTUP_NEEDLES = (
    "Load weight",
    "Init torch distributed",
    "KV Cache",
    "Using KV cache dtype",
    "Memory pool end",
    "max_total_num_tokens=",
    "sliding window memory pool",
    "graph begin",
    "Post-capture",
    "KV pool holds",
)
_RESTART_MARKER = re.compile(r"Load weight begin|Init torch distributed begin")
_BATCH_HEADS = (BATCH_NEEDLE, "Decode batch")  # the scheduler's per-batch lines (sglang_batches)
# Messages only SGLang prints, whatever envelope (or none) they come in: a bare line with one of them is an
# SGLang line (engine_common.sniff_format). They are the start-up, batch and request lines above and in
# sglang_batches / sglang_events (reference §1.2-1.4); vLLM prints none of them (vllm_lines.LINE_SIGNATURE).
LINE_SIGNATURE = re.compile(
    r"server_args=(?:ServerArgs\(|\{)|max_total_num_tokens=\d|Load weight (?:begin|end)\. "
    r"|KV Cache (?:is allocated|VA upper bound)\.|Memory pool end\. |The server is fired up and ready to roll"
    r"|Init torch distributed begin\.|Use sliding window memory pool|Capture (?:cuda graph|\w+ CUDA graph) begin"
    r"|^(?:Prefill|Decode) batch(?: ?\[\d+\])?[.,(] |ReqTimeStats\(rid=|Req Time Stats\(rid="
)


ROLE_HINT_NEEDLES = (
    "#bootstrap-req",
    "#inflight-req",
    "#unbootstrapped-req",
    "#transferring-req",
    "CommonKVBootstrapServer",
    "bootstrap failed",
    "transfer failed",
    "End of prefill disaggregation",
    "#prealloc-req",
    "#transfer-req",
    "pre-allocated usage",
    "handshake failed",
)
ROLE_HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"#bootstrap-req|#inflight-req|#unbootstrapped-req|#transferring-req|CommonKVBootstrapServer started"
            r"|Prefill (?:bootstrap|transfer) failed"
            r"|End of prefill disaggregation mode warmup"
        ),
        "prefill",
    ),
    (
        re.compile(r"#prealloc-req|#transfer-req|pre-allocated usage|Decode (?:transfer|handshake) failed"),
        "decode",
    ),
)

"""The role-hint patterns must be RE2 patterns too: the columnar reader runs them in DuckDB."""


@dataclass(frozen=True)
class RequestRun:
    """A run of consecutive self-contained ``ReqTimeStats`` and prefill batch lines read elsewhere
    (engine_columnar.py)."""

    first_line: int
    last_line: int
    first_ts: datetime
    last_ts: datetime
    last_stamp: str  # the stamp text of the last line ("2026-08-27 10:00:00.123")
    ranks: tuple[tuple[int, str], ...]  # (first line, rank prefix text such as " TP0") per prefix, by line
    first_stats_line: int | None = None  # its first ReqTimeStats line
    role_hint: tuple[str, int, str] | None = None  # its first role hint: (role, line, the text)
    first_cached_batch_line: int | None = None  # its first prefill batch with #cached-token > 0
    first_plain_batch_line: int | None = None  # its first prefill batch without a role hint (PD queue counts)


# Texts that make a line matter to the parser beyond one request event or prefill batch: a line with
# none of them (and a dated stamp, and a ReqTimeStats event or a prefill batch) changes nothing but the
# time and ranks last seen; a prefill batch line may also carry a role hint (ROLE_HINT_NEEDLES), which
# a run hands over (RequestRun.role_hint). The columnar reader (engine_columnar.py) reads only such lines.
_LINE_EXCLUDES = (
    *_STARTUP_NEEDLES,
    *SHUTDOWN_NEEDLES,
    *OTHER_EVENT_NEEDLES,
    "server_args=",
    "fired up",
    "lang",
    "LANG",
    '"event": "request.',
    "\x00",
    "\x1b",
    "\r",
)
SELF_CONTAINED_EXCLUDES = tuple(dict.fromkeys((*_LINE_EXCLUDES, *ROLE_HINT_NEEDLES)))
BATCH_LINE_EXCLUDES = tuple(dict.fromkeys((*_LINE_EXCLUDES, "ReqTimeStats(")))


class SglangParser:
    """Reads one instance's lines in file order: :meth:`feed` each line, then :meth:`finish`."""

    def __init__(self, instance: str, tz: ZoneInfo, clock_offset_s: float) -> None:
        self.instance = instance
        self.clock = LocalClock(tz, clock_offset_s)
        self.skew = DockerSkewCheck()
        self.out = EngineLogParse()
        self.current: SglangStartup | None = None
        self.pending_version: tuple[str, int, str] | None = None
        self.args_continuation: tuple[SglangStartup, list[str], int] | None = None
        self.dedup: dict[tuple[str, str, str], tuple[dict[str, int], list[int]]] = {}
        self.dedup_dropped = 0
        self.undated_time_lines = 0
        self.gpu_lines = 0
        self.nul_lines = 0
        self.last_canary_line = -2
        self.last_ts: datetime | None = None
        self.inherited_ts = 0
        self._last_stamp: tuple[str, datetime | None] = ("", None)

    # -- lines --------------------------------------------------------------------------------

    def feed(self, number: int, text: str | None, raw: bytes) -> None:
        self.out.lines_read += 1
        if text is None:
            self._quarantine(number, unreadable_reason(raw), raw)
            return
        if "\x00" in text:
            stripped = text.replace("\x00", "")
            if not stripped.strip():
                self._quarantine(number, "only NUL bytes (a file hole left by a crash?)", raw)
                return
            self.nul_lines += 1
            text = stripped
        try:
            self._feed_text(number, text, raw)
        except Exception as e:  # noqa: BLE001 - never crash on one bad line: record it and go on
            self._quarantine(number, f"internal parser error ({type(e).__name__}: {e})", raw)

    def _quarantine(self, number: int, reason: str, raw: bytes | str) -> None:
        self.out.quarantined.append(QuarantinedLine(number, reason, raw_for_quarantine(raw)))

    def _envelope(self, number: int, text: str, raw: bytes) -> _Line | None:
        outer = split_outer_prefixes(text)
        rest = outer.rest
        docker_ts = self.clock.shift(outer.docker_ts)
        m = _STAMP_ENV.match(rest)
        if m:
            ts: datetime | None = None
            stamp = rest[1 : m.end("frac") if m["frac"] else m.end("time")]
            envelope = "datetime" if m["date"] else "time"
            if stamp == self._last_stamp[0]:
                ts = self._last_stamp[1]
            else:
                try:
                    time = m["time"]
                    hh, mm, ss = int(time[0:2]), int(time[3:5]), int(time[6:8])
                    if m["date"]:
                        d = m["date"]
                        frac = int((m["frac"] or "0").ljust(6, "0"))
                        local = datetime(int(d[0:4]), int(d[5:7]), int(d[8:10]), hh, mm, ss, frac)
                        ts = self.clock.to_utc(local, number)
                    else:
                        datetime(2000, 1, 1, hh, mm, ss)  # validate the time of day
                except ValueError:
                    self._quarantine(number, f"bad timestamp '{stamp}'", raw)
                    return None
                self._last_stamp = (stamp, ts)
            self.skew.observe(number, ts, outer.docker_ts)
            if ts is None:
                if docker_ts is None:
                    self.undated_time_lines += 1
                ts = docker_ts
            rank, tp, dp, pp = rank_tags(m["extra"])
            return _Line(number, ts, rank, tp, dp, pp, rest[m.end() :], envelope)
        g = _GPU_ENV.match(rest)
        if g:
            if docker_ts is None:
                self.gpu_lines += 1
            return _Line(number, docker_ts, f"gpu={g['gpu']}", int(g["gpu"]), None, None, rest[g.end() :], "gpu")
        loose = _LOOSE_ENV.match(rest)
        if loose:
            self._quarantine(number, f"unrecognised line prefix '{loose.group(0)[:60]}'", raw)
            return None
        return _Line(number, docker_ts, "", None, None, None, rest, "none")

    def _feed_text(self, number: int, text: str, raw: bytes) -> None:
        if self.args_continuation is not None and self._continue_server_args(number, text):
            return
        line = self._envelope(number, text, raw)
        if line is None:
            return
        if line.ts is not None:
            self.last_ts = line.ts
        msg = line.msg

        if "server_args=" in msg and _SERVER_ARGS.search(msg):
            self._server_args(line)
            return
        if contains_any(msg, _STARTUP_NEEDLES) and _STARTUP_MARKER.search(msg):
            self._startup_line(line)
        elif "fired up" in msg and _FIRED_UP.search(msg) and self.current is not None:
            self.current.fired_up_line = self.current.fired_up_line or line.number
        st = self.current
        if st is not None:
            if st.ts is None and line.ts is not None:
                st.ts = line.ts
            st.last_line = line.number
            st.last_ts = line.ts or st.last_ts
            if st.shutdown is None and (why := shutdown_reason(msg)) is not None:
                st.shutdown = (line.number, line.ts or self.last_ts, why)
            if line.rank and line.envelope != "gpu":
                self._ranks(st, line.number, line.tp, line.dp, line.pp)
            if line.envelope == "gpu":
                st.clue("gpu_envelope", line.number)
            elif line.envelope == "time":
                st.clue("time_only_envelope", line.number)
            if st.role_hint is None and st.server_args is None and contains_any(msg, ROLE_HINT_NEEDLES):
                for pattern, role in ROLE_HINTS:
                    hint = pattern.search(msg)
                    if hint:
                        st.role_hint = (role, line.number, hint.group(0))
                        break
            elif (
                st.plain_batch_line is None
                and msg.startswith(_BATCH_HEADS)
                and not contains_any(msg, ROLE_HINT_NEEDLES)
            ):
                st.plain_batch_line = line.number  # a batch line without the PD queue counts: a unified server
        if "lang" in msg or "LANG" in msg:
            self._version_line(line)
        if msg.startswith(BATCH_NEEDLE):
            self._prefill_batch(line, raw)
        self._event(line)

    # -- start-ups ----------------------------------------------------------------------------

    def _new_startup(self, line: _Line) -> SglangStartup:
        self._finish_current()
        st = SglangStartup(line=line.number, ts=line.ts, last_line=line.number, last_ts=line.ts)
        if self.pending_version and line.number - self.pending_version[1] <= 50:
            st.exact_version = self.pending_version
        self.pending_version = None
        self.current = st
        self.dedup.clear()  # rank copies of one message never span a restart
        return st

    def _server_args(self, line: _Line) -> None:
        st = self.current
        # attach to a start-up that began a few lines earlier without server args (out-of-order
        # stdout of the launcher and its subprocesses), otherwise this is a new start-up
        if (
            st is None
            or st.server_args is not None
            or st.fired_up_line is not None
            or st.shutdown is not None
            or st.summary
            or st.kv_allocs
        ):
            st = self._new_startup(line)
        dump = line.msg[_SERVER_ARGS.search(line.msg).end() :]  # type: ignore[union-attr]
        st.server_args_line = line.number
        st.clue("server_args_dict" if dump.startswith("{") else "server_args_repr", line.number)
        fields, complete = parse_repr_fields(dump)
        st.server_args = fields
        if not complete:
            self.args_continuation = (st, [dump], line.number)
        if line.ts is not None and st.ts is None:
            st.ts = line.ts

    def _continue_server_args(self, number: int, text: str) -> bool:
        """Join the continuation lines of a wrapped server_args dump; True if *text* was one."""
        assert self.args_continuation is not None
        st, parts, first = self.args_continuation
        rest = split_outer_prefixes(text).rest
        if _STAMP_ENV.match(rest) or _GPU_ENV.match(rest) or _NOT_A_CONTINUATION.match(rest) or number - first > 50:
            add_note(
                st.notes,
                f"server_args dump at line {first} is cut off; fields after the cut were not read",
            )
            self.args_continuation = None
            return False
        parts.append(rest)
        fields, complete = parse_repr_fields("".join(parts))
        st.server_args = fields
        if complete:
            add_note(st.notes, f"server_args dump at line {first} is wrapped over {len(parts)} lines; joined")
            self.args_continuation = None
        return True

    def _startup_line(self, line: _Line) -> None:
        msg = line.msg
        st = self.current
        if st is None or st.fired_up_line is not None or st.shutdown is not None:
            st = self._new_startup(line)
        else:
            restart = _RESTART_MARKER.search(msg)
            if restart and line.rank in st.summary:
                # the same rank starts loading again after it already printed its pool summary,
                # and no "fired up" line came in between: the previous start-up never finished
                add_note(st.notes, f"ended without a 'fired up' line (next start-up begins at line {line.number})")
                st = self._new_startup(line)
        if st.ts is None and line.ts is not None:
            st.ts = line.ts
        st.read_pool_line(line.number, line.rank, msg)

    @staticmethod
    def _ranks(st: SglangStartup, number: int, tp: int | None, dp: int | None, pp: int | None) -> None:
        for seen, value in ((st.tp_seen, tp), (st.dp_seen, dp), (st.pp_seen, pp)):
            if value is not None:
                seen.setdefault(value, number)

    def _version_line(self, line: _Line) -> None:
        for i, pattern in enumerate(VERSION_LINES):
            m = pattern.search(line.msg)
            if m is None:
                continue
            found = (m["v"], line.number, m.group(0).strip())
            st = self.current
            # "sglang version: X" and check_env print at process start: after a finished start-up
            # they announce the next one; an install path (traceback) belongs to the running one
            announces_next = i < 2 and st is not None and st.fired_up_line is not None
            if st is None or announces_next:
                self.pending_version = found
            elif st.exact_version is None:
                st.exact_version = found
            return

    def _finish_current(self) -> None:
        if self.current is None:
            return
        if self.args_continuation is not None and self.args_continuation[0] is self.current:
            add_note(self.current.notes, f"server_args dump at line {self.args_continuation[2]} is cut off")
            self.args_continuation = None
        self.out.startups.append(startup_record(self.current, instance=self.instance, notes=self.out.notes))
        self.current = None

    def _event(self, line: _Line) -> None:
        msg = line.msg
        found = match_event(msg)
        if found is None:
            return
        kind = found.kind
        if found.clue is not None and self.current is not None:
            self.current.clue(found.clue, line.number)
        if kind == "canary_violation":
            # newer builds print a structured line followed by the older header line: one event
            if "KV cache canary violation detected" in msg and self.last_canary_line == line.number - 1:
                return
            self.last_canary_line = line.number
        if found.request_id is None and line.tp is not None and self._duplicate_across_ranks(kind, line):
            return
        limit = found.limit_tokens
        if limit is not None and self.current is not None and "maximum allowed length" in msg:
            self.current.abort_limits.append((limit, line.number))
        ts = line.ts
        if ts is None and line.envelope == "none" and self.last_ts is not None:
            ts = self.last_ts  # a traceback / continuation line: the time of the line it follows
            self.inherited_ts += 1
        self.out.events.append(
            EngineEvent(
                instance=self.instance,
                ts=ts,
                line=line.number,
                kind=kind,
                request_id=found.request_id,
                prompt_tokens=found.prompt_tokens,
                limit_tokens=limit,
                detail=truncate_detail(msg),
                cached_tokens=found.cached_tokens,
            )
        )

    def _prefill_batch(self, line: _Line, raw: bytes) -> None:
        found = match_prefill_batch(line.msg)
        if found is None:
            return
        if isinstance(found, BatchRefusal):
            self._quarantine(line.number, found.reason, raw)
            return
        if found.cached_token > 0 and self.current is not None and self.current.cached_batch_line is None:
            self.current.cached_batch_line = line.number
        self.out.prefill_batches.append(
            PrefillBatch(
                instance=self.instance,
                ts=line.ts,
                line=line.number,
                new_seq=found.new_seq,
                new_token=found.new_token,
                cached_token=found.cached_token,
                running_req=found.running_req,
                queue_req=found.queue_req,
                token_usage=found.token_usage,
                role=found.role,
                ranks=line.rank,
            )
        )

    def _duplicate_across_ranks(self, kind: str, line: _Line) -> bool:
        """Every TP rank of one replica sees the same requests in the same order, and older builds
        (0.4.3-0.4.6) log the same rid-less error on each of them: the k-th copy of a message from
        any TP rank of a replica is one event."""
        key = (kind, f"DP{line.dp}" if line.dp is not None else "", line.msg)
        per_rank, emitted = self.dedup.setdefault(key, ({}, [0]))
        count = per_rank.get(line.rank, 0) + 1
        per_rank[line.rank] = count
        if count > emitted[0]:
            emitted[0] = count
            return False
        self.dedup_dropped += 1
        return True

    # -- end ----------------------------------------------------------------------------------

    def feed_request_run(self, run: RequestRun) -> None:
        """Take in a run of self-contained ``ReqTimeStats`` and prefill batch lines read elsewhere.

        Valid only after the line before the run went through :meth:`feed` and for dated lines
        without any of :data:`SELF_CONTAINED_EXCLUDES` (prefill batch lines: of :data:`BATCH_LINE_EXCLUDES`):
        then each line changes only the time last seen, the start-up's last line, the ranks it has
        seen, its first role hint and its first prefix-cache hit, as :meth:`feed` would.
        """
        self.out.lines_read += run.last_line - run.first_line + 1
        st = self.current
        if st is not None:
            for number, extra in run.ranks:
                _rank, tp, dp, pp = rank_tags(extra)
                self._ranks(st, number, tp, dp, pp)
            if st.ts is None:
                st.ts = run.first_ts
            if run.first_stats_line is not None:
                st.clue("req_time_stats_new", run.first_stats_line)
            if st.role_hint is None and st.server_args is None and run.role_hint is not None:
                st.role_hint = run.role_hint
            if st.plain_batch_line is None:
                st.plain_batch_line = run.first_plain_batch_line
            if st.cached_batch_line is None:
                st.cached_batch_line = run.first_cached_batch_line
            st.last_line, st.last_ts = run.last_line, run.last_ts
        self.last_ts = run.last_ts
        self._last_stamp = (run.last_stamp, run.last_ts)

    def finish(self) -> EngineLogParse:
        self._finish_current()
        notes = self.out.notes
        if self.undated_time_lines:
            add_note(
                notes,
                f"{self.undated_time_lines} line(s) carry a time but no date ([HH:MM:SS TPn], SGLang 0.2.x); "
                "their timestamps are left empty",
            )
        if self.gpu_lines:
            add_note(notes, f"{self.gpu_lines} line(s) in the [gpu=N] format carry no timestamp; left empty")
        if self.dedup_dropped:
            add_note(
                notes,
                f"{self.dedup_dropped} copies of rid-less error lines printed by several TP ranks were counted once",
            )
        add_reading_notes(
            notes, inherited_ts=self.inherited_ts, nul_lines=self.nul_lines, clock=self.clock, skew=self.skew
        )
        return self.out


def parse_lines(
    lines: Iterable[EngineLine],
    *,
    instance: str,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
) -> EngineLogParse:
    """Parse SGLang log lines (as yielded by :func:`~kvforensics.sources.engine_logs.parse.open_lines`).

    ``year`` is accepted for symmetry with vLLM and unused: SGLang stamps carry a date, or none.
    """
    del year
    parser = SglangParser(instance, tz, clock_offset_s)
    for number, text, raw in lines:
        parser.feed(number, text, raw)
    return parser.finish()
