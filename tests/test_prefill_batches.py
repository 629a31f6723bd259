"""The engines' own prefix-cache evidence: SGLang prefill batch lines (``#cached-token``) into
``prefill_batches``, ReqTimeStats ``cached_input_len=`` into ``engine_events.cached_tokens``, and both
filling ``requests.cached_tokens`` where the gateway gives none (with where each value came from), a
contradiction between gateway and engine reported, and audit check 6 reading a cache hit as "on"."""

from __future__ import annotations

import json
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from conftest import INCIDENT  # a gateway source and an SGLang engine_log source

from kvforensics.audit import audit_database, audit_paths
from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.mechanisms import present_inputs
from kvforensics.sources.engine_logs.contract import EngineLogParse, PrefillBatch
from kvforensics.sources.engine_logs.sglang import parser as sglang
from kvforensics.stages import conclusive
from kvforensics.stages.ingest import ingest

UTC = ZoneInfo("UTC")


def parse(lines: list[str]) -> EngineLogParse:
    return sglang.parse_lines(((i, t, t.encode()) for i, t in enumerate(lines, 1)), instance="p0", tz=UTC)


# Each form as SGLang prints it:
# 0.5.x  https://github.com/sgl-project/sglang/blob/v0.5.4/python/sglang/srt/managers/scheduler_metrics_mixin.py
#        (log_prefill_stats; PD prefill adds #bootstrap-req / #inflight-req / #optimistic-req), and in later
#        releases python/sglang/srt/managers/scheduler_components/metrics_reporter.py (``Prefill batch [iter],``
#        with SGLANG_LOG_FORWARD_ITERS; ``full token usage`` / ``swa token usage`` or ``mamba usage`` for hybrid
#        pools; ``#unbootstrapped-req`` / ``#transferring-req`` in the PD prefill variant)
# 0.4.x  https://github.com/sgl-project/sglang/blob/v0.4.3/python/sglang/srt/managers/scheduler.py
#        (``Prefill batch.`` with a period and ``cache hit rate``; ``Prefill batch(mixed #running-req: N).``)
FORMS = [
    "[2026-08-28 09:00:00 TP0] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 64, token usage: 0.02, "
    "#running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 0, #optimistic-req: 0, "
    "cuda graph: False, input throughput (token/s): 10542.61",
    "[2026-08-28 09:00:01 DP1 TP1] Prefill batch [1234], #new-seq: 3, #new-token: 512, #cached-token: 0, "
    "full token usage: 0.10, swa token usage: 0.30, #running-req: 2, #queue-req: 5, ",
    "[2026-08-28 09:00:02] Prefill batch, #new-seq: 1, #new-token: 9, #cached-token: 7, full token usage: 0.20, "
    "mamba usage: 0.40, #unbootstrapped-req: 0, #queue-req: 1, #transferring-req: 2, "
    "input throughput (token/s): 12.00, ",
    "[2025-02-20 10:13:01 TP0] Prefill batch. #new-seq: 2, #new-token: 33, #cached-token: 5, cache hit rate: 13.16%, "
    "token usage: 0.00, #running-req: 1, #queue-req: 0",
    "[2025-02-20 10:13:02 TP0] Prefill batch(mixed #running-req: 4). #new-seq: 1, #new-token: 20, #cached-token: 0, "
    "cache hit rate: 0.00%, #queue-req: 3",
]


def test_every_form_of_the_prefill_batch_line_is_read() -> None:
    out = parse(FORMS)
    assert not out.quarantined
    got = [
        (b.line, b.ranks, b.new_seq, b.new_token, b.cached_token, b.running_req, b.queue_req, b.token_usage, b.role)
        for b in out.prefill_batches
    ]
    assert got == [
        (1, "TP0", 1, 8192, 64, 0, 0, 0.02, "prefill"),
        (2, "DP1 TP1", 3, 512, 0, 2, 5, 0.10, None),
        (3, "", 1, 9, 7, None, 1, 0.20, "prefill"),
        (4, "TP0", 2, 33, 5, 1, 0, 0.00, None),
        (5, "TP0", 1, 20, 0, 4, 3, None, None),
    ]
    assert (
        out.prefill_batches[0].ts is not None and out.prefill_batches[0].ts.isoformat() == "2026-08-28T09:00:00+00:00"
    )


def test_batch_lines_without_their_counts_are_quarantined_and_look_alikes_ignored() -> None:
    lines = [
        "[2026-08-28 09:00:00] Prefill batch, #new-seq: 1, #new-token: 9, token usage: 0.10",
        "[2026-08-28 09:00:01] Prefill batch, #new-seq: 1, #new-token: -9, #cached-token: 0",
        "[2026-08-28 09:00:02] Prefill batches are logged every step",  # not a batch line
        "[2026-08-28 09:00:03] Decode batch, #running-req: 1, #token: 100, token usage: 0.01, gen throughput "
        "(token/s): 9.00, #queue-req: 0",
        "[2026-08-28 09:00:04] Receive: obj=GenerateReqInput(text='Prefill batch, #new-seq: 1')",
    ]
    out = parse(lines)
    assert [(q.line, q.reason) for q in out.quarantined] == [
        (1, "prefill batch line without a readable #cached-token"),
        (2, "prefill batch line without a readable #new-token"),
    ]
    assert out.prefill_batches == []


def test_req_time_stats_keep_the_engines_cached_count_where_the_version_logs_it() -> None:
    out = parse(
        [
            "[2026-08-28 09:00:00 TP0] ReqTimeStats(rid=a, bootstrap_room=1, input_len=1000, cached_input_len=256, "
            "output_len=1, attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=50.00ms",
            "[2026-08-28 09:00:01 TP0] Req Time Stats(rid=b, input len=1000, output len=1, type=prefill)",  # 0.4.10-0.5.9
        ]
    )
    assert [(e.request_id, e.prompt_tokens, e.cached_tokens) for e in out.events] == [
        ("a", 1000, 256),
        ("b", 1000, None),
    ]


def test_a_cache_hit_in_a_batch_line_is_a_flag_of_its_start_up() -> None:
    startup = [
        "[2026-08-28 08:00:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500000, KV size: 10.00 GB",
        "[2026-08-28 08:00:06] max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=64, context_len=131072, available_gpu_mem=12.34 GB",
        "[2026-08-28 08:00:30] The server is fired up and ready to roll!",
    ]
    miss = "[2026-08-28 09:00:00] Prefill batch, #new-seq: 1, #new-token: 100, #cached-token: 0, token usage: 0.01"
    hit = "[2026-08-28 09:00:01] Prefill batch, #new-seq: 1, #new-token: 100, #cached-token: 64, token usage: 0.01"
    (record,) = parse([*startup, miss, hit]).startups
    assert record.flags["prefix_cache_hit_line"] == "5" and record.evidence["prefix_cache_hit"] == 5
    (record,) = parse([*startup, miss]).startups
    assert "prefix_cache_hit_line" not in record.flags


# --- requests.cached_tokens from the engines -------------------------------------------------------------

ENGINE_LOG = """\
[2026-08-28 08:00:00] server_args=ServerArgs(model_path='m', served_model_name='m', tp_size=1, context_length=131072, page_size=64, disaggregation_mode='prefill')
[2026-08-28 08:00:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500000, KV size: 10.00 GB
[2026-08-28 08:00:06] max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=131072, available_gpu_mem=12.34 GB
[2026-08-28 08:00:30] The server is fired up and ready to roll!
[2026-08-28 09:00:01] ReqTimeStats(rid=a, bootstrap_room=1, input_len=1000, cached_input_len=256, output_len=1, attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=50.00ms
[2026-08-28 09:01:00] Prefill batch, #new-seq: 1, #new-token: 700, #cached-token: 300, token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cuda graph: False, input throughput (token/s): 5000.00
[2026-08-28 09:02:00] Prefill batch, #new-seq: 1, #new-token: 1500, #cached-token: 500, token usage: 0.01, #running-req: 0, #queue-req: 1, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cuda graph: False, input throughput (token/s): 5000.00
[2026-08-28 09:03:01] ReqTimeStats(rid=e, bootstrap_room=2, input_len=3000, cached_input_len=64, output_len=1, attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=50.00ms
[2026-08-28 09:04:01] ReqTimeStats(rid=f, bootstrap_room=3, input_len=3000, cached_input_len=512, output_len=1, attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=50.00ms
[2026-08-28 09:05:01] ReqTimeStats(rid=g, bootstrap_room=4, input_len=1, cached_input_len=0, output_len=1, attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=1.00ms
[2026-08-28 09:06:00] Prefill batch, #new-seq: 2, #new-token: 900, #cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cuda graph: False, input throughput (token/s): 5000.00
[2026-08-28 09:09:00] Prefill batch, #new-seq: 1, #new-token: 400, #cached-token: 100, token usage: 0.01, #running-req: 0, #queue-req: 0, #pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cuda graph: False, input throughput (token/s): 5000.00
"""


def request(rid: str, minute: int, prompt: int, cached: int | None, *, second: str = "00", ttft: float = 500.0) -> dict:
    row = {
        "rid": rid,
        "received_at": f"2026-08-28T09:{minute:02d}:{second}Z",
        "account_id": f"acct-{rid}",
        "model": "m",
        "http_status": 200,
        "prompt_tokens": prompt,
        "completion_tokens": 10,
        "ttft_ms": ttft,
        "latency_ms": ttft + 1000,
        "prefill_instance": "p0",
    }
    if cached is not None:
        row["cached_tokens"] = cached
    return row


REQUESTS = [
    request("a", 0, 1000, None),  # ReqTimeStats of a on p0: 256
    request("b", 1, 1000, None, second="00.300"),  # the only batch of one request, 700 + 300 = 1000
    request("c", 2, 2000, None),
    request("d", 2, 2000, None),  # one batch, two requests it fits: neither
    request("e", 3, 3000, 64),  # gateway and engine agree
    request("f", 4, 3000, 0),  # gateway 0, engine 512: a contradiction
    request("g", 5, 5000, None),  # the engine saw a 1-token stub, not this prompt
    request("h", 6, 900, None),  # a batch of two requests says nothing about one
    request("i", 9, 500, None, ttft=50.0, second="02"),  # the batch is stamped before the request arrived
]


def write_incident(root: Path, rows: list[dict]) -> Path:
    (root / "gateway").mkdir(parents=True)
    (root / "engine").mkdir()
    (root / "engine" / "p0.log").write_text(ENGINE_LOG)
    (root / "gateway" / "day1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "incident.toml").write_text(INCIDENT)
    return root / "incident.toml"


def cached(con) -> dict[str, tuple[int | None, str | None]]:
    return {
        rid: (n, how)
        for rid, n, how in con.execute(
            "SELECT request_id, cached_tokens, cached_tokens_source FROM requests ORDER BY 1"
        ).fetchall()
    }


def test_the_engines_fill_cached_tokens_the_gateway_lacks_and_say_so(tmp_path: Path) -> None:
    con = connect()
    result = ingest(con, load_incident(write_incident(tmp_path, REQUESTS)))
    assert cached(con) == {
        "a": (256, "engine_request"),
        "b": (300, "engine_batch"),
        "c": (None, None),
        "d": (None, None),
        "e": (64, "gateway"),
        "f": (0, "gateway"),
        "g": (None, None),
        "h": (None, None),
        "i": (None, None),
    }
    assert con.execute(
        "SELECT count(*), count(*) FILTER (WHERE role = 'prefill'), sum(cached_token) FROM prefill_batches"
    ).fetchall() == [(4, 4, 900)]
    assert con.execute(
        "SELECT request_id, cached_tokens FROM engine_events WHERE kind = 'req_time_stats' ORDER BY 1"
    ).fetchall() == [("a", 256), ("e", 64), ("f", 512), ("g", 0)]
    assert con.execute(
        "SELECT request_id, engine_cached, gateway_cached FROM engine_cached_tokens ORDER BY 1"
    ).fetchall() == [("a", 256, None), ("e", 64, 64), ("f", 512, 0)]
    (warning,) = [w for w in result.warnings if "cached_tokens" in w]
    assert "differ for 1 of 2 request(s) both count (e.g. 'f')" in warning
    assert any(
        "1 request(s) without cached_tokens from the gateway took it from a prefill batch" in a
        for a in result.assumptions
    )

    # the same gateway record delivered again compares equal with the one loaded (the engine's value is not the
    # gateway's), and the fill is made again
    (tmp_path / "gateway" / "day2.jsonl").write_text(json.dumps(REQUESTS[0]) + "\n")
    again = ingest(con, load_incident(tmp_path / "incident.toml"))
    day2 = next(f for f in again.files if f.file.endswith("day2.jsonl"))
    assert (day2.loaded, day2.duplicates, day2.quarantined) == (0, 1, 0)
    assert cached(con)["a"] == (256, "engine_request")


def test_an_instance_whose_lines_for_a_request_disagree_fills_nothing(tmp_path: Path) -> None:
    """Two ReqTimeStats lines of one request on one instance (a retried prefill) are the engine's count only when
    they agree on both input_len and cached_input_len: a request whose lines disagree on either keeps no count."""
    retried = (
        "[2026-08-28 09:07:01] ReqTimeStats(rid=j, bootstrap_room=5, input_len=800, cached_input_len=128, output_len=1, "
        "attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=10.00ms\n"
        "[2026-08-28 09:07:02] ReqTimeStats(rid=j, bootstrap_room=5, input_len=800, cached_input_len=128, output_len=1, "
        "attempts=2, type=prefill): queue_duration=1.00ms, forward_duration=10.00ms\n"
        "[2026-08-28 09:08:01] ReqTimeStats(rid=k, bootstrap_room=6, input_len=800, cached_input_len=128, output_len=1, "
        "attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=10.00ms\n"
        "[2026-08-28 09:08:02] ReqTimeStats(rid=k, bootstrap_room=6, input_len=800, cached_input_len=0, output_len=1, "
        "attempts=2, type=prefill): queue_duration=1.00ms, forward_duration=10.00ms\n"
        "[2026-08-28 09:08:31] ReqTimeStats(rid=l, bootstrap_room=7, input_len=800, cached_input_len=64, output_len=1, "
        "attempts=1, type=prefill): queue_duration=1.00ms, forward_duration=10.00ms\n"
        "[2026-08-28 09:08:32] ReqTimeStats(rid=l, bootstrap_room=7, input_len=900, cached_input_len=64, output_len=1, "
        "attempts=2, type=prefill): queue_duration=1.00ms, forward_duration=10.00ms\n"
    )
    rows = [request("j", 7, 800, None), request("k", 8, 800, None), request("l", 8, 800, None, second="30")]
    path = write_incident(tmp_path, rows)
    log = tmp_path / "engine" / "p0.log"
    log.write_text(log.read_text() + retried)
    con = connect()
    ingest(con, load_incident(path))
    assert {rid: got for rid, got in cached(con).items() if rid in "jkl"} == {
        "j": (128, "engine_request"),  # two lines that agree
        "k": (None, None),  # cached_input_len 128, then 0
        "l": (None, None),  # input_len 800, then 900
    }


def test_engine_counts_make_the_prefix_mechanisms_input_present(tmp_path: Path) -> None:
    con = connect()
    ingest(con, load_incident(write_incident(tmp_path, [r for r in REQUESTS if r.get("cached_tokens") is None])))
    assert present_inputs(con, ["requests.cached_tokens"]) == {"requests.cached_tokens"}
    con.execute("UPDATE requests SET cached_tokens = NULL WHERE cached_tokens_source LIKE 'engine%'")
    assert present_inputs(con, ["requests.cached_tokens"]) == set()


def test_a_contradiction_above_the_share_makes_the_run_inconclusive(tmp_path: Path) -> None:
    con = connect()
    ingest(con, load_incident(write_incident(tmp_path, REQUESTS)))
    con.execute("CREATE TEMP TABLE analysed_requests AS SELECT * FROM requests")  # what scope analyses
    (reason,) = conclusive.evaluate(con, only=("cached_tokens_disagree",))
    assert reason.message.startswith(
        "cached_tokens: the gateway's count and the engines' own count (ReqTimeStats cached_input_len) differ for "
        "1 of the 2 requests both count (50.0%, above 1.0%; e.g. 'f')"
    )
    assert reason.evidence == {"differing": 1, "compared": 2, "fraction": 0.5, "max_fraction": 0.01}
    con.execute("UPDATE engine_cached_tokens SET engine_cached = gateway_cached WHERE gateway_cached IS NOT NULL")
    assert conclusive.evaluate(con, only=("cached_tokens_disagree",)) == []


# --- audit check 6 -------------------------------------------------------------------------------------

BARE_STARTUP = """\
[2026-08-28 08:00:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500000, KV size: 10.00 GB
[2026-08-28 08:00:06] max_total_num_tokens=500000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=131072, available_gpu_mem=12.34 GB
[2026-08-28 08:00:30] The server is fired up and ready to roll!
[2026-08-28 09:00:00] Prefill batch, #new-seq: 1, #new-token: 100, #cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0
"""
HIT = (
    "[2026-08-28 09:00:01] Prefill batch, #new-seq: 1, #new-token: 100, #cached-token: 64, token usage: 0.01, "
    "#running-req: 0, #queue-req: 0\n"
)


@pytest.mark.parametrize("hit", [True, False])
def test_a_batch_served_from_the_cache_shows_prefix_caching_on_when_the_flags_do_not_say(
    tmp_path: Path, hit: bool
) -> None:
    log = tmp_path / "u0.log"
    log.write_text(BARE_STARTUP + (HIT if hit else ""))
    (v,) = [v for v in audit_paths([log]).verdicts if v.check == 6]
    if hit:
        assert (v.status, v.evidence_line) == ("unknown", 5)  # on, and no manifest says who shares it
        assert v.detail.startswith("prefix cache on: a prefill batch line reports #cached-token > 0")
    else:
        assert v.detail == "no server_args line: whether the radix cache is on is not in the log"


def test_the_evidence_database_keeps_the_cache_hit_for_the_audit(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "u0.log").write_text(BARE_STARTUP + HIT)
    (tmp_path / "gateway" / "day1.jsonl").write_text(json.dumps(request("a", 0, 1000, None)) + "\n")
    (tmp_path / "incident.toml").write_text(INCIDENT)
    con = connect()
    ingest(con, load_incident(tmp_path / "incident.toml"))
    (v,) = [v for v in audit_database(con).verdicts if v.check == 6]
    assert (v.evidence_file, v.evidence_line) == (str(tmp_path / "engine" / "u0.log"), 5)
    assert v.detail.startswith("prefix cache on: a prefill batch line reports #cached-token > 0")


def test_batches_keep_their_fields_through_a_table() -> None:
    from kvforensics.sources.engine_logs.contract import batches_from_table, batches_table

    batches = parse(FORMS).prefill_batches
    assert batches_from_table(batches_table(batches)) == batches
    assert all(isinstance(b, PrefillBatch) for b in batches)


def test_in_a_collection_envelope_batches_and_the_hit_flag_name_the_files_lines(tmp_path: Path) -> None:
    """Docker's json-file records (https://docs.docker.com/engine/logging/drivers/json-file/), written out of
    clock order: the parse reads them in the envelope's order and names the file's own lines."""
    from kvforensics.sources.engine_logs.parse import parse_engine_file

    records = [
        ("08:00:05", BARE_STARTUP.splitlines()[0]),
        ("09:00:01", HIT.rstrip("\n")),
        ("08:00:06", BARE_STARTUP.splitlines()[1]),
        ("08:00:30", BARE_STARTUP.splitlines()[2]),
    ]
    path = tmp_path / "u0.log"
    path.write_text(
        "".join(
            json.dumps({"log": text + "\n", "stream": "stdout", "time": f"2026-08-28T{t}.000000000Z"}) + "\n"
            for t, text in records
        )
    )
    parsed = parse_engine_file(path, fmt="sglang", instance="u0", tz=UTC, envelope="auto")
    assert parsed.envelope == "docker"
    assert [(b.line, b.cached_token) for b in parsed.batches] == [(2, 64)]
    (startup,) = parsed.startups
    assert startup.flags["prefix_cache_hit_line"] == "2" and startup.evidence["prefix_cache_hit"] == 2
