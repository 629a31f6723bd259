"""Shared fixtures: a small hand-built incident (one exposed prefill instance, one leak)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

PREFILL_LOG = """\
[2026-08-27 14:00:00] server_args=ServerArgs(model_path='zai-org/GLM-5.3-FP8', served_model_name='zai-org/GLM-5.3-FP8', tp_size=2, context_length=1048576, page_size=64, disaggregation_mode='prefill', disaggregation_transfer_backend='mooncake', disaggregation_bootstrap_port=8998)
[2026-08-27 14:00:05 TP0] Load weight begin. avail mem=139.50 GB
[2026-08-27 14:01:05 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 681280, KV size: 40.10 GB
[2026-08-27 14:01:05 TP1] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 681280, KV size: 40.10 GB
[2026-08-27 14:01:06 TP0] max_total_num_tokens=681280, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=1048576, available_gpu_mem=12.34 GB
[2026-08-27 14:01:30] The server is fired up and ready to roll!
[2026-08-28 10:00:00 TP0] Input length (700000 tokens) exceeds the maximum allowed length (681274 tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='r-leak'
[2026-09-09 12:00:00] server_args=ServerArgs(model_path='zai-org/GLM-5.3-FP8', served_model_name='zai-org/GLM-5.3-FP8', tp_size=2, context_length=1048576, page_size=64, disaggregation_mode='prefill', disaggregation_transfer_backend='mooncake', disaggregation_bootstrap_port=8998)
[2026-09-09 12:01:05 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 2042880, KV size: 80.10 GB
[2026-09-09 12:01:06 TP0] max_total_num_tokens=2042880, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=1048576, available_gpu_mem=12.34 GB
"""
DECODE_LOG = """\
[2026-08-27 14:00:00] server_args=ServerArgs(model_path='zai-org/GLM-5.3-FP8', served_model_name='zai-org/GLM-5.3-FP8', tp_size=1, context_length=1048576, page_size=64, disaggregation_mode='decode')
[2026-08-27 14:01:06] max_total_num_tokens=1310720, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=1048576, available_gpu_mem=12.34 GB
"""
INCIDENT = """\
[incident]
id = "mini"
title = "Mini incident"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway/*.jsonl"
format = "jsonl"
columns = { request_id = "rid", ts = "received_at", status = "http_status" }

[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*.log"
format = "sglang"

[models]
aliases = { "zai-org/GLM-5.3-FP8" = "@cf/zai-org/glm-5.3" }

[scope]
internal_accounts = ["loadtest-*"]
"""


def mini_requests(seed: int = 1) -> list[dict]:
    rnd = random.Random(seed)
    rows = []
    for i in range(400):
        n = int(10 ** rnd.uniform(3, 5.75))
        t = (50 + 0.05 * n + 1e-7 * n * n) * rnd.uniform(1.0, 3.0)
        rows.append(
            {
                "rid": f"r{i}",
                "received_at": f"2026-08-28T{8 + i // 60:02d}:{i % 60:02d}:00Z",
                "account_id": f"acct-{i % 17}",
                "model": "@cf/zai-org/glm-5.3",
                "http_status": 200,
                "prompt_tokens": n,
                "completion_tokens": 100,
                "cached_tokens": 0,
                "ttft_ms": round(t, 1),
                "latency_ms": round(t + 3000, 1),
                "prefill_instance": "p0",
                "decode_instance": "d0",
            }
        )
    rows.append(
        {
            "rid": "r-leak",
            "received_at": "2026-08-28T10:00:00Z",
            "account_id": "victim-recipient",
            "model": "@cf/zai-org/glm-5.3",
            "http_status": 200,
            "prompt_tokens": 700000,
            "completion_tokens": 50,
            "ttft_ms": 150.0,
            "latency_ms": 2000,
            "prefill_instance": "p0",
            "decode_instance": "d0",
        }
    )
    rows.append(
        {
            "rid": "r-400",
            "received_at": "2026-08-28T10:05:00Z",
            "account_id": "acct-1",
            "model": "@cf/zai-org/glm-5.3",
            "http_status": 400,
            "prompt_tokens": 1100000,
        }
    )
    return rows


def write_mini(root: Path, rows: list[dict] | None = None, incident: str = INCIDENT) -> Path:
    (root / "gateway").mkdir(parents=True, exist_ok=True)
    (root / "engine").mkdir(exist_ok=True)
    (root / "engine" / "p0.log").write_text(PREFILL_LOG)
    (root / "engine" / "d0.log").write_text(DECODE_LOG)
    with (root / "gateway" / "day1.jsonl").open("w") as fh:
        for r in rows if rows is not None else mini_requests():
            fh.write(json.dumps(r) + "\n")
    (root / "incident.toml").write_text(incident)
    return root / "incident.toml"


@pytest.fixture
def mini_incident(tmp_path: Path) -> Path:
    return write_mini(tmp_path / "mini")


SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample" / "incident.toml"


@pytest.fixture(scope="session")
def sample_incident() -> Path:
    assert SAMPLE.exists(), "data/sample is missing: run `kvforensics simulate --seed 7 --out data/sample`"
    return SAMPLE


@pytest.fixture(scope="session")
def sample_run(tmp_path_factory, sample_incident) -> Path:
    """The whole investigation of the bundled sample, run once per test session."""
    from kvforensics.investigation import run

    out = tmp_path_factory.mktemp("sample-run")
    run(sample_incident, out, progress=False)
    return out


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """Small incidents of each shape (tests/incidents.py SHAPES), each run once per session when first asked for:
    ``shapes[name]`` is (exit code, output folder)."""
    from incidents import ShapeRuns

    return ShapeRuns(tmp_path_factory.mktemp("shapes"))
