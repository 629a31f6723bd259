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

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo

from kvforensics.loaders.engine_common import (
    DockerSkewCheck,
    EngineEvent,
    EngineLine,
    EngineLogParse,
    LocalClock,
    PoolReport,
    PoolReports,
    QuarantinedLine,
    StartupRecord,
    add_note,
    add_reading_notes,
    as_int,
    contains_any,
    flag_value,
    parse_repr_fields,
    raw_for_quarantine,
    split_outer_prefixes,
    truncate_detail,
)
from kvforensics.loaders.shutdown import shutdown_reason

ENGINE = "sglang"

# ---------------------------------------------------------------------------------------------
# Envelopes
# ---------------------------------------------------------------------------------------------

_STAMP_ENV = re.compile(
    r"^\[(?:(?P<date>\d{4}-\d{2}-\d{2}) )?(?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,6}))?"
    r"(?P<extra>(?: +[^\]\s]+)*) *\] ?"
)
_GPU_ENV = re.compile(r"^\[gpu=(?P<gpu>\d+)\] ?")
# looks like a stamped line ("[2026-08-2x ...", "[12:3x:00 TP0]") but is not one of the envelopes
_LOOSE_ENV = re.compile(
    r"^\[\s*(?:\d{2,4}[-/.]\w{1,3}[-/.]\w{1,3}|\d{1,2}:\w{1,2}(?::\w{1,2})?)[^\]]{0,60}\]?"
)
_RANK_TAG = re.compile(r"\b(DP|PP|ATTN_CP|MOE_DP|TP|EP)(\d+)\b")
# lines that start a record of their own, so cannot continue a wrapped server_args dump
_NOT_A_CONTINUATION = re.compile(
    r"^(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[: ]|Traceback |\[|sglang version)"
)


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
_SUMMARY = re.compile(r"\bmax_total_num_tokens=(?P<tokens>\d+)")
_KEY_VALUES = re.compile(r"\b(\w+)=([^,\s]+)")
_KV_ALLOC_BODY = r"KV Cache (?P<state>is allocated|VA upper bound)\.\s*(?:dtype: (?P<dtype>[^,]+),\s*)?(?:#tokens: (?P<tokens>\d+))?"
# "{cache_name} is allocated": cache_name is "KV Cache" or "{allocation_label} KV Cache"; the label
# is only read when the message starts with it (an unknown outer prefix must not pass for a label)
_KV_ALLOC_LABELLED = re.compile(
    r"^(?:(?P<label>[A-Za-z][\w\-]*(?: [A-Za-z][\w\-]*){0,2}) )?" + _KV_ALLOC_BODY
)
_KV_ALLOC = re.compile(_KV_ALLOC_BODY)
_POST_CAPTURE_ALLOC = re.compile(
    r"Post-capture KV sizing: KV cache allocated\. dtype: (?P<dtype>[^,]+), #tokens: (?P<tokens>\d+)"
)
_SWA_POOL = re.compile(
    r"(?:Post-capture KV sizing:|Use sliding window memory pool\.) full_layer_tokens=(?P<full>\d+), swa_layer_tokens=(?P<swa>\d+)"
)
_ALL_SWA_POOL = re.compile(r"Use sliding window memory pool \(all SWA\)\. swa_layer_tokens=(?P<swa>\d+)")
_POOL_WARNING = re.compile(r"KV pool holds (?P<pool>\d+) tokens, fewer than --context-length (?P<ctx>\d+)")

_VERSION_LINES = (
    re.compile(
        r"\bsglang version:\s*v?(?P<v>\d+\.\d+(?:\.\d+)?(?:\.post\d+|rc\d+|\.dev\d+)?)", re.IGNORECASE
    ),
    re.compile(r"^\s*sglang:\s*(?P<v>\d+\.\d+\.\d+(?:\.post\d+|rc\d+|\.dev\d+)?)\s*$"),  # check_env
    re.compile(r"\bsglang(?:==|-)v?(?P<v>\d+\.\d+\.\d+(?:\.post\d+|rc\d+|\.dev\d+)?)(?=[/\s.'\")]|$)"),
)

_ROLE_HINT_NEEDLES = (
    "#bootstrap-req",
    "#inflight-req",
    "CommonKVBootstrapServer",
    "bootstrap failed",
    "transfer failed",
    "End of prefill disaggregation",
    "#prealloc-req",
    "#transfer-req",
    "pre-allocated usage",
    "handshake failed",
)
_ROLE_HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"#bootstrap-req|#inflight-req|CommonKVBootstrapServer started|Prefill (?:bootstrap|transfer) failed"
            r"|End of prefill disaggregation mode warmup"
        ),
        "prefill",
    ),
    (
        re.compile(r"#prealloc-req|#transfer-req|pre-allocated usage|Decode (?:transfer|handshake) failed"),
        "decode",
    ),
)

# server args kept as flags: these names, plus names containing one of the fragments, plus
# enable_* switches that are on
_FLAG_KEYS = (
    "model_path",
    "served_model_name",
    "tp_size",
    "dp_size",
    "pp_size",
    "context_length",
    "max_total_tokens",
    "mem_fraction_static",
    "page_size",
    "chunked_prefill_size",
    "max_running_requests",
    "allow_auto_truncate",
    "disaggregation_mode",
    "disaggregation_transfer_backend",
    "enable_dp_attention",
    "log_requests",
    "log_requests_level",
    "kv_cache_dtype",
)
_FLAG_FRAGMENTS = ("checksum", "canary", "defer", "release", "mooncake", "transfer", "disaggregation_")

# ---------------------------------------------------------------------------------------------
# Version inference from format features (reference §1.7). Bounds are exclusive at the nearest
# release read that lacked (or still had) the feature, so the range never claims more than known.
# ---------------------------------------------------------------------------------------------

_Version = tuple[int, ...]


@dataclass(frozen=True)
class _Clue:
    label: str
    low: _Version | None = None
    low_inclusive: bool = False
    high: _Version | None = None
    high_inclusive: bool = False


_CLUES: dict[str, _Clue] = {
    "gpu_envelope": _Clue("[gpu=N] envelope", high=(0, 2, 15)),
    "time_only_envelope": _Clue("[HH:MM:SS TPn] envelope", high=(0, 3, 6)),
    "tp_tag_on_tp1": _Clue("TP0 suffix on a tp_size=1 server", high=(0, 4, 6), high_inclusive=True),
    "summary_no_chunked": _Clue("max_total_num_tokens line without chunked_prefill_size", high=(0, 4, 3)),
    "summary_no_avail": _Clue(
        "max_total_num_tokens line without available_gpu_mem", low=(0, 3, 6), high=(0, 4, 10)
    ),
    "summary_avail": _Clue("available_gpu_mem in the max_total_num_tokens line", low=(0, 4, 6)),
    "kv_no_tokens": _Clue("KV Cache line without #tokens", low=(0, 3, 6), high=(0, 4, 4)),
    "kv_tokens_no_dtype": _Clue("KV Cache line with #tokens but no dtype", low=(0, 4, 3), high=(0, 5, 15)),
    "kv_dtype": _Clue("dtype: in the KV Cache line", low=(0, 5, 9)),
    "req_time_stats_old": _Clue("'Req Time Stats(... input len=...)'", low=(0, 4, 6), high=(0, 5, 15)),
    "req_time_stats_new": _Clue("'ReqTimeStats(... input_len=...)'", low=(0, 5, 9)),
    "server_args_repr": _Clue("server_args=ServerArgs(...)", high=(0, 5, 20)),
    "server_args_dict": _Clue("server_args={...} dict", low=(0, 5, 15)),
}


def _vstr(v: _Version) -> str:
    return ".".join(str(x) for x in v)


def _infer_version(clues: Iterable[str]) -> tuple[str | None, list[str]]:
    """Intersect the version ranges of the clues seen; (specifier, labels) or (None, labels)."""
    low: _Version | None = None
    low_inc = False
    high: _Version | None = None
    high_inc = False
    labels = []
    for key in clues:
        c = _CLUES[key]
        labels.append(c.label)
        if c.low is not None and (low is None or c.low > low or (c.low == low and not c.low_inclusive)):
            low, low_inc = c.low, c.low_inclusive
        if c.high is not None and (
            high is None or c.high < high or (c.high == high and not c.high_inclusive)
        ):
            high, high_inc = c.high, c.high_inclusive
    if not labels:
        return None, labels
    if low is not None and high is not None and (low > high or (low == high and not (low_inc and high_inc))):
        return None, labels
    parts = []
    if low is not None:
        parts.append(f"{'>=' if low_inc else '>'}{_vstr(low)}")
    if high is not None:
        parts.append(f"{'<=' if high_inc else '<'}{_vstr(high)}")
    return ",".join(parts), labels


# ---------------------------------------------------------------------------------------------
# Request events
# ---------------------------------------------------------------------------------------------

_SELF_RID = re.compile(r"\bself\.rid=(?:'(?P<a>[^']*)'|\"(?P<b>[^\"]*)\"|(?P<c>[^\s,]+))")
_REQ_RID = re.compile(r"\b(?:decode_req\.)?req\.rid=(?:'(?P<a>[^']*)'|\"(?P<b>[^\"]*)\"|(?P<c>[^\s,]+))")
_ANY_RID = re.compile(r"\brid=(?:'(?P<a>[^']*)'|\"(?P<b>[^\"]*)\"|(?P<c>[\w.:\-]+))")
_REQUEST_LOG = re.compile(r"^(?:Receive(?: OpenAI)?: obj=|Finish: obj=|in=)|\"event\": \"request\.")


def _rid(m: re.Match[str] | None) -> str | None:
    if m is None:
        return None
    return m["a"] if m["a"] is not None else m["b"] if m["b"] is not None else m["c"]


@dataclass(frozen=True)
class _EventRule:
    kind: str
    needles: tuple[str, ...]  # one of these literals is in every line the pattern matches (fast filter)
    pattern: re.Pattern[str]
    prompt: str | None = None  # group name for prompt_tokens
    limit: str | None = None  # group name for limit_tokens
    rid: str | None = None  # group name for the request id (else self.rid= / req.rid= / rid=)


_EVENT_RULES: tuple[_EventRule, ...] = (
    _EventRule(
        "abort_input_too_long",
        ("Input length (",),
        re.compile(
            r"Input length \((?P<n>\d+) tokens\) exceeds the maximum allowed length \((?P<m>\d+) tokens\)"
        ),
        "n",
        "m",
    ),
    _EventRule(
        "abort_input_too_long",
        ("exceeds the maximum number of tokens",),
        re.compile(r"Request (?P<rid>\S+) exceeds the maximum number of tokens: (?P<n>\d+) > (?P<m>\d+)"),
        "n",
        "m",
        "rid",
    ),
    _EventRule(
        "abort_input_too_long",
        ("Multimodal prompt is too long",),
        re.compile(
            r"Multimodal prompt is too long after expanding multimodal tokens\..*?=> (?P<n>\d+) >= (?P<m>\d+)"
        ),
        "n",
        "m",
    ),
    _EventRule(
        "input_truncated",
        ("longer than the model's context length",),
        re.compile(
            r"The input \((?P<n>\d+) tokens\) is longer than the model's context length \((?P<m>\d+) tokens\)\."
            r" Truncating"
        ),
        "n",
        "m",
    ),
    _EventRule(
        "abort_input_too_long",
        ("longer than the model's context length",),
        re.compile(
            r"The input \((?P<n>\d+) tokens\) is longer than the model's context length \((?P<m>\d+) tokens\)"
        ),
        "n",
        "m",
    ),
    _EventRule(
        "input_truncated",
        ("Request length is longer than the KV cache pool",),
        re.compile(
            r"Request length is longer than the KV cache pool size or the max context length\. Truncated"
            r"(?:.*?len\(req\.origin_input_ids\)=(?P<n>\d+), max_req_input_len=(?P<m>\d+))?"
        ),
        "n",
        "m",
    ),
    _EventRule(
        "abort_other",
        ("Requested token count exceeds",),
        re.compile(
            r"Requested token count exceeds the model's maximum context length of (?P<m>\d+) tokens\. "
            r"You requested a total of \d+ tokens: (?P<n>\d+) tokens from the input messages"
        ),
        "n",
        "m",
    ),
    _EventRule(
        "abort_other",
        ("requires too many SWA KV tokens",),
        re.compile(
            r"Request (?P<rid>\S+) requires too many SWA KV tokens for decode preallocation: \d+ > (?P<m>\d+)"
        ),
        None,
        "m",
        "rid",
    ),
    _EventRule(
        "abort_other",
        ("FULL/SWA KV byte budget",),
        re.compile(r"Request (?P<rid>\S+) exceeds the unified FULL/SWA KV byte budget"),
        rid="rid",
    ),
    _EventRule(
        "checksum_mismatch",
        ("KV checksum mismatch",),
        re.compile(r"KV checksum mismatch req=(?P<rid>\S+)"),
        rid="rid",
    ),
    _EventRule(
        "context_corruption",
        ("Context corruption detected",),
        re.compile(r"Context corruption detected: Request (?P<rid>\S+)"),
        rid="rid",
    ),
    _EventRule(
        "transfer_failure",
        (" failed for request",),
        re.compile(r"(?:Prefill (?:bootstrap|transfer)|Decode (?:handshake|transfer)) failed for request"),
    ),
    _EventRule(
        "transfer_failure",
        ("Metadata unexpectedly not ready",),
        re.compile(r"Metadata unexpectedly not ready after readiness gate: request (?P<rid>[^,\s]+)"),
        rid="rid",
    ),
    _EventRule(
        "transfer_failure",
        (
            "KVTransferError(",
            "Lost connection with prefill",
            "Session ",
            "Failed to send kv chunk",
            "AUX_DATA length mismatch",
            "Prefill transfer kvcache error",
        ),
        re.compile(
            r"KVTransferError\(bootstrap_room=|Lost connection with prefill instance|Session \S+ failed\."
            r"|Failed to send kv chunk of |AUX_DATA length mismatch for bootstrap_room"
            r"|Prefill transfer kvcache error"
        ),
    ),
    _EventRule(
        "canary_violation",
        ("kv_canary violation", "KV cache canary violation"),
        re.compile(r"kv_canary violation: |KV cache canary violation detected"),
    ),
    _EventRule(
        "abort_other",
        ("retract_decode: aborted",),
        re.compile(r"retract_decode: aborted request (?P<rid>[^\s:]+)"),
        rid="rid",
    ),
    _EventRule(
        "abort_other",
        ("Out of memory even after retracting", "Retracted under decode memory pressure"),
        re.compile(
            r"Out of memory even after retracting all other requests"
            r"|Retracted under decode memory pressure without a KV backup"
        ),
    ),
)
_REQ_TIME_STATS_NEEDLES = ("ReqTimeStats(", "Req Time Stats(")
_GENERIC_ABORT_NEEDLES = ("bort", "BORT")
_EVENT_NEEDLES = tuple(
    dict.fromkeys(
        [n for rule in _EVENT_RULES for n in rule.needles]
        + [*_REQ_TIME_STATS_NEEDLES, *_GENERIC_ABORT_NEEDLES]
    )
)
_GENERIC_ABORT = re.compile(r"(?i)\babort|FINISH_ABORT")
_REQ_TIME_STATS_NEW = re.compile(r"ReqTimeStats\((?P<body>[^)]*)\)")
_REQ_TIME_STATS_OLD = re.compile(
    r"Req Time Stats\(rid=(?P<rid>[^,]*),(?: bootstrap_room=[^,]*,)? input len=(?P<n>\d+), output len=(?P<out>\d+)"
)


# ---------------------------------------------------------------------------------------------
# One start-up being read
# ---------------------------------------------------------------------------------------------


@dataclass
class _KvAlloc:
    line: int
    rank: str
    tokens: int
    source: str
    label: str


@dataclass
class _Startup:
    line: int
    ts: datetime | None
    server_args: dict[str, object] | None = None
    server_args_line: int | None = None
    fired_up_line: int | None = None
    summary: dict[str, tuple[int, dict[str, str]]] = field(default_factory=dict)  # rank -> (line, values)
    kv_allocs: list[_KvAlloc] = field(default_factory=list)
    swa: list[tuple[int, str, int, int]] = field(default_factory=list)  # line, rank, full, swa
    all_swa: tuple[int, int] | None = None
    pool_warning: tuple[int, int, int, str] | None = None  # pool, ctx, line, rank
    va_upper_bound: int | None = None
    clues: dict[str, int] = field(default_factory=dict)
    exact_version: tuple[str, int, str] | None = None
    tp_seen: dict[int, int] = field(default_factory=dict)  # tp index -> first line
    dp_seen: dict[int, int] = field(default_factory=dict)
    pp_seen: dict[int, int] = field(default_factory=dict)
    role_hint: tuple[str, int, str] | None = None
    abort_limits: list[tuple[int, int]] = field(default_factory=list)  # (limit, line)
    notes: list[str] = field(default_factory=list)
    last_line: int | None = None
    last_ts: datetime | None = None
    shutdown: tuple[int, datetime | None, str] | None = None  # line, time, what it says

    def clue(self, key: str, line: int) -> None:
        self.clues.setdefault(key, line)


class _SglangParser:
    def __init__(self, instance: str, tz: ZoneInfo, clock_offset_s: float) -> None:
        self.instance = instance
        self.clock = LocalClock(tz, clock_offset_s)
        self.skew = DockerSkewCheck()
        self.out = EngineLogParse()
        self.current: _Startup | None = None
        self.pending_version: tuple[str, int, str] | None = None
        self.args_continuation: tuple[_Startup, list[str], int] | None = None
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
            self._quarantine(number, "not UTF-8", raw)
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
            found = _RANK_TAG.findall(m["extra"]) if m["extra"] else []
            tags = {k: int(v) for k, v in found}
            rank = " ".join(f"{k}{v}" for k, v in found)
            return _Line(
                number, ts, rank, tags.get("TP"), tags.get("DP"), tags.get("PP"), rest[m.end() :], envelope
            )
        g = _GPU_ENV.match(rest)
        if g:
            if docker_ts is None:
                self.gpu_lines += 1
            return _Line(
                number, docker_ts, f"gpu={g['gpu']}", int(g["gpu"]), None, None, rest[g.end() :], "gpu"
            )
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
                self._ranks(st, line)
            if line.envelope == "gpu":
                st.clue("gpu_envelope", line.number)
            elif line.envelope == "time":
                st.clue("time_only_envelope", line.number)
            if st.role_hint is None and st.server_args is None and contains_any(msg, _ROLE_HINT_NEEDLES):
                for pattern, role in _ROLE_HINTS:
                    hint = pattern.search(msg)
                    if hint:
                        st.role_hint = (role, line.number, hint.group(0))
                        break
        if "lang" in msg or "LANG" in msg:
            self._version_line(line)
        if contains_any(msg, _EVENT_NEEDLES) and not _REQUEST_LOG.search(msg):
            self._event(line)

    # -- start-ups ----------------------------------------------------------------------------

    def _new_startup(self, line: _Line) -> _Startup:
        self._finish_current()
        st = _Startup(line=line.number, ts=line.ts, last_line=line.number, last_ts=line.ts)
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
        if (
            _STAMP_ENV.match(rest)
            or _GPU_ENV.match(rest)
            or _NOT_A_CONTINUATION.match(rest)
            or number - first > 50
        ):
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
                add_note(
                    st.notes, f"ended without a 'fired up' line (next start-up begins at line {line.number})"
                )
                st = self._new_startup(line)
        if st.ts is None and line.ts is not None:
            st.ts = line.ts

        m = _SUMMARY.search(msg)
        if m:
            values = dict(_KEY_VALUES.findall(msg))
            st.summary[line.rank] = (line.number, values)
            if "chunked_prefill_size" not in values:
                st.clue("summary_no_chunked", line.number)
            elif "available_gpu_mem" in values or "available_cpu_mem" in values:
                st.clue("summary_avail", line.number)
            else:
                st.clue("summary_no_avail", line.number)
            return
        m = _POST_CAPTURE_ALLOC.search(msg)
        if m:
            st.kv_allocs.append(
                _KvAlloc(line.number, line.rank, int(m["tokens"]), "Post-capture KV sizing", "")
            )
            st.clue("kv_dtype", line.number)
            return
        m = _SWA_POOL.search(msg)
        if m:
            st.swa.append((line.number, line.rank, int(m["full"]), int(m["swa"])))
            return
        m = _ALL_SWA_POOL.search(msg)
        if m:
            st.all_swa = (int(m["swa"]), line.number)
            return
        m = _POOL_WARNING.search(msg)
        if m:
            st.pool_warning = (int(m["pool"]), int(m["ctx"]), line.number, line.rank)
            return
        m = _KV_ALLOC_LABELLED.match(msg) or _KV_ALLOC.search(msg)
        if m:
            if m["dtype"]:
                st.clue("kv_dtype", line.number)
            elif m["tokens"]:
                st.clue("kv_tokens_no_dtype", line.number)
            elif "K size:" in msg or "KV size:" in msg:
                st.clue("kv_no_tokens", line.number)
            if m["tokens"] is None:
                return
            tokens = int(m["tokens"])
            if m["state"] == "VA upper bound":
                st.va_upper_bound = tokens
                return
            label = m.groupdict().get("label") or ""
            st.kv_allocs.append(_KvAlloc(line.number, line.rank, tokens, "KV Cache is allocated", label))

    @staticmethod
    def _ranks(st: _Startup, line: _Line) -> None:
        for seen, value in ((st.tp_seen, line.tp), (st.dp_seen, line.dp), (st.pp_seen, line.pp)):
            if value is not None:
                seen.setdefault(value, line.number)

    def _version_line(self, line: _Line) -> None:
        for i, pattern in enumerate(_VERSION_LINES):
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
        self.out.startups.append(self._record(self.current))
        self.current = None

    def _record(self, st: _Startup) -> StartupRecord:
        args = st.server_args or {}
        flags: dict[str, str] = {}
        evidence: dict[str, int] = {}
        notes = self.out.notes

        def note(text: str) -> None:
            add_note(notes, f"start-up at line {st.line}: {text}")

        for n in st.notes:
            note(n)
        if st.server_args_line is not None:
            evidence["server_args"] = st.server_args_line
            for key, value in args.items():
                lowered = key.lower()
                if (
                    key in _FLAG_KEYS
                    or any(f in lowered for f in _FLAG_FRAGMENTS)
                    or (lowered.startswith("enable_") and value not in (False, None, 0, "", [], {}))
                ):
                    flags[key] = flag_value(value)
        if st.fired_up_line is not None:
            evidence["fired_up"] = st.fired_up_line

        # role
        mode = args.get("disaggregation_mode")
        if mode is not None and st.server_args_line is not None:
            role = {"prefill": "prefill", "decode": "decode"}.get(str(mode), "unified")
            if str(mode) not in ("null", "prefill", "decode", "None"):
                note(f"unknown disaggregation_mode {mode!r}; read as unified")
            evidence["role"] = st.server_args_line
        elif st.role_hint is not None:
            role, hint_line, why = st.role_hint
            evidence["role"] = hint_line
            flags["role_source"] = f"inferred from '{why}'"
            note(f"role {role} inferred from '{why}' at line {hint_line} (no server_args line)")
        else:
            role = "unified"
            if st.server_args_line is None:
                flags["role_source"] = "default (no server_args line)"

        # model
        model = None
        for key in ("served_model_name", "model_path"):
            value = args.get(key)
            if isinstance(value, list | tuple) and value:
                value = value[0]
            if isinstance(value, str) and value:
                model = value
                if st.server_args_line is not None:
                    evidence["model"] = st.server_args_line
                break

        # parallelism
        tp_size = as_int(args.get("tp_size"))
        if tp_size is not None and st.server_args_line is not None:
            evidence["tp_size"] = st.server_args_line
        elif st.tp_seen:
            flags["tp_size_source"] = "inferred from rank prefixes (TPn)"
            if max(st.tp_seen) > 0:
                tp_size = max(st.tp_seen) + 1
                evidence["tp_size"] = min(st.tp_seen.values())
            else:  # only TP0 seen: tp=1 on <= 0.4.6, tp > 1 on later builds (an excerpt?)
                flags["tp_size_source"] = "unknown (only TP0 lines and no server_args line)"
        dp_size = as_int(args.get("dp_size"))
        if dp_size is not None and st.server_args_line is not None:
            evidence["dp_size"] = st.server_args_line
        elif st.dp_seen:
            dp_size = max(st.dp_seen) + 1
            evidence["dp_size"] = min(st.dp_seen.values())
            flags["dp_size_source"] = "inferred from rank prefixes (DPn)"
        pp_size = as_int(args.get("pp_size"))
        if pp_size is None and st.pp_seen:
            flags["pp_size"] = str(max(st.pp_seen) + 1)
        if tp_size == 1 and 0 in st.tp_seen and "tp_size_source" not in flags:
            st.clue("tp_tag_on_tp1", st.tp_seen[0])

        # KV pool
        pool = PoolReports()
        for rank, (line_no, values) in st.summary.items():
            tokens = as_int(values.get("max_total_num_tokens"))
            if tokens is not None:
                pool.add(PoolReport(line_no, rank, tokens, "max_total_num_tokens"))
        # hybrid SWA: the full-attention layers bound one request; the SWA pool is recorded only.
        # An allocation line with a count the SWA line gave for swa (and not for full) layers is
        # the SWA pool. Per rank, the last full-pool value wins (post-capture resizes).
        swa_values = {swa for _, _, _, swa in st.swa}
        full_values = {full for _, _, full, _ in st.swa}
        full_pool: list[PoolReport] = []
        if st.swa:
            _, _, last_full, last_swa = st.swa[-1]
            flags["swa_full_layer_tokens"] = str(last_full)
            flags["swa_layer_tokens"] = str(last_swa)
            flags["kv_pool_kind"] = "hybrid SWA (full-attention layer tokens bound one request)"
            full_pool += [PoolReport(ln, rank, full, "full_layer_tokens") for ln, rank, full, _ in st.swa]
        if st.all_swa is not None:
            flags["swa_layer_tokens"] = str(st.all_swa[0])
            flags["kv_pool_kind"] = "all SWA"
        swa_allocs: list[int] = []
        for alloc in st.kv_allocs:
            is_swa = bool(re.search(r"swa|sliding", alloc.label, re.IGNORECASE)) or (
                alloc.tokens in swa_values and alloc.tokens not in full_values
            )
            if is_swa:
                swa_allocs.append(alloc.tokens)
                continue
            if alloc.label and not re.search(r"full", alloc.label, re.IGNORECASE):
                flags[f"kv_pool_{alloc.label.lower().replace(' ', '_')}_tokens"] = str(alloc.tokens)
                continue
            full_pool.append(PoolReport(alloc.line, alloc.rank, alloc.tokens, alloc.source))
        for report in sorted(full_pool, key=lambda r: r.line):
            pool.add(report, group="alloc")
        if any(a.source == "Post-capture KV sizing" for a in st.kv_allocs):
            flags["kv_pool_resized_after_capture"] = "true"
        if st.pool_warning is not None:
            p, _ctx, w_line, w_rank = st.pool_warning
            pool.add(PoolReport(w_line, w_rank, p, "KV pool holds N tokens warning"))
            flags["kv_pool_below_context_warning"] = "true"
        if st.va_upper_bound is not None:
            flags["kv_va_upper_bound_tokens"] = str(st.va_upper_bound)

        best = pool.effective(prefer_source="max_total_num_tokens")
        kv_pool_tokens = best.tokens if best else None
        pool_line = best.line if best else None
        if best is not None:
            evidence["kv_pool_tokens"] = best.line
            flags["kv_pool_reports"] = pool.summary()
            if len({r.tokens for r in pool.reports()}) > 1:
                note(f"ranks report different KV pool sizes ({pool.summary()}); the smallest is used")
        elif st.abort_limits:
            limit, limit_line = st.abort_limits[0]
            ctx_for_limit = self._context_length(st, args)[0]
            if ctx_for_limit is None or limit + 6 < ctx_for_limit:
                kv_pool_tokens, pool_line = limit + 6, limit_line
                evidence["kv_pool_tokens"] = limit_line
                flags["kv_pool_source"] = "implied by an abort limit (maximum allowed length + 6)"
                note(
                    f"no KV pool line; pool {limit + 6} implied by 'maximum allowed length ({limit} tokens)' "
                    f"at line {limit_line} (SGLang rejects prompts >= min(context_len, pool) - 6)"
                )
        if st.kv_allocs and not st.summary and best is not None:
            flags["kv_pool_source"] = "KV Cache is allocated lines (no max_total_num_tokens line)"
        if dp_size is not None and dp_size > 1 and kv_pool_tokens is not None:
            flags["kv_pool_scope"] = f"per DP replica (dp_size={dp_size}); one request can use at most this"
            flags["kv_pool_tokens_x_dp_size"] = str(kv_pool_tokens * dp_size)
        if swa_allocs:
            flags["swa_kv_allocated_tokens"] = str(min(swa_allocs))

        # context length
        context_length, ctx_line = self._context_length(st, args)
        if ctx_line is not None:
            evidence["context_length"] = ctx_line

        # page size
        page_size = as_int(args.get("page_size"))
        if page_size is not None and st.server_args_line is not None:
            evidence["page_size"] = st.server_args_line
        else:
            page_size = 1
            flags["page_size_source"] = "default (not logged; SGLang's default page_size is 1)"
            note("page_size not logged; SGLang's default of 1 assumed")

        # version
        version, version_source = self._version(st, flags, evidence, note)

        return StartupRecord(
            instance=self.instance,
            ts=st.ts,
            line=st.line,
            engine=ENGINE,
            engine_version=version,
            version_source=version_source,
            role=role,
            model=model,
            kv_pool_tokens=kv_pool_tokens,
            pool_source_line=pool_line,
            context_length=context_length,
            page_size=page_size,
            tp_size=tp_size,
            dp_size=dp_size,
            flags=flags,
            evidence=evidence,
            last_line=st.last_line,
            last_ts=st.last_ts,
            shutdown_line=st.shutdown[0] if st.shutdown else None,
            shutdown_ts=st.shutdown[1] if st.shutdown else None,
            shutdown_reason=st.shutdown[2] if st.shutdown else None,
        )

    @staticmethod
    def _context_length(st: _Startup, args: dict[str, object]) -> tuple[int | None, int | None]:
        for line_no, values in sorted(st.summary.values(), key=lambda v: v[0], reverse=True):
            ctx = as_int(values.get("context_len"))
            if ctx is not None:
                return ctx, line_no
        ctx = as_int(args.get("context_length"))
        if ctx is not None:
            return ctx, st.server_args_line
        return None, None

    @staticmethod
    def _version(
        st: _Startup, flags: dict[str, str], evidence: dict[str, int], note: Callable[[str], None]
    ) -> tuple[str | None, str | None]:
        spec, labels = _infer_version(sorted(st.clues, key=lambda k: st.clues[k]))
        if st.exact_version is not None:
            version, line_no, text = st.exact_version
            evidence["engine_version"] = line_no
            flags["version_evidence"] = text
            if labels:
                flags["version_format_clues"] = "; ".join(labels)
            if spec is not None and not _satisfies(version, spec):
                note(
                    f"logged version {version} does not match the format clues ({spec}: {'; '.join(labels)})"
                )
            return version, "log"
        if spec is None:
            if labels:
                note(f"format clues conflict, version not inferred: {'; '.join(labels)}")
            return None, None
        evidence["engine_version"] = min(st.clues.values())
        flags["engine_version_spec"] = spec
        flags["version_evidence"] = "; ".join(labels)
        return f"{spec} (inferred: {'; '.join(labels)})", "inferred from format"

    # -- events -------------------------------------------------------------------------------

    def _event(self, line: _Line) -> None:
        msg = line.msg
        kind = rid = None
        prompt = limit = None
        for rule in _EVENT_RULES:
            if not contains_any(msg, rule.needles):
                continue
            m = rule.pattern.search(msg)
            if m is None:
                continue
            kind = rule.kind
            rid = m[rule.rid] if rule.rid else None
            prompt = int(m[rule.prompt]) if rule.prompt and m[rule.prompt] else None
            limit = int(m[rule.limit]) if rule.limit and m[rule.limit] else None
            break
        if kind is None:
            m_new = _REQ_TIME_STATS_NEW.search(msg)
            m_old = _REQ_TIME_STATS_OLD.search(msg) if m_new is None else None
            if m_new is not None:
                body = dict(re.findall(r"(\w+)=([^,]*)", m_new["body"]))
                kind, rid, prompt = (
                    "req_time_stats",
                    body.get("rid", "").strip() or None,
                    as_int(body.get("input_len")),
                )
                if self.current is not None:
                    self.current.clue("req_time_stats_new", line.number)
            elif m_old is not None:
                kind, rid, prompt = "req_time_stats", m_old["rid"].strip() or None, int(m_old["n"])
                if self.current is not None:
                    self.current.clue("req_time_stats_old", line.number)
            elif _GENERIC_ABORT.search(msg) and (
                _SELF_RID.search(msg) or _REQ_RID.search(msg) or _ANY_RID.search(msg)
            ):
                kind = "abort_other"
            else:
                return
        if kind == "canary_violation":
            # newer builds print a structured line followed by the older header line: one event
            if "KV cache canary violation detected" in msg and self.last_canary_line == line.number - 1:
                return
            self.last_canary_line = line.number
        if rid is None:
            rid = _rid(_SELF_RID.search(msg)) or _rid(_REQ_RID.search(msg))
            if rid is None and kind in ("abort_other", "req_time_stats"):
                rid = _rid(_ANY_RID.search(msg))
        if rid is None and line.tp is not None and self._duplicate_across_ranks(kind, line):
            return
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
                request_id=rid,
                prompt_tokens=prompt,
                limit_tokens=limit,
                detail=truncate_detail(msg),
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
        add_reading_notes(notes, inherited_ts=self.inherited_ts, nul_lines=self.nul_lines, clock=self.clock,
                          skew=self.skew)
        return self.out


def parse_lines(
    lines: Iterable[EngineLine],
    *,
    instance: str,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
) -> EngineLogParse:
    """Parse SGLang log lines (as yielded by :func:`~kvforensics.loaders.engine_common.open_lines`).

    ``year`` is accepted for symmetry with vLLM and unused: SGLang stamps carry a date, or none.
    """
    del year
    parser = _SglangParser(instance, tz, clock_offset_s)
    for number, text, raw in lines:
        parser.feed(number, text, raw)
    return parser.finish()


def _satisfies(version: str, spec: str) -> bool:
    nums = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if nums is None:
        return True
    v = tuple(int(x) for x in nums.groups(default="0"))
    for part in spec.split(","):
        m = re.match(r"(>=|<=|>|<)(.+)", part)
        if m is None:
            continue
        bound = tuple(int(x) for x in m[2].split("."))
        op = m[1]
        if (op == ">=" and not v >= bound) or (op == ">" and not v > bound):
            return False
        if (op == "<=" and not v <= bound) or (op == "<" and not v < bound):
            return False
    return True
