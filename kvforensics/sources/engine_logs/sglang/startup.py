"""One SGLang start-up being read, and the :class:`StartupRecord` it becomes.

:class:`SglangStartup` collects what the start-up's lines say (server args, KV pool lines of each
rank, version clues, role hints ...); :func:`startup_record` decides the start-up's KV pool,
context length, role, parallelism and version from them, noting every assumption.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from kvforensics.sources.engine_logs.contract import StartupRecord, add_note, log_end_fields
from kvforensics.sources.engine_logs.fields import PoolReport, PoolReports, as_int, flag_value
from kvforensics.sources.engine_logs.sglang.versions import infer_version, satisfies

ENGINE = "sglang"
UNKNOWN_ROLE = "unknown"  # a start-up whose log shows neither server_args nor any line only one role prints

_SUMMARY = re.compile(r"\bmax_total_num_tokens=(?P<tokens>\d+)")
_KEY_VALUES = re.compile(r"\b(\w+)=([^,\s]+)")
_KV_ALLOC_BODY = (
    r"KV Cache (?P<state>is allocated|VA upper bound)\.\s*(?:dtype: (?P<dtype>[^,]+),\s*)?(?:#tokens: (?P<tokens>\d+))?"
)
# "{cache_name} is allocated": cache_name is "KV Cache" or "{allocation_label} KV Cache"; the label
# is only read when the message starts with it (an unknown outer prefix must not pass for a label)
_KV_ALLOC_LABELLED = re.compile(r"^(?:(?P<label>[A-Za-z][\w\-]*(?: [A-Za-z][\w\-]*){0,2}) )?" + _KV_ALLOC_BODY)
_KV_ALLOC = re.compile(_KV_ALLOC_BODY)
_POST_CAPTURE_ALLOC = re.compile(
    r"Post-capture KV sizing: KV cache allocated\. dtype: (?P<dtype>[^,]+), #tokens: (?P<tokens>\d+)"
)
_SWA_POOL = re.compile(
    r"(?:Post-capture KV sizing:|Use sliding window memory pool\.) full_layer_tokens=(?P<full>\d+), swa_layer_tokens=(?P<swa>\d+)"
)
_ALL_SWA_POOL = re.compile(r"Use sliding window memory pool \(all SWA\)\. swa_layer_tokens=(?P<swa>\d+)")
_POOL_WARNING = re.compile(r"KV pool holds (?P<pool>\d+) tokens, fewer than --context-length (?P<ctx>\d+)")

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
    "disable_radix_cache",  # prefix cache and its external stores (audit check 6)
    "enable_hierarchical_cache",
    "hicache_storage_backend",
    "enable_lmcache",
)
_FLAG_FRAGMENTS = ("checksum", "canary", "defer", "release", "mooncake", "transfer", "disaggregation_")


@dataclass
class _KvAlloc:
    line: int
    rank: str
    tokens: int
    source: str
    label: str


@dataclass
class SglangStartup:
    """What the lines of one start-up said so far (the parser decides which lines belong to it)."""

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
    plain_batch_line: int | None = None  # the first batch line without the PD queue counts
    cached_batch_line: int | None = None  # the first prefill batch line with #cached-token > 0
    abort_limits: list[tuple[int, int]] = field(default_factory=list)  # (limit, line)
    notes: list[str] = field(default_factory=list)
    last_line: int | None = None
    last_ts: datetime | None = None
    shutdown: tuple[int, datetime | None, str] | None = None  # line, time, what it says

    def clue(self, key: str, line: int) -> None:
        """Note a version clue (sglang_versions) at its first line."""
        self.clues.setdefault(key, line)

    def read_pool_line(self, number: int, rank: str, msg: str) -> None:
        """Read a start-up line about the KV pool (summary, allocation, SWA, pool warning)."""
        m = _SUMMARY.search(msg)
        if m:
            values = dict(_KEY_VALUES.findall(msg))
            self.summary[rank] = (number, values)
            if "chunked_prefill_size" not in values:
                self.clue("summary_no_chunked", number)
            elif "available_gpu_mem" in values or "available_cpu_mem" in values:
                self.clue("summary_avail", number)
            else:
                self.clue("summary_no_avail", number)
            return
        m = _POST_CAPTURE_ALLOC.search(msg)
        if m:
            self.kv_allocs.append(_KvAlloc(number, rank, int(m["tokens"]), "Post-capture KV sizing", ""))
            self.clue("kv_dtype", number)
            return
        m = _SWA_POOL.search(msg)
        if m:
            self.swa.append((number, rank, int(m["full"]), int(m["swa"])))
            return
        m = _ALL_SWA_POOL.search(msg)
        if m:
            self.all_swa = (int(m["swa"]), number)
            return
        m = _POOL_WARNING.search(msg)
        if m:
            self.pool_warning = (int(m["pool"]), int(m["ctx"]), number, rank)
            return
        m = _KV_ALLOC_LABELLED.match(msg) or _KV_ALLOC.search(msg)
        if m:
            if m["dtype"]:
                self.clue("kv_dtype", number)
            elif m["tokens"]:
                self.clue("kv_tokens_no_dtype", number)
            elif "K size:" in msg or "KV size:" in msg:
                self.clue("kv_no_tokens", number)
            if m["tokens"] is None:
                return
            tokens = int(m["tokens"])
            if m["state"] == "VA upper bound":
                self.va_upper_bound = tokens
                return
            label = m.groupdict().get("label") or ""
            self.kv_allocs.append(_KvAlloc(number, rank, tokens, "KV Cache is allocated", label))


def startup_record(st: SglangStartup, *, instance: str, notes: list[str]) -> StartupRecord:
    """What the start-up *st* says, as a record; assumptions go to *notes*."""
    args = st.server_args or {}
    flags: dict[str, str] = {}
    evidence: dict[str, int] = {}

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
    if st.cached_batch_line is not None:  # the prefix cache served tokens: it is on (audit check 6)
        evidence["prefix_cache_hit"] = st.cached_batch_line
        flags["prefix_cache_hit_line"] = str(st.cached_batch_line)

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
    elif st.server_args_line is None and st.plain_batch_line is not None:
        # the scheduler adds its PD queue counts to every batch line of a prefill or decode server
        # (log_prefill_stats / log_decode_stats: "if self.disaggregation_mode == DisaggregationMode.PREFILL"
        # ... DECODE, srt/managers/scheduler.py to 0.4.x, scheduler_metrics_mixin.py and
        # scheduler_components/metrics_reporter.py in 0.5.x): a batch line without them is a unified server's
        role = "unified"
        evidence["role"] = st.plain_batch_line
        flags["role_source"] = "inferred from a batch line without the PD queue counts"
        note(
            f"role unified inferred from the batch line at line {st.plain_batch_line}, which has none of the "
            "PD queue counts a prefill or decode server logs (no server_args line)"
        )
    elif st.server_args_line is None:
        role = UNKNOWN_ROLE  # no line says: the audit and the capacity table both say so
        flags["role_source"] = "default (no server_args line)"
    else:
        role = "unified"

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
        ctx_for_limit = _context_length(st, args)[0]
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
    context_length, ctx_line = _context_length(st, args)
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
    version, version_source = _version(st, flags, evidence, note)

    return StartupRecord(
        instance=instance,
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
        **log_end_fields(st.last_line, st.last_ts, st.shutdown),
    )


def _context_length(st: SglangStartup, args: dict[str, object]) -> tuple[int | None, int | None]:
    for line_no, values in sorted(st.summary.values(), key=lambda v: v[0], reverse=True):
        ctx = as_int(values.get("context_len"))
        if ctx is not None:
            return ctx, line_no
    ctx = as_int(args.get("context_length"))
    if ctx is not None:
        return ctx, st.server_args_line
    return None, None


def _version(
    st: SglangStartup, flags: dict[str, str], evidence: dict[str, int], note: Callable[[str], None]
) -> tuple[str | None, str | None]:
    spec, labels = infer_version(sorted(st.clues, key=lambda k: st.clues[k]))
    if st.exact_version is not None:
        version, line_no, text = st.exact_version
        evidence["engine_version"] = line_no
        flags["version_evidence"] = text
        if labels:
            flags["version_format_clues"] = "; ".join(labels)
        if spec is not None and not satisfies(version, spec):
            note(f"logged version {version} does not match the format clues ({spec}: {'; '.join(labels)})")
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
