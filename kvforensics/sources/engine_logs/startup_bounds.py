"""Physical plausibility of what a start-up says: a value no engine can have is refused, not trusted.

A KV pool of 0 tokens or a context length of 0 would make every response of the start-up's lifetime exceed its pool
(a false exposure, and a false "received foreign data" notice to every account it served); a number beyond 64 bits
cannot be stored at all. Each value is checked against the bounds below once a file is parsed, by every engine
parser; a refused value is removed from the start-up (unknown, as if the log did not say it), its line is
quarantined with the reason, and the start-up's flags say what was refused where (``refused_values``) and which
fields (``refused_fields``), for the conclusiveness gate (reason ``startup_value_refused`` when the KV pool or the
context length was refused) and the audit.
"""

from __future__ import annotations

from dataclasses import replace

from kvforensics.sources.engine_logs.contract import EngineFileParse, QuarantinedLine, StartupRecord

MAX_TOKENS = 1 << 40
"""The largest KV pool or context length believed (2^40, about 1.1 trillion tokens: at the ~100 KB a token of KV
cache takes, some 100 PB; today's largest pools and contexts are a few million to tens of millions)."""
BOUNDS: dict[str, tuple[str, int]] = {
    "kv_pool_tokens": ("KV pool", MAX_TOKENS),
    "context_length": ("context length", MAX_TOKENS),
    "page_size": ("page size", 1 << 20),
    "tp_size": ("tensor parallel size", 1 << 16),
    "dp_size": ("data parallel size", 1 << 16),
}
# the evidence key of the line each field came from (StartupRecord.evidence), else the start-up's first line
_EVIDENCE = {"kv_pool_tokens": "kv_pool_tokens", "context_length": "context_length"}
REASON = "impossible start-up value"


def _shown(value: int) -> str:
    text = f"{value:,}" if abs(value) < 10**30 else f"{str(value)[:12]}... ({len(str(abs(value)))} digits)"
    return text


def refused_values(startup: StartupRecord) -> list[tuple[str, int, int]]:
    """The fields of *startup* whose value is outside its bounds: (field, value, line it came from)."""
    refused = []
    # an engine that refused to start may say it has no room for the cache at all (a pool of 0): it never served
    failed = startup.flags.get("startup_refused") == "true"
    for name, (_, bound) in BOUNDS.items():
        value = getattr(startup, name)
        if failed and name == "kv_pool_tokens" and value == 0:
            continue
        if value is not None and not 1 <= value <= bound:
            line = (
                startup.pool_source_line if name == "kv_pool_tokens" else startup.evidence.get(_EVIDENCE.get(name, ""))
            )
            refused.append((name, value, line or startup.line))
    return refused


def refuse_impossible_values(parse: EngineFileParse) -> None:
    """Every start-up of *parse* with its impossible values removed, each refusal quarantined at its line."""
    for instance in parse.instances.values():
        checked = []
        for startup in instance.startups:
            refused = refused_values(startup)
            if refused:
                said = []
                for name, value, line in refused:
                    what, bound = BOUNDS[name]
                    said.append(f"{what} {_shown(value)} (line {line})")
                    instance.quarantined.append(
                        QuarantinedLine(
                            line,
                            f"{REASON}: {what} {_shown(value)} is outside 1..{bound:,}; the start-up's {what} "
                            "is unknown",
                            f"{name}={_shown(value)}",
                        )
                    )
                startup = replace(
                    startup,
                    **{name: None for name, _, _ in refused},
                    flags={
                        **startup.flags,
                        "refused_values": "; ".join(said),
                        "refused_fields": ",".join(name for name, _, _ in refused),
                    },
                )
            checked.append(startup)
        instance.startups[:] = checked
