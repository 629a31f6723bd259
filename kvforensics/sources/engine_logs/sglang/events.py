"""SGLang request events: which per-request line reports what (aborts, transfer failures, checksum,
canary and corruption lines, ``ReqTimeStats``), read from the message without its envelope.

:func:`match_event` is stateless; the parser adds what needs the lines around (the start-up a
line belongs to, copies of one message printed by several TP ranks, the time of a line without a
stamp). The columnar reader (:mod:`kvforensics.sources.engine_logs.columnar`) reads the plainest
``ReqTimeStats`` lines in SQL as :func:`match_event` reads them, and leaves every other line to the parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvforensics.sources.engine_logs.fields import as_int
from kvforensics.sources.engine_logs.lines import contains_any

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
        re.compile(r"Input length \((?P<n>\d+) tokens\) exceeds the maximum allowed length \((?P<m>\d+) tokens\)"),
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
        re.compile(r"Multimodal prompt is too long after expanding multimodal tokens\..*?=> (?P<n>\d+) >= (?P<m>\d+)"),
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
        re.compile(r"The input \((?P<n>\d+) tokens\) is longer than the model's context length \((?P<m>\d+) tokens\)"),
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
        re.compile(r"Request (?P<rid>\S+) requires too many SWA KV tokens for decode preallocation: \d+ > (?P<m>\d+)"),
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
OTHER_EVENT_NEEDLES = tuple(
    dict.fromkeys([n for rule in _EVENT_RULES for n in rule.needles] + [*_GENERIC_ABORT_NEEDLES, "Req Time Stats("])
)
"""Texts of every event line other than the new ``ReqTimeStats(...)`` one."""
EVENT_NEEDLES = tuple(
    dict.fromkeys(
        [n for rule in _EVENT_RULES for n in rule.needles] + [*_REQ_TIME_STATS_NEEDLES, *_GENERIC_ABORT_NEEDLES]
    )
)
_GENERIC_ABORT = re.compile(r"(?i)\babort|FINISH_ABORT")
_REQ_TIME_STATS_NEW = re.compile(r"ReqTimeStats\((?P<body>[^)]*)\)")
_REQ_TIME_STATS_OLD = re.compile(
    r"Req Time Stats\(rid=(?P<rid>[^,]*),(?: bootstrap_room=[^,]*,)? input len=(?P<n>\d+), output len=(?P<out>\d+)"
)


@dataclass(frozen=True)
class EventMatch:
    """What one message reports about a request."""

    kind: str  # one of kvforensics.sources.engine_logs.contract.EVENT_KINDS
    request_id: str | None
    prompt_tokens: int | None
    limit_tokens: int | None
    clue: str | None = None  # the version clue the line's format gives (sglang_versions), if any
    cached_tokens: int | None = None  # ReqTimeStats cached_input_len= (>= 0.5.15): the prefix-cache hit


def match_event(msg: str) -> EventMatch | None:
    """The request event *msg* (a line without its envelope) reports, or None.

    The engine's own request log lines (``Receive: obj=...``, ``Finish: obj=...``) quote prompts and
    are never events, whatever text they quote.
    """
    if not contains_any(msg, EVENT_NEEDLES) or _REQUEST_LOG.search(msg):
        return None
    kind = rid = clue = None
    prompt = limit = cached = None
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
            kind, rid, prompt = "req_time_stats", body.get("rid", "").strip() or None, as_int(body.get("input_len"))
            cached = as_int(body.get("cached_input_len"))
            clue = "req_time_stats_new"
        elif m_old is not None:
            kind, rid, prompt = "req_time_stats", m_old["rid"].strip() or None, int(m_old["n"])
            clue = "req_time_stats_old"
        elif _GENERIC_ABORT.search(msg) and (_SELF_RID.search(msg) or _REQ_RID.search(msg) or _ANY_RID.search(msg)):
            kind = "abort_other"
        else:
            return None
    if rid is None:
        rid = _rid(_SELF_RID.search(msg)) or _rid(_REQ_RID.search(msg))
        if rid is None and kind in ("abort_other", "req_time_stats"):
            rid = _rid(_ANY_RID.search(msg))
    return EventMatch(kind, rid, prompt, limit, clue, cached)
