"""Strict incident files: every table and key is known (a misspelling names the nearest valid key) and
of the right type; a file belongs to one source; content text never reaches the quarantine."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from conftest import INCIDENT, SAMPLE, write_mini

from kvforensics.cli import main
from kvforensics.config import incident_from_dict, load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.simulate.exports import export_toml
from kvforensics.simulate.fleet.deployment import build_deployment
from kvforensics.simulate.scenario import COLUMN_STYLES, Scenario
from kvforensics.simulate.sources.incident_files import incident_toml
from kvforensics.stages.ingest import ingest

ROOT = Path(__file__).resolve().parent.parent

# Every table of the incident file, each key once.
FULL = (
    INCIDENT
    + """
[[events]]
ts = "2026-09-08T23:11:00Z"
title = "Report received"
description = "bug bounty"

[models.hardware."@cf/zai-org/glm-5.3"]
active_params = 32e9
layers = 78
hidden_size = 6144
n_gpus = 8
gpu = "H200_SXM"
precision = "fp8"

[settings]
year = 2026
memory_limit = "2GB"
max_quarantine_fraction = 0.05
spark_requests_table = "db.requests"

[instances]
match = "^(?P<instance>[^.:]+)"
map = { "gw-0" = "p0" }
handover_s = 600

[rules.prefill_too_fast]
max_fraction = 0.25
min_uncached_tokens = 40000
"""
)


def load_text(tmp_path: Path, text: str):
    path = tmp_path / "incident.toml"
    path.write_text(text, encoding="utf-8")
    return load_incident(path)


def test_every_table_and_key_loads(tmp_path):
    inc = load_text(tmp_path, FULL)
    assert inc.year == 2026 and inc.memory_limit == "2GB" and inc.max_quarantine_fraction == 0.05
    assert inc.rule_parameters == {"prefill_too_fast": {"max_fraction": 0.25, "min_uncached_tokens": 40000}}
    assert inc.instances.handover_s == 600.0 and inc.events[0].description == "bug bounty"
    assert inc.hardware["@cf/zai-org/glm-5.3"]["layers"] == 78


UNKNOWN_KEYS = [
    (("[models]\n", "[modles]\n"), "incident.toml: unknown table [modles]; did you mean [models]?"),
    (("[[events]]\n", "[[event]]\n"), "incident.toml: unknown table [[event]]; did you mean [[events]]?"),
    (("[scope]\n", "[scoep]\n"), "incident.toml: unknown table [scoep]; did you mean [scope]?"),
    (
        ('title = "Mini incident"', 'titel = "Mini incident"'),
        "incident.toml: [incident]: unknown key 'titel'; did you mean 'title'?",
    ),
    (
        ("internal_accounts =", "internal_acounts ="),
        "incident.toml: [scope]: unknown key 'internal_acounts'; did you mean 'internal_accounts'?",
    ),
    (
        ('description = "bug bounty"', 'descripton = "bug bounty"'),
        "incident.toml: events[0]: unknown key 'descripton'; did you mean 'description'?",
    ),
    (("aliases =", "alias ="), "incident.toml: [models]: unknown key 'alias'; did you mean 'aliases'?"),
    (
        ("layers = 78", "layer = 78"),
        "incident.toml: [models.hardware.\"@cf/zai-org/glm-5.3\"]: unknown key 'layer'; did you mean 'layers'?",
    ),
    (
        ('memory_limit = "2GB"', 'memory_limt = "2GB"'),
        "incident.toml: [settings]: unknown key 'memory_limt'; did you mean 'memory_limit'?",
    ),
    (
        ("handover_s = 600", "handover = 600"),
        "incident.toml: [instances]: unknown key 'handover'; did you mean 'handover_s'?",
    ),
    (
        ('format = "sglang"', 'fromat = "sglang"'),
        "incident.toml: source 'engines': unknown key 'fromat'; did you mean 'format'?",
    ),
    (
        ('request_id = "rid"', 'reqest_id = "rid"'),
        "incident.toml: source 'gateway': columns maps unknown canonical field 'reqest_id'; did you mean 'request_id'?",
    ),
    (
        ("[rules.prefill_too_fast]", "[rules.prefill_to_fast]"),
        "incident.toml: [rules]: unknown rule 'prefill_to_fast'; did you mean 'prefill_too_fast'?",
    ),
    (
        ("max_fraction = 0.25", "max_fractoin = 0.25"),
        "incident.toml: [rules.prefill_too_fast]: unknown parameter 'max_fractoin'; did you mean 'max_fraction'?",
    ),
    (
        ('format = "sglang"', 'format = "sglang"\nrole = "prefill"'),
        "incident.toml: source 'engines': unknown key 'role'; valid keys: ambiguous, clock_offset_s, columns, envelope, "
        "format, instance, kind, model, name, null_tokens, path, preset, timezone, values, year",
    ),
    (
        ('memory_limit = "2GB"', 'colour = "red"'),
        "incident.toml: [settings]: unknown key 'colour'; valid keys: allow_outside, max_quarantine_fraction, "
        "memory_limit, spark_requests_table, winnow_window, year",
    ),
]


def _refused(tmp_path: Path, change: tuple[str, str]) -> str:
    """The error of the full incident file with one edit (the edited text must be in it)."""
    assert change[0] in FULL
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, FULL.replace(*change, 1))
    return str(e.value)


@pytest.mark.parametrize(("change", "message"), UNKNOWN_KEYS)
def test_an_unknown_key_at_any_level_names_the_nearest_valid_key(tmp_path, change, message):
    assert _refused(tmp_path, change) == message


def test_a_top_level_key_outside_any_table_lists_the_tables(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, "colour = 3\n" + FULL)
    assert str(e.value) == (
        "incident.toml: unknown top-level key 'colour'; the top level holds mechanisms = [...] "
        "and the tables [incident], [[sources]], [scope], [[events]], [models], [settings], "
        "[instances], [rules], [prefix_cache], [quarantine], [notice]"
    )


WRONG_TYPES = [
    (
        ('internal_accounts = ["loadtest-*"]', 'internal_accounts = "loadtest-*"'),
        "incident.toml: [scope]: 'internal_accounts' must be a list of strings, e.g. internal_accounts = "
        "[\"a\", \"b\"], got a string",
    ),
    (
        ("max_fraction = 0.25", 'max_fraction = "0.25"'),
        "incident.toml: [rules.prefill_too_fast]: 'max_fraction' must be a number like its default 0.2, got a string",
    ),
    (
        ("layers = 78", 'layers = "78"'),
        "incident.toml: [models.hardware.\"@cf/zai-org/glm-5.3\"]: 'layers' must be a number, got a string",
    ),
    (
        ('precision = "fp8"', 'precision = "fp16"'),
        "incident.toml: [models.hardware.\"@cf/zai-org/glm-5.3\"]: precision 'fp16' is not one of ['bf16', 'fp8']",
    ),
    (
        ("year = 2026", 'year = "2026"'),
        "incident.toml: [settings]: 'year' must be an integer such as 2026, got a string",
    ),
    (
        ('memory_limit = "2GB"', "memory_limit = 2"),
        "incident.toml: [settings]: 'memory_limit' must be a string, got an integer",
    ),
    (('format = "sglang"', "format = 5"), "incident.toml: source 'engines': 'format' must be a string, got an integer"),
    (
        ('format = "sglang"', 'format = "sglang"\nclock_offset_s = true'),
        "incident.toml: source 'engines': 'clock_offset_s' must be a number of seconds, got a boolean",
    ),
    (
        ('description = "bug bounty"', "description = 3"),
        "incident.toml: events[0]: 'description' must be a string, got an integer",
    ),
    (
        ('aliases = { "zai-org/GLM-5.3-FP8" = "@cf/zai-org/glm-5.3" }', 'aliases = { "zai-org/GLM-5.3-FP8" = 1 }'),
        "incident.toml: [models.aliases]: aliases must be a table of \"<engine served_model_name>\" = "
        "\"<gateway model id>\" strings",
    ),
]


@pytest.mark.parametrize(("change", "message"), WRONG_TYPES)
def test_a_value_of_the_wrong_type_says_what_is_expected(tmp_path, change, message):
    assert _refused(tmp_path, change) == message


def test_a_table_written_as_a_value_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, "scope = 3\n" + FULL.replace('[scope]\ninternal_accounts = ["loadtest-*"]\n', ""))
    assert str(e.value) == "incident.toml: 'scope' must be a table, got an integer"


@pytest.mark.parametrize(("change", "message"), UNKNOWN_KEYS[:3] + UNKNOWN_KEYS[4:5] + WRONG_TYPES[:1])
def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys, change, message):
    path = write_mini(tmp_path, incident=FULL.replace(*change, 1))
    assert main(["ingest", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"Error: {message}\n"
    assert not (tmp_path / "out" / "evidence.duckdb").exists()


# --- a file belongs to one source -----------------------------------------------------------------

CONTENT = """
[[sources]]
name = "content"
kind = "content"
path = "{path}"
format = "jsonl"
"""


def test_a_file_two_sources_name_is_refused_before_anything_is_read(tmp_path, capsys):
    path = write_mini(
        tmp_path, incident=INCIDENT.replace("[models]", CONTENT.format(path="gateway/day*.jsonl") + "\n[models]")
    )
    with pytest.raises(ConfigError) as e:
        ingest(connect(), load_incident(path))
    assert str(e.value) == (
        "incident.toml: file gateway/day1.jsonl matches the paths of sources 'gateway' and "
        "'content'; a file belongs to one source: narrow one of the paths"
    )
    assert main(["ingest", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"Error: {e.value}\n"


def test_the_same_file_reached_by_two_spellings_of_a_path_is_one_file(tmp_path):
    incident = INCIDENT.replace('path = "engine/*.log"', 'path = "engine/../engine/d0.log"')
    incident += '\n[[sources]]\nname = "engines2"\nkind = "engine_log"\npath = "engine/*0.log"\n'
    with pytest.raises(ConfigError) as e:
        load_incident(write_mini(tmp_path, incident=incident)).source_files()
    assert str(e.value) == (
        "incident.toml: file engine/d0.log matches the paths of sources 'engines' and "
        "'engines2'; a file belongs to one source: narrow one of the paths"
    )


def test_an_sglang_server_log_may_be_read_for_its_start_ups_and_for_its_request_lines(tmp_path):
    """SGLang writes its --log-requests lines into the server log that also holds its start-ups."""
    incident = INCIDENT + (
        '\n[[sources]]\nname = "engine-requests"\nkind = "requests"\npath = "engine/p0.log"\n'
        'format = "sglang_requests"\n'
    )
    plan = load_incident(write_mini(tmp_path, incident=incident)).source_files()
    assert [(s.name, [f.name for f in files]) for s, files in plan][1:] == [
        ("engines", ["d0.log", "p0.log"]),
        ("engine-requests", ["p0.log"]),
    ]
    twice = (
        incident
        + '\n[[sources]]\nname = "again"\nkind = "requests"\npath = "engine/p*.log"\nformat = "sglang_requests"\n'
    )
    with pytest.raises(
        ConfigError, match="file engine/p0.log matches the paths of sources 'engine-requests' and 'again'"
    ):
        load_incident(write_mini(tmp_path, incident=twice)).source_files()


def test_sources_naming_different_files_each_keep_their_own(tmp_path):
    inc = load_incident(write_mini(tmp_path))
    assert [(s.name, [f.name for f in files]) for s, files in inc.source_files()] == [
        ("gateway", ["day1.jsonl"]),
        ("engines", ["d0.log", "p0.log"]),
    ]


def test_the_content_loader_quarantines_where_and_why_never_the_text(tmp_path):
    path = write_mini(
        tmp_path, incident=INCIDENT.replace("[models]", CONTENT.format(path="content/*.jsonl") + "\n[models]")
    )
    (tmp_path / "content").mkdir()
    lines = [
        json.dumps({"request_id": "r1", "prompt": "secret prompt words here", "output": "secret reply"}),
        '{"request_id": "r2", "prompt": "secret unterminated',
        json.dumps({"prompt": "secret without an id"}),
        json.dumps(["secret", "in a list"]),
        "secret,not,json",
    ]
    (tmp_path / "content" / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    con = connect()
    ingest(con, load_incident(path))
    rows = con.execute("SELECT line, reason, raw FROM quarantine WHERE source = 'content' ORDER BY line").fetchall()
    assert [(line, raw) for line, _, raw in rows] == [(2, None), (3, None), (4, None), (5, None)]
    assert not any("secret" in str(v) for row in con.execute("SELECT * FROM quarantine").fetchall() for v in row)


# --- the incident files we ship, document and generate all load ----------------------------------


def _whole_incident_blocks(doc: Path) -> list[str]:
    blocks = re.findall(r"```toml\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S)
    return [b for b in blocks if re.search(r"^\[incident\]", b, flags=re.M)]


@pytest.mark.parametrize("doc", ["README.md", "docs/incident-config.md"])
def test_the_documented_incident_files_load(doc):
    blocks = _whole_incident_blocks(ROOT / doc)
    assert blocks, f"{doc} has no whole incident file"
    for block in blocks:
        incident_from_dict(tomllib.loads(block), ROOT / "incident.toml")


def test_the_sample_incident_loads():
    assert load_incident(SAMPLE).id


@pytest.mark.parametrize("columns", COLUMN_STYLES)
@pytest.mark.parametrize("with_content", [False, True])
def test_the_simulators_incident_files_load(columns, with_content):
    scenario = Scenario(
        gateway_columns=columns,
        custom_columns={"account_id": "customer"},
        gateway_timestamps="naive_local" if columns == "canonical" else "iso_z",
    )
    dep = build_deployment(scenario)
    incident_from_dict(tomllib.loads(incident_toml(dep, with_content)), Path("incident.toml"))
    if not with_content:
        incident_from_dict(tomllib.loads(export_toml(dep)), Path("incident.toml"))


def test_notice_keys_are_checked_and_typed(tmp_path):
    """[notice] (issue 27): what the notices say the responder declares; its keys and their types are checked."""
    incident = load_text(
        tmp_path,
        FULL + '\n[notice]\nprovider = "Example Inference Ltd"\ncontact = "privacy@example.com"\n'
        'measures = ["Restarted the servers."]\n',
    )
    assert (incident.notice.provider, incident.notice.contact, incident.notice.measures, incident.notice.missing) == (
        "Example Inference Ltd",
        "privacy@example.com",
        ("Restarted the servers.",),
        (),
    )
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, FULL + '\n[notice]\nprovder = "x"\n')
    assert str(e.value) == "incident.toml: [notice]: unknown key 'provder'; did you mean 'provider'?"
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, FULL + '\n[notice]\nmeasures = "restarted"\n')
    assert "'measures' must be a list of strings" in str(e.value)
    assert load_text(tmp_path, FULL).notice.missing == ("provider", "contact", "measures")
