"""Presets: each shipped preset loads its fixture (written from the upstream documented schema, see
tests/fixtures/presets/README.md) with `preset = ...` and a couple of lines of config, and gives
exactly these canonical fields for every record."""

from __future__ import annotations

import json
import shutil
import tomllib
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.sources.requests.load import load_requests_files
from kvforensics.sources.requests.presets import PRESET_KEYS, available, load_preset

FIXTURES = Path(__file__).parent / "fixtures" / "presets"
FIELDS = (
    "request_id",
    "ts",
    "account_id",
    "model",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "latency_ms",
    "prefill_instance",
    "decode_instance",
)


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def incident(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "incident.toml"
    path.write_text(f'[incident]\nid = "t"\n\n[[sources]]\nname = "gw"\nkind = "requests"\n{source}\n')
    return path


def load_rows(tmp_path: Path, fixture: str, source: str, fixtures: Path = FIXTURES) -> tuple[list[tuple], list[tuple]]:
    if fixtures != tmp_path:
        shutil.copy(fixtures / fixture, tmp_path / fixture)
    inc = load_incident(incident(tmp_path, source))
    con = connect()
    (src,) = inc.sources
    load_requests_files(con, src, src.files())
    rows = con.execute(f"SELECT {', '.join(FIELDS)} FROM requests ORDER BY ts, request_id").fetchall()
    refused = con.execute("SELECT line, reason FROM quarantine ORDER BY line").fetchall()
    return rows, refused


KEY = "88dc28d0f030c55ed4ab77ed8faf098196cb1c05df778539800c9f1243fe6b4b"
LITELLM_ROWS = [
    # a row written before LiteLLM logged a status: a success; Anthropic-style cache reads
    (
        "chatcmpl-0ld50000",
        utc("2026-08-27 17:05:00"),
        "team-acme",
        "claude-sonnet",
        200,
        3000,
        100,
        2048,
        400.0,
        2000.0,
        None,
        None,
    ),
    # streaming, team_id set, OpenAI-style cached tokens in metadata
    (
        "chatcmpl-7d1e0a52",
        utc("2026-08-27 17:15:03.123"),
        "team-acme",
        "glm-5.3",
        200,
        40960,
        270,
        1024,
        1412.0,
        6738.0,
        None,
        None,
    ),
    # team_id empty: the key's team from metadata; no completionStartTime: no TTFT
    (
        "chatcmpl-3f9a1b07",
        utc("2026-08-27 17:16:41.002"),
        "team-globex",
        "glm-5.3",
        200,
        2048,
        300,
        None,
        None,
        3248.0,
        None,
        None,
    ),
    # no team: the key's user
    (
        "chatcmpl-c0ffee01",
        utc("2026-08-27 17:20:00.5"),
        "initech-dev",
        "glm-5.3",
        200,
        512,
        100,
        None,
        250.0,
        1400.0,
        None,
        None,
    ),
    # no team, no user: the hashed key
    (
        "chatcmpl-beefcafe",
        utc("2026-08-27 17:21:10"),
        "ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12cd34ef56ab12",
        "glm-5.3",
        200,
        128,
        0,
        None,
        None,
        40.0,
        None,
        None,
    ),
    # a failed request as LiteLLM logs it: the provider's 400 from metadata.error_information.error_code
    ("e5f7a3c1-failed", utc("2026-08-27 17:22:30.25"), "team-acme", "glm-5.3", 400, 0, 0, None, None, 60.0, None, None),
    # a failure without a status code (error_code ""): 500
    ("9b2d4f60-failed", utc("2026-08-27 17:23:05"), "team-globex", "glm-5.3", 500, 0, 0, None, None, 15.0, None, None),
]


@pytest.mark.parametrize("fixture", ["litellm_spendlogs.csv", "litellm_spendlogs.jsonl"])
def test_litellm_spend_logs_export(tmp_path, fixture):
    rows, refused = load_rows(tmp_path, fixture, f'path = "{fixture}"\npreset = "litellm"')
    assert refused == []
    assert rows == LITELLM_ROWS


def test_litellm_api_base_as_the_prefill_instance_when_the_proxy_names_one(tmp_path):
    rows, _ = load_rows(
        tmp_path,
        "litellm_spendlogs.csv",
        'path = "litellm_spendlogs.csv"\npreset = "litellm"\ncolumns = { prefill_instance = "api_base" }',
    )
    assert [r[10] for r in rows] == [
        "https://api.anthropic.com",
        "http://glm53-prefill-0.pd.svc.cluster.local:30000/v1",
        "http://glm53-prefill-1.pd.svc.cluster.local:30000/v1",
        "http://glm53-prefill-0.pd.svc.cluster.local:30000/v1",
        "http://glm53-prefill-1.pd.svc.cluster.local:30000/v1",
        None,
        None,
    ]
    assert KEY not in {r[2] for r in rows}


def test_user_keys_override_the_preset_one_field_at_a_time(tmp_path):
    rows, refused = load_rows(
        tmp_path,
        "litellm_spendlogs.csv",
        """path = "litellm_spendlogs.csv"
preset = "litellm"
columns = { account_id = "api_key", ts = "endTime" }
values = { status = { success = 201 } }""",
    )
    by_id = {r[0]: r for r in rows}
    first = by_id["chatcmpl-7d1e0a52"]
    assert first[1:5] == (utc("2026-08-27 17:15:09.861"), KEY, "glm-5.3", 201)
    assert first[5:] == LITELLM_ROWS[1][5:]  # every field the user did not map is the preset's
    # the user's status map replaced the preset's whole map for that field: "failure" is no longer known
    # (a failure with an HTTP status in its error information still gives that status)
    assert refused == [(8, "status is not an HTTP status code: 'failure'")]
    assert by_id["e5f7a3c1-failed"][4] == 400
    assert len(rows) == 6


OPENAI_ROWS = [
    (
        "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
        utc("2025-03-04 12:00:00"),
        "acct-7",
        "gpt-4o-2024-08-06",
        200,
        1117,
        46,
        1024,
        None,
        None,
        None,
        None,
    ),
    (
        "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        utc("2025-03-04 12:00:05"),
        "acct-9",
        "gpt-4o-mini-2024-07-18",
        200,
        19,
        10,
        0,
        None,
        None,
        None,
        None,
    ),
    (
        "cmpl-uqkvlQyYK7bGYrRHQ0eXlWi7",
        utc("2025-03-04 12:00:09"),
        "acct-7",
        "gpt-3.5-turbo-instruct",
        200,
        5,
        7,
        None,
        None,
        None,
        None,
        None,
    ),
]


def test_openai_response_logs(tmp_path):
    rows, refused = load_rows(tmp_path, "openai_responses.jsonl", 'path = "openai_responses.jsonl"\npreset = "openai"')
    assert refused == []
    assert rows == OPENAI_ROWS


# OpenAI Responses API objects (tests/fixtures/presets/openai_responses_api.jsonl)
RESPONSES_ROWS = [
    (
        "resp_68af4c1e8a7c8193b2f0d6c1e5a94b3f0c7e2d1a9b8c7d6e",
        utc("2025-08-27 18:20:00"),
        "acct-7",
        "gpt-4.1-2025-04-14",
        200,
        36,
        87,
        0,
        None,
        None,
        None,
        None,
    ),
    # a follow-up turn: most of its input read from OpenAI's prompt cache
    (
        "resp_68af4c2b19e48193a6d2c7f0b1e3a5d7092c4e6f8a1b3c5d",
        utc("2025-08-27 18:20:13"),
        "acct-9",
        "gpt-4.1-2025-04-14",
        200,
        2006,
        300,
        1920,
        None,
        None,
        None,
        None,
    ),
    # incomplete (max_output_tokens): what it generated was delivered
    (
        "resp_68af4c3f5d1081939e7a4b2c6d8f0e1a3b5c7d9e0f2a4b6c",
        utc("2025-08-27 18:20:35"),
        "acct-7",
        "o4-mini-2025-04-16",
        200,
        120,
        16,
        0,
        None,
        None,
        None,
        None,
    ),
]
RESPONSES_REFUSED = [
    (
        4,
        'missing required field \'prompt_tokens\' (columns.prompt_tokens = coalesce("usage.prompt_tokens", '
        '"usage.input_tokens") gave NULL)',
    )
]


def test_openai_preset_reads_responses_api_objects(tmp_path):
    """``"object": "response"``: created_at, usage.input_tokens / output_tokens /
    input_tokens_details.cached_tokens, and the object's own status; a failed response without usage
    has no prompt tokens and is quarantined with the reason."""
    rows, refused = load_rows(
        tmp_path, "openai_responses_api.jsonl", 'path = "openai_responses_api.jsonl"\npreset = "openai"'
    )
    assert rows == RESPONSES_ROWS
    assert refused == RESPONSES_REFUSED


def test_openai_preset_reads_chat_completions_and_responses_in_one_file(tmp_path):
    text = (FIXTURES / "openai_responses.jsonl").read_text() + (FIXTURES / "openai_responses_api.jsonl").read_text()
    (tmp_path / "mixed.jsonl").write_text(text)
    rows, refused = load_rows(tmp_path, "mixed.jsonl", 'path = "mixed.jsonl"\npreset = "openai"', fixtures=tmp_path)
    assert rows == sorted(OPENAI_ROWS + RESPONSES_ROWS, key=lambda r: (r[1], r[0]))
    assert refused == [(RESPONSES_REFUSED[0][0] + 3, RESPONSES_REFUSED[0][1])]


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        ("completed", None, (200, [])),
        ("incomplete", None, (200, [])),
        ("failed", {"code": "server_error"}, (500, [])),
        ("cancelled", None, (499, [])),
        ("in_progress", None, (None, ["status is not an HTTP status code: 'in_progress'"])),
    ],
)
def test_a_responses_objects_status(tmp_path, status, error, expected):
    record = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1756318800,
        "status": status,
        "error": error,
        "model": "gpt-4.1",
        "user": "acct-1",
        "usage": {"input_tokens": 10, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 0}},
    }
    (tmp_path / "r.jsonl").write_text(json.dumps(record) + "\n")
    rows, refused = load_rows(tmp_path, "r.jsonl", 'path = "r.jsonl"\npreset = "openai"', fixtures=tmp_path)
    assert ([r[4] for r in rows][0] if rows else None, [reason for _, reason in refused]) == expected


def test_a_presets_optional_field_the_export_lacks_is_left_empty_and_said(tmp_path):
    """vLLM's chat completions carry no prompt_tokens_details unless asked to: the preset's cached_tokens
    reads nothing, which is no mapping mistake (a field the incident file maps itself would be)."""
    record = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1756318800,
        "model": "glm-5.3",
        "user": "acct-1",
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }
    (tmp_path / "v.jsonl").write_text(json.dumps(record) + "\n")
    (src,) = load_incident(incident(tmp_path, 'path = "v.jsonl"\npreset = "openai"')).sources
    (result,) = load_requests_files(connect(), src, src.files())
    assert (result.loaded, result.quarantined) == (1, 0)
    assert (
        "cached_tokens left empty: preset 'openai' reads it from 'usage.prompt_tokens_details.cached_tokens', "
        "'usage.input_tokens_details.cached_tokens', which v.jsonl does not have"
    ) in result.notes


def test_openai_batch_output(tmp_path):
    rows, refused = load_rows(
        tmp_path,
        "openai_batch_output.jsonl",
        """path = "openai_batch_output.jsonl"
preset = "openai_batch"
columns = { account_id = "('acct-1234')" }""",
    )
    assert rows == [
        (
            "batch_req_wnaDys",
            utc("2024-04-16 22:07:58"),
            "acct-1234",
            "gpt-4o-mini",
            200,
            22,
            2,
            0,
            None,
            None,
            None,
            None,
        ),
        (
            "batch_req_c4Kx2j",
            utc("2024-04-16 22:08:01"),
            "acct-1234",
            "gpt-4o-mini",
            200,
            1904,
            120,
            1792,
            None,
            None,
            None,
            None,
        ),
    ]
    assert refused == [(3, "missing required field 'ts' (column response.body.created)")]


def test_sglang_requests_preset_names_the_format(tmp_path):
    fixtures = Path(__file__).parent / "fixtures" / "sglang_requests"
    name = "sglang-0.5.23-json.log"
    rows = {}
    for way in ('preset = "sglang_requests"', 'format = "sglang_requests"'):
        rows[way] = load_rows(
            tmp_path, name, f'path = "{name}"\n{way}\ntimezone = "Europe/Berlin"\nmodel = "gemma-3-27b"', fixtures
        )
    assert rows['preset = "sglang_requests"'] == rows['format = "sglang_requests"']
    g = "gemma-3-27b"
    assert rows['preset = "sglang_requests"'][0] == [  # as tests/test_sglang_requests.py states them
        ("j1", utc("2026-09-10T09:20:00.114233"), "acct-7", g, 200, 9000, 120, 8192, None, 3437.63, None, None),
        ("j2", utc("2026-09-10T09:20:00.13"), "acct-8", g, 400, 140000, 0, 0, None, 31.0, None, None),
        ("j3", utc("2026-09-10T09:21:10"), "acct-7", g, 200, 50, 3, 0, None, 500.0, None, None),
        ("j4", utc("2026-09-10T09:21:59.75"), "acct-9", g, 200, 70, 10, 64, 62.5, 250.0, None, None),
    ]


def test_unknown_preset_lists_the_presets(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_incident(incident(tmp_path, 'path = "x.csv"\npreset = "litelm"'))
    assert str(e.value) == (f"incident.toml: source 'gw': unknown preset 'litelm'; presets: {', '.join(available())}")


@pytest.mark.parametrize("name", available())
def test_every_preset_file_is_well_formed(name):
    preset = load_preset(name)
    assert set(preset) <= set(PRESET_KEYS)
    assert preset["description"] and preset["schema"].startswith("https://")
    raw = tomllib.loads(
        (Path(__file__).parents[1] / "kvforensics" / "sources" / "requests" / "presets" / f"{name}.toml").read_text()
    )
    assert raw == preset


def test_a_load_says_which_preset_mapped_it_and_what_it_assumes(tmp_path):
    shutil.copy(FIXTURES / "litellm_spendlogs.csv", tmp_path / "spend.csv")
    (src,) = load_incident(incident(tmp_path, 'path = "spend.csv"\npreset = "litellm"')).sources
    (result,) = load_requests_files(connect(), src, src.files())
    (note,) = [n for n in result.notes if n.startswith("mapped by preset")]
    assert note.startswith(
        "mapped by preset 'litellm': LiteLLM proxy LiteLLM_SpendLogs export (CSV or JSON lines "
        "from Postgres). Account: the team (team_id, else the key's team in "
        "metadata.user_api_key_team_id), else the key's user"
    )
    assert note.endswith("(schema: https://github.com/BerriAI/litellm/blob/main/schema.prisma)")
