"""vLLM engine logs (0.6 V0, 0.8 V0/V1, 0.10 V1 with PD, 0.33): one fixture per format, plus inline cases."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from kvforensics.sources.engine_logs.parse import EngineLogParse, parse_engine_log
from kvforensics.sources.engine_logs.vllm import parser as vllm

FIXTURES = Path(__file__).parent / "fixtures" / "engine_logs"
UTC_ZONE = ZoneInfo("UTC")
LA = ZoneInfo("America/Los_Angeles")


def fixture(name: str, tz: ZoneInfo = UTC_ZONE, year: int | None = 2026) -> EngineLogParse:
    return parse_engine_log(FIXTURES / name, fmt="vllm", instance="v", tz=tz, year=year)


def parse(text: str, tz: ZoneInfo = UTC_ZONE, year: int | None = 2026) -> EngineLogParse:
    lines = text.strip("\n").split("\n")
    return vllm.parse_lines(((i, t, t.encode()) for i, t in enumerate(lines, start=1)), instance="v", tz=tz, year=year)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def test_0_6_3_v0_blocks_times_block_size_and_the_config_line() -> None:
    p = fixture("vllm-0.6.3.log")
    [s] = p.startups
    assert (s.engine, s.engine_version, s.version_source, s.ts, s.line) == (
        "vllm",
        "0.6.3.post1",
        "log",
        utc(2026, 8, 27, 14, 0, 3),
        1,
    )
    assert (s.role, s.model, s.context_length, s.tp_size, s.page_size) == (
        "unified",
        "llama-3.1-8b",
        32768,
        2,
        16,
    )
    assert (s.kv_pool_tokens, s.pool_source_line) == (12200 * 16, 8)
    assert s.flags["kv_pool_reports"] == "195200 (engine: # GPU blocks x block_size 16)"
    assert s.flags["gpu_memory_utilization"] == "0.9"
    assert s.evidence["ready"] == 13
    assert "vLLM timestamps carry no year: 2026 assumed (given)" in p.notes


def test_0_6_3_events_scheduler_frontend_abort_and_kv_blocks() -> None:
    p = fixture("vllm-0.6.3.log")
    assert [(e.line, e.kind, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events] == [
        (16, "abort_input_too_long", None, 40000, 32768),
        (18, "abort_input_too_long", None, 40000, 32768),  # 40000 in the messages alone
        (19, "abort_other", None, 32000, 32768),  # the messages fit; messages + completion do not
        (22, "abort_other", "chat-77ff", None, None),
        (23, "abort_other", "chat-88aa", None, None),
    ]
    # the ValueError lines have no stamp: they take the time of the ERROR line above them
    assert p.events[1].ts == utc(2026, 8, 27, 15, 3)
    assert any("given the time of the last stamped line" in n for n in p.notes)


def test_0_8_5_v1_workers_report_different_sizes_and_the_year_rolls_over() -> None:
    p = fixture("vllm-0.8.5-v1-rollover.log")
    [s] = p.startups
    assert (s.engine_version, s.model, s.context_length, s.tp_size, s.dp_size) == (
        "0.8.5",
        "qwen-72b",
        131072,
        4,
        1,
    )
    assert (s.kv_pool_tokens, s.pool_source_line) == (1040000, 9)
    assert s.ts == utc(2026, 12, 31, 23, 58)
    assert s.page_size == 16 and s.flags["block_size_source"].startswith("default")
    assert p.notes[1:] == [
        "vLLM timestamps carry no year: 2026 assumed (given)",
        "vLLM timestamps roll over from December to January at line 9: 2027 from there on",
        "1 December line(s) after the new year were dated to the old year",
        (
            "1 event line(s) without a timestamp of their own (tracebacks, continuation lines) were given the time "
            "of the last stamped line before them"
        ),
    ]
    [event] = p.events
    assert (event.kind, event.prompt_tokens, event.limit_tokens, event.ts) == (
        "abort_input_too_long",
        140000,
        131072,
        utc(2027, 1, 1, 0, 12),
    )


def test_0_8_5_v0_startup_refusal_then_a_restart_give_two_startups() -> None:
    p = fixture("vllm-0.8.5-v0-refused-restart.log")
    first, second = p.startups
    assert (first.line, first.kv_pool_tokens, first.context_length, first.flags["startup_refused"]) == (
        1,
        23648,
        29000,
        "true",
    )
    assert first.evidence["startup_refused"] == 9
    assert "ready" not in first.evidence
    assert (second.line, second.kv_pool_tokens, second.context_length) == (12, 1952 * 16, 20000)
    assert "startup_refused" not in second.flags
    assert "start-up at line 1: did not become ready (next start-up begins at line 12)" in p.notes
    [event] = p.events
    assert (event.kind, event.prompt_tokens, event.limit_tokens) == ("abort_input_too_long", 21000, None)


def test_0_10_pd_producer_is_prefill_and_docker_prefix_agrees_with_local_time() -> None:
    p = fixture("vllm-0.10.1-pd-producer-docker.log", tz=LA)
    [s] = p.startups
    assert (s.role, s.engine_version, s.model, s.kv_pool_tokens, s.context_length, s.tp_size) == (
        "prefill",
        "0.10.1.1",
        "gpt-oss-120b",
        460496,
        131072,
        2,
    )
    assert (s.flags["kv_role"], s.flags["kv_connector"]) == ("kv_producer", "NixlConnector")
    assert s.ts == utc(2026, 8, 27, 21, 0, 3)  # 14:00:03 PDT
    assert not any("Docker" in n for n in p.notes)
    assert [(e.kind, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events] == [
        ("transfer_failure", "cmpl-3d2e-0", None, None),
        ("abort_input_too_long", None, 140001, 131072),
        ("abort_other", None, 130000, 131072),
    ]


def test_wrong_timezone_is_caught_by_the_docker_prefix() -> None:
    p = fixture("vllm-0.10.1-pd-producer-docker.log", tz=UTC_ZONE)
    assert (
        "engine timestamps differ from the Docker --timestamps prefix (UTC) by +7.00 h (first compared at line 1): "
        "check the source's timezone or clock offset"
    ) in p.notes


def test_without_a_year_the_docker_prefix_gives_it() -> None:
    p = fixture("vllm-0.10.1-pd-producer-docker.log", tz=LA, year=None)
    assert p.startups[0].ts == utc(2026, 8, 27, 21, 0, 3)
    assert "vLLM timestamps carry no year: 2026 assumed (from the Docker --timestamps prefix)" in p.notes


def test_0_33_banner_one_line_kv_size_and_dp_engines() -> None:
    p = fixture("vllm-0.33.0-banner-dp.log")
    [s] = p.startups
    assert (s.line, s.engine_version, s.model, s.context_length, s.page_size, s.tp_size, s.dp_size) == (
        2,
        "0.33.0",
        "google/gemma-4-31B-it",
        262144,
        32,
        1,
        2,
    )
    assert (s.kv_pool_tokens, s.pool_source_line) == (283115, 12)  # the smaller of the two DP engines
    assert s.flags["kv_pool_reports"] == (
        "283115 (EngineCore_DP1: GPU KV cache size), 288358 (EngineCore_DP0: GPU KV cache size)"
    )
    assert [(e.kind, e.request_id, e.prompt_tokens, e.limit_tokens) for e in p.events] == [
        ("abort_other", "chatcmpl-9f1", None, None),
        ("abort_other", "chatcmpl-9f2", None, None),
        ("abort_input_too_long", None, 262145, 262144),
    ]


def test_no_year_and_no_docker_prefix_leaves_timestamps_empty_and_says_why() -> None:
    p = parse("INFO 08-27 14:00:03 [api_server.py:1] vLLM API server version 0.8.5", year=None)
    assert p.startups[0].ts is None
    assert p.notes == [
        "1 vLLM line(s) carry no year and no year was given: their timestamps are left empty (give the incident year)"
    ]


def test_logo_disabled_version_line_kv_consumer_and_v1_refusal() -> None:
    p = parse("""
(APIServer pid=1) INFO 09-01 10:00:00 [startup.py:80] vLLM server version 0.33.0, serving model zai-org/GLM-5.3
(APIServer pid=1) INFO 09-01 10:00:00 [startup.py:81] non-default args: {'model': 'zai-org/GLM-5.3', 'max_model_len': 1048576, 'kv_transfer_config': KVTransferConfig(kv_connector='MooncakeConnector', kv_role='kv_consumer')}
(EngineCore pid=316) ValueError: To serve at least one request with the model's max seq len (1048576), (61.20 GiB KV cache is needed, which is larger than the available KV cache memory (39.80 GiB). Based on the available memory, the estimated maximum model length is 681280. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.
""")
    [s] = p.startups
    assert (s.engine_version, s.model, s.role, s.context_length, s.kv_pool_tokens) == (
        "0.33.0",
        "zai-org/GLM-5.3",
        "decode",
        1048576,
        681280,
    )
    assert s.flags["startup_refused"] == "true"
    assert s.flags["kv_pool_source"] == "estimated maximum model length from the start-up refusal"


def test_older_models_s_spelling_of_the_v1_refusal_is_read() -> None:
    p = parse(
        "ValueError: To serve at least one request with the models's max seq len (100000), (4.26 GiB KV cache "
        "is needed, which is larger than the available KV cache memory (4.25 GiB). Based on the available memory, "
        "the estimated maximum model length is 99808. Try increasing `gpu_memory_utilization`."
    )
    [s] = p.startups
    assert (s.context_length, s.kv_pool_tokens, s.flags["startup_refused"]) == (100000, 99808, "true")


def test_bad_stamps_and_non_utf8_lines_are_quarantined() -> None:
    lines = [
        (1, "INFO 13-45 10:00:00 [x.py:1] hello", b""),
        (2, "INFO 02-29 10:00:00 [x.py:1] not in 2026", b""),
        (3, None, b"INFO 08-27 10:00:00 [x.py:1] \xff\xfe"),
        (4, 'INFO:     10.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK', b""),
        (5, "INFO 0x-27 10:00:00 [x.py:1] garbled", b""),
    ]
    p = vllm.parse_lines(lines, instance="v", tz=UTC_ZONE, year=2026)
    assert p.lines_read == 5
    assert [(q.line, q.reason) for q in p.quarantined] == [
        (1, "bad timestamp '13-45 10:00:00'"),
        (2, "bad timestamp '02-29 10:00:00' (not a date in 2026)"),
        (3, "not UTF-8"),
        (5, "bad timestamp '0x-27 10:00:00'"),
    ]


def test_cuda_blocks_without_block_size_use_the_default_and_say_so() -> None:
    p = parse("""
INFO 03-03 10:00:05 [llm_engine.py:240] Initializing a V0 LLM engine (v0.7.3) with config: model='m', max_seq_len=8192, tensor_parallel_size=1
INFO 03-03 10:00:31 [executor_base.py:112] # cuda blocks: 1000, # CPU blocks: 2048
""")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.page_size, s.engine_version) == (16000, 16, "0.7.3")
    assert (
        "start-up at line 1: block_size not logged; the CUDA default of 16 is used to turn blocks into tokens"
    ) in p.notes


# Issue 29, observation 1. vllm-0.11.0-hybrid-pd-prefill.log is written from vLLM's source: the KV cache
# lines of vllm/v1/core/kv_cache_utils.py (_report_kv_cache_config, v0.10 - v0.19: "GPU KV cache size: %s
# tokens" and "Maximum concurrency for %s tokens per request: %.2fx"), the hybrid page-size lines of
# vllm/model_executor/models/config.py, the numbers of the hybrid model observed in issue 29 (a token
# figure below max_model_len with a concurrency above 1x, vllm-project/vllm#40691).
def test_a_hybrid_models_derived_token_figure_gives_way_to_the_concurrency_line() -> None:
    p = fixture("vllm-0.11.0-hybrid-pd-prefill.log")
    [s] = p.startups
    assert (s.role, s.context_length, s.kv_pool_tokens, s.pool_source_line) == ("prefill", 180000, 190800, 8)
    assert (s.flags["kv_cache_size_logged"], s.flags["kv_pool_concurrency"]) == ("67728", "1.06")
    assert s.flags["kv_pool_source"].startswith("Maximum concurrency x max_model_len")
    assert "kv_pool_note" not in s.flags
    assert any(
        "KV cache size 67728 tokens (line 7) is below what 'Maximum concurrency for 180000 tokens "
        "per request: 1.06x' (line 8) implies" in n
        for n in p.notes
    )


def test_an_ordinary_models_token_figure_stays_the_pool() -> None:
    # one KV cache group: the token figure is num_blocks x block_size, never below concurrency x max_model_len
    p = parse("""
(EngineCore_DP0 pid=1) INFO 10-03 16:22:10 [core.py:77] Initializing a V1 LLM engine (v0.11.0) with config: model='Qwen/Qwen3-14B', max_seq_len=32768, tensor_parallel_size=1
(EngineCore_DP0 pid=1) INFO 10-03 16:22:17 [kv_cache_utils.py:864] GPU KV cache size: 42,656 tokens
(EngineCore_DP0 pid=1) INFO 10-03 16:22:17 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per request: 1.30x
""")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.pool_source_line) == (42656, 2)
    assert "kv_pool_concurrency" not in s.flags and "kv_pool_note" in s.flags


def test_the_limiting_workers_concurrency_line_is_kept() -> None:
    p = parse("""
INFO 05-01 10:00:00 [core.py:58] Initializing a V1 LLM engine (v0.8.5) with config: model='m', max_seq_len=100000, tensor_parallel_size=2
(VllmWorker rank=0 pid=1) INFO 05-01 10:01:00 [kv_cache_utils.py:634] Maximum concurrency for 100,000 tokens per request: 1.20x
(VllmWorker rank=1 pid=2) INFO 05-01 10:01:00 [kv_cache_utils.py:634] Maximum concurrency for 100,000 tokens per request: 1.40x
""")
    [s] = p.startups
    assert (s.kv_pool_tokens, s.pool_source_line) == (120000, 2)


def test_a_terminal_wrapped_engine_config_is_joined_and_names_the_engine_that_ran() -> None:
    # issue 29, observation 2 (the fixture's provenance: tests/test_audit_prefix_cache.py)
    p = fixture("vllm-0.10.1-v1-wrapped-config.log")
    [s] = p.startups
    assert (s.flags["engine_generation"], s.evidence["engine_generation"]) == ("V1", 5)
    assert (s.flags["enable_prefix_caching"], s.evidence["enable_prefix_caching"]) == ("true", 9)
    assert (s.context_length, s.evidence["context_length"], s.kv_pool_tokens) == (32768, 6, 426800)
    assert not p.quarantined and p.lines_read == 15


def test_only_lines_that_read_as_the_dumps_rest_are_joined() -> None:
    p = parse("""
INFO 09-01 10:00:00 [api_server.py:1] vLLM API server version 0.9.2
INFO 09-01 10:00:00 [api_server.py:2] args: Namespace(model='m', max_model_len=4096, kv_transfer_config='{"kv_connector":"Nix
lConnector","kv_role":"kv_consumer"}', enable_prefix_caching=False)
INFO 09-01 10:00:01 [core.py:58] Initializing a V0 LLM engine (v0.9.2) with config: model='m', max_seq_len=4096
[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0
tokens=12 is not a config field
INFO 09-01 10:00:02 [api_server.py:3] non-default args: {'model': 'm', 'served_model_name': ['x
(EngineCore_0 pid=1) ValueError: To serve at least one request with the model's max seq len (4096), (1.00 GiB KV cache is needed, which is larger than the available KV cache memory (0.50 GiB).
""")
    [s] = p.startups
    assert (s.role, s.flags["kv_connector"], s.flags["enable_prefix_caching"]) == ("decode", "NixlConnector", "false")
    assert s.flags["engine_generation"] == "V0" and "tokens" not in s.flags
    assert s.flags["startup_refused"] == "true"  # the ValueError line is not taken for a piece of the dump
    assert "start-up at line 1: args dump at line 2 is wrapped over 2 lines; joined" in p.notes
    assert (
        "start-up at line 1: non-default args dump at line 7 is cut off; fields after the cut were not read" in p.notes
    )


def test_the_connectors_the_engine_builds_are_kept_with_their_line() -> None:
    # issue 29, observation 6 (the fixture's provenance: tests/test_audit_prefix_cache.py)
    p = fixture("vllm-0.33.0-lmcache-mp-no-prefix-caching.log")
    [s] = p.startups
    assert (s.flags["kv_connectors_created"], s.evidence["kv_connector_created"]) == ("LMCacheMPConnector", 6)
    assert (s.flags["kv_connector"], s.flags["enable_prefix_caching"], s.role) == (
        "LMCacheMPConnector",
        "false",
        "unified",
    )
