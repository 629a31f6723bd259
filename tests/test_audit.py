"""The deployment exposure audit (issue 6): the checks per instance and start-up, never a pass on
missing evidence, exit 1 when exposed / 0 when clean / 2 when nothing could be audited."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from kvforensics.audit import (
    CHECKS,
    AuditReport,
    Verdict,
    audit_database,
    audit_incident,
    audit_paths,
    audit_startups,
    read_manifest,
    read_server_info,
)
from kvforensics.cli import main
from kvforensics.core import db
from kvforensics.core.errors import InputError
from kvforensics.sources.engine_logs.parse import EngineEvent, StartupRecord

FIXTURES = Path(__file__).parent / "fixtures"
ENGINE = FIXTURES / "engine_logs"
AUDIT = FIXTURES / "audit"
SAMPLE = Path(__file__).parent.parent / "data" / "sample"
GLM53 = {"zai-org/GLM-5.3-FP8": "@cf/zai-org/glm-5.3"}


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def verdict(report: AuditReport, check: int, startup: int = 0, instance: str | None = None) -> Verdict:
    """The verdict of *check* for the *startup*-th start-up (in time order) of *instance*."""
    rows = [v for v in report.verdicts if v.check == check and (instance is None or v.instance == instance)]
    return rows[startup]


def audit_one(name: str, **kwargs: Any) -> AuditReport:
    folder = ENGINE if (ENGINE / name).exists() else AUDIT
    return audit_paths([folder / name], year=2026, **kwargs)


def pd_pair(**kwargs: Any) -> AuditReport:
    return audit_paths([AUDIT / "glm53-prefill-0.log", AUDIT / "glm53-decode-0.log"], model_aliases=GLM53, **kwargs)


# ---------------------------------------------------------------------------------------------
# Check 1: KV pool vs context length, in every engine log format
# ---------------------------------------------------------------------------------------------

CHECK1 = [
    # file, start-up, role, status, exposed, evidence line
    ("sglang-0.2-gpu-prefix.log", 0, "unified", "pass", False, 12),
    ("sglang-0.2.15-time-only.log", 0, "unified", "pass", False, 7),
    ("sglang-0.3-tp0-on-tp1.log", 0, "unified", "pass", False, 7),
    ("sglang-0.4.3-tp8.log", 0, "unified", "not_applicable", False, 50),
    ("sglang-0.4.6-dp-attention.log", 0, "unified", "unknown", False, 22),
    ("sglang-0.5.4-pd-prefill.log", 0, "prefill", "pass", False, 13),
    ("sglang-0.5.15-pd-prefill-tp8.log", 0, "prefill", "fail", True, 58),
    ("sglang-0.5.15-pd-decode-tp8.log", 0, "decode", "pass", False, 18),
    ("sglang-0.5.21-hybrid-swa.log", 0, "unified", "pass", False, 19),
    ("sglang-0.5.23-ray-post-capture.log", 0, "unified", "not_applicable", False, 15),
    ("sglang-restarts.log", 0, "prefill", "pass", False, 4),
    ("sglang-restarts.log", 1, "prefill", "fail", True, 14),
    ("sglang-restarts.log", 2, "prefill", "pass", False, 18),
    ("vllm-0.6.3.log", 0, "unified", "pass", False, 8),
    ("vllm-0.6.3-v0.log", 0, "unified", "pass", False, 5),
    ("vllm-0.8.5-multiworker.log", 0, "unified", "pass", False, 8),
    ("vllm-0.8.5-v0-refused-restart.log", 0, "unified", "not_applicable", False, 9),
    ("vllm-0.8.5-v0-refused-restart.log", 1, "unified", "pass", False, 15),
    ("vllm-0.8.5-v1-rollover.log", 0, "unified", "pass", False, 9),
    ("vllm-0.10.1-pd-producer-docker.log", 0, "prefill", "pass", False, 5),
    ("vllm-0.11.0-hybrid-pd-prefill.log", 0, "prefill", "pass", False, 8),
    ("vllm-0.10.1-refused.log", 0, "unified", "not_applicable", False, 6),
    ("vllm-0.10.1-refused.log", 1, "unified", "pass", False, 11),
    ("vllm-0.33.0-banner-dp.log", 0, "unified", "pass", False, 12),
    ("vllm-0.33.0-pd-prefill.log", 0, "prefill", "pass", False, 5),
    ("glm53-prefill-0.log", 0, "prefill", "fail", True, 6),
    ("glm53-prefill-0.log", 1, "prefill", "pass", False, 18),
    ("glm53-decode-0.log", 0, "decode", "fail", True, 6),
    ("glm53-decode-0.log", 1, "decode", "pass", False, 17),
]


@pytest.mark.parametrize(("name", "startup", "role", "status", "exposed", "line"), CHECK1)
def test_pool_vs_context_in_every_engine_log_format(
    name: str, startup: int, role: str, status: str, exposed: bool, line: int
) -> None:
    v = verdict(audit_one(name), 1, startup)
    assert (v.role, v.status, v.exposed, Path(v.evidence_file or "").name, v.evidence_line) == (
        role,
        status,
        exposed,
        name,
        line,
    )


def test_pd_prefill_pool_below_context_is_exposed_with_the_exact_limit_and_the_value_to_set() -> None:
    v = verdict(pd_pair(), 1, instance="glm53-prefill-0")
    assert v.detail == (
        "KV pool 681,280 < context 1,048,576: the scheduler limit is min(1,048,575, 681,279) - 5 = 681,274, "
        "so prompts of 681,274-1,048,575 tokens pass the context check and are aborted by the scheduler; on "
        "the disaggregated path, builds before 0.5.22 still hand them to decode, which answers them from "
        "stale KV pages (HTTP 200); set --context-length <= 681,280 (the pool) on both roles; the log shows "
        "2 scheduler abort(s) in this start-up (first at glm53-prefill-0.log:9)"
    )
    assert (v.model, v.startup_from, v.startup_to) == (
        "@cf/zai-org/glm-5.3",
        utc("2026-08-27 15:42:00"),
        utc("2026-09-09 14:05:00"),
    )


def test_a_hybrid_vllm_model_that_fits_one_request_is_no_false_alarm() -> None:
    # issue 29, observation 1: 'GPU KV cache size: 67,728 tokens' under max_model_len 180,000 on a PD
    # prefill, with 'Maximum concurrency for 180,000 tokens per request: 1.06x'
    v = verdict(audit_one("vllm-0.11.0-hybrid-pd-prefill.log"), 1)
    assert (v.status, v.exposed, v.evidence_line) == ("pass", False, 8)  # the concurrency line
    assert v.detail.split("; ") == [
        "vLLM's 'Maximum concurrency for 180,000 tokens per request: 1.06x': one request of max_model_len fits "
        "the KV cache (the V1 engine refuses to start otherwise, check_enough_kv_cache_memory), and vLLM admits "
        "no prompt longer than max_model_len",
        "its 'KV cache size' of 67,728 tokens is derived per KV cache group for hybrid / sliding-window models "
        "(vllm-project/vllm#40691), not a limit on one request",
    ]


def test_pd_decode_pool_below_context_is_exposed_too() -> None:
    v = verdict(pd_pair(), 1, instance="glm53-decode-0")
    assert (v.status, v.exposed) == ("fail", True)
    assert v.detail == (
        "KV pool 983,040 < context 1,048,576: the scheduler limit is min(1,048,575, 983,039) - 5 = 983,034, "
        "so prompts of 983,034-1,048,575 tokens pass the context check and are aborted by the scheduler; "
        "this decode node cannot hold every request its prefill peers admit; set --context-length <= 983,040 "
        "(the pool) on both roles of the pair"
    )


def test_restart_with_a_larger_pool_is_clean() -> None:
    report = pd_pair()
    after = [verdict(report, 1, 1, instance) for instance in ("glm53-prefill-0", "glm53-decode-0")]
    assert [(v.status, v.exposed, v.startup_from, v.startup_to) for v in after] == [
        ("pass", False, utc("2026-09-09 14:05:00"), None),
        ("pass", False, utc("2026-09-09 14:35:00"), None),
    ]
    assert after[0].detail == (
        "KV pool 2,042,880 >= context 1,048,576: the pool never lowers the scheduler limit (context - 6 = 1,048,570)"
    )
    assert [(w.instance, w.start, w.end) for w in report.exposure_windows] == [
        ("glm53-decode-0", utc("2026-08-27 15:36:00"), utc("2026-09-09 14:35:00")),
        ("glm53-prefill-0", utc("2026-08-27 15:42:00"), utc("2026-09-09 14:05:00")),
    ]


def test_unified_pool_below_context_is_not_applicable_and_not_exposed() -> None:
    """A unified server's scheduler refuses a prompt beyond its pool with an error: check 1's exposure needs a
    disaggregated hand-off, so the verdict is n/a with what the clients see, never a FAIL the headline then
    calls "Not exposed" (issue 27, observation 4)."""
    report = audit_one("sglang-0.5.23-ray-post-capture.log")
    v = verdict(report, 1)
    assert v.detail == (
        "KV pool 119,808 < context 131,072 (after the post-capture resize): the scheduler limit is "
        "min(131,071, 119,807) - 5 = 119,802, so prompts of 119,802-131,071 tokens pass the context check "
        "and are aborted by the scheduler; a unified server answers them with an error, so nothing is served "
        "from stale KV (that needs a disaggregated hand-off); set --context-length <= 119,808 (the pool) so the "
        "context check refuses them up front; the log shows 1 scheduler abort(s) in this start-up (first at "
        "sglang-0.5.23-ray-post-capture.log:17)"
    )
    assert (v.status, v.exposed, report.exit_code, report.exit_code_now) == ("not_applicable", False, 0, 0)


def test_multi_rank_pool_is_the_smallest_rank_and_dp_attention_pool_is_per_replica() -> None:
    v = verdict(audit_one("sglang-0.4.3-tp8.log"), 1)
    assert v.detail.startswith("KV pool 59,868 < context 163,840: the scheduler limit is min(163,839, 59,867) - 5")
    dp = verdict(audit_one("sglang-0.4.6-dp-attention.log"), 1)
    assert "(per DP replica, dp_size=2)" in dp.detail


def test_abort_limits_that_contradict_the_pool_and_context_make_a_pass_unknown() -> None:
    v = verdict(audit_one("sglang-0.4.6-dp-attention.log"), 1)
    assert v.status == "unknown"
    assert v.detail.endswith(
        "the log shows 2 scheduler abort(s) in this start-up (first at sglang-0.4.6-dp-attention.log:29) "
        "reporting a limit of 410,746, not the 163,834 these numbers give: the pool or context reading is "
        "inconsistent (a /get_server_info dump shows max_req_input_len)"
    )


def test_hybrid_swa_pool_is_the_full_attention_pool() -> None:
    v = verdict(audit_one("sglang-0.5.21-hybrid-swa.log"), 1)
    assert v.detail == (
        "KV pool 258,048 >= context 131,072 (hybrid SWA pool; the full-attention layers bound one request): "
        "the pool never lowers the scheduler limit (context - 6 = 131,066)"
    )


def test_restart_without_server_args_carries_the_role_over_and_says_so() -> None:
    v = verdict(audit_one("sglang-restarts.log"), 1, 2)
    assert (v.role, v.model) == ("prefill", "@cf/zai-org/glm-5.3")
    assert v.detail.endswith(
        "[role and model assumed from the previous start-up (sglang-restarts.log:11): this one logged no server_args]"
    )


def test_vllm_start_up_that_refused_to_start_served_nothing() -> None:
    report = audit_one("vllm-0.10.1-refused.log")
    v = verdict(report, 1)
    assert v.detail == (
        "vLLM refused to start: the KV cache cannot hold max_model_len 131,072 (estimated maximum model "
        "length 59,296); this start-up served nothing"
    )
    assert [verdict(report, c).status for c in range(2, 6)] == ["not_applicable"] * 4
    assert verdict(report, 1, 1).detail == (
        "KV cache 59,296 tokens >= max_model_len 32,768: vLLM admits no prompt longer than max_model_len, so "
        "every admitted prompt fits (vLLM V1 token counts are derived; hybrid / sliding-window models may "
        "hold fewer physical slots)"
    )


def record(**overrides: object) -> StartupRecord:
    """A start-up record with nothing known but what the test says."""
    base: dict[str, object] = {
        "instance": "node",
        "ts": utc("2026-09-01 00:00:00"),
        "line": 1,
        "engine": "sglang",
        "engine_version": None,
        "version_source": None,
        "role": "prefill",
        "model": None,
        "kv_pool_tokens": None,
        "pool_source_line": None,
        "context_length": None,
        "page_size": None,
        "tp_size": None,
        "dp_size": None,
        "flags": {},
        "evidence": {},
    }
    base.update(overrides)
    return StartupRecord(**base)  # type: ignore[arg-type]


def test_missing_pool_or_context_is_unknown_never_pass() -> None:
    report = audit_startups([record(context_length=131072)], source_file="node.log")
    v = verdict(report, 1)
    assert (v.status, v.exposed) == ("unknown", False)
    assert v.detail == "no KV pool size in this start-up's log: pool vs context cannot be checked"
    assert (v.evidence_file, v.evidence_line) == ("node.log", 1)


def test_unknown_role_with_pool_below_context_fails_closed() -> None:
    rec = record(
        role="unified",
        kv_pool_tokens=1000,
        context_length=4096,
        pool_source_line=3,
        flags={"role_source": "default (no server_args line)"},
    )
    v = verdict(audit_startups([rec]), 1)
    assert (v.role, v.status, v.exposed) == ("unknown", "fail", True)
    assert "the role is unknown (no server_args line)" in v.detail


def test_vllm_pd_pool_below_max_model_len_without_refusal_is_exposed() -> None:
    rec = record(
        engine="vllm",
        role="decode",
        kv_pool_tokens=100_000,
        context_length=131_072,
        pool_source_line=9,
        engine_version="0.8.5",
        version_source="log",
    )
    v = verdict(audit_startups([rec]), 1)
    assert (v.status, v.exposed) == ("fail", True)
    assert v.detail == (
        "KV cache 100,000 tokens < max_model_len 131,072 and the engine did not refuse to start: prompts "
        "longer than the pool are admitted; set --max-model-len <= 100,000"
    )


def test_vllm_approximate_pool_too_close_to_call_is_unknown() -> None:
    rec = record(
        engine="vllm",
        role="unified",
        kv_pool_tokens=131_072,
        context_length=131_072,
        flags={"kv_pool_source": "approximate: max_model_len x maximum concurrency (2 decimals)"},
    )
    assert verdict(audit_startups([rec]), 1).status == "unknown"


# ---------------------------------------------------------------------------------------------
# Check 2: engine version
# ---------------------------------------------------------------------------------------------


def test_version_inferred_below_the_fix_fails_on_pd_roles() -> None:
    v = verdict(audit_one("sglang-0.5.15-pd-prefill-tp8.log"), 2)
    assert v.status == "fail"
    assert v.detail == (
        "SGLang >0.5.9,<0.5.20 (inferred from format: server_args=ServerArgs(...); dtype: in the KV Cache "
        "line; available_gpu_mem in the max_total_num_tokens line; 'ReqTimeStats(... input_len=...)'): every "
        "release in that range is below 0.5.22, which first refuses oversize requests before the hand-off; "
        "upgrade to >= 0.5.22; the log shows 1 scheduler abort(s) on this prefill node (first at "
        "sglang-0.5.15-pd-prefill-tp8.log:62): with this build each was still handed to decode"
    )


def test_version_range_straddling_the_fix_is_unknown_and_logged_fixed_version_passes() -> None:
    report = pd_pair()
    before = verdict(report, 2, 0, "glm53-decode-0")
    assert (before.status, before.evidence_line) == ("unknown", 1)
    assert before.detail.endswith(
        "the range includes releases before and after 0.5.22; give a /get_server_info dump to confirm the build"
    )
    after = verdict(report, 2, 1, "glm53-prefill-0")
    assert (after.status, after.evidence_line) == ("pass", 12)
    assert after.detail == (
        "SGLang 0.5.22 (from the log, glm53-prefill-0.log:12) >= 0.5.22: a request with a pending abort is "
        "refused at the disaggregation admission queue before any KV is sent"
    )


def test_version_from_server_info_says_so_and_points_into_the_dump() -> None:
    report = pd_pair(server_info=[AUDIT / "glm53-prefill-0.server_info.json"])
    v = verdict(report, 2, 0, "glm53-prefill-0")
    assert (v.status, Path(v.evidence_file or "").name, v.evidence_line) == (
        "fail",
        "glm53-prefill-0.server_info.json",
        17,
    )
    assert v.detail.startswith("SGLang 0.5.20 (from glm53-prefill-0.server_info.json) < 0.5.22: ")


def test_unified_and_vllm_report_their_version_but_the_fix_does_not_apply() -> None:
    v = verdict(audit_one("sglang-0.5.21-hybrid-swa.log"), 2)
    assert (v.status, v.evidence_line) == ("not_applicable", 1)
    assert v.detail == (
        "unified (non-disaggregated) server: the PD reject-path fix (>= 0.5.22) does not apply; engine "
        "version 0.5.21 (from the log, sglang-0.5.21-hybrid-swa.log:1)"
    )
    assert verdict(audit_one("vllm-0.33.0-pd-prefill.log"), 2).detail == (
        "vllm: the SGLang disaggregated reject-path fix (>= 0.5.22) does not apply; engine version 0.33.0 "
        "(from the log, vllm-0.33.0-pd-prefill.log:1)"
    )


@pytest.mark.parametrize(
    ("version", "source", "spec", "status"),
    [
        ("0.5.22", "log", None, "pass"),
        ("0.5.23.post1", "log", None, "pass"),
        ("0.5.21", "log", None, "fail"),
        ("0.5.22rc1", "log", None, "unknown"),
        (">=0.5.22 (inferred: x)", "inferred from format", ">=0.5.22", "pass"),
        (">0.5.15 (inferred: x)", "inferred from format", ">0.5.15", "unknown"),
        ("<=0.4.6 (inferred: x)", "inferred from format", "<=0.4.6", "fail"),
        (None, None, None, "unknown"),
    ],
)
def test_version_verdicts(version: str | None, source: str | None, spec: str | None, status: str) -> None:
    flags = {"engine_version_spec": spec} if spec else {}
    rec = record(engine_version=version, version_source=source, flags=flags, evidence={"engine_version": 1})
    assert verdict(audit_startups([rec]), 2).status == status


def test_log_and_server_info_versions_that_disagree_are_unknown(tmp_path: Path) -> None:
    dump = tmp_path / "node.server_info.json"
    dump.write_text(json.dumps({"version": "0.5.22", "disaggregation_mode": "prefill"}))
    rec = record(engine_version="0.5.15", version_source="log", evidence={"engine_version": 4})
    v = verdict(audit_startups([rec], source_file="node.log", server_info=[read_server_info(dump)]), 2)
    assert v.status == "unknown"
    assert v.detail == (
        "the log says SGLang 0.5.15 (node.log:4) but node.server_info.json says 0.5.22: confirm which build runs"
    )


# ---------------------------------------------------------------------------------------------
# Check 3: deferred KV release and a capped Mooncake transfer batch
# ---------------------------------------------------------------------------------------------


def test_deferred_release_and_capped_batch_pass() -> None:
    v = verdict(pd_pair(), 3, 1, "glm53-prefill-0")
    assert (v.status, v.evidence_line) == ("pass", 13)
    assert v.detail == (
        "deferred KV release on (disaggregation_defer_kv_release=true); Mooncake transfer batch capped at 64 "
        "(disaggregation_mooncake_transfer_batch_size=64)"
    )


def test_absent_settings_are_unknown_and_a_default_is_not_evidence() -> None:
    v = verdict(pd_pair(), 3, 0, "glm53-prefill-0")
    assert (v.status, v.evidence_line) == ("unknown", 1)
    assert v.detail == (
        "deferred KV release: not in the server args (newer builds default it on, but a default is not "
        "evidence); Mooncake transfer batch cap: not in the server args"
    )
    unset = verdict(pd_pair(), 3, 1, "glm53-decode-0")
    assert unset.status == "unknown"
    assert "Mooncake transfer batch cap not set (disaggregation_mooncake_transfer_batch_size=None)" in unset.detail


def test_settings_from_server_info_fill_what_the_log_lacks() -> None:
    report = pd_pair(server_info=[AUDIT / "glm53-prefill-0.server_info.json"])
    v = verdict(report, 3, 0, "glm53-prefill-0")
    assert (v.status, Path(v.evidence_file or "").name, v.evidence_line) == (
        "fail",
        "glm53-prefill-0.server_info.json",
        10,
    )
    assert v.detail.startswith("deferred KV release off (disaggregation_defer_kv_release=false); ")


def test_other_transfer_backends_and_unified_servers() -> None:
    rec = record(
        flags={"disaggregation_transfer_backend": "nixl", "disaggregation_defer_kv_release": "true"},
        evidence={"server_args": 1},
    )
    v = verdict(audit_startups([rec]), 3)
    assert (v.status, v.detail) == (
        "pass",
        (
            "deferred KV release on (disaggregation_defer_kv_release=true); transfer backend nixl: the "
            "Mooncake batch cap does not apply"
        ),
    )
    assert verdict(audit_one("sglang-0.5.23-ray-post-capture.log"), 3).status == "not_applicable"
    assert verdict(audit_one("vllm-0.10.1-pd-producer-docker.log"), 3).detail == (
        "vllm (KV moves via NixlConnector): deferred KV release and the Mooncake transfer batch are SGLang settings"
    )


# ---------------------------------------------------------------------------------------------
# Check 4: KV checksum / canary and evidence of verification
# ---------------------------------------------------------------------------------------------


def test_detection_on_without_verification_evidence_is_unknown() -> None:
    v = verdict(pd_pair(), 4, 1, "glm53-prefill-0")
    assert (v.status, v.evidence_line) == ("unknown", 13)
    assert v.detail == (
        "detection on (disaggregation_enable_kv_checksum=true, kv_canary=log) but nothing in the log shows a "
        "request being verified: SGLang logs only mismatches, so a quiet log is no proof; check the engine's "
        "checksum / canary counters"
    )


def test_detection_off_fails_and_absent_is_unknown() -> None:
    off = verdict(pd_pair(), 4, 0, "glm53-prefill-0")
    assert (off.status, off.detail) == (
        "fail",
        (
            "corruption detection is off (disaggregation_enable_kv_checksum=false, kv_canary=none): turn on "
            "--disaggregation-enable-kv-checksum or --kv-canary where the model supports it"
        ),
    )
    older = verdict(audit_one("sglang-0.5.15-pd-prefill-tp8.log"), 4)  # the build predates --kv-canary
    assert (older.status, older.evidence_line) == ("fail", 1)
    assert older.detail.startswith(
        "corruption detection is off (disaggregation_enable_kv_checksum=false) (--kv-canary is not among "
        "the logged server args): "
    )
    absent = verdict(audit_one("sglang-0.5.4-pd-prefill.log"), 4)
    assert (absent.status, absent.detail) == (
        "unknown",
        "neither --disaggregation-enable-kv-checksum nor --kv-canary is in the server args",
    )


def test_mismatches_and_corruption_in_the_interval_fail_with_their_line() -> None:
    v = verdict(pd_pair(), 4, 0, "glm53-decode-0")
    assert (v.status, v.evidence_line) == ("fail", 10)
    assert v.detail == (
        "corruption detected in this start-up: 1 KV checksum mismatch(es) (first at glm53-decode-0.log:10); "
        "the responses involved may carry another request's KV"
    )
    swa = verdict(audit_one("sglang-0.5.21-hybrid-swa.log"), 4)  # a unified server: still a failure
    assert (swa.status, swa.evidence_line) == ("fail", 21)
    assert "1 KV canary violation(s) (first at sglang-0.5.21-hybrid-swa.log:22)" in swa.detail
    decode = verdict(audit_one("sglang-0.5.15-pd-decode-tp8.log"), 4)
    assert (decode.status, decode.evidence_line) == ("fail", 25)


def test_events_in_a_file_without_a_start_up_are_placed_by_time() -> None:
    rec = record(
        kv_pool_tokens=10,
        context_length=5,
        flags={"disaggregation_enable_kv_checksum": "true"},
        evidence={"server_args": 1},
    )
    later = EngineEvent("node", utc("2026-09-02 00:00:00"), 7, "checksum_mismatch", "r1", None, None, "x")
    report = audit_startups([("node.log", rec)], [("node.log.1", later)])
    v = verdict(report, 4)
    assert (v.status, v.evidence_file, v.evidence_line) == ("fail", "node.log.1", 7)


# ---------------------------------------------------------------------------------------------
# Check 5: load balancer, from the manifest only
# ---------------------------------------------------------------------------------------------


def test_without_a_manifest_the_load_balancer_is_unknown() -> None:
    v = verdict(pd_pair(), 5, 0, "glm53-prefill-0")
    assert (v.status, v.detail) == (
        "unknown",
        "no deployment manifest given: the load balancer's abort-on-disconnect behaviour is unknown",
    )
    assert verdict(audit_one("sglang-0.5.23-ray-post-capture.log"), 5).status == "not_applicable"


@pytest.mark.parametrize(
    ("manifest", "default_line", "override_line"),
    [
        ("manifest.toml", 4, 7),
        ("manifest.yaml", 7, 6),
    ],
)
def test_manifest_toml_and_yaml(manifest: str, default_line: int, override_line: int) -> None:
    report = pd_pair(manifest=AUDIT / manifest)
    ok = verdict(report, 5, 0, "glm53-prefill-0")
    assert (ok.status, Path(ok.evidence_file or "").name, ok.evidence_line) == (
        "pass",
        manifest,
        default_line,
    )
    assert ok.detail == "load balancer 'sgl-model-gateway' aborts only after the first token on client disconnect"
    bad = verdict(report, 5, 0, "glm53-decode-0")
    assert (bad.status, bad.evidence_line) == ("fail", override_line)
    assert bad.detail == (
        "load balancer 'sgl-model-gateway' aborts a request on client disconnect even before its first token "
        "(setting for instance glm53-decode-0): that abort needs prefill/decode coordination; set "
        'abort_on_client_disconnect = "after_first_token" or "never"'
    )


def test_manifest_model_overrides_booleans_and_gaps(tmp_path: Path) -> None:
    path = tmp_path / "lb.toml"
    path.write_text(
        '[load_balancer]\n[load_balancer.models."@cf/zai-org/glm-5.3"]\nabort_on_client_disconnect = false\n'
    )
    manifest = read_manifest(path)
    report = pd_pair(manifest=manifest)
    assert verdict(report, 5, 0, "glm53-prefill-0").detail == (
        "the load balancer never aborts on client disconnect (setting for model @cf/zai-org/glm-5.3)"
    )
    path.write_text('[load_balancer]\nname = "lb"\n')
    assert verdict(pd_pair(manifest=path), 5).status == "unknown"
    path.write_text("[deployment]\nreplicas = 2\n")
    assert verdict(pd_pair(manifest=path), 5).detail == "the manifest has no [load_balancer] table"


def test_a_bad_manifest_value_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "lb.toml"
    path.write_text('[load_balancer]\nabort_on_client_disconnect = "sometimes"\n')
    with pytest.raises(InputError) as err:
        read_manifest(path)
    assert str(err.value) == (
        f"{path}: load_balancer.abort_on_client_disconnect = 'sometimes'; use one of 'never', "
        "'after_first_token', 'always'"
    )


# ---------------------------------------------------------------------------------------------
# Never a pass on missing evidence; exit codes
# ---------------------------------------------------------------------------------------------

ALL_LOGS = sorted(ENGINE.glob("*.log")) + sorted(AUDIT.glob("*.log"))


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: p.name)
def test_every_fixture_gets_a_verdict_per_check_and_start_up_and_every_pass_has_evidence(path: Path) -> None:
    report = audit_paths([path], year=2026)
    assert report.verdicts and len(report.verdicts) == len(CHECKS) * report.startups
    for v in report.verdicts:
        assert v.status in ("pass", "fail", "unknown", "not_applicable")
        assert v.exposed == (v.check == 1 and v.status == "fail")  # one story: a FAIL is exposed
        if v.status == "pass":
            assert v.evidence_file is not None and v.evidence_line is not None, v
        assert v.check_name == CHECKS[v.check]


flag_values = st.sampled_from(["true", "false", "none", "64", "0", "log", ""])


@settings(max_examples=200, deadline=None)
@given(
    engine=st.sampled_from(["sglang", "vllm"]),
    role=st.sampled_from(["prefill", "decode", "unified"]),
    pool=st.none() | st.integers(1, 3_000_000),
    context=st.none() | st.integers(1, 3_000_000),
    version=st.none() | st.sampled_from(["0.5.15", "0.5.22", "0.6.0"]),
    flags=st.dictionaries(
        st.sampled_from(
            [
                "disaggregation_defer_kv_release",
                "disaggregation_mooncake_transfer_batch_size",
                "disaggregation_enable_kv_checksum",
                "kv_canary",
                "role_source",
                "startup_refused",
            ]
        ),
        flag_values,
    ),
)
def test_no_pass_without_the_evidence_it_needs(
    engine: str, role: str, pool: int | None, context: int | None, version: str | None, flags: dict[str, str]
) -> None:
    rec = record(
        engine=engine,
        role=role,
        kv_pool_tokens=pool,
        context_length=context,
        flags=flags,
        engine_version=version,
        version_source="log" if version else None,
    )
    report = audit_startups([rec], source_file="x.log")
    by_check = {v.check: v for v in report.verdicts}
    if by_check[1].status == "pass":
        assert pool is not None and context is not None and pool >= context
    if by_check[2].status == "pass":
        assert version is not None
    if by_check[3].status == "pass":
        assert flags.get("disaggregation_defer_kv_release") == "true"
        assert int(flags["disaggregation_mooncake_transfer_batch_size"]) > 0
    assert by_check[4].status != "pass"  # SGLang logs no successful verification
    assert by_check[5].status != "pass"  # no manifest
    assert report.exit_code == (1 if report.exposed else 0)


def test_exit_codes() -> None:
    assert pd_pair().exit_code == 1
    assert audit_one("sglang-0.5.15-pd-decode-tp8.log").exit_code == 0  # fails and unknowns, none exposed
    assert audit_one("sglang-0.4.6-dp-attention.log").exit_code == 0  # unknowns alone do not fail
    empty = audit_startups([])
    assert (empty.exit_code, empty.notes) == (2, ["no engine start-up found in the inputs: nothing to audit"])


def test_unreadable_inputs_raise_input_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="engine log not found"):
        audit_paths([tmp_path / "missing.log"])
    with pytest.raises(InputError, match="no engine logs given"):
        audit_paths([])
    bad = tmp_path / "x.server_info.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="server_info dump is not JSON"):
        read_server_info(bad)
    with pytest.raises(InputError, match="unknown time zone 'Mars/Olympus'"):
        audit_paths([AUDIT / "glm53-prefill-0.log"], tz="Mars/Olympus")


def test_server_info_for_an_unknown_instance_is_noted_not_used(tmp_path: Path) -> None:
    dump = tmp_path / "elsewhere.server_info.json"
    dump.write_text(json.dumps({"version": "0.5.22"}))
    report = pd_pair(server_info=[dump])
    assert report.notes == [
        (f"{dump}: server_info for instance 'elsewhere', which has no start-up in the engine logs; not used")
    ]


# ---------------------------------------------------------------------------------------------
# Presenters
# ---------------------------------------------------------------------------------------------


def hostile_report() -> AuditReport:
    rec = record(
        model="<script>alert(1)</script>|[bold]x[/bold]",
        kv_pool_tokens=5,
        context_length=10,
        pool_source_line=2,
    )
    return audit_startups([rec], source_file="n.log")


def test_json_frame_markdown_html_and_terminal() -> None:
    report = pd_pair(manifest=AUDIT / "manifest.toml")
    doc = json.loads(report.to_json())
    assert doc["summary"] == {
        "exposed": True,
        "exit_code": 1,
        "startups": 4,
        "instances": 2,
        "exposed_startups": 2,
        "shared_cache_startups": 0,
        # check 6 (prefix cache) is unknown on each start-up: the manifest has no [prefix_cache] table
        "verdicts": {"pass": 7, "fail": 6, "unknown": 7 + 4, "not_applicable": 0},
    }
    assert doc["verdicts"][0]["startup_from"] == "2026-08-27T15:36:00Z"
    frame = report.to_frame()
    assert len(frame) == 4 * len(CHECKS) and str(frame["startup_from"].dtype) == "datetime64[us, UTC]"
    assert list(frame.columns[:12]) == [
        "instance",
        "role",
        "model",
        "startup_from",
        "startup_to",
        "check",
        "check_name",
        "status",
        "exposed",
        "detail",
        "evidence_file",
        "evidence_line",
    ]
    md = report.to_markdown()
    assert md.startswith(
        "**EXPOSED: 2 start-up(s) serve prompts beyond their KV pool. 4 start-up(s) of 2 "
        "instance(s) x 6 checks = 24 verdicts: 7 pass, 6 fail, 11 unknown (the evidence cannot tell), 0 not "
        "applicable.**"
    )
    assert (
        "| glm53-prefill-0 | prefill | @cf/zai-org/glm-5.3 | 2026-08-27 15:42 → 2026-09-09 14:05 | 1. KV "
        "pool vs context length | FAIL (exposed) |" in md
    )


def test_untrusted_strings_are_escaped_everywhere() -> None:
    report = hostile_report()
    html_text = report._repr_html_()
    assert "<script>" not in html_text and "&lt;script&gt;alert(1)&lt;/script&gt;" in html_text
    md = report.to_markdown()
    assert "<script>" not in md and "\\|\\[bold\\]x\\[/bold\\]" in md
    console = Console(record=True, width=400, color_system=None)
    report.render_terminal(console)
    text = console.export_text()
    assert "[bold]x[/bold]" in text  # printed as text, not read as Rich markup
    assert "FAIL (exposed)" in text and "EXPOSED: 1 start-up(s)" in text


# ---------------------------------------------------------------------------------------------
# The evidence database
# ---------------------------------------------------------------------------------------------

CAPACITY_COLUMNS = (
    "instance, role, model, engine_model, valid_from, valid_to, kv_pool_tokens, context_length, "
    "page_size, engine, engine_version, version_source, tp_size, dp_size, flags, startup_refused, "
    "source, source_file, source_line, pool_source_line"
)


def test_audit_database_from_capacity_rows() -> None:
    con = db.connect()
    flags = json.dumps({"disaggregation_mode": "prefill", "engine_version_spec": ">0.5.9,<0.5.20"})
    for row in (
        (
            "glm53-prefill-0",
            "prefill",
            "@cf/zai-org/glm-5.3",
            "zai-org/GLM-5.3-FP8",
            utc("2026-08-27 15:42:00"),
            utc("2026-09-09 14:05:00"),
            681280,
            1048576,
            64,
            "sglang",
            ">0.5.9,<0.5.20 (inferred: x)",
            "inferred from format",
            8,
            1,
            flags,
            False,
            "engines",
            "engine/glm53-prefill-0.log",
            1,
            34,
        ),
        (
            "glm53-prefill-0",
            "prefill",
            "@cf/zai-org/glm-5.3",
            "zai-org/GLM-5.3-FP8",
            utc("2026-09-09 14:05:00"),
            None,
            2042880,
            1048576,
            64,
            "sglang",
            "0.5.22",
            "log",
            8,
            1,
            flags,
            False,
            "engines",
            "engine/glm53-prefill-0.log",
            2872,
            2905,
        ),
    ):
        con.execute(
            f"INSERT INTO capacity ({CAPACITY_COLUMNS}) VALUES "
            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            list(row),
        )
    con.execute(
        "INSERT INTO engine_events (instance, ts, kind, request_id, prompt_tokens, limit_tokens, detail, source, "
        "source_file, source_line) VALUES ('glm53-prefill-0', ?, 'abort_input_too_long', 'r1', 702311, "
        "681274, 'Input length (702311 tokens) exceeds the maximum allowed length (681274 tokens). "
        "Use a shorter input or enable --allow-auto-truncate., self.rid=''r1''', 'engines', "
        "'engine/glm53-prefill-0.log', 40)",
        [utc("2026-08-28 10:00:00")],
    )
    report = audit_database(con)
    first, second = verdict(report, 1, 0), verdict(report, 1, 1)
    assert (first.status, first.exposed, first.evidence_file, first.evidence_line) == (
        "fail",
        True,
        "engine/glm53-prefill-0.log",
        34,
    )
    assert first.detail.endswith(
        "the log shows 1 scheduler abort(s) in this start-up (first at glm53-prefill-0.log:40)"
    )
    assert (first.startup_from, first.startup_to) == (utc("2026-08-27 15:42:00"), utc("2026-09-09 14:05:00"))
    assert (second.status, second.exposed, second.evidence_line) == ("pass", False, 2905)
    assert verdict(report, 2, 1).detail.startswith("SGLang 0.5.22 (from the log) >= 0.5.22")
    assert report.exit_code == 1


def test_audit_database_agrees_with_audit_paths_on_every_fixture() -> None:
    from zoneinfo import ZoneInfo

    from kvforensics.sources.engine_logs.parse import parse_engine_log

    con = db.connect()
    startups = []
    for path in ALL_LOGS:
        parse = parse_engine_log(
            path, fmt="auto", instance=path.stem, tz=ZoneInfo("UTC"), year=2026, envelope="auto"
        )  # as audit_paths reads them
        startups += [(path, s) for s in parse.startups]
        for e in parse.events:
            con.execute(
                "INSERT INTO engine_events (instance, ts, kind, request_id, prompt_tokens, limit_tokens, detail, "
                "source, source_file, source_line) VALUES (?, ?, ?, ?, ?, ?, ?, 'engines', ?, ?)",
                [
                    e.instance,
                    e.ts,
                    e.kind,
                    e.request_id,
                    e.prompt_tokens,
                    e.limit_tokens,
                    e.detail,
                    str(path),
                    e.line,
                ],
            )
    by_instance: dict[str, list[tuple[Path, StartupRecord]]] = {}
    for path, s in startups:
        by_instance.setdefault(s.instance, []).append((path, s))
    for items in by_instance.values():  # what ingest does: valid_to = the instance's next start-up
        items.sort(key=lambda it: (it[1].ts is None, it[1].ts or datetime.min.replace(tzinfo=UTC)))
        for i, (path, s) in enumerate(items):
            valid_to = items[i + 1][1].ts if i + 1 < len(items) else None
            con.execute(
                f"INSERT INTO capacity ({CAPACITY_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'engines', ?, ?, ?)",
                [
                    s.instance,
                    s.role,
                    s.model,
                    s.model,
                    s.ts,
                    valid_to,
                    s.kv_pool_tokens,
                    s.context_length,
                    s.page_size,
                    s.engine,
                    s.engine_version,
                    s.version_source,
                    s.tp_size,
                    s.dp_size,
                    json.dumps(s.flags),
                    s.flags.get("startup_refused") == "true",
                    str(path),
                    s.line,
                    s.pool_source_line,
                ],
            )
    from_db = audit_database(con)
    from_logs = audit_paths(ALL_LOGS, year=2026)

    def key(r: AuditReport) -> list[tuple[object, ...]]:
        return [(v.instance, v.startup_from, v.check, v.role, v.status, v.exposed) for v in r.verdicts]

    assert key(from_db) == key(from_logs)

    def pool_evidence(r: AuditReport) -> list[tuple[str | None, int | None]]:
        # the database keeps no refusal line: there a refused vLLM start-up points at its pool line
        return [(v.evidence_file, v.evidence_line) for v in r.verdicts if v.check == 1 and v.status != "not_applicable"]

    assert pool_evidence(from_db) == pool_evidence(from_logs)


def test_the_event_kinds_the_sql_reads_are_the_audited_ones() -> None:
    from kvforensics.audit import AUDIT_EVENT_KINDS

    text = db.sql("audit_events")
    listed = text[text.index("WHERE kind IN") :].split(")")[0]
    assert sorted(k.strip(" '\n(") for k in listed.split("IN")[1].split(",")) == sorted(AUDIT_EVENT_KINDS)


# ---------------------------------------------------------------------------------------------
# The sample incident
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not (SAMPLE / "incident.toml").exists(),
    reason="data/sample is not generated yet (kvforensics simulate --seed 7 --out data/sample)",
)
def test_sample_incident_glm53_prefill_exposed_27_aug_to_9_sep_and_glm52_clean() -> None:
    from kvforensics.config import load_incident

    report = audit_incident(load_incident(SAMPLE / "incident.toml"))
    pools = [v for v in report.verdicts if v.check == 1]
    glm53_prefill = [v for v in pools if v.model == "@cf/zai-org/glm-5.3" and v.role == "prefill"]
    assert glm53_prefill, "no glm-5.3 prefill start-up found in data/sample/engine"
    exposed = [v for v in glm53_prefill if v.exposed]
    assert exposed and all(
        v.startup_from is not None
        and v.startup_from.date().isoformat() == "2026-08-27"
        and v.startup_to is not None
        and v.startup_to.date().isoformat() == "2026-09-09"
        for v in exposed
    )
    assert {v.instance for v in exposed} == {v.instance for v in glm53_prefill}
    after = [v for v in glm53_prefill if not v.exposed]
    assert after and all(
        v.status == "pass" and v.startup_from is not None and v.startup_from >= utc("2026-09-09 00:00:00")
        for v in after
    )
    glm52 = [v for v in report.verdicts if v.model == "@cf/zai-org/glm-5.2"]
    assert glm52 and all(not v.exposed for v in glm52)
    assert all(v.status == "pass" for v in glm52 if v.check == 1)
    assert {w.instance for w in report.exposure_windows} == {v.instance for v in exposed}
    assert report.exit_code == 1


def _two_pods_with_one_file_name(root: Path) -> list[Path]:
    """engines/prefill-0/sglang.log.gz and engines/prefill-1/sglang.log.gz: two engines, one start-up each."""
    import gzip

    startup = (FIXTURES / "engine_logs" / "sglang-0.5.4-pd-prefill.log").read_text().splitlines(keepends=True)[:17]
    paths = []
    for pod in ("prefill-0", "prefill-1"):
        path = root / "engines" / pod / "sglang.log.gz"
        path.parent.mkdir(parents=True)
        path.write_bytes(gzip.compress("".join(startup).encode()))
        paths.append(path)
    return paths


def test_files_of_one_name_in_several_folders_are_several_instances_by_default(tmp_path: Path) -> None:
    """Issue 26: `engines/*/sglang.log.gz` under the default {stem} would be one instance, `sglang`, whose two
    start-ups read as a restart; each folder is its own instance instead, and a note says so."""
    import gzip

    paths = _two_pods_with_one_file_name(tmp_path)
    report = audit_paths(paths)
    assert {v.instance for v in report.verdicts} == {"prefill-0", "prefill-1"}
    assert report.notes[0] == (
        "2 files in different folders share the instance name 'sglang' that --instance '{stem}' gives: told apart "
        "by their folder instead (--instance '{parent}'); pass --instance '{stem}' if they are one engine's logs"
    )
    assert {v.startup_to for v in report.verdicts} == {None}  # both still running
    merged = audit_paths(paths, instance_template="{stem}")
    assert {v.instance for v in merged.verdicts} == {"sglang"}
    assert len({v.startup_to for v in merged.verdicts}) == 2  # one read as restarted by the other
    assert not any("share the instance name" in n for n in merged.notes)
    both = audit_paths(paths, instance_template="{parent}/{stem}")
    assert {v.instance for v in both.verdicts} == {"prefill-0/sglang", "prefill-1/sglang"}
    # a note about one of them names its folder too
    (tmp_path / "engines" / "prefill-2").mkdir()
    (tmp_path / "engines" / "prefill-2" / "sglang.log.gz").write_bytes(gzip.compress(b"not a start-up\n"))
    notes = audit_paths([*paths, tmp_path / "engines" / "prefill-2" / "sglang.log.gz"], fmt="sglang").notes
    assert "prefill-2/sglang.log.gz: no engine start-up found; this file gives no KV pool size" in notes


def test_the_default_instance_template_keeps_the_stem_unless_folders_share_it() -> None:
    from kvforensics.audit.api import default_instance_template

    assert default_instance_template([Path("engine/p0.log"), Path("engine/d0.log.gz")]) == ("{stem}", None)
    # one engine's logs rotated in one folder: one instance
    assert default_instance_template([Path("engine/p0.log"), Path("engine/p0.log.gz")]) == ("{stem}", None)
    # a folder a day, several pods in each: the folder alone would merge the pods of a day
    template, note = default_instance_template(
        [Path("logs/2026-08-27/p0.log"), Path("logs/2026-08-27/p1.log"), Path("logs/2026-08-28/p0.log")]
    )
    assert template == "{parent}/{stem}" and note is not None and "'p0'" in note


def test_cli_audit_instance_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(p) for p in _two_pods_with_one_file_name(tmp_path)]
    main(["audit", "--json", *paths])
    doc = json.loads(capsys.readouterr().out)
    assert {v["instance"] for v in doc["verdicts"]} == {"prefill-0", "prefill-1"}
    assert "told apart by their folder instead (--instance '{parent}')" in doc["notes"][0]
    main(["audit", "--json", "--instance", "{stem}", *paths])
    assert {v["instance"] for v in json.loads(capsys.readouterr().out)["verdicts"]} == {"sglang"}
    assert main(["audit", "--instance", "{pod}", *paths]) == 2
    assert capsys.readouterr().err == (
        "Error: instance template '{pod}' may only use {stem}, {name}, {parent} and {label:NAME}: "
        "e.g. --instance '{parent}'\n"
    )
    assert main(["audit", "--incident", str(tmp_path / "incident.toml"), "--instance", "{parent}"]) == 2
    assert capsys.readouterr().err == (
        "Error: --instance names the instances of engine logs given on the command line; with --incident, set "
        "`instance` in each engine_log source of the incident file\n"
    )
