"""SGLang engine logs: one fixture per log format the reference documents, plus small inline cases."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from kvforensics.sources.engine_logs.parse import EngineLogParse, QuarantinedLine, parse_engine_log
from kvforensics.sources.engine_logs.sglang import parser as sglang

FIXTURES = Path(__file__).parent / "fixtures" / "engine_logs"
UTC_ZONE = ZoneInfo("UTC")


def fixture(name: str, tz: ZoneInfo = UTC_ZONE) -> EngineLogParse:
    return parse_engine_log(FIXTURES / name, fmt="sglang", instance=name.removesuffix(".log"), tz=tz)


def parse(text: str, tz: ZoneInfo = UTC_ZONE) -> EngineLogParse:
    lines = text.strip("\n").split("\n")
    return sglang.parse_lines(((i, t, t.encode()) for i, t in enumerate(lines, start=1)), instance="i", tz=tz)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# --- the incident configuration: disaggregated prefill and decode, TP8, 0.5.15 format ------------


def test_pd_prefill_tp8_startup_reads_pool_context_role_and_flags() -> None:
    p = fixture("sglang-0.5.15-pd-prefill-tp8.log")
    [s] = p.startups
    assert (s.instance, s.engine, s.line, s.ts) == (
        "sglang-0.5.15-pd-prefill-tp8",
        "sglang",
        1,
        utc(2026, 8, 26, 21, 10),
    )
    assert (s.role, s.model, s.kv_pool_tokens, s.context_length, s.page_size, s.tp_size, s.dp_size) == (
        "prefill",
        "@cf/zai-org/glm-5.3",
        681280,
        1048576,
        64,
        8,
        1,
    )
    assert s.pool_source_line == 58  # TP0's max_total_num_tokens line (the 8 ranks' KV lines agree)
    assert s.flags["kv_pool_reports"] == (
        "681280 (TP0..TP7 (8 reporters): KV Cache is allocated; TP0: max_total_num_tokens)"
    )
    assert s.flags["disaggregation_mode"] == "prefill"
    assert s.flags["disaggregation_transfer_backend"] == "mooncake"
    assert s.flags["disaggregation_enable_kv_checksum"] == "false"
    assert s.flags["allow_auto_truncate"] == "false"
    assert (s.engine_version, s.version_source) == (
        (
            ">0.5.9,<0.5.20 (inferred: server_args=ServerArgs(...); dtype: in the KV Cache line; "
            "available_gpu_mem in the max_total_num_tokens line; 'ReqTimeStats(... input_len=...)')"
        ),
        "inferred from format",
    )
    assert s.flags["engine_version_spec"] == ">0.5.9,<0.5.20"
    assert s.evidence == {
        "server_args": 1,
        "fired_up": 61,
        "role": 1,
        "model": 1,
        "tp_size": 1,
        "dp_size": 1,
        "kv_pool_tokens": 58,
        "context_length": 58,
        "page_size": 1,
        "engine_version": 1,
    }
    assert p.lines_read == 65
    assert p.quarantined == []


def test_pd_prefill_events_keep_the_real_prompt_length_of_a_stubbed_request() -> None:
    p = fixture("sglang-0.5.15-pd-prefill-tp8.log")
    summary = [(e.line, e.kind, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events]
    assert summary == [
        (62, "abort_input_too_long", "7f3c9a10d2b44e0f9a1c2b3d4e5f6a7b", 702311, 681274),
        (63, "req_time_stats", "7f3c9a10d2b44e0f9a1c2b3d4e5f6a7b", 1, None),  # the 1-token stub
        (64, "req_time_stats", "0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a", 412233, None),
        (65, "transfer_failure", "c0ffee00000000000000000000000001", None, None),
    ]
    assert p.events[0].ts == utc(2026, 8, 28, 14, 3, 11)
    assert "cached_input_len=65536" in p.events[2].detail
    assert all(len(e.detail) <= 300 for e in p.events)


def test_pd_decode_tp8_reads_role_pool_and_transfer_events() -> None:
    p = fixture("sglang-0.5.15-pd-decode-tp8.log")
    [s] = p.startups
    assert (s.role, s.kv_pool_tokens, s.context_length) == ("decode", 1423360, 1048576)
    assert [(e.kind, e.request_id, e.prompt_tokens) for e in p.events] == [
        ("req_time_stats", "7f3c9a10d2b44e0f9a1c2b3d4e5f6a7b", 702311),
        ("transfer_failure", "c0ffee00000000000000000000000001", None),
        ("transfer_failure", None, None),  # KVTransferError(bootstrap_room=7001)
        ("transfer_failure", None, None),  # Lost connection with prefill instance
        ("context_corruption", "5e5e5e", None),
        ("transfer_failure", "6f6f6f", None),  # metadata not ready after readiness gate
    ]


def test_pd_prefill_0_5_4_reads_old_req_time_stats_bootstrap_failure_and_capacity_abort() -> None:
    p = fixture("sglang-0.5.4-pd-prefill.log")
    [s] = p.startups
    assert (s.role, s.kv_pool_tokens, s.context_length, s.page_size, s.tp_size) == (
        "prefill",
        362752,
        32768,
        64,
        2,
    )
    assert s.flags["engine_version_spec"] == ">0.4.6,<0.5.15"
    assert [(e.kind, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events] == [
        ("req_time_stats", "5c1e2a", 8192, None),
        ("abort_input_too_long", "9ab3f0", 33001, 32762),
        ("req_time_stats", "9ab3f0", 1, None),
        ("transfer_failure", "77aa01", None, None),
        ("abort_input_too_long", "88bb02", 400000, 362752),
    ]


# --- older envelopes -------------------------------------------------------------------------


def test_gpu_prefix_format_has_no_timestamps_and_every_rank_prints_the_summary() -> None:
    p = fixture("sglang-0.2-gpu-prefix.log")
    [s] = p.startups
    assert (s.ts, s.line, s.kv_pool_tokens, s.context_length, s.tp_size, s.pool_source_line) == (
        None,
        1,
        951231,
        8192,
        2,
        12,
    )
    assert s.flags["kv_pool_reports"] == "951231 (gpu=0,gpu=1: max_total_num_tokens)"
    assert s.engine_version == (
        "<0.2.15 (inferred: server_args=ServerArgs(...); [gpu=N] envelope; "
        "max_total_num_tokens line without chunked_prefill_size)"
    )
    assert s.page_size == 1 and s.flags["page_size_source"].startswith("default")
    assert "13 line(s) in the [gpu=N] format carry no timestamp; left empty" in p.notes
    assert "start-up at line 1: page_size not logged; SGLang's default of 1 assumed" in p.notes


def test_time_only_format_leaves_timestamps_empty_and_quarantines_an_impossible_time() -> None:
    p = fixture("sglang-0.2.15-time-only.log")
    [s] = p.startups
    assert (s.ts, s.model, s.kv_pool_tokens, s.context_length) == (None, "qwen2-7b", 1011302, 32768)
    assert s.flags["engine_version_spec"] == "<0.3.6"
    assert p.quarantined == [
        QuarantinedLine(
            13,
            "bad timestamp '25:61:00'",
            "[25:61:00 TP0] Decode batch. #running-req: 1, #token: 66, token usage: 0.00, gen throughput "
            "(token/s): 1.05, #queue-req: 0",
        )
    ]
    [truncated] = p.events
    assert (truncated.kind, truncated.line, truncated.ts) == ("input_truncated", 8, None)
    assert any("carry a time but no date" in n for n in p.notes)


def test_tp0_suffix_on_a_single_gpu_server_dates_the_build_to_0_4_6_or_older() -> None:
    [s] = fixture("sglang-0.3-tp0-on-tp1.log").startups
    assert (s.tp_size, s.kv_pool_tokens, s.context_length) == (1, 438576, 65536)
    assert s.flags["engine_version_spec"] == "<0.4.3"
    assert "TP0 suffix on a tp_size=1 server" in s.flags["version_evidence"]


def test_0_4_3_tp8_counts_a_rid_less_error_printed_by_every_rank_once() -> None:
    p = fixture("sglang-0.4.3-tp8.log")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.context_length, s.tp_size) == (59868, 163840, 8)
    assert s.flags["engine_version_spec"] == ">0.3.6,<0.4.4"  # 'K size' without '#tokens'
    assert [(e.line, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events] == [
        (62, None, 160062, 59862),  # first printed by TP3
        (71, None, 160062, 59862),  # the same text again: a second request
        (79, None, 61000, 59862),
    ]
    assert "21 copies of rid-less error lines printed by several TP ranks were counted once" in p.notes


def test_dp_attention_pool_is_per_replica_and_records_dp_size() -> None:
    p = fixture("sglang-0.4.6-dp-attention.log")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.tp_size, s.dp_size, s.role) == (410752, 4, 2, "unified")
    assert s.flags["enable_dp_attention"] == "true"
    assert s.flags["kv_pool_scope"] == "per DP replica (dp_size=2); one request can use at most this"
    assert s.flags["kv_pool_tokens_x_dp_size"] == "821504"
    assert s.flags["engine_version_spec"] == ">0.4.3,<0.4.10"
    # one request per DP replica, each printed by its two TP ranks
    assert [(e.line, e.prompt_tokens) for e in p.events] == [(29, 420000), (31, 420000)]


# --- newer builds: dict server_args, hybrid SWA, post-capture resize, Ray, ANSI ---------------


def test_hybrid_swa_pool_is_the_full_layer_tokens_after_post_capture_resize() -> None:
    p = fixture("sglang-0.5.21-hybrid-swa.log")
    [s] = p.startups
    assert (s.line, s.ts) == (2, datetime(2026, 9, 10, 8, 0, 0, 114000, tzinfo=UTC))  # SGLANG_LOG_MS
    assert (s.kv_pool_tokens, s.pool_source_line, s.context_length, s.model) == (
        258048,
        19,
        131072,
        "gemma-3-27b",
    )
    assert s.flags["swa_full_layer_tokens"] == "258048"
    assert s.flags["swa_layer_tokens"] == "206438"
    assert s.flags["swa_kv_allocated_tokens"] == "209715"
    assert s.flags["kv_pool_kind"] == "hybrid SWA (full-attention layer tokens bound one request)"
    assert (s.engine_version, s.version_source, s.evidence["engine_version"]) == ("0.5.21", "log", 1)
    # corruption-detection and transfer settings (operator checks 3 and 4)
    assert s.flags["disaggregation_enable_kv_checksum"] == "true"
    assert s.flags["disaggregation_defer_kv_release"] == "true"
    assert s.flags["disaggregation_mooncake_transfer_batch_size"] == "64"
    assert s.flags["kv_canary"] == "log"
    assert "watermark_secret" not in s.flags


def test_checksum_canary_and_retraction_events_and_request_logs_are_not_events() -> None:
    p = fixture("sglang-0.5.21-hybrid-swa.log")
    assert [(e.line, e.kind, e.request_id) for e in p.events] == [
        (21, "checksum_mismatch", "aa11bb22"),
        (22, "canary_violation", None),  # the header on line 23 is the same violation
        (31, "abort_other", "dd44"),
    ]


def test_ray_ansi_va_upper_bound_post_capture_and_pool_warning() -> None:
    p = fixture("sglang-0.5.23-ray-post-capture.log")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.context_length, s.tp_size, s.page_size) == (119808, 131072, 4, 16)
    assert s.model == "meta-llama/Llama-3.3-70B-Instruct"  # served_model_name=None: model_path
    assert s.flags["kv_va_upper_bound_tokens"] == "600000"  # an address-space bound, not the pool
    assert s.flags["kv_pool_resized_after_capture"] == "true"
    assert s.flags["kv_pool_below_context_warning"] == "true"
    assert s.flags["engine_version_spec"] == ">0.5.15"  # dict server_args
    [abort] = p.events
    assert (abort.request_id, abort.prompt_tokens, abort.limit_tokens) == ("ee55", 125000, 119802)


def test_restarts_give_one_startup_each_with_its_own_pool() -> None:
    p = fixture("sglang-restarts.log")
    got = [(s.line, s.ts, s.model, s.kv_pool_tokens, s.context_length, s.engine_version) for s in p.startups]
    assert got == [
        (
            1,
            utc(2026, 8, 20, 12),
            "@cf/zai-org/glm-5.2",
            1048576,
            524288,
            "0.5.15",
        ),  # from the traceback path
        (
            11,
            utc(2026, 8, 26, 21, 10),
            "@cf/zai-org/glm-5.3",
            681280,
            1048576,
            (
                ">0.5.9,<0.5.20 (inferred: server_args=ServerArgs(...); dtype: in the KV Cache line; "
                "available_gpu_mem in the max_total_num_tokens line)"
            ),
        ),
        # no server_args line: begins at the first start-up line after the 'fired up' line
        (
            16,
            utc(2026, 9, 9, 3),
            None,
            2043904,
            1048576,
            ">0.5.9 (inferred: dtype: in the KV Cache line; available_gpu_mem in the max_total_num_tokens line)",
        ),
    ]
    third = p.startups[2]
    assert (third.role, third.tp_size) == ("unknown", None)  # no line of its own says (issue 29, observation 5)
    assert third.flags["role_source"] == "default (no server_args line)"
    assert third.flags["tp_size_source"] == "unknown (only TP0 lines and no server_args line)"


# --- inline cases ----------------------------------------------------------------------------


def test_the_smallest_pool_any_rank_reports_is_effective() -> None:
    p = parse("""
[2026-08-27 10:00:01 TP0] KV Cache is allocated. #tokens: 681280, KV size: 20.00 GB
[2026-08-27 10:00:01 TP1] KV Cache is allocated. #tokens: 679936, KV size: 20.00 GB
[2026-08-27 10:00:02 TP0] max_total_num_tokens=681280, chunked_prefill_size=8192, max_prefill_tokens=8192, max_running_requests=64, context_len=1048576, available_gpu_mem=5.00 GB
""")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.pool_source_line, s.tp_size) == (679936, 2, 2)
    assert "start-up at line 1: ranks report different KV pool sizes" in p.notes[0]


def test_local_timezone_is_converted_to_utc_with_dst() -> None:
    la = ZoneInfo("America/Los_Angeles")
    p = parse(
        """
[2026-08-27 10:00:00] max_total_num_tokens=100, chunked_prefill_size=8, max_prefill_tokens=8, max_running_requests=1, context_len=50, available_gpu_mem=1.00 GB
[2026-11-01 01:30:00] Input length (200 tokens) exceeds the maximum allowed length (44 tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='r1'
[2026-12-01 10:00:00] Input length (200 tokens) exceeds the maximum allowed length (44 tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='r2'
""",
        tz=la,
    )
    assert p.startups[0].ts == utc(2026, 8, 27, 17)  # PDT = UTC-7
    assert [e.ts for e in p.events] == [utc(2026, 11, 1, 8, 30), utc(2026, 12, 1, 18)]  # fold=0, then PST
    assert any("repeated hour when daylight saving time ends" in n for n in p.notes)


def test_non_utf8_garbled_stamp_and_nul_lines_are_quarantined_with_reasons() -> None:
    lines = [
        (1, None, b"[2026-08-27 10:00:00] caf\xe9"),
        (2, "[2026-13-45 99:00:00 TP0] Load weight begin.", b""),
        (3, "[2026-08-2x 10:00:00 TP0] Load weight begin.", b""),
        (4, "\x00\x00\x00", b"\x00\x00\x00"),
        (5, "\x00\x00[2026-08-27 10:00:05 TP0] Load weight begin. avail mem=1 GB", b""),
        (6, "an ordinary unrecognised line", b""),
    ]
    p = sglang.parse_lines(lines, instance="i", tz=UTC_ZONE)
    assert p.lines_read == 6
    assert [(q.line, q.reason) for q in p.quarantined] == [
        (1, "not UTF-8"),
        (2, "bad timestamp '2026-13-45 99:00:00'"),
        (3, "unrecognised line prefix '[2026-08-2x 10:00:00 TP0]'"),
        (4, "only NUL bytes (a file hole left by a crash?)"),
    ]
    assert p.quarantined[0].raw == "[2026-08-27 10:00:00] caf\\xe9"
    assert [s.line for s in p.startups] == [5]  # NULs before a line are dropped, the line is read
    assert "1 line(s) contained NUL bytes, which were removed before reading" in p.notes


def test_pool_is_implied_by_the_abort_limit_when_no_pool_line_survived() -> None:
    p = parse("""
[2026-08-27 10:00:00] server_args=ServerArgs(model_path='m', tp_size=1, context_length=1048576, page_size=64, disaggregation_mode='prefill')
[2026-08-27 10:00:09] The server is fired up and ready to roll!
[2026-08-28 10:00:00] Input length (700000 tokens) exceeds the maximum allowed length (681274 tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='x'
""")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.pool_source_line, s.context_length) == (681280, 3, 1048576)
    assert s.flags["kv_pool_source"] == "implied by an abort limit (maximum allowed length + 6)"


def test_a_wrapped_server_args_dump_is_joined() -> None:
    p = parse("""
[2026-08-27 10:00:00] server_args=ServerArgs(model_path='zai-org/GLM-5.3', served_model
_name='glm', tp_size=8, disaggregation_mo
de='decode', page_size=64)
[2026-08-27 10:00:05 TP0] Load weight begin. avail mem=1 GB
""")
    [s] = p.startups
    assert (s.model, s.role, s.tp_size, s.page_size) == ("glm", "decode", 8, 64)
    assert "start-up at line 1: server_args dump at line 1 is wrapped over 3 lines; joined" in p.notes


def test_a_restart_without_fired_up_line_starts_a_new_startup() -> None:
    p = parse("""
[2026-08-27 10:00:00 TP0] Load weight begin. avail mem=1 GB
[2026-08-27 10:00:05 TP0] max_total_num_tokens=500, chunked_prefill_size=8, max_prefill_tokens=8, max_running_requests=1, context_len=100, available_gpu_mem=1.00 GB
[2026-08-27 10:05:00 TP0] Load weight begin. avail mem=1 GB
[2026-08-27 10:05:05 TP0] max_total_num_tokens=400, chunked_prefill_size=8, max_prefill_tokens=8, max_running_requests=1, context_len=100, available_gpu_mem=1.00 GB
""")
    assert [(s.line, s.kv_pool_tokens) for s in p.startups] == [(1, 500), (3, 400)]
    assert "start-up at line 1: ended without a 'fired up' line (next start-up begins at line 3)" in p.notes


def test_a_cut_off_server_args_dump_keeps_its_fields_and_does_not_swallow_the_next_lines() -> None:
    p = parse("""
server_args=ServerArgs(model_path='m', tp_size=2, disaggregation_mode='decode', context_len
INFO:     Started server process [1]
[2026-08-27 10:00:05 TP1] KV Cache is allocated. #tokens: 5000, KV size: 1.00 GB
""")
    [s] = p.startups
    assert (s.model, s.tp_size, s.role, s.kv_pool_tokens) == ("m", 2, "decode", 5000)
    assert "start-up at line 1: server_args dump at line 1 is cut off; fields after the cut were not read" in (p.notes)


def test_sglang_version_line_before_server_args_is_exact_and_role_is_inferred_without_args() -> None:
    p = parse("""
sglang version: 0.5.22
[2026-09-10 08:00:05 TP0] Load weight begin. avail mem=1 GB
[2026-09-10 08:00:09] CommonKVBootstrapServer started successfully on 0.0.0.0:8998
""")
    [s] = p.startups
    assert (s.engine_version, s.version_source, s.role) == ("0.5.22", "log", "prefill")
    assert s.evidence["role"] == 3


EVENT_EXAMPLES = [
    # (message after the envelope, kind, request_id, prompt_tokens, limit_tokens)
    (
        (
            "Input length (160062 tokens) exceeds the maximum allowed length (59862 tokens). Use a shorter input "
            "or enable --allow-auto-truncate., self.rid='a1'"
        ),
        "abort_input_too_long",
        "a1",
        160062,
        59862,
    ),
    (
        "Request b2 exceeds the maximum number of tokens: 700000 > 681280",
        "abort_input_too_long",
        "b2",
        700000,
        681280,
    ),
    (
        (
            "Multimodal prompt is too long after expanding multimodal tokens. After expanding "
            "len(req.origin_input_ids_unpadded)=100 => 70000 >= 65530., self.rid='c3'"
        ),
        "abort_input_too_long",
        "c3",
        70000,
        65530,
    ),
    (
        "The input (140000 tokens) is longer than the model's context length (131072 tokens).",
        "abort_input_too_long",
        None,
        140000,
        131072,
    ),
    (
        "The input (140000 tokens) is longer than the model's context length (131072 tokens). Truncating the input.",
        "input_truncated",
        None,
        140000,
        131072,
    ),
    (
        (
            "Request length is longer than the KV cache pool size or the max context length. Truncated. "
            "len(req.origin_input_ids)=90000, max_req_input_len=81914."
        ),
        "input_truncated",
        None,
        90000,
        81914,
    ),
    (
        (
            "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total "
            "of 9000 tokens: 8000 tokens from the input messages and 1000 tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within the limit."
        ),
        "abort_other",
        None,
        8000,
        8192,
    ),
    (
        "Request d4 requires too many SWA KV tokens for decode preallocation: 9000 > 8192",
        "abort_other",
        "d4",
        None,
        8192,
    ),
    (
        "Request e5 exceeds the unified FULL/SWA KV byte budget: full=1, swa=2",
        "abort_other",
        "e5",
        None,
        None,
    ),
    (
        "KV checksum mismatch req=f6 bootstrap_room=1 expected=0x1 got=0x2",
        "checksum_mismatch",
        "f6",
        None,
        None,
    ),
    (
        (
            "Context corruption detected: Request g7 (bootstrap_room=1) received metadata from bootstrap_room=2. "
            "Metadata buffer index: 3. This indicates metadata buffer index collision."
        ),
        "context_corruption",
        "g7",
        None,
        None,
    ),
    (
        "Decode handshake failed for request rank=0 decode_req.req.rid='h8' decode_req.req.bootstrap_room=9",
        "transfer_failure",
        "h8",
        None,
        None,
    ),
    (
        ("Metadata unexpectedly not ready after readiness gate: request i9, bootstrap_room=1, metadata_buffer_index=2"),
        "transfer_failure",
        "i9",
        None,
        None,
    ),
    ("Session 10.0.0.1:17777 failed.", "transfer_failure", None, None, None),
    ("Failed to send kv chunk of 5512 to 10.0.0.2:8998", "transfer_failure", None, None, None),
    ("AUX_DATA length mismatch for bootstrap_room 5512", "transfer_failure", None, None, None),
    (
        "Prefill transfer kvcache error, layers_current_pp_stage is out of range: 3",
        "transfer_failure",
        None,
        None,
        None,
    ),
    (
        "KV cache canary violation detected (kernel_kind=SWEEP_V_SWA, slot_idx=1, position=2)",
        "canary_violation",
        None,
        None,
        None,
    ),
    (
        "Out of memory even after retracting all other requests in the decode batch. Aborting the last request.",
        "abort_other",
        None,
        None,
        None,
    ),
    ("Abort request because client disconnected, rid=j10", "abort_other", "j10", None, None),
    (
        "Receive: obj=GenerateReqInput(rid='k11'), abort=False",
        None,
        None,
        None,
        None,
    ),  # request log: not an event
]


def test_every_sglang_event_form_is_recognised() -> None:
    for message, kind, rid, prompt, limit in EVENT_EXAMPLES:
        p = parse(f"[2026-08-27 10:00:00] {message}")
        got = [(e.kind, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events]
        assert got == ([(kind, rid, prompt, limit)] if kind else []), message


def test_python_literals_are_read_safely_by_threads_side_by_side() -> None:
    """Engine logs are parsed in threads at once. CPython 3.11's ast.literal_eval, called from two
    threads with garbage collections in between, raises SystemError ("AST constructor recursion depth
    mismatch"): a server_args line was quarantined that way. The collector is made to run often here
    (cycles with finalizers, threshold 1), which makes the bare call fail within a few hundred tries. What the
    process held before is frozen (``gc.freeze``), so each collection walks the test's objects only: the bare call
    fails as often, and the test takes seconds, not the tens of seconds a test worker's heap took."""
    import gc
    import sys
    import threading

    from kvforensics.sources.engine_logs.sglang.python_repr import literal

    class Finalized:
        def __del__(self) -> None:
            pass

    text = "[" + ", ".join(f"{{'k{i}': ({i}, [{i}, {{'x': 'y'}}], None)}}" for i in range(100)) + "]"
    expected = literal(text)
    failures: list[object] = []

    def work() -> None:
        for _ in range(200):
            junk: list[object] = [Finalized() for _ in range(10)]
            junk.append(junk)
            del junk
            try:
                if literal(text) != expected:
                    failures.append("different value")
            except SystemError as e:
                failures.append(e)

    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(1, 1, 1)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    assert failures == []
