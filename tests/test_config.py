"""The incident file: what is accepted and the exact errors for what is not."""

from __future__ import annotations

import pytest

from kvforensics.config import load_incident
from kvforensics.core.errors import ConfigError

GOOD = """
[incident]
id = "t-1"
title = "Test"

[[sources]]
name = "gateway"
kind = "requests"
path = "gw/*.jsonl"
columns = { request_id = "rid" }

[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*.log"
timezone = "America/Los_Angeles"

[scope]
internal_accounts = ["loadtest-*"]
start = "2026-08-01T00:00:00Z"

[[events]]
ts = "2026-09-08T23:11:00Z"
title = "Report received"
"""


def write(tmp_path, text):
    p = tmp_path / "incident.toml"
    p.write_text(text)
    return p


def test_good_incident_parses(tmp_path):
    inc = load_incident(write(tmp_path, GOOD))
    assert inc.id == "t-1"
    gw, eng = inc.sources
    assert gw.format == "jsonl" and gw.column("request_id") == "rid" and gw.column("ts") == "ts"
    assert eng.format == "sglang" and eng.timezone == "America/Los_Angeles"
    assert inc.scope.internal_accounts == ("loadtest-*",)
    assert inc.events[0].title == "Report received"
    assert eng.instance_for(tmp_path / "engine" / "glm53-prefill-0.log.gz") == "glm53-prefill-0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('id = "t-1"', 'id = "T 1"'), "incident.toml: [incident]: id 'T 1' may only use a-z, 0-9 and '-'"),
        (
            ('kind = "engine_log"', 'kind = "engine"'),
            "incident.toml: source 'engines': kind 'engine' is not one of ['requests', 'engine_log', 'changes', 'content', 'kv_events']",
        ),
        (
            ('timezone = "America/Los_Angeles"', 'timezone = "Mars/Olympus"'),
            "incident.toml: source 'engines': unknown time zone 'Mars/Olympus'; use an IANA name such as 'UTC' or 'Europe/Berlin'",
        ),
        (
            ('columns = { request_id = "rid" }', 'columns = { req = "rid" }'),
            "incident.toml: source 'gateway': columns maps unknown canonical field(s) ['req']; canonical fields are "
            "['request_id', 'ts', 'account_id', 'model', 'status', 'prompt_tokens', 'completion_tokens', 'cached_tokens', "
            "'ttft_ms', 'latency_ms', 'prefill_instance', 'decode_instance', 'cache_salt']",
        ),
        (
            ('start = "2026-08-01T00:00:00Z"', 'start = "2026-08-01T00:00:00"'),
            "incident.toml: [scope].start: timestamp 2026-08-01T00:00:00 has no time zone; add 'Z' or an offset such as +02:00",
        ),
        (('name = "engines"', 'name = "gateway"'), "incident.toml: source names must be unique; repeated: ['gateway']"),
    ],
)
def test_bad_incident_files_say_what_to_fix(tmp_path, change, message):
    with pytest.raises(ConfigError) as e:
        load_incident(write(tmp_path, GOOD.replace(*change)))
    assert str(e.value) == message


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="incident file not found"):
        load_incident(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_incident(write(tmp_path, "[incident\n"))
    with pytest.raises(ConfigError, match="no source of kind 'requests'"):
        load_incident(
            write(
                tmp_path,
                GOOD.replace('kind = "requests"', 'kind = "changes"').replace('columns = { request_id = "rid" }', ''),
            )
        )
