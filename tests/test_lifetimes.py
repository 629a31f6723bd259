"""Instance lifetimes: a start-up ends at the next start-up, its own shutdown lines, or the end of its
log when a successor took over (kvforensics/stages/instances.py). Pods replaced in rolling restarts must
not stay in force for ever.

The shutdown lines below are the engines' own texts (sources cited in kvforensics/sources/engine_logs/shutdown.py).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import duckdb
import pytest
from conftest import INCIDENT
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforensics.investigation import run
from kvforensics.sources.engine_logs.sglang import parser as sglang
from kvforensics.sources.engine_logs.shutdown import shutdown_reason
from kvforensics.sources.engine_logs.vllm import parser as vllm
from kvforensics.stages.instances import Lifetime, PlacedStartup, lifetimes

CTX = 1_048_576
SMALL, LARGE = 681_280, 2_042_880
SIGTERM = "SIGTERM received. signum=15 frame=None. Draining requests and shutting down..."
UVICORN_SHUTDOWN = [
    "INFO:     Shutting down",
    "INFO:     Waiting for application shutdown.",
    "INFO:     Application shutdown complete.",
    "INFO:     Finished server process [1]",
]


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S")


def sglang_pod(
    start: datetime, pool: int, *, serve_until: datetime, shutdown: bool = False, role: str = "prefill"
) -> str:
    """An SGLang pod's log: start-up, hourly batch lines until *serve_until*, then shutdown lines or nothing."""
    lines = [
        f"[{_stamp(start)}] server_args=ServerArgs(model_path='zai-org/GLM-5.3-FP8', "
        f"served_model_name='zai-org/GLM-5.3-FP8', tp_size=1, context_length={CTX}, page_size=64, "
        f"disaggregation_mode='{role}', disaggregation_transfer_backend='mooncake')",
        f"[{_stamp(start + timedelta(seconds=60))} TP0] KV Cache is allocated. dtype: torch.bfloat16, "
        f"#tokens: {pool}, KV size: 40.10 GB",
        f"[{_stamp(start + timedelta(seconds=61))} TP0] max_total_num_tokens={pool}, chunked_prefill_size=8192, "
        f"max_prefill_tokens=16384, max_running_requests=64, context_len={CTX}, available_gpu_mem=12.34 GB",
        f"[{_stamp(start + timedelta(seconds=90))}] The server is fired up and ready to roll!",
    ]
    t = start + timedelta(hours=1)
    while t <= serve_until:
        lines.append(
            f"[{_stamp(t)} TP0] Prefill batch, #new-seq: 1, #new-token: 5000, #cached-token: 0, "
            "token usage: 0.01, #running-req: 0, #queue-req: 0"
        )
        t += timedelta(hours=1)
    if shutdown:
        lines.append(f"[{_stamp(serve_until + timedelta(minutes=1))}] {SIGTERM}")
        lines += [f"[{_stamp(serve_until + timedelta(minutes=2))}] {u}" for u in UVICORN_SHUTDOWN]
    return "\n".join(lines) + "\n"


# --- the parsers record how a start-up's log ends ----------------------------------------------


def _parse_sglang(text: str):
    lines = [(i, t, t.encode()) for i, t in enumerate(text.splitlines(), 1)]
    return sglang.parse_lines(lines, instance="p", tz=ZoneInfo("UTC"))


def test_sglang_shutdown_lines_end_the_startup():
    t0 = datetime(2026, 8, 20, 10, 0, tzinfo=UTC)
    parsed = _parse_sglang(sglang_pod(t0, SMALL, serve_until=t0 + timedelta(hours=3), shutdown=True))
    (s,) = parsed.startups
    assert s.shutdown_reason == "SIGTERM received"
    assert s.shutdown_line == 8 and s.shutdown_ts == t0 + timedelta(hours=3, minutes=1)
    assert s.last_line == 12 and s.last_ts == t0 + timedelta(hours=3, minutes=2)


def test_sglang_log_that_merely_stops_has_no_shutdown():
    t0 = datetime(2026, 8, 20, 10, 0, tzinfo=UTC)
    (s,) = _parse_sglang(sglang_pod(t0, SMALL, serve_until=t0 + timedelta(hours=3))).startups
    assert s.shutdown_line is None and s.shutdown_reason is None
    assert s.last_line == 7 and s.last_ts == t0 + timedelta(hours=3)


def test_sglang_restart_after_a_crash_before_ready_is_a_new_startup():
    # the scheduler dies during start-up; the pod restarts without server_args in between
    text = (
        "[2026-08-20 10:00:00] server_args=ServerArgs(served_model_name='m', context_length=1000, "
        "disaggregation_mode='prefill')\n"
        "[2026-08-20 10:00:05 TP0] Load weight begin. avail mem=70.00 GB\n"
        "[2026-08-20 10:00:30 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
        "RuntimeError: CUDA error: out of memory\n"
        "[2026-08-20 10:00:31] Received sigquit from a child process. It usually means the child failed.\n"
        "[2026-08-20 10:05:05 TP0] Load weight begin. avail mem=70.00 GB\n"
        "[2026-08-20 10:06:05 TP0] max_total_num_tokens=900, context_len=1000\n"
    )
    first, second = _parse_sglang(text).startups
    assert first.shutdown_line == 3 and first.shutdown_reason == "fatal exception (Scheduler)"
    assert second.line == 6 and second.kv_pool_tokens == 900


def test_vllm_shutdown_lines_end_the_startup():
    text = (
        "INFO 08-20 10:00:00 [api_server.py:1043] vLLM API server version 0.9.2\n"
        "INFO 08-20 10:00:01 [api_server.py:1044] args: Namespace(model='m', max_model_len=4096)\n"
        "INFO 08-20 10:01:00 [kv_cache_utils.py:716] GPU KV cache size: 100,000 tokens\n"
        "INFO 08-20 10:01:30 [launcher.py:37] Application startup complete.\n"
        "INFO 08-20 12:00:00 [loggers.py:118] Engine 000: Avg prompt throughput: 1.0 tokens/s\n"
        "INFO 08-20 12:30:00 [launcher.py:80] Shutting down FastAPI HTTP server.\n"
        "INFO:     Shutting down\n"
        "INFO:     Finished server process [7]\n"
    )
    lines = [(i, t, t.encode()) for i, t in enumerate(text.splitlines(), 1)]
    (s,) = vllm.parse_lines(lines, instance="v", tz=ZoneInfo("UTC"), year=2026).startups
    assert s.shutdown_line == 6 and s.shutdown_reason == "API server shutting down"
    assert s.shutdown_ts == datetime(2026, 8, 20, 12, 30, tzinfo=UTC)
    assert s.last_line == 8 and s.last_ts == datetime(2026, 8, 20, 12, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    "message, reason",
    [
        (SIGTERM, "SIGTERM received"),
        (
            "SIGQUIT received. signum=3, frame=None. It usually means one child failed.",
            "a child process failed (SIGQUIT)",
        ),
        ("Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.", "engine core died"),
        ("AsyncLLMEngine has failed, terminating server process", "engine failed, server terminated"),
        ("[shutdown] API server: shutting down FastAPI HTTP server", "API server shutting down"),
        ("INFO:     Application shutdown complete.", "HTTP server shutting down"),
        ("KeyboardInterrupt", "KeyboardInterrupt"),
        ("Prefill batch, #new-seq: 1, shutting down nothing", None),
        ("Decode batch, #running-req: 3", None),
        ("INFO:     Shutting down the connection pool of tenant 7", None),
        # a request log line quoting a prompt that holds a shutdown text does not end the start-up
        ("Receive: obj=GenerateReqInput(text='SIGTERM received. signum=15', rid='r1')", None),
        (
            "Finish: obj=GenerateReqInput(text='x'), out={'text': 'Engine core proc EngineCore_DP0 died unexpectedly'}",
            None,
        ),
    ],
)
def test_shutdown_lines(message, reason):
    assert shutdown_reason(message) == reason


# --- the lifetime rule ------------------------------------------------------------------------

T = datetime(2026, 8, 20, tzinfo=UTC)


def _placed(
    instance: str,
    start_h: float,
    last_h: float | None,
    *,
    shutdown_h: float | None = None,
    model: str | None = "m",
    role: str = "prefill",
) -> PlacedStartup:
    def at(h: float | None) -> datetime | None:
        return None if h is None else T + timedelta(hours=h)

    return PlacedStartup(
        instance=instance,
        role=role,
        model=model,
        ts=at(start_h),
        file=f"{instance}.log",
        line=1,
        last_ts=at(last_h),
        last_line=50,
        shutdown_ts=at(shutdown_h),
        shutdown_line=40 if shutdown_h is not None else None,
    )


def test_next_startup_and_shutdown():
    got = lifetimes([_placed("p", 0, 10), _placed("p", 12, 20, shutdown_h=19), _placed("p", 30, 40)])
    assert got[0] == Lifetime(T + timedelta(hours=12), "next_startup", T + timedelta(hours=12), "p.log", 1)
    assert got[1] == Lifetime(T + timedelta(hours=19), "shutdown", T + timedelta(hours=19), "p.log", 40)
    assert got[2] == Lifetime(None, None)  # its log merely stops: still running


def test_a_pod_replaced_under_a_new_name_is_retired():
    old, new = _placed("old", 0, 10), _placed("new", 9.5, 30)
    got = lifetimes([old, new])
    assert got[0] == Lifetime(T + timedelta(hours=10), "log_end", T + timedelta(hours=10), "old.log", 50, "new")
    assert got[1] == Lifetime(None, None)


def test_a_successor_starting_soon_after_the_last_line_closes_the_gap():
    got = lifetimes([_placed("old", 0, 10), _placed("new", 10.5, 30)])
    assert got[0].end_reason == "log_end" and got[0].valid_to == T + timedelta(hours=10.5)
    late = lifetimes([_placed("old", 0, 10), _placed("new", 14, 30)])  # 4 h later: not the old pod's time
    assert late[0].end_reason == "log_end" and late[0].valid_to == T + timedelta(hours=10)


@pytest.mark.parametrize(
    "other",
    [
        _placed("sibling", 0.1, 30),  # a replica started with it, long before its log ends
        _placed("new", 9.5, 9.8),  # started late but went silent first: did not take over
        _placed("new", 9.5, 30, model="other"),  # another model
        _placed("new", 9.5, 30, role="decode"),  # another role
    ],
    ids=["sibling", "not-outliving", "other-model", "other-role"],
)
def test_no_successor_leaves_the_startup_running(other):
    assert lifetimes([_placed("p", 0, 10), other])[0] == Lifetime(None, None)


def test_handover_window_is_configurable():
    pods = [_placed("old", 0, 10), _placed("new", 7, 30)]
    assert lifetimes(pods)[0].end_reason is None  # 3 h before the last line: a sibling by default
    assert lifetimes(pods, handover_s=4 * 3600)[0].end_reason == "log_end"


def test_startups_without_time_or_model_stay_open():
    got = lifetimes([_placed("a", None, None), _placed("b", 0, 5, model=None), _placed("c", 1, 30, model=None)])
    assert got == [Lifetime(None, None)] * 3


# --- a rolling restart end to end -------------------------------------------------------------

MODEL = "@cf/zai-org/glm-5.3"  # the gateway id conftest.INCIDENT aliases the engine model to


def _rollout(root: Path) -> Path:
    """Generation A (safe pool) -> rollout to B (pool below the context: exposed) -> rollout to C
    (fixed), each under new pod names. Of each old generation one pod logs its shutdown and one log
    simply stops. Requests name no prefill instance, so the model's pools in force decide."""
    day = datetime(2026, 8, 20, 10, tzinfo=UTC)
    b_at, c_at = day + timedelta(days=5), day + timedelta(days=12)
    end = day + timedelta(days=16)
    pods = {
        "glm-a-0": sglang_pod(day, LARGE, serve_until=b_at + timedelta(minutes=20), shutdown=True),
        "glm-a-1": sglang_pod(day + timedelta(minutes=5), LARGE, serve_until=b_at + timedelta(minutes=30)),
        "glm-b-0": sglang_pod(b_at, SMALL, serve_until=c_at + timedelta(minutes=20), shutdown=True),
        "glm-b-1": sglang_pod(b_at + timedelta(minutes=10), SMALL, serve_until=c_at + timedelta(minutes=25)),
        "glm-c-0": sglang_pod(c_at, LARGE, serve_until=end),
        "glm-c-1": sglang_pod(c_at + timedelta(minutes=10), LARGE, serve_until=end),
        "glm-d-0": sglang_pod(day, 4 * LARGE, serve_until=end, role="decode"),
    }
    (root / "engine").mkdir(parents=True)
    for name, text in pods.items():
        (root / "engine" / f"{name}.log").write_text(text)
    requests = []
    for i in range(300):  # ordinary traffic across the whole period
        t = day + timedelta(minutes=70 * i)
        requests.append(
            {
                "rid": f"n{i}",
                "received_at": t.isoformat(),
                "account_id": f"acct-{i % 9}",
                "model": MODEL,
                "http_status": 200,
                "prompt_tokens": 2000 + 37 * i,
                "completion_tokens": 80,
            }
        )
    oversize = {
        "during-a": day + timedelta(days=2),
        "during-b-1": b_at + timedelta(days=1),
        "during-b-2": b_at + timedelta(days=4),
        "during-c": c_at + timedelta(days=2),
    }
    for rid, t in oversize.items():
        requests.append(
            {
                "rid": rid,
                "received_at": t.isoformat(),
                "account_id": "victim",
                "model": MODEL,
                "http_status": 200,
                "prompt_tokens": 900_000,
                "completion_tokens": 40,
            }
        )
    (root / "gateway").mkdir()
    (root / "gateway" / "day.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (root / "incident.toml").write_text(INCIDENT)
    return root / "incident.toml"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    run(_rollout(root / "data"), root / "out", progress=False, pdf=False)
    return root / "out"


def test_rollout_retires_replaced_pods(rollout):
    con = duckdb.connect(str(rollout / "evidence.duckdb"), read_only=True)
    ends = {
        r[0]: r[1:]
        for r in con.execute("SELECT instance, end_reason, successor, valid_to IS NULL FROM capacity").fetchall()
    }
    assert ends == {
        "glm-a-0": ("shutdown", None, False),
        "glm-a-1": ("log_end", "glm-b-0", False),
        "glm-b-0": ("shutdown", None, False),
        "glm-b-1": ("log_end", "glm-c-0", False),
        "glm-c-0": (None, None, True),
        "glm-c-1": (None, None, True),
        "glm-d-0": (None, None, True),
    }


def test_rollout_exposure_windows_close(rollout):
    scope = json.loads((rollout / "scope.json").read_text())
    windows = {w["instance"]: (w["start"], w["end"]) for w in scope["exposure_windows"]}
    assert windows == {
        "glm-b-0": ("2026-08-25T10:00:00Z", "2026-09-01T10:21:00Z"),
        "glm-b-1": ("2026-08-25T10:10:00Z", "2026-09-01T10:10:00Z"),
    }  # its last line
    assert {w["instance"]: w["end_reason"] for w in scope["exposure_windows"]} == {
        "glm-b-0": "shutdown",
        "glm-b-1": "log_end",
    }


def test_rollout_oversize_responses_are_counted_at_the_right_tier(rollout):
    con = duckdb.connect(str(rollout / "evidence.duckdb"), read_only=True)
    strength = dict(
        con.execute("SELECT request_id, strength FROM findings WHERE rule_id = 'prompt_exceeds_kv_pool'").fetchall()
    )
    assert strength == {"during-b-1": "strong", "during-b-2": "strong"}
    scope = json.loads((rollout / "scope.json").read_text())
    assert scope["affected_responses"] == 2
    assert scope["possible_responses_not_counted"] == 0


_HOURS = st.one_of(st.none(), st.integers(0, 48).map(float))


@st.composite
def _startups(draw):
    out = []
    for _ in range(draw(st.integers(0, 8))):
        start = draw(_HOURS)
        since = draw(st.one_of(st.none(), st.integers(0, 12)))
        last = None if start is None or since is None else start + since
        shutdown = None if last is None else draw(st.one_of(st.none(), st.just(last)))
        out.append(
            _placed(
                draw(st.sampled_from(["a", "b", "c"])),
                start,
                last,
                shutdown_h=shutdown,
                model=draw(st.sampled_from(["m", "n", None])),
                role=draw(st.sampled_from(["prefill", "decode"])),
            )
        )
    return out


@settings(max_examples=int(os.environ.get("KVF_EXAMPLES", 200)), deadline=None)
@given(startups=_startups(), handover=st.sampled_from([0.0, 1800.0, 3600.0, 86400.0]))
def test_lifetime_invariants(startups, handover):
    got = lifetimes(startups, handover)
    assert len(got) == len(startups)
    for s, lt in zip(startups, got, strict=True):
        if lt.valid_to is not None and s.ts is not None:
            assert lt.valid_to >= s.ts
        if lt.end_reason is None:
            assert (lt.valid_to, lt.end_ts, lt.successor) == (None, None, None)
        if lt.end_reason == "log_end":
            assert lt.valid_to is not None and lt.successor not in (None, s.instance)
            assert any(o.instance == lt.successor and o.model == s.model and o.role == s.role for o in startups)
        if lt.end_reason == "shutdown":
            assert s.shutdown_line is not None
