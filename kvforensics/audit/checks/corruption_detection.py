"""Check 4: KV checksum / canary on, and evidence that requests are verified.

``disaggregation_enable_kv_checksum``, ``kv_canary`` not ``none``. Checksum mismatches, canary
violations or context corruption in the interval fail (any role). Detection off fails when the
logged options are all off (an option missing from a ``server_args`` dump does not exist in that
build); neither option logged is ``unknown``. Detection on but no verification in the log is
``unknown``: SGLang logs failures only, so a quiet log does not show that anything is checked.
"""

from __future__ import annotations

from kvforensics.audit.checks.common import OFF, Judged, no_args_note, role_unknown, server_arg
from kvforensics.audit.phrases import loc, thousands
from kvforensics.audit.startups import Startup

_CORRUPTION_KINDS = ("checksum_mismatch", "canary_violation", "context_corruption")


def check_corruption_detection(s: Startup) -> Judged:
    file, line = s.where("server_args")
    hits = [(k, s.events[k]) for k in _CORRUPTION_KINDS if k in s.events]
    if hits:
        names = {
            "checksum_mismatch": "KV checksum mismatch(es)",
            "canary_violation": "KV canary violation(s)",
            "context_corruption": "context corruption(s) (metadata buffer collision)",
        }
        first = min((st for _, st in hits), key=lambda st: (st.first_file or "", st.first_line or 0))
        listed = ", ".join(
            f"{thousands(st.count)} {names[k]} (first at {loc(st.first_file, st.first_line)})" for k, st in hits
        )
        return (
            "fail",
            (f"corruption detected in this start-up: {listed}; the responses involved may carry another request's KV"),
            first.first_file,
            first.first_line,
        )
    if s.engine != "sglang":
        return "not_applicable", f"{s.engine}: no KV checksum or canary to enable", file, line
    checksum = server_arg(s, lambda k: "checksum" in k)
    canary = server_arg(s, lambda k: "canary" in k)
    if s.pd is False:
        state = ", ".join(f"{f[0]}={f[1]}" for f in (checksum, canary) if f is not None) or "not logged"
        return (
            "not_applicable",
            (f"unified server: hand-off checksums do not apply ({state}); no corruption reported in this start-up"),
            file,
            line,
        )
    if checksum is None and canary is None:
        return (
            "unknown",
            "neither --disaggregation-enable-kv-checksum nor --kv-canary is in the server args" + no_args_note(s),
            file,
            line,
        )
    described = []
    enabled = []
    for f in (checksum, canary):
        if f is None:
            continue
        key, value, ff, fl = f
        on = value.lower() not in OFF
        described.append(f"{key}={value}")
        if on:
            enabled.append((ff, fl))
    state = ", ".join(described)
    if not enabled:
        missing = (
            " (--kv-canary is not among the logged server args)"
            if canary is None
            else " (--disaggregation-enable-kv-checksum is not among the logged server args)"
            if checksum is None
            else ""
        )
        return role_unknown(
            s,
            (
                "fail",
                (
                    f"corruption detection is off ({state}){missing}: turn on "
                    "--disaggregation-enable-kv-checksum or --kv-canary where the model supports it"
                ),
                file,
                line,
            ),
        )
    ff, fl = enabled[0]
    return (
        "unknown",
        (
            f"detection on ({state}) but nothing in the log shows a request being verified: SGLang "
            "logs only mismatches, so a quiet log is no proof; check the engine's checksum / canary counters"
        ),
        ff,
        fl,
    )
