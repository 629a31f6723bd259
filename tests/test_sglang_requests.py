"""SGLang's own --log-requests output as a requests source: the rows and reasons each form must give."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforensics.config import Source, load_incident
from kvforensics.core.db import connect
from kvforensics.sources.engine_logs.sglang.python_repr import (
    ReprDump,
    top_level_items,
    top_level_items_by_token,
)
from kvforensics.sources.requests.load import load_requests_file
from kvforensics.sources.requests.sglang import NO_ACCOUNT, read_line, recognises
from kvforensics.stages.ingest import ingest

FIXTURES = Path(__file__).parent / "fixtures" / "sglang_requests"


@pytest.fixture(autouse=True)
def _keep_typed(monkeypatch):
    """The tests read the typed records of the last load (loaded or not) from typed_all."""
    import kvforensics.sources.requests.load as requests_loader

    monkeypatch.setattr(requests_loader, "KEEP_BATCH_TABLES", True)


ORPHAN = (
    "Receive line without a Finish line in this file (the client disconnected, the request was still "
    "running when the log ends, or it finished in a later file)"
)
ROW_COLUMNS = (
    "request_id, ts, account_id, model, status, prompt_tokens, completion_tokens, cached_tokens, "
    "ttft_ms, latency_ms, source_line"
)


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def source(
    fmt: str = "sglang_requests", tz: str = "UTC", columns: dict | None = None, model: str | None = None
) -> Source:
    return Source(
        name="engine-requests",
        kind="requests",
        path="*",
        format=fmt,
        timezone=tz,
        base_dir=FIXTURES,
        columns=columns or {},
        model=model,
    )


def load(path: Path, **kw):
    con = connect()
    result = load_requests_file(con, source(**kw), path)
    rows = con.execute(f"SELECT {ROW_COLUMNS} FROM requests ORDER BY source_line").fetchall()
    quarantine = con.execute("SELECT line, reason FROM quarantine ORDER BY line").fetchall()
    return con, result, rows, quarantine


def typed(con) -> list[tuple]:
    """The typed values of every record, loaded or not (the staging step's reading of the log)."""
    return con.execute(
        "SELECT line, request_id, ts, account_id, model, status, prompt_tokens, completion_tokens, "
        "cached_tokens, ttft_ms, latency_ms FROM kvf_batch.typed_all ORDER BY line"
    ).fetchall()


def write(tmp_path: Path, lines: list[str], name: str = "requests.log") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_0_4_6_inline_text_level0_has_no_account_so_every_request_is_quarantined_with_a_clear_reason():
    con, r, rows, quarantine = load(FIXTURES / "sglang-0.4.6-text-level0.log", tz="Europe/Berlin")
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (6, 0, 6, 0)
    assert rows == []
    assert quarantine == [
        (8, NO_ACCOUNT),
        (12, NO_ACCOUNT),
        (14, NO_ACCOUNT),
        (15, NO_ACCOUNT),
        (16, NO_ACCOUNT),
        (17, ORPHAN),
    ]
    assert typed(con) == [
        # received 15:00:16 CEST (Receive line); finished normally
        (
            8,
            "3f1c0e8b6a2d4c9e8f7a6b5c4d3e2f10",
            utc("2025-05-09T13:00:16"),
            None,
            "qwen2.5-7b",
            200,
            1536,
            87,
            0,
            None,
            2912.417,
        ),
        # abort with status_code HTTPStatus.BAD_REQUEST (Python 3.10 str of the enum)
        (
            12,
            "9b2e61d04c7a4f0e9d3b8a1c2e5f7d90",
            utc("2025-05-09T13:01:02"),
            None,
            "qwen2.5-7b",
            400,
            40000,
            0,
            0,
            None,
            21.302,
        ),
        # both halves of a batch Receive (rid=[...]) get its time
        (
            14,
            "b0a1e6c2a3d94f2c8e1f0d9c8b7a6f01",
            utc("2025-05-09T13:01:40"),
            None,
            "qwen2.5-7b",
            200,
            12,
            16,
            0,
            None,
            801.1,
        ),
        (
            15,
            "b0a1e6c2a3d94f2c8e1f0d9c8b7a6f02",
            utc("2025-05-09T13:01:40"),
            None,
            "qwen2.5-7b",
            200,
            12,
            16,
            12,
            None,
            810.7,
        ),
        # received in an earlier file: Finish time 15:02:30 minus e2e_latency 1.5 s
        (
            16,
            "77e0c2d1b4a9480f9e6d5c4b3a291807",
            utc("2025-05-09T13:02:28.5"),
            None,
            "qwen2.5-7b",
            200,
            2048,
            300,
            1024,
            None,
            1500.0,
        ),
        (17, None, None, None, None, None, None, None, None, None, None),
    ]
    assert r.notes == [
        "read as SGLang --log-requests output (text format): 5 finished request(s), 4 matched to their Receive line",
        "receive times: 4 from the Receive line, 1 from the Finish line time minus e2e_latency",
        "5 request(s) without an account id quarantined: SGLang logs only whitelisted headers (x-smg-routing-key "
        "plus SGLANG_LOG_REQUEST_HEADERS); map the one that carries the account with "
        "columns = { account_id = \"headers.<name>\" }",
        "model for 5 request(s) from this file's server_args (served model 'qwen2.5-7b'), an engine name: set the "
        "source's model to the gateway's model id if they differ",
        "status is the engine's view (finish_reason abort -> its status_code, otherwise 200), not the HTTP status "
        "a gateway in front may have returned; 1 abort(s)",
        "1 Receive line(s) without a Finish line quarantined",
        "8 line(s) that are not request-log lines skipped",
    ]


def test_0_5_15_request_logger_text_level1_with_routing_key_and_metrics():
    con, r, rows, quarantine = load(FIXTURES / "sglang-0.5.15-text-level1.log", model="@cf/zai-org/glm-5.3")
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (5, 3, 2, 0)
    m = "@cf/zai-org/glm-5.3"
    assert rows == [
        (
            "c0ffee00000000000000000000000001",
            utc("2026-08-28T10:00:00.123456"),
            "acct-0042",
            m,
            200,
            4312,
            1024,
            4096,
            412.3,
            12407.124,
            4,
        ),
        (
            "c0ffee00000000000000000000000002",
            utc("2026-08-28T10:00:20.001"),
            "acct-0042",
            m,
            400,
            1100000,
            0,
            0,
            None,
            44.1,
            7,
        ),
        # abort without a status_code: 500, the engine's view
        (
            "c0ffee00000000000000000000000003",
            utc("2026-08-28T10:01:00.5"),
            "bounty-4471",
            m,
            500,
            900,
            3,
            0,
            4900.0,
            5000.0,
            9,
        ),
    ]
    assert quarantine == [(11, NO_ACCOUNT), (12, ORPHAN)]
    assert (
        "status is the engine's view (finish_reason abort -> its status_code, otherwise 200), not the HTTP "
        "status a gateway in front may have returned; 2 abort(s), 1 without a status_code read as 500"
    ) in r.notes
    assert "receive times: 4 from meta_info.request_received_ts" in r.notes
    assert "model set from the source's model setting (@cf/zai-org/glm-5.3)" in r.notes
    assert "1 'Receive OpenAI' line(s) skipped: they carry no request id" in r.notes


def test_0_5_23_text_level2_truncated_prompt_cannot_forge_fields():
    con, r, rows, quarantine = load(FIXTURES / "sglang-0.5.23-text-level2.log")
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (3, 3, 0, 0)
    assert rows == [
        # received_time (epoch) on the obj wins over the Receive line's time
        ("cc33", utc("2026-09-10T09:20:00.129"), "acct-1", "gemma-3-27b", 200, 120000, 8, 0, None, 2870.245, 5),
        # the prompt imitates ", headers={... 'victim'}, out={'meta_info': {'id': 'forged' ...": it stays text
        ("dd44", utc("2026-09-10T09:21:00"), "acct-2", "gemma-3-27b", 200, 31, 5, 0, None, 250.0, 7),
        # output_ids cut as "[...] ... [...]" at level 2; no Receive: Finish time minus e2e_latency
        ("ee55", utc("2026-09-10T09:21:59.5"), "acct-3", "gemma-3-27b", 200, 9, 4096, 0, None, 500.0, 8),
    ]
    assert quarantine == []


def test_json_format_in_local_time_with_envelope_nan_logprobs_and_a_cut_line():
    con, r, rows, quarantine = load(FIXTURES / "sglang-0.5.23-json.log", tz="Europe/Berlin", model="gemma-3-27b")
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (6, 4, 2, 0)
    g = "gemma-3-27b"
    assert rows == [
        # the request.received record's "timestamp" (local, CEST) is the receive time
        ("j1", utc("2026-09-10T09:20:00.114233"), "acct-7", g, 200, 9000, 120, 8192, None, 3437.63, 4),
        ("j2", utc("2026-09-10T09:20:00.13"), "acct-8", g, 400, 140000, 0, 0, None, 31.0, 5),
        # -Infinity and NaN in output_token_logprobs do not matter
        ("j3", utc("2026-09-10T09:21:10"), "acct-7", g, 200, 50, 3, 0, None, 500.0, 6),
        # "[date] {json}": a JSON record behind the text envelope
        ("j4", utc("2026-09-10T09:21:59.75"), "acct-9", g, 200, 70, 10, 64, 62.5, 250.0, 7),
    ]
    assert quarantine == [
        (8, "malformed JSON request-log line"),
        (9, "completion_tokens is not a non-negative integer: 'ten'"),
    ]
    assert (
        "receive times: 1 from meta_info.request_received_ts, 1 from obj.received_time, 1 from the Receive "
        "line, 2 from the Finish line time minus e2e_latency" in r.notes
    )


def test_json_request_log_given_as_jsonl_is_recognised_and_read_the_same():
    con, r, rows, quarantine = load(
        FIXTURES / "sglang-0.5.23-json.log", fmt="jsonl", tz="Europe/Berlin", model="gemma-3-27b"
    )
    assert (r.records_read, r.loaded, r.quarantined) == (6, 4, 2)
    assert [row[0] for row in rows] == ["j1", "j2", "j3", "j4"]
    assert r.notes[0] == "recognised as SGLang --log-requests JSON; read as format = \"sglang_requests\""


def test_0_3_in_out_line_uses_the_finish_time_when_no_latency_is_logged():
    con, r, rows, quarantine = load(FIXTURES / "sglang-0.3.6-in-out.log", columns={"account_id": "obj.rid"})
    assert rows == [
        (
            "5d8f0a2b9c3e4f1a8b7c6d5e4f3a2b1c",
            utc("2024-11-02T10:05:07"),
            "5d8f0a2b9c3e4f1a8b7c6d5e4f3a2b1c",
            "meta-llama/Llama-3.1-8B-Instruct",
            200,
            6,
            16,
            1,
            None,
            None,
            3,
        )
    ]
    assert (
        "receive times: 1 from the Finish line time (no e2e_latency logged: later than the receive time by the "
        "request's duration)"
    ) in r.notes


def test_account_from_a_mapped_header_and_its_absence_named(tmp_path):
    obj = "GenerateReqInput(rid='{rid}', stream=False)"
    meta = (
        "{{'meta_info': {{'id': '{rid}', 'finish_reason': {{'type': 'stop', 'matched': 2}}, 'prompt_tokens': 10, "
        "'completion_tokens': 2, 'cached_tokens': 0, 'e2e_latency': 0.5}}}}"
    )
    lines = [
        f"[2026-08-28 10:00:01] Finish: obj={obj.format(rid='h1')}, headers={{'x-smg-routing-key': 'route-1', "
        f"'X-Account': 'acct-9'}}, out={meta.format(rid='h1')}",
        f"[2026-08-28 10:00:02] Finish: obj={obj.format(rid='h2')}, headers={{'x-smg-routing-key': 'route-2'}}, "
        f"out={meta.format(rid='h2')}",
    ]
    p = write(tmp_path, lines)
    for mapped in ("headers.x-account", "x-account"):
        con, r, rows, quarantine = load(p, columns={"account_id": mapped}, model="m")
        assert [(row[0], row[2]) for row in rows] == [("h1", "acct-9")]
        assert quarantine == [(2, f"no account id in the request log (columns.account_id = '{mapped}' is absent)")]
    con, r, rows, quarantine = load(p, model="m")
    assert [(row[0], row[2]) for row in rows] == [("h1", "route-1"), ("h2", "route-2")]
    assert (
        "account_id read from the router's routing key (the x-smg-routing-key header, else obj.routing_key): "
        "check that your router sets it to the account"
    ) in r.notes


def test_level3_untruncated_prompt_is_read_quickly_and_never_copied(tmp_path):
    secret = "CONFIDENTIAL-" + ("the quick ' brown \" fox ), out={'meta_info': {'id': 'x'}} [1, 2] " * 5000)
    obj = f"GenerateReqInput(rid='big1', text={secret!r}, input_ids=None, sampling_params={{'max_new_tokens': 4}})"
    out = (
        "{'text': " + repr(secret[:5000]) + ", 'output_ids': " + str(list(range(3000))) + ", 'meta_info': "
        "{'id': 'big1', 'finish_reason': {'type': 'length', 'length': 4}, 'prompt_tokens': 700000, "
        "'completion_tokens': 4, 'cached_tokens': 0, 'e2e_latency': 0.2}}"
    )
    lines = [
        f"[2026-08-28 10:00:00] Receive: obj={obj}",
        f"[2026-08-28 10:00:01] Finish: obj={obj}, out={out}",
        f"[2026-08-28 10:00:02] Finish: obj={obj.replace('big1', 'big2')}, out={out.replace('big1', 'big2')}",
    ]
    p = write(tmp_path, lines)
    started = time.perf_counter()
    con, r, rows, quarantine = load(p, columns={"account_id": "obj.rid"})  # no model: big2 is quarantined
    assert time.perf_counter() - started < 5
    assert rows == []
    assert [q[1] for q in quarantine] == [
        "no model in the request log (set model = \"<gateway model id>\" on the source)"
    ] * 2
    raws = [row[0] for row in con.execute("SELECT raw FROM quarantine").fetchall()]
    assert raws and not any("CONFIDENTIAL" in raw or "brown" in raw for raw in raws)
    assert json.loads(raws[0])["meta_info"]["prompt_tokens"] == "700000"  # as written in the line
    con, r, rows, quarantine = load(p, columns={"account_id": "obj.rid"}, model="m")
    assert [(row[0], row[1], row[5]) for row in rows] == [
        ("big1", utc("2026-08-28T10:00:00"), 700000),
        ("big2", utc("2026-08-28T10:00:01.8"), 700000),
    ]


def test_unreadable_request_line_shows_no_prompt_text(tmp_path):
    line = (
        '{"timestamp": "2026-08-28T10:00:00", "event": "request.finished", "rid": "q1", "obj": {"text": "'
        + "my secret medical history " * 10
        + '"'
    )
    con, r, rows, quarantine = load(write(tmp_path, [line]), model="m")
    assert quarantine == [(1, "malformed JSON request-log line")]
    raw = con.execute("SELECT raw FROM quarantine").fetchall()[0][0]
    assert "medical" not in raw and "chars>" in raw


def test_same_log_loaded_twice_is_duplicates_not_new_requests():
    con = connect()
    src = source(model="gemma-3-27b")
    first = load_requests_file(con, src, FIXTURES / "sglang-0.5.23-text-level2.log")
    second = load_requests_file(con, src, FIXTURES / "sglang-0.5.23-text-level2.log")
    assert (first.loaded, second.loaded, second.duplicates) == (3, 0, 3)


def test_meta_info_shaped_gateway_jsonl_is_recognised_without_a_mapping(tmp_path):
    def rec(rid, fr, **meta):
        return json.dumps(
            {
                "account_id": "acct-1",
                "model": "m",
                "timestamp": "2026-08-28T10:00:00Z",
                "meta_info": {
                    "id": rid,
                    "finish_reason": fr,
                    "prompt_tokens": 100,
                    "completion_tokens": 5,
                    "cached_tokens": 10,
                    "e2e_latency": 1.25,
                    **meta,
                },
            }
        )

    lines = [
        rec("g1", {"type": "stop", "matched": 2}, first_token_latency=0.1),
        rec("g2", {"type": "abort", "message": "too long", "status_code": 400, "err_type": "BadRequestError"}),
        rec("g3", {"type": "abort", "message": "Abort in waiting queue", "status_code": None}),
        rec("g4", {"type": "length", "length": 5}, e2e_latency="slow"),
    ]
    con = connect()
    r = load_requests_file(con, source(fmt="jsonl"), write(tmp_path, lines, "gw.jsonl"))
    rows = con.execute(
        "SELECT request_id, status, prompt_tokens, completion_tokens, cached_tokens, ttft_ms, latency_ms "
        "FROM requests ORDER BY request_id"
    ).fetchall()
    assert rows == [
        ("g1", 200, 100, 5, 10, 100.0, 1250.0),
        ("g2", 400, 100, 5, 10, None, 1250.0),
        ("g3", 500, 100, 5, 10, None, 1250.0),
    ]
    assert con.execute("SELECT line, reason FROM quarantine").fetchall() == [
        (4, "latency_ms is not a non-negative number: 'slow'")
    ]
    assert (
        "status derived from meta_info.finish_reason (the engine's view: abort -> its status_code, or 500 "
        "without one; otherwise 200), as the records have no status column"
    ) in r.notes
    assert any("latency_ms <- meta_info.e2e_latency" in n and "request_id <- meta_info.id" in n for n in r.notes)


def test_recognises_request_logs_but_not_engine_logs_or_gateway_jsonl(tmp_path):
    assert all(recognises(p) for p in FIXTURES.glob("*.log"))
    engine = Path(__file__).parent / "fixtures" / "engine_logs" / "sglang-0.5.15-pd-prefill-tp8.log"
    assert not recognises(engine)
    gateway = [
        json.dumps({"rid": "r", "event": "login"}),
        json.dumps({"rid": "r", "event": "request.finished", "account_id": "a", "status": 200}),
    ]
    assert not recognises(write(tmp_path, gateway, "gw.jsonl"))


def test_repr_reader_keeps_quoted_text_whole():
    dump = ReprDump.parse("GenerateReqInput(rid='a,b', text=\"it's ), x=(\", sampling_params={'stop': [')']})")
    assert dump is not None
    assert (dump.get("rid"), dump.get("text"), dump.keys()) == (
        "a,b",
        "it's ), x=(",
        ["rid", "text", "sampling_params"],
    )
    event = read_line(
        1,
        "(SGLangWorker pid=7) [2026-08-28 10:00:00.250 DP1 TP0] Receive: obj=GenerateReqInput("
        "rid='r1'), headers={'x-smg-routing-key': 'k'}",
    )
    assert event is not None and (event.kind, event.ts, event.rid) == ("receive", "2026-08-28T10:00:00.250000", "r1")


def _engine_request_incident(tmp_path: Path, *, models: str = "", source_model: str = "") -> Path:
    """An incident whose requests come from an SGLang engine's own log (0.5.23, level 2), with that
    log also read as an engine log; ``models`` and ``source_model`` are extra TOML lines."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "gemma-0.log").write_text((FIXTURES / "sglang-0.5.23-text-level2.log").read_text())
    path = tmp_path / "incident.toml"
    path.write_text(f"""
[incident]
id = "sglang-requests"
{models}
[[sources]]
name = "engine-requests"
kind = "requests"
path = "engine/*.log"
format = "sglang_requests"
{source_model}
[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*.log"
format = "sglang"
""")
    return path


def test_incident_file_accepts_the_format_and_ingest_reads_the_engines_own_log(tmp_path):
    _engine_request_incident(tmp_path, source_model='model = "gemma-3-27b"')
    incident = load_incident(tmp_path / "incident.toml")
    assert incident.sources[0].format == "sglang_requests"
    con = connect()
    ingest(con, incident)
    assert con.execute("SELECT source, records_read, loaded, quarantined FROM load_report ORDER BY source").fetchall()[
        0
    ] == ("engine-requests", 3, 3, 0)
    assert con.execute("SELECT count(*) FROM requests").fetchall() == [(3,)]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="()[]{},'\"\\ab1 =:", max_size=40), data=st.data())
def test_fast_item_splitter_agrees_with_the_token_scanner(text, data):
    start = data.draw(st.integers(0, len(text)))
    assert top_level_items(text, start) == top_level_items_by_token(text, start)


def test_model_aliases_rename_the_engines_model_names_so_requests_match_their_capacity(tmp_path):
    """Without a model setting, an engine's request log names the model the engine's way; the
    incident's [models] aliases (matched case-insensitively) give the gateway id, as they do for the
    capacity built from the same engine's log, so the oversize rule can join the two."""
    _engine_request_incident(tmp_path, models='[models]\naliases = { "GEMMA-3-27B" = "@cf/google/gemma-3-27b-it" }\n')
    con = connect()
    ingest(con, load_incident(tmp_path / "incident.toml"))
    assert con.execute("SELECT DISTINCT model FROM requests").fetchall() == [("@cf/google/gemma-3-27b-it",)]
    assert con.execute("SELECT DISTINCT model FROM capacity").fetchall() == [("@cf/google/gemma-3-27b-it",)]
    (notes,) = con.execute("SELECT notes FROM load_report WHERE source = 'engine-requests'").fetchone()
    assert "3 record(s) named the model the engine's way; renamed to the gateway's model id" in notes
