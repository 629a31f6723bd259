"""Small hand-written incidents of each deployment shape, for the tests that read a whole run's story.

Each builder writes an incident folder (engine logs, a gateway log, ``incident.toml``) and returns the path of its
incident file. The engine logs are written in the engines' own start-up formats (the fixtures under
``tests/fixtures/engine_logs`` show the real ones they follow); the traffic is a few dozen requests, so a run takes
seconds.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

# vLLM 0.8.5 V1, unified (no kv_transfer_config), whose log reports a KV cache of 50,000 tokens under max_model_len
# 131,072 (issue 27, observation 1): vLLM would have refused to start (check_enough_kv_cache_memory)
VLLM_UNIFIED_LOG = """\
INFO 08-27 14:00:00 [api_server.py:1043] vLLM API server version 0.8.5
INFO 08-27 14:00:00 [api_server.py:1044] args: Namespace(subparser='serve', model_tag='Qwen/Qwen2.5-72B-Instruct', model='Qwen/Qwen2.5-72B-Instruct', max_model_len=131072, tensor_parallel_size=4, served_model_name=['qwen-72b'], kv_transfer_config=None)
INFO 08-27 14:00:10 [core.py:58] Initializing a V1 LLM engine (v0.8.5) with config: model='Qwen/Qwen2.5-72B-Instruct', max_seq_len=131072, tensor_parallel_size=4, served_model_name=qwen-72b, enable_prefix_caching=True
INFO 08-27 14:01:58 [kv_cache_utils.py:634] GPU KV cache size: 50,000 tokens
INFO 08-27 14:01:58 [kv_cache_utils.py:637] Maximum concurrency for 131,072 tokens per request: 0.38x
INFO 08-27 14:02:10 [api_server.py:1090] Starting vLLM API server on http://0.0.0.0:8000
"""

# vLLM 0.10.1 V1, a NIXL kv_producer (prefill) whose KV cache (96,496 tokens) is below max_model_len; no decode log
# (observation 3)
VLLM_PRODUCER_LOG = """\
INFO 08-27 14:00:03 [api_server.py:1805] vLLM API server version 0.10.1.1
INFO 08-27 14:00:03 [utils.py:326] non-default args: {'model_tag': 'openai/gpt-oss-120b', 'port': 8100, 'model': 'openai/gpt-oss-120b', 'max_model_len': 131072, 'tensor_parallel_size': 2, 'served_model_name': ['gpt-oss-120b'], 'kv_transfer_config': KVTransferConfig(kv_connector='NixlConnector', engine_id='3c1e5a', kv_buffer_device='cuda', kv_buffer_size=1000000000.0, kv_role='kv_producer', kv_rank=None, kv_parallel_size=1, kv_ip='127.0.0.1', kv_port=14579, kv_connector_extra_config={}, kv_connector_module_path=None)}
INFO 08-27 14:00:10 [core.py:73] Initializing a V1 LLM engine (v0.10.1.1) with config: model='openai/gpt-oss-120b', max_seq_len=131072, tensor_parallel_size=2, served_model_name=gpt-oss-120b, enable_prefix_caching=True
INFO 08-27 14:02:41 [gpu_worker.py:276] Available KV cache memory: 6.62 GiB
INFO 08-27 14:02:42 [kv_cache_utils.py:849] GPU KV cache size: 96,496 tokens
INFO 08-27 14:02:42 [kv_cache_utils.py:853] Maximum concurrency for 131,072 tokens per request: 0.74x
INFO 08-27 14:03:10 [api_server.py:1857] Starting vLLM API server 0 on http://0.0.0.0:8100
"""


def sglang_log(
    mode: str | None,
    pool: int,
    context: int,
    *,
    model: str = "m",
    version: str | None = None,
    restart_pool: int | None = None,
) -> str:
    """An SGLang start-up (``server_args`` and the pool line) of a role (``prefill``, ``decode``, None: unified), and,
    with ``restart_pool``, a restart on 9 Sep with that pool."""
    mode_arg = f", disaggregation_mode='{mode}'" if mode else ""
    head = (
        f"[2026-08-27 14:00:00] server_args=ServerArgs(model_path='{model}', served_model_name='{model}', "
        f"tp_size=1, context_length={context}, page_size=64{mode_arg})\n"
    )
    if version:
        head = f"[2026-08-27 13:59:59] sglang version {version}\n" + head
    pool_line = (
        f"max_total_num_tokens={{pool}}, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        f"max_running_requests=64, context_len={context}, available_gpu_mem=12.34 GB\n"
    )
    text = head + "[2026-08-27 14:01:06] " + pool_line.format(pool=pool)
    if restart_pool is not None:
        text += (
            head.replace("2026-08-27 14:00:00", "2026-09-09 12:00:00")
            + "[2026-09-09 12:01:06] "
            + pool_line.format(pool=restart_pool)
        )
    return text


def traffic(
    model: str,
    *,
    n: int = 60,
    accounts: int = 4,
    seed: int = 5,
    hour: int = 10,
    timed: bool = True,
    largest: int = 60_000,
    **fields: object,
) -> list[dict]:
    """``n`` ordinary requests of ``model`` on 28 Aug, one a minute from ``hour``:00, prompts of 1k to ``largest`` tokens
    and a prefill time growing with them, from accounts ``tenant-0`` ... (``fields``: added to each)."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        tokens = int(10 ** rnd.uniform(3, math.log10(largest)))
        row: dict[str, object] = {
            "request_id": f"q{i}",
            "ts": f"2026-08-28T{hour + i // 60:02d}:{i % 60:02d}:00Z",
            "account_id": f"tenant-{i % accounts}",
            "model": model,
            "status": 200,
            "prompt_tokens": tokens,
            "completion_tokens": 50,
            **fields,
        }
        if timed:
            ttft = (60 + 0.04 * tokens + 2e-7 * tokens * tokens) * rnd.uniform(1.0, 2.0)
            row.update(ttft_ms=round(ttft, 1), latency_ms=round(ttft + 2500, 1))
        rows.append(row)
    return rows


def write_incident(
    root: Path,
    logs: dict[str, str],
    rows: Iterable[dict],
    *,
    engine_format: str = "sglang",
    extra: str = "",
    title: str = "Hand-written incident",
    year: int = 2026,
) -> Path:
    """An incident folder: ``engine/<instance>.log`` per log, ``gateway/requests.jsonl``, ``incident.toml``; ``year``
    dates the vLLM lines (any format but ``sglang``, whose lines carry their year)."""
    (root / "engine").mkdir(parents=True, exist_ok=True)
    (root / "gateway").mkdir(parents=True, exist_ok=True)
    for instance, text in logs.items():
        (root / "engine" / f"{instance}.log").write_text(text)
    with (root / "gateway" / "requests.jsonl").open("w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    year_key = f"year = {year}\n" if engine_format != "sglang" else ""
    (root / "incident.toml").write_text(f"""[incident]
id = "{root.name.lower().replace('_', '-')}"
title = "{title}"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway/*.jsonl"

[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*.log"
format = "{engine_format}"
{year_key}
[scope]
internal_accounts = ["loadtest-*"]
reporter_accounts = ["bounty-*"]
{extra}""")
    return root / "incident.toml"


def vllm_unified(root: Path, **kw: object) -> Path:
    """Observation 1: 19 ordinary requests and one 80,214-token prompt answered 200 in 38 ms, on a unified vLLM
    0.8.5 server whose log reports a KV cache of 50,000 tokens under max_model_len 131,072."""
    rows = traffic("qwen-72b", n=19, largest=40_000)
    rows.append(
        {
            "request_id": "q-big",
            "ts": "2026-08-28T11:00:00Z",
            "account_id": "tenant-x",
            "model": "qwen-72b",
            "status": 200,
            "prompt_tokens": 80214,
            "completion_tokens": 50,
            "ttft_ms": 38,
            "latency_ms": 900,
        }
    )
    return write_incident(root, {"vllm-0": VLLM_UNIFIED_LOG}, rows, engine_format="vllm", **kw)  # type: ignore[arg-type]


def nixl_producer(root: Path, **kw: object) -> Path:
    """Observation 3: a NIXL kv_producer with a KV cache below max_model_len, no decode log, the gateway naming only
    the prefill instance; four tenants' traffic, then one 120,000-token prompt answered 200 in 90 ms."""
    rows = traffic("gpt-oss-120b", prefill_instance="prefill-0")
    rows.append(
        {
            "request_id": "q-big",
            "ts": "2026-08-28T11:00:00Z",
            "account_id": "tenant-x",
            "model": "gpt-oss-120b",
            "status": 200,
            "prompt_tokens": 120000,
            "completion_tokens": 50,
            "ttft_ms": 90,
            "latency_ms": 1900,
            "prefill_instance": "prefill-0",
        }
    )
    return write_incident(root, {"prefill-0": VLLM_PRODUCER_LOG}, rows, engine_format="vllm", **kw)  # type: ignore[arg-type]


def decode_window(root: Path, **kw: object) -> Path:
    """An SGLang PD pair whose decode pool (100,000) is below the context (131,072), its prefill pool above it; the
    gateway names only the prefill instance and has 19 timed requests (too few for a latency model): no rule can
    judge the decode window."""
    logs = {"p0": sglang_log("prefill", 262144, 131072), "d0": sglang_log("decode", 100000, 131072)}
    return write_incident(root, logs, traffic("m", n=19, prefill_instance="p0"), **kw)  # type: ignore[arg-type]


NOTICE = """
[notice]
provider = "Example Inference Ltd"
contact = "privacy@example.com"
reference = "INC-2026-0913"
measures = ["On 9 September we restarted the affected servers with enough memory for every request they accept."]
advice = ["Write to privacy@example.com if you believe you were affected in another way."]
"""


def exploited_mini(root: Path, *, notice: bool = True) -> Path:
    """conftest's mini incident (one exposed prefill instance, one leak) with a customer that probes the pool (twelve
    prompts just above it within an hour: a suspected exploiter), the provider's load test and the reporter each
    receiving an affected response, a response in the possible tier (a 400,000-token prompt answered in 60 ms), and,
    unless ``notice`` is false, a ``[notice]`` table."""
    from conftest import INCIDENT, mini_requests, write_mini

    rows = mini_requests()
    extra = [("acct-prober", f"2026-08-28T11:{2 * k:02d}:00Z", 681_280 + 10 * k) for k in range(12)]
    extra += [("loadtest-1", "2026-08-28T12:00:00Z", 690_000), ("bounty-1", "2026-08-28T12:10:00Z", 700_500)]
    for k, (account, ts, tokens) in enumerate(extra):
        rows.append(
            {
                "rid": f"r-extra{k}",
                "received_at": ts,
                "account_id": account,
                "model": "@cf/zai-org/glm-5.3",
                "http_status": 200,
                "prompt_tokens": tokens,
                "completion_tokens": 40,
                "ttft_ms": 140.0,
                "latency_ms": 1900,
                "prefill_instance": "p0",
                "decode_instance": "d0",
            }
        )
    # a prompt well inside the pool answered far faster than any prefill of it: one weak signal, the possible tier
    rows.append(
        {
            "rid": "r-fast",
            "received_at": "2026-08-28T12:20:00Z",
            "account_id": "acct-3",
            "model": "@cf/zai-org/glm-5.3",
            "http_status": 200,
            "prompt_tokens": 400_000,
            "completion_tokens": 40,
            "ttft_ms": 60.0,
            "latency_ms": 1500,
            "prefill_instance": "p0",
            "decode_instance": "d0",
        }
    )
    incident = INCIDENT.replace(
        'internal_accounts = ["loadtest-*"]', 'internal_accounts = ["loadtest-*"]\nreporter_accounts = ["bounty-*"]'
    )
    return write_mini(root, rows, incident + (NOTICE if notice else ""))


def sglang_unified(root: Path, **kw: object) -> Path:
    """An SGLang unified server whose KV pool (100,000) is below its context (131,072); ordinary traffic below the
    pool: not exposed (the scheduler refuses a prompt beyond the pool with an error), nothing affected."""
    return write_incident(root, {"u0": sglang_log(None, 100_000, 131_072)}, traffic("m", prefill_instance="u0"), **kw)  # type: ignore[arg-type]


def prefix_probe(root: Path, **kw: object) -> Path:
    """``kvforensics simulate --mechanism prefix_reuse --prefix-scenario prefix-probe`` at 1,000 requests: an unsalted
    shared vLLM deployment on which one account reads other tenants' prompts back by timing."""
    from kvforensics.simulate.prefix import simulate_prefix

    simulate_prefix("prefix-probe", root, requests=1000)
    incident = root / "incident.toml"
    incident.write_text(incident.read_text() + str(kw.get("extra", "")))
    return incident


# the shapes of incident the report is read on (tests/test_report_shapes.py): builder and whether [notice] is given
SHAPES = {
    "sglang-pd": lambda root: exploited_mini(root),  # PD, SGLang, exposure ended by a restart, suspects
    "sglang-unified": lambda root: sglang_unified(root, extra=NOTICE),  # unified, SGLang, none affected
    "vllm-unified": lambda root: vllm_unified(root, extra=NOTICE),  # unified, vLLM, inconclusive (observation 1)
    "vllm-pd-running": lambda root: nixl_producer(root, extra=NOTICE),  # PD, vLLM, still running (observation 3)
    "prefix-cache": lambda root: prefix_probe(root, extra=NOTICE),  # prefix_reuse, vLLM, a prober
    "sglang-pd-draft": lambda root: exploited_mini(root, notice=False),  # as sglang-pd, no [notice]: drafts
}


class ShapeRuns:
    """Each shape's incident run once, when a test first asks for it: ``runs[name]`` is (exit code, output folder)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, tuple[int, Path]] = {}

    def __getitem__(self, name: str) -> tuple[int, Path]:
        if name not in self._done:
            from kvforensics.cli import main

            folder = self.root / name
            incident = SHAPES[name](folder / "data")
            out = folder / "out"
            self._done[name] = (main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf"]), out)
        return self._done[name]
