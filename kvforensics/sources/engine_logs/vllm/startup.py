"""One vLLM start-up being read, and the :class:`StartupRecord` it becomes.

:class:`VllmStartup` collects what the start-up's lines say (args, non-default args, the engine
config, block and KV cache size lines of each worker, a refusal to start ...); :func:`startup_record`
decides the start-up's KV pool, context length (max_model_len), role and parallelism from them,
noting every assumption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from kvforensics.sources.engine_logs.contract import StartupRecord, add_note, log_end_fields
from kvforensics.sources.engine_logs.fields import PoolReport, PoolReports, as_int, flag_value

ENGINE = "vllm"
DEFAULT_BLOCK_SIZE = 16

_FLAG_KEYS = (
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "kv_cache_dtype",
    "block_size",
    "max_model_len",
    "num_gpu_blocks_override",
    "quantization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "kv_transfer_config",
    "swap_space",
    "cpu_offload_gb",
    "prefix_caching_hash_algo",
    "kv_offloading_backend",
)
# settings whose line the audit cites (check 6, prefix-cache isolation)
_EVIDENCE_KEYS = ("enable_prefix_caching", "prefix_caching_hash_algo", "kv_transfer_config", "kv_offloading_backend")


@dataclass
class VllmStartup:
    """What the lines of one start-up said so far (the parser decides which lines belong to it)."""

    line: int
    ts: datetime | None
    markers: set[str] = field(default_factory=set)
    ready_line: int | None = None
    version: tuple[str, int] | None = None
    args: dict[str, object] = field(default_factory=dict)  # args: Namespace(...)
    args_line: int | None = None
    non_default: dict[str, object] = field(default_factory=dict)
    non_default_line: int | None = None
    config: dict[str, object] = field(default_factory=dict)  # engine config string
    config_line: int | None = None
    field_lines: dict[str, int] = field(default_factory=dict)  # a setting read from a terminal-wrapped line: its line
    generation: tuple[str, int] | None = None  # "V0" / "V1" of "Initializing a V1 LLM engine", its line
    serving_model: tuple[str, int] | None = None
    blocks: list[tuple[int, str, int, str]] = field(default_factory=list)  # line, process, blocks, device
    kv_tokens: list[tuple[int, str, int, str]] = field(default_factory=list)  # line, process, tokens, device
    concurrency: tuple[int, float, int] | None = None  # max_len, ratio, line
    refusal: tuple[int, int | None, int, str] | None = None  # max_len, pool/estimate, line, kind
    kv_role: tuple[str, int] | None = None
    kv_connector: str | None = None
    connectors_created: dict[str, int] = field(default_factory=dict)  # "Creating v1 connector" lines: name -> line
    available_kv_gib: str | None = None
    notes: list[str] = field(default_factory=list)
    last_line: int | None = None
    last_ts: datetime | None = None
    shutdown: tuple[int, datetime | None, str] | None = None  # line, time, what it says


def _derived_token_figure(st: VllmStartup, logged: int, context_length: int | None) -> tuple[int, float, int] | None:
    """The concurrency line (max_len, ratio, line) when the logged KV cache size is below what it implies.

    vLLM V1 logs ``GPU KV cache size: N tokens`` and ``Maximum concurrency for L tokens per request:
    X.XXx`` (``vllm/v1/core/kv_cache_utils.py``, ``_report_kv_cache_config``). The concurrency is
    ``num_blocks / blocks one request of max_model_len needs`` over every KV cache group
    (``get_max_concurrency_for_kv_cache_config``), while up to the fix of vllm-project/vllm#40691 the
    token figure is ``num_blocks // len(kv_cache_groups) * min_block_size``: for a model with one KV
    cache group the two agree (``N >= X * L``), for a hybrid (Mamba / linear-attention) or
    sliding-window model with several groups the token figure falls short of ``X * L``. That shortfall,
    beyond the 2-decimal rounding of X, is what marks the figure as derived: the concurrency line is
    then what says whether one request of max_model_len fits (V1 refuses to start when it does not,
    ``check_enough_kv_cache_memory``).
    """
    if st.concurrency is None:
        return None
    max_len, ratio, _line = st.concurrency
    if context_length in (None, max_len) and logged + 1 < (ratio - 0.005) * max_len:
        return st.concurrency
    return None


def startup_record(st: VllmStartup, *, instance: str, notes: list[str]) -> StartupRecord:
    """What the start-up *st* says, as a record; assumptions go to *notes*."""
    flags: dict[str, str] = {}
    evidence: dict[str, int] = {}

    def note(text: str) -> None:
        add_note(notes, f"start-up at line {st.line}: {text}")

    for n in st.notes:
        note(n)

    # the same setting can come from the engine config line, args or non-default args:
    # the engine config is the resolved value, args the requested one
    sources: list[tuple[dict[str, object], int | None]] = [
        (st.config, st.config_line),
        (st.args, st.args_line),
        (st.non_default, st.non_default_line),
    ]

    def setting(*keys: str) -> tuple[object, int | None]:
        for values, line_no in sources:
            for key in keys:
                value = values.get(key)
                if value is not None and value != "None":
                    return value, st.field_lines.get(key, line_no)
        return None, None

    for values, line_no in reversed(sources):
        for key, value in values.items():
            if key in _FLAG_KEYS or "kv_transfer" in key or "kv_connector" in key:
                flags[key] = flag_value(value)
                if key in _EVIDENCE_KEYS and line_no is not None:
                    evidence[key] = st.field_lines.get(key, line_no)
    if st.ready_line is not None:
        evidence["ready"] = st.ready_line

    # version
    version = version_source = None
    if st.version is not None:
        version, evidence["engine_version"] = st.version
        version_source = "log"

    # the engine generation: which default prefix caching had between V1 becoming the default (v0.8.0)
    # and V0's removal (v0.11.0), audit check 6
    if st.generation is not None:
        flags["engine_generation"], evidence["engine_generation"] = st.generation

    # role
    role = "unified"
    if st.kv_role is not None:
        kv_role, evidence["role"] = st.kv_role
        flags["kv_role"] = kv_role
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(kv_role, "unified")
        if kv_role == "kv_both":
            note("kv_role kv_both: the instance both sends and receives KV; read as unified")
    if st.kv_connector:
        flags["kv_connector"] = st.kv_connector
    if st.connectors_created:  # what the engine built, whether or not an args line is in the log
        flags["kv_connectors_created"] = ", ".join(st.connectors_created)
        evidence["kv_connector_created"] = min(st.connectors_created.values())

    # model
    model: str | None = None
    served, served_line = setting("served_model_name")
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    if isinstance(served, str) and served:
        model, evidence["model"] = served, served_line or st.line
    elif st.serving_model is not None:
        model, evidence["model"] = st.serving_model
    else:
        name, name_line = setting("model", "model_tag")
        if isinstance(name, str) and name:
            model, evidence["model"] = name, name_line or st.line

    # parallelism
    tp_value, tp_line = setting("tensor_parallel_size")
    tp_size = as_int(tp_value)
    if tp_size is not None and tp_line is not None:
        evidence["tp_size"] = tp_line
    dp_value, dp_line = setting("data_parallel_size")
    dp_size = as_int(dp_value)
    if dp_size is not None and dp_line is not None:
        evidence["dp_size"] = dp_line

    # context length (max_model_len)
    context_length: int | None = None
    ctx_value, ctx_line = setting("max_seq_len")
    if as_int(ctx_value) is not None:
        context_length = as_int(ctx_value)
    elif st.concurrency is not None:
        context_length, ctx_line = st.concurrency[0], st.concurrency[2]
    elif st.refusal is not None:
        context_length, ctx_line = st.refusal[0], st.refusal[2]
    else:
        ctx_value, ctx_line = setting("max_model_len")
        context_length = as_int(ctx_value)
    if context_length is not None and ctx_line is not None:
        evidence["context_length"] = ctx_line

    # block size (page size)
    bs_value, bs_line = setting("block_size")
    block_size = as_int(bs_value)
    if block_size is not None and bs_line is not None:
        evidence["page_size"] = bs_line
    else:
        block_size = DEFAULT_BLOCK_SIZE
        flags["block_size_source"] = f"default (not logged; vLLM's CUDA default block_size is {DEFAULT_BLOCK_SIZE})"
        if st.blocks:
            note(f"block_size not logged; the CUDA default of {DEFAULT_BLOCK_SIZE} is used to turn blocks into tokens")

    # KV pool: vLLM prints the size once per worker, often all from one process (0.8.x prints it
    # before unify_kv_cache_configs() shrinks every worker to the minimum): every line counts
    pool = PoolReports()
    for line_no, process, blocks, device in st.blocks:
        source = f"# {device} blocks x block_size {block_size}"
        pool.add(PoolReport(line_no, process or "engine", blocks * block_size, source), group=str(line_no))
    for line_no, process, tokens, device in st.kv_tokens:
        pool.add(
            PoolReport(line_no, process or "engine", tokens, f"{device} KV cache size"),
            group=str(line_no),
        )
    if st.refusal is not None:
        max_len, value, line_no, kind = st.refusal
        flags["startup_refused"] = "true"
        evidence["startup_refused"] = line_no
        if kind == "v0" and value is not None:
            pool.add(PoolReport(line_no, "engine", value, "max seq len refusal"), group="refusal")
        elif value is not None:
            flags["estimated_max_model_len"] = str(value)
    best = pool.effective()
    kv_pool_tokens = best.tokens if best else None
    pool_line = best.line if best else None
    if best is not None:
        evidence["kv_pool_tokens"] = best.line
        flags["kv_pool_reports"] = pool.summary()
        if len({r.tokens for r in pool.reports()}) > 1:
            note(f"workers report different KV cache sizes ({pool.summary()}); the smallest is used")
    elif st.refusal is not None and st.refusal[1] is not None:
        kv_pool_tokens, pool_line = st.refusal[1], st.refusal[2]
        evidence["kv_pool_tokens"] = pool_line
        flags["kv_pool_source"] = "estimated maximum model length from the start-up refusal"
    elif st.concurrency is not None:
        max_len, ratio, line_no = st.concurrency
        kv_pool_tokens, pool_line = int(max_len * ratio), line_no
        evidence["kv_pool_tokens"] = line_no
        flags["kv_pool_source"] = "approximate: max_model_len x maximum concurrency (2 decimals)"
        note(f"no KV cache size line; pool approximated as {max_len} x {ratio} from line {line_no}")
    if best is not None and st.refusal is None and (derived := _derived_token_figure(st, best.tokens, context_length)):
        max_len, ratio, line_no = derived
        kv_pool_tokens, pool_line = int(max_len * ratio), line_no
        evidence["kv_pool_tokens"] = line_no
        flags["kv_cache_size_logged"] = str(best.tokens)
        flags["kv_pool_concurrency"] = f"{ratio:.2f}"
        flags["kv_pool_source"] = (
            "Maximum concurrency x max_model_len (the 'KV cache size' figure is derived per KV cache group "
            "for hybrid / sliding-window models, vllm-project/vllm#40691)"
        )
        note(
            f"KV cache size {best.tokens} tokens (line {best.line}) is below what 'Maximum concurrency for "
            f"{max_len} tokens per request: {ratio:.2f}x' (line {line_no}) implies: a hybrid / sliding-window "
            f"model, whose token figure is derived; the pool is taken as {max_len} x {ratio:.2f}"
        )
    elif st.kv_tokens and context_length and st.concurrency:
        flags["kv_pool_note"] = (
            "V1 token counts are derived (hybrid / sliding-window models may hold fewer physical slots)"
        )
    if st.available_kv_gib is not None:
        flags["available_kv_cache_gib"] = st.available_kv_gib
    if dp_size is not None and dp_size > 1 and kv_pool_tokens is not None:
        flags["kv_pool_scope"] = f"per engine (data_parallel_size={dp_size}); one request can use at most this"

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
        page_size=block_size,
        tp_size=tp_size,
        dp_size=dp_size,
        flags=flags,
        evidence=evidence,
        **log_end_fields(st.last_line, st.last_ts, st.shutdown),
    )
