"""vLLM's lines: the envelope, the start-up and event messages the parser reads, and what only vLLM prints.

Every pattern here is written from vLLM's source (reference §2: ``vllm/logger.py`` for the envelope,
``entrypoints/openai/api_server.py`` and ``entrypoints/common/startup.py`` for the version and args lines,
``v1/engine/core.py`` / ``engine/llm_engine.py`` for the engine config, ``v1/core/kv_cache_utils.py`` and
``executor/*`` for the KV cache lines, ``distributed/kv_transfer/kv_connector/factory.py`` for the connectors,
the schedulers and frontends for the events). :mod:`kvforensics.sources.engine_logs.vllm.parser` reads a log with them;
:data:`LINE_SIGNATURE` lets a bare line (no envelope) tell vLLM from SGLang.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LEVELS = r"DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL"
ENV = re.compile(
    rf"^(?P<level>{LEVELS})\s+(?P<month>\d{{2}})-(?P<day>\d{{2}}) (?P<time>\d{{2}}:\d{{2}}:\d{{2}})"
    r"(?:[.,](?P<frac>\d{1,6}))?\s+(?:\[(?P<loc>[^\]]*)\]|(?P<loc2>[^\s\]]+:\d+)\])\s?"
)
# a level word followed by something stamp-like that is not a valid envelope
LOOSE_ENV = re.compile(rf"^(?:{LEVELS}) +(?P<stamp>\w{{1,2}}[-/]\w{{1,2}} +\w{{1,2}}:\w{{1,2}}(?::\w{{1,2}})?)")

# start-up lines
VERSION_API = re.compile(r"vLLM API server version (?P<v>\S+)")
VERSION_SERVER = re.compile(r"vLLM server version (?P<v>[^\s,]+),? serving model (?P<model>\S+)")
BANNER_VERSION = re.compile(r"[\u2580-\u259f].*\bversion\s+(?P<v>\d\S*)\s*$")
BANNER_MODEL = re.compile(r"[\u2580-\u259f].*\bmodel\s+(?P<model>\S+)\s*$")
BANNER = re.compile(r"[\u2580-\u259f]")  # the block characters of the ASCII-art logo
ARGS = re.compile(r"(?<!non-default )\bargs: (?=Namespace\()")
NON_DEFAULT = re.compile(r"non-default args: (?=\{)")
ENGINE_INIT = re.compile(r"Initializing (?:an|a (?P<gen>V0|V1)|a) LLM engine \(v(?P<v>[^)]+)\) with config: ")
BLOCKS = re.compile(r"# (?P<dev>[A-Za-z]+) blocks: (?P<n>\d+)(?:, # CPU blocks: (?P<cpu>\d+))?")
KV_SIZE = re.compile(r"(?P<dev>[A-Z][A-Za-z]*(?: \+ host)?) KV cache size: (?P<n>[\d,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<x>[\d.]+)x")
REFUSE_V0 = re.compile(
    r"The model's max seq len \((?P<len>\d+)\) is larger than the maximum number of tokens that can be "
    r"stored in KV cache \((?P<pool>\d+)\)"
)
REFUSE_V1 = re.compile(
    r"To serve at least one request with the models?'s max seq len \((?P<len>\d+)\)"
    r"(?:.*?estimated maximum model length is (?P<est>\d+))?"
)
AVAILABLE_KV = re.compile(r"Available KV cache memory: (?P<gib>[\d.]+) GiB")
OTHER_STARTUP = re.compile(
    r"Starting to load model|Loading model weights took|Model loading took|Memory profiling|"
    r"Available KV cache memory|the rest of the memory reserved for KV Cache"
)
READY = re.compile(r"Application startup complete|Starting vLLM (?:API )?server (?:\d+ )?on|Uvicorn running on")
# literals one of which is in every start-up line above (the banner is caught by its non-ASCII blocks)
STARTUP_NEEDLES = (
    "Application startup complete",
    "Starting vLLM",
    "Uvicorn running",
    "server version",
    "args: ",
    "LLM engine (v",
    "max seq len",
    " blocks: ",
    "KV cache size",
    "Maximum concurrency",
    "Available KV cache memory",
    "Starting to load model",
    "Loading model weights",
    "Model loading took",
    "Memory profiling",
    "reserved for KV Cache",
    "Creating v1 connector",
)
# vllm/distributed/kv_transfer/kv_connector/factory.py: each KV connector the engine builds (scheduler and
# worker sides, every connector of a MultiConnector), whatever the args say
CONNECTOR_CREATED = re.compile(r"Creating v1 connector with name: (?P<c>[\w.]+)")
KV_ROLE = re.compile(r"kv_role['\"]?\s*[:=]\s*['\"]?(?P<role>kv_producer|kv_consumer|kv_both)")
KV_CONNECTOR = re.compile(r"kv_connector['\"]?\s*[:=]\s*['\"]?(?P<c>[\w.]+)")


# events
FRONTEND_REQUESTED = re.compile(
    r"This model's maximum context length is (?P<m>\d+) tokens\. However, you requested (?P<t>\d+) tokens "
    r"(?:\((?P<n>\d+) in the messages, (?P<c>\d+) in the completion\)|in the messages)"
)
EVENT_NEEDLES = (
    "Input prompt (",
    "Failing the request",
    "prompt (length",
    "maximum context length",
    "pulling kv_caches",
    "Aborted request",
)
ABORTED = re.compile(r"\bAborted request(?:\(s\))? (?P<ids>.+?)\.?\s*$")


# terminal-wrapped dumps: a line that starts a record of its own cannot continue one
NOT_A_CONTINUATION = re.compile(
    rf"^(?:(?:{LEVELS})[: ]|Traceback |\s*File \"|\[|\(|Loading |Capturing |Process |[A-Za-z]*(?:Error|Exception)\b)"
)
KEY_VALUE = re.compile(r"\b[A-Za-z_]\w*=")
CONTINUATION_LINES = 50  # a wrapped dump spans at most this many lines after its first
DUMPS = {"args": "args dump", "non_default": "non-default args dump", "config": "engine config"}


def left_open(text: str) -> bool:
    """Whether *text* ends inside a quote or an unclosed bracket (a line cut there goes on)."""
    depth = 0
    quote: str | None = None
    escaped = False
    for c in text:
        if quote is not None:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}" and depth:
            depth -= 1
    return quote is not None or depth > 0


@dataclass(frozen=True)
class EventRule:
    kind: str
    pattern: re.Pattern[str]
    prompt: str | None = None
    limit: str | None = None
    rid: str | None = None


EVENT_RULES: tuple[EventRule, ...] = (
    EventRule(
        "abort_input_too_long",
        re.compile(r"Input prompt \((?P<n>\d+) tokens\) is too long and exceeds limit of (?P<m>\d+)"),
        "n",
        "m",
    ),
    EventRule(
        "abort_input_too_long",
        re.compile(r"Input prompt \((?P<n>\d+) tokens\) \+ lookahead slots \(\d+\) is too long"),
        "n",
    ),
    EventRule(
        "abort_other",
        re.compile(r"Failing the request (?P<rid>\S+) because there's not enough kv cache blocks"),
        rid="rid",
    ),
    EventRule(
        "abort_input_too_long",
        re.compile(
            r"The (?:\w+ )?prompt \(length (?P<n>\d+)\) (?:plus the number of requested output tokens "
            r"\(at least 1\) )?is longer than the maximum model length of (?P<m>\d+)"
        ),
        "n",
        "m",
    ),
    EventRule(
        "abort_other",
        re.compile(
            r"'max_tokens' or 'max_completion_tokens' is too large: \d+\. This model's maximum context "
            r"length is (?P<m>\d+) tokens and your request has (?P<n>\d+) input tokens"
        ),
        "n",
        "m",
    ),
    EventRule(
        "abort_input_too_long",
        re.compile(
            r"This model's maximum context length is (?P<m>\d+) tokens\. However, your "
            r"(?:request has |prompt contains (?:at least )?)(?P<n>\d+) input tokens"
        ),
        "n",
        "m",
    ),
    EventRule("transfer_failure", re.compile(r"pulling kv_caches for (?P<rid>\S+) failed"), rid="rid"),
)


# Messages only vLLM prints, whatever envelope (or none) they come in: a bare line with one of them is a
# vLLM line (engine_common.sniff_format). Each is one of the patterns above or from the same source
# files; SGLang prints none of them (sglang.LINE_SIGNATURE is the other side).
LINE_SIGNATURE = re.compile(
    r"vLLM (?:API )?server version |Initializing (?:an|a V0|a V1|a) LLM engine \(v|non-default args: \{"
    r"|\bargs: Namespace\(|[A-Z][A-Za-z]*(?: \+ host)? KV cache size: [\d,]+ tokens"
    r"|Maximum concurrency for [\d,]+ tokens per request|# [A-Za-z]+ blocks: \d+|Available KV cache memory: "
    r"|Starting vLLM (?:API )?server|Loading model weights took|Creating v1 connector with name: "
    r"|To serve at least one request with the models?'s max seq len"
)
