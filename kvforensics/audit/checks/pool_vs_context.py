"""Check 1: is the KV pool at least the context length, where a prompt beyond the pool would be served?

SGLang's scheduler refuses a prompt of ``n`` tokens when ``n >= max_req_input_len =
min(context_len - 1, max_total_num_tokens - 1) - 5``; the tokenizer's context check refuses ``n >=
context_len`` (HTTP 400). With a pool smaller than the context, prompts of ``pool - 6 .. context - 1``
tokens pass the context check and are aborted by the scheduler, which on the disaggregated path
(before 0.5.22) still hands them to decode: the response is served from stale KV pages. ``fail``
when ``pool < context``; the largest safe context length is the pool itself (``--context-length <=
pool``): from there down the pool no longer lowers the limit and the engine behaves as with an
unlimited pool. (Any SGLang build leaves prompts within 6 tokens of the context length to the
scheduler rather than the context check; only the engine fix, check 2, makes that refusal safe on
the PD path.) vLLM refuses to start when the pool cannot hold ``max_model_len``: such a start-up
served nothing (``not_applicable``); ``pool >= max_model_len`` passes. For a hybrid (Mamba /
linear-attention) or sliding-window model vLLM's ``GPU KV cache size`` token figure is derived per KV
cache group and can fall below max_model_len although one request fits (vllm-project/vllm#40691): the
loader then takes the pool from ``Maximum concurrency for L tokens per request: X.XXx``
(``vllm/v1/core/kv_cache_utils.py``), and a concurrency of 1.00x or more passes. Scheduler aborts in the log
whose limit contradicts the pool and context read turn a pass into ``unknown`` (the readings are in
doubt).

On a unified server the engines' own admission keeps a prompt beyond the pool off pages it did not
write, so the stale-pages exposure this check is about cannot happen there: SGLang's scheduler answers
it with an error (``srt/managers/scheduler.py`` -> ``validate_input_length``, the reject path the
public GLM-5.3 report found working on a single server); vLLM refuses to start with a KV cache that
cannot hold ``max_model_len`` (V1 ``vllm/v1/core/kv_cache_utils.py`` ``check_enough_kv_cache_memory``,
V0 ``vllm/worker/worker.py`` ``raise_if_cache_size_invalid``) and its schedulers never run a prompt on
blocks they could not allocate (V1 ``vllm/v1/core/sched/scheduler.py``: ``allocate_slots`` returns
None and the request waits; V0 ``vllm/core/scheduler.py``: "exceeds the capacity of block_manager",
the prompt is ignored). A unified SGLang server with a pool below its context is ``not_applicable``
(its sentence says the clients get errors and what to set); a unified vLLM start-up that logs a KV
cache below ``max_model_len`` and did not refuse is ``unknown``: vLLM would have refused, so the pool
or ``max_model_len`` read is in doubt.

``fail`` is **exposed**, always: on a prefill or decode role, or where the role is unknown (no
``server_args`` line and nothing else to tell; the deploy gate fails closed). A verdict never says
"fail" for a start-up the audit then calls not exposed.
"""

from __future__ import annotations

from kvforensics.audit.checks.common import ON
from kvforensics.audit.checks.engine_version import exact_version, is_fixed
from kvforensics.audit.phrases import loc, thousands, to_int
from kvforensics.audit.startups import Startup


def _pool_notes(s: Startup) -> str:
    parts = []
    if s.dp_size is not None and s.dp_size > 1:
        parts.append(f"per DP replica, dp_size={s.dp_size}")
    kind = s.flags.get("kv_pool_kind", "")
    full = to_int(s.flags.get("swa_full_layer_tokens"))
    if kind.startswith("hybrid"):
        if full is not None and s.pool is not None and full != s.pool:
            parts.append(
                f"hybrid SWA pool: full-attention layers {thousands(full)} tokens, the smallest KV "
                f"allocation logged ({thousands(s.pool)}) is used"
            )
        else:
            parts.append("hybrid SWA pool; the full-attention layers bound one request")
    elif kind:
        parts.append(kind)
    if s.flags.get("kv_pool_resized_after_capture") == "true":
        parts.append("after the post-capture resize")
    source = s.flags.get("kv_pool_source", "")
    if source.startswith(("implied", "server_info", "estimated")):
        parts.append(source)
    return f" ({'; '.join(parts)})" if parts else ""


def check_pool_vs_context(s: Startup) -> tuple[str, str, str | None, int | None, bool]:
    """Check 1; returns (status, detail, file, line, exposed)."""
    pool_at = (s.pool_file or s.file, s.pool_line) if s.pool_line is not None else s.where("kv_pool_tokens")
    note = f" [{s.role_note}]" if s.role_note else ""
    if s.engine == "vllm" and s.refused:
        est = s.flags.get("estimated_max_model_len")
        why = (
            f" (estimated maximum model length {thousands(int(est))})"
            if est and est.isdigit()
            else f" (it holds {thousands(s.pool)} tokens)"
            if s.pool is not None
            else ""
        )
        file, line = s.where("startup_refused")
        held = f"max_model_len {thousands(s.context)}" if s.context is not None else "max_model_len"
        return (
            "not_applicable",
            (f"vLLM refused to start: the KV cache cannot hold {held}{why}; this start-up served nothing"),
            file,
            line,
            False,
        )
    if s.pool is None or s.context is None:
        missing = " and ".join(x for x, v in (("KV pool size", s.pool), ("context length", s.context)) if v is None)
        file, line = s.where()
        return (
            "unknown",
            f"no {missing} in this start-up's log: pool vs context cannot be checked{note}",
            file,
            line,
            False,
        )
    pool, ctx = s.pool, s.context
    scope = _pool_notes(s)
    if s.engine == "vllm":
        if s.flags.get("kv_pool_source", "").startswith("approximate"):
            ratio = pool / ctx  # the pool is max_model_len x a concurrency printed with 2 decimals
            if ratio - 0.005 < 1 <= ratio + 0.005:
                return (
                    "unknown",
                    (
                        f"KV cache ~{thousands(pool)} tokens (max_model_len x a concurrency rounded to 2 "
                        f"decimals) is too close to max_model_len {thousands(ctx)} to tell{note}"
                    ),
                    *pool_at,
                    False,
                )
        concurrency = s.flags.get("kv_pool_concurrency")
        if concurrency is not None and pool >= ctx:
            logged = to_int(s.flags.get("kv_cache_size_logged"))
            figure = (
                f" its 'KV cache size' of {thousands(logged)} tokens" if logged is not None else " its token figure"
            )
            return (
                "pass",
                (
                    f"vLLM's 'Maximum concurrency for {thousands(ctx)} tokens per request: {concurrency}x': one "
                    "request of max_model_len fits the KV cache (the V1 engine refuses to start otherwise, "
                    "check_enough_kv_cache_memory), and vLLM admits no prompt longer than max_model_len;"
                    f"{figure} is derived per KV cache group for hybrid / sliding-window models "
                    f"(vllm-project/vllm#40691), not a limit on one request{note}"
                ),
                *pool_at,
                False,
            )
        if pool >= ctx:
            derived = (
                (" (vLLM V1 token counts are derived; hybrid / sliding-window models may hold fewer physical slots)")
                if s.flags.get("kv_pool_note")
                else ""
            )
            return (
                "pass",
                (
                    f"KV cache {thousands(pool)} tokens >= max_model_len {thousands(ctx)}: vLLM admits no prompt longer "
                    f"than max_model_len, so every admitted prompt fits{derived}{note}"
                ),
                *pool_at,
                False,
            )
        if s.pd is False:
            return (
                "unknown",
                (
                    f"KV cache {thousands(pool)} tokens < max_model_len {thousands(ctx)}{scope}, yet the engine did not "
                    "refuse to start, which vLLM does when its KV cache cannot hold max_model_len "
                    "(check_enough_kv_cache_memory): the pool or max_model_len read is in doubt (compare the "
                    "'GPU KV cache size' line with /get_server_info); either way a unified vLLM server never runs a "
                    "prompt on KV blocks it could not allocate (the scheduler leaves it waiting, or ignores it), so "
                    f"nothing is served from stale KV; set --max-model-len <= {thousands(pool)} if the pool is right"
                    f"{note}"
                ),
                *pool_at,
                False,
            )
        return (
            "fail",
            (
                f"KV cache {thousands(pool)} tokens < max_model_len {thousands(ctx)}{scope} and the engine did not "
                f"refuse to start: prompts longer than the pool are admitted; set --max-model-len <= "
                f"{thousands(pool)}{note}"
            ),
            *pool_at,
            True,  # a prefill or decode role, or an unknown one (fail closed)
        )
    # SGLang
    limit = min(ctx - 1, pool - 1) - 5
    aborts = s.events.get("scheduler_abort")
    seen = ""
    conflict = False
    if aborts is not None:
        seen = (
            f"; the log shows {thousands(aborts.count)} scheduler abort(s) in this start-up (first at "
            f"{loc(aborts.first_file, aborts.first_line)})"
        )
        if aborts.min_limit is not None and (aborts.min_limit != limit or aborts.max_limit != limit):
            conflict = True
            shown = (
                thousands(aborts.min_limit)
                if aborts.min_limit == aborts.max_limit
                else f"{thousands(aborts.min_limit)}-{thousands(aborts.max_limit or 0)}"
            )
            seen += (
                f" reporting a limit of {shown}, not the {thousands(limit)} these numbers give: the pool or context "
                "reading is inconsistent (a /get_server_info dump shows max_req_input_len)"
            )
    if pool >= ctx:
        return (
            "unknown" if conflict else "pass",
            (
                f"KV pool {thousands(pool)} >= context {thousands(ctx)}{scope}: the pool never lowers the scheduler limit "
                f"(context - 6 = {thousands(limit)}){seen}{note}"
            ),
            *pool_at,
            False,
        )
    head = (
        f"KV pool {thousands(pool)} < context {thousands(ctx)}{scope}: the scheduler limit is "
        f"min({thousands(ctx - 1)}, {thousands(pool - 1)}) - 5 = {thousands(limit)}, so prompts of {thousands(limit)}-{thousands(ctx - 1)} "
        "tokens pass the context check and are aborted by the scheduler"
    )
    fix = f"set --context-length <= {thousands(pool)} (the pool)"
    if s.pd is None:
        role = (
            "; the role is unknown (no server_args line): if this instance is disaggregated, builds before "
            "0.5.22 still hand those requests to decode, which answers them from stale KV pages"
        )
        return "fail", f"{head}{role}; {fix}{seen}{note}", *pool_at, True
    if s.role == "prefill":
        version = exact_version(s)
        fixed = (
            f"; this build ({version}) refuses them at the admission queue, but the checklist says not to "
            "rely on the engine"
            if version is not None and is_fixed(version)
            else ""
        )
        body = (
            "; on the disaggregated path, builds before 0.5.22 still hand them to decode, which answers "
            f"them from stale KV pages (HTTP 200){fixed}; {fix} on both roles"
        )
        return "fail", f"{head}{body}{seen}{note}", *pool_at, True
    if s.role == "decode":
        body = f"; this decode node cannot hold every request its prefill peers admit; {fix} on both roles of the pair"
        return "fail", f"{head}{body}{seen}{note}", *pool_at, True
    truncate = s.flags.get("allow_auto_truncate", "").lower() in ON or "input_truncated" in s.events
    body = (
        f"; with --allow-auto-truncate they are cut to {thousands(limit)} tokens and served within the pool"
        if truncate
        else "; a unified server answers them with an error"
    )
    return (
        "not_applicable",
        f"{head}{body}, so nothing is served from stale KV (that needs a disaggregated hand-off); {fix} so the "
        f"context check refuses them up front{seen}{note}",
        *pool_at,
        False,
    )
