"""Check 3: deferred KV release and a capped Mooncake transfer batch (disaggregated SGLang).

Read from the server args: a flag whose name holds ``defer`` and ``release``
(``disaggregation_defer_kv_release``) must be on; one holding ``mooncake``/``transfer`` and
``batch``/``max`` (``disaggregation_mooncake_transfer_batch_size``) must be a positive number. An
absent or ``None`` setting is ``unknown`` (the engine default is not in the log).
"""

from __future__ import annotations

from kvforensics.audit.checks.common import ON, Judged, no_args_note, role_unknown, server_arg
from kvforensics.audit.phrases import thousands, to_int
from kvforensics.audit.startups import Startup


def _is_defer_release(k: str) -> bool:
    return "defer" in k and "release" in k


def _is_batch_cap(k: str) -> bool:
    return ("mooncake" in k or "transfer" in k) and ("batch" in k or "max" in k) and "backend" not in k


def check_release_and_batch(s: Startup) -> Judged:
    file, line = s.where("server_args")
    if s.engine != "sglang":
        connector = s.flags.get("kv_connector")
        via = f" (KV moves via {connector})" if connector else ""
        return (
            "not_applicable",
            (f"{s.engine}{via}: deferred KV release and the Mooncake transfer batch are SGLang settings"),
            file,
            line,
        )
    if s.pd is False:
        return "not_applicable", "unified server: no KV hand-off between nodes", file, line
    parts: list[str] = []
    statuses: list[str] = []
    at: tuple[str | None, int | None] | None = None
    defer = server_arg(s, _is_defer_release)
    if defer is None:
        parts.append(
            "deferred KV release: not in the server args"
            + no_args_note(s)
            + " (newer builds default it on, but a default is not evidence)"
        )
        statuses.append("unknown")
    else:
        key, value, f, ln = defer
        on = value.lower() in ON
        off = value.lower() in ("false", "0", "no", "off")
        statuses.append("pass" if on else "fail" if off else "unknown")
        state = (
            "on"
            if on
            else "off"
            if off
            else "not set, the engine default applies"
            if value.lower() in ("none", "null", "")
            else "unreadable"
        )
        parts.append(f"deferred KV release {state} ({key}={value})")
        at = at or (f, ln)
    backend = s.flags.get("disaggregation_transfer_backend") or (
        s.server_info.args.get("disaggregation_transfer_backend") if s.server_info else None
    )
    if backend is not None and backend.lower() not in ("mooncake", "none"):
        parts.append(f"transfer backend {backend}: the Mooncake batch cap does not apply")
    else:
        cap = server_arg(s, _is_batch_cap)
        if cap is None:
            parts.append("Mooncake transfer batch cap: not in the server args" + no_args_note(s))
            statuses.append("unknown")
        else:
            key, value, f, ln = cap
            number = to_int(value)
            if number is not None and number > 0:
                statuses.append("pass")
                parts.append(f"Mooncake transfer batch capped at {thousands(number)} ({key}={value})")
            elif number is not None or value.lower() in ("false", "off", "no"):
                statuses.append("fail")
                parts.append(f"Mooncake transfer batch uncapped ({key}={value})")
            elif value.lower() in ("none", "null", ""):
                statuses.append("unknown")
                parts.append(
                    f"Mooncake transfer batch cap not set ({key}={value}): the engine default applies, "
                    "which the log does not show"
                )
            else:
                statuses.append("unknown")
                parts.append(f"Mooncake transfer batch cap unreadable ({key}={value})")
            at = at or (f, ln)
    status = "fail" if "fail" in statuses else "unknown" if "unknown" in statuses else "pass"
    if status == "fail":
        parts.append(
            "turn on deferred KV release on both roles and cap the transfer batch, so a timeout "
            "cannot leave an unbounded tail write"
        )
    file, line = at or (file, line)
    return role_unknown(s, (status, "; ".join(parts), file, line))
