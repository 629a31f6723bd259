"""Exposure mechanisms as units: the registry, a new mechanism as a folder, selection, and where the choice shows."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import duckdb
import pytest
import yaml
from markupsafe import escape

from kvforensics.audit.model import CHECKS
from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.investigation import run
from kvforensics.mechanisms import MECHANISMS_DIR, load_mechanisms, present_inputs, read_mechanism, select
from kvforensics.stages import conclusive
from kvforensics.stages.detect import detect, load_case_tables
from kvforensics.stages.rulebook import load_rules

STALE = MECHANISMS_DIR / "stale_pages"
STALE_RULES = {
    "prompt_exceeds_kv_pool",
    "prefill_too_fast",
    "engine_abort_but_success",
    "engine_token_count_mismatch",
    "transfer_integrity",
}


def test_the_shipped_mechanisms_and_their_rules():
    mechanisms = {m.id: m for m in load_mechanisms()}
    assert {"stale_pages", "prefix_reuse"} <= set(mechanisms)
    assert set(mechanisms["stale_pages"].rule_ids) == STALE_RULES
    assert mechanisms["stale_pages"].audit_checks == (1, 2, 3, 4, 5)
    assert mechanisms["prefix_reuse"].audit_checks == (6,)
    for m in mechanisms.values():
        assert set(m.audit_checks) <= set(CHECKS), m.id
    rules = load_rules()
    for rule in rules:
        assert rule.id in mechanisms[rule.mechanism].rule_ids
    assert sum(len(m.rule_ids) for m in mechanisms.values()) == len(rules)


def _copy_mechanism(root: Path, new_id: str, rule_ids: tuple[str, ...] = ("prefill_too_fast",)) -> Path:
    """A mechanism folder under *root* made from stale_pages' yml, with copies of some of its rules renamed."""
    folder = root / new_id
    (folder / "rules").mkdir(parents=True)
    meta = yaml.safe_load((STALE / "mechanism.yml").read_text())
    (folder / "mechanism.yml").write_text(yaml.safe_dump({**meta, "id": new_id, "title": f"{new_id} title"}))
    for rule_id in rule_ids:
        rule = yaml.safe_load((STALE / "rules" / f"{rule_id}.yml").read_text())
        (folder / "rules" / f"{new_id}_{rule_id}.yml").write_text(yaml.safe_dump({**rule, "id": f"{new_id}_{rule_id}"}))
        shutil.copyfile(STALE / "rules" / f"{rule_id}.sql", folder / "rules" / f"{new_id}_{rule_id}.sql")
    return folder


def test_adding_a_mechanism_is_adding_a_folder(tmp_path):
    shutil.copytree(MECHANISMS_DIR / "stale_pages", tmp_path / "stale_pages")
    _copy_mechanism(tmp_path, "tapped_bus")
    assert [m.id for m in load_mechanisms(tmp_path)] == ["stale_pages", "tapped_bus"]
    rules = {r.id: r for r in load_rules(tmp_path)}
    assert set(rules) == STALE_RULES | {"tapped_bus_prefill_too_fast"}
    assert rules["tapped_bus_prefill_too_fast"].mechanism == "tapped_bus"
    assert rules["prefill_too_fast"].mechanism == "stale_pages"
    # one mechanism's folder, or its rules folder, loads its rules alone
    assert {r.id for r in load_rules(tmp_path / "tapped_bus")} == {"tapped_bus_prefill_too_fast"}
    assert {r.mechanism for r in load_rules(tmp_path / "tapped_bus" / "rules")} == {"tapped_bus"}


def test_moving_rules_kept_their_versions():
    """A rule's version is the hash of its two files and of the SQL fragments its query includes: a finding's
    rule_version still names the same text, and changes with a fragment's."""
    import hashlib

    from kvforensics.core.db import sql

    with_fragments = 0
    for rule in load_rules():
        folder = MECHANISMS_DIR / rule.mechanism / "rules"
        raw = (folder / f"{rule.id}.yml").read_bytes() + b"\0" + (folder / f"{rule.id}.sql").read_bytes()
        included = sorted(set(re.findall(r"fragment\('([a-z_]+)'\)", (folder / f"{rule.id}.sql").read_text())))
        with_fragments += bool(included)
        for name in included:
            raw += b"\0" + sql(name).encode("utf-8")
        assert rule.version == hashlib.sha256(raw).hexdigest()[:12]
    assert with_fragments >= 2  # cross_tenant_prefix_hit and prefix_salt_mismatch include prefix_senders


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: {**m, "colour": "red"}, "unknown key(s) ['colour']"),
        (lambda m: {k: v for k, v in m.items() if k != "summary"}, "missing key(s) ['summary']"),
        (lambda m: {**m, "id": "other"}, "must be the folder's name 'broken'"),
        (lambda m: {**m, "summary": ""}, "'summary' must be a non-empty text"),
        (lambda m: {**m, "inputs": {"required": ["gateway"]}}, "unknown input 'gateway'"),
        (lambda m: {**m, "inputs": {"required": ["content.prompt"]}}, "unknown input 'content.prompt'"),
        (lambda m: {**m, "inputs": {"needs": ["requests"]}}, "inputs must be a mapping with required"),
        (lambda m: {**m, "audit_checks": ["prefix_cache"]}, "audit_checks must be a list of audit check numbers"),
        (lambda m: ["not", "a", "mapping"], "a mechanism.yml is a mapping"),
    ],
)
def test_a_bad_mechanism_file_is_a_clear_error_naming_it(tmp_path, change, message):
    folder = tmp_path / "broken"
    folder.mkdir()
    meta = yaml.safe_load((STALE / "mechanism.yml").read_text())
    (folder / "mechanism.yml").write_text(yaml.safe_dump({**meta, "id": "broken"}))
    read_mechanism(folder)  # the unchanged copy is valid
    (folder / "mechanism.yml").write_text(yaml.safe_dump(change({**meta, "id": "broken"})))
    with pytest.raises(ConfigError) as e:
        read_mechanism(folder)
    assert message in str(e.value)
    assert str(folder / "mechanism.yml") in str(e.value)


def test_two_mechanisms_may_not_share_a_rule_id(tmp_path):
    shutil.copytree(MECHANISMS_DIR / "stale_pages", tmp_path / "stale_pages")
    twin = _copy_mechanism(tmp_path, "twin")
    for suffix in (".yml", ".sql"):
        (twin / "rules" / f"twin_prefill_too_fast{suffix}").rename(twin / "rules" / f"prefill_too_fast{suffix}")
    rule = yaml.safe_load((twin / "rules" / "prefill_too_fast.yml").read_text())
    (twin / "rules" / "prefill_too_fast.yml").write_text(yaml.safe_dump({**rule, "id": "prefill_too_fast"}))
    with pytest.raises(ConfigError, match="rule id 'prefill_too_fast' is used by two mechanisms"):
        load_rules(tmp_path)


def test_a_rule_id_is_its_file_name(tmp_path):
    folder = _copy_mechanism(tmp_path, "named")
    path = folder / "rules" / "named_prefill_too_fast.yml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "id": "something_else"}))
    with pytest.raises(ConfigError, match="must be the file's name 'named_prefill_too_fast'"):
        load_rules(tmp_path)


# --- selection ---------------------------------------------------------------------------------------------


def test_select_by_inputs_or_by_name():
    prefix = {m.id: m for m in load_mechanisms()}["prefix_reuse"]
    assert prefix.missing({"requests"}) == ("requests.cached_tokens", "kv_events or requests.cache_salt")
    assert prefix.missing({"requests", "requests.cached_tokens"}) == ("kv_events or requests.cache_salt",)
    assert prefix.missing({"requests", "kv_events"}) == ("requests.cached_tokens",)
    assert prefix.missing({"requests", "requests.cached_tokens", "kv_events"}) == ()
    chosen = {s.mechanism.id: s for s in select(None, {"requests", "requests.cached_tokens", "content"})}
    assert chosen["stale_pages"].selected and not chosen["prefix_reuse"].selected
    assert not chosen["prefix_reuse"].named
    chosen = {s.mechanism.id: s for s in select(None, {"requests", "requests.cached_tokens", "requests.cache_salt"})}
    assert chosen["stale_pages"].selected and chosen["prefix_reuse"].selected
    chosen = {s.mechanism.id: s for s in select(["prefix_reuse"], {"requests"})}
    assert not chosen["stale_pages"].selected
    assert chosen["prefix_reuse"].selected and chosen["prefix_reuse"].named
    assert chosen["prefix_reuse"].missing == ("requests.cached_tokens", "kv_events or requests.cache_salt")


def test_present_inputs_reads_the_evidence():
    con = connect()
    names = {
        "requests",
        "requests.cached_tokens",
        "requests.ttft_ms",
        "kv_events",
        "engine_log",
        "content",
        "kv_events.salt",
        "requests.no_such_column",
    }
    assert present_inputs(con, names) == {"requests"}
    load_case_tables(
        con,
        {
            "requests": [{"request_id": "a", "cached_tokens": 64}],
            "kv_events": [
                {
                    "instance": "i",
                    "ts": "2026-08-28T00:00:00Z",
                    "batch": 1,
                    "seq": 0,
                    "kind": "stored",
                    "block_hash": "1",
                    "source": "t",
                    "source_file": "t",
                    "source_line": 1,
                }
            ],
        },
    )
    assert present_inputs(con, names) == {"requests", "requests.cached_tokens", "kv_events"}


# --- the incident file -------------------------------------------------------------------------------------


def _incident(tmp_path: Path, line: str) -> Path:
    path = tmp_path / "incident.toml"
    path.write_text(f'{line}\n[incident]\nid = "m"\n[[sources]]\nname = "gw"\nkind = "requests"\npath = "gw/*.jsonl"\n')
    return path


def test_the_incident_file_names_mechanisms(tmp_path):
    assert load_incident(_incident(tmp_path, "")).mechanisms is None
    assert load_incident(_incident(tmp_path, 'mechanisms = ["prefix_reuse", "stale_pages"]')).mechanisms == (
        "prefix_reuse",
        "stale_pages",
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('mechanisms = ["prefix_reus"]', "unknown mechanism 'prefix_reus'; did you mean 'prefix_reuse'?"),
        ('mechanisms = ["tapped_bus"]', "unknown mechanism 'tapped_bus'; valid mechanisms: prefix_reuse, stale_pages"),
        ("mechanisms = []", "'mechanisms' is empty"),
        ('mechanisms = "stale_pages"', "'mechanisms' must be a list of strings"),
        ('mechanisms = ["stale_pages", "stale_pages"]', "names ['stale_pages'] more than once"),
        ('mechanism = ["stale_pages"]', "did you mean mechanisms = [...]?"),
    ],
)
def test_bad_mechanisms_say_what_to_write(tmp_path, line, message):
    with pytest.raises(ConfigError) as e:
        load_incident(_incident(tmp_path, line))
    assert message in str(e.value)


# --- detect and what the choice leaves ---------------------------------------------------------------------

LEAK = {"request_id": "leak", "model": "m", "status": 200, "prompt_tokens": 700000, "ttft_ms": 150}
MODEL = {
    "model": "m",
    "usable": True,
    "a_ms": 50,
    "b_ms_per_token": 0.05,
    "c_ms_per_token2": 0.0000001,
    "max_tokens": 800000,
}


def _mechanisms(con: duckdb.DuckDBPyConnection) -> list[tuple]:
    return con.execute("SELECT id, named, selected, missing_inputs FROM mechanisms ORDER BY id").fetchall()


def test_detect_runs_only_the_selected_mechanisms_rules():
    con = connect()
    load_case_tables(
        con,
        {
            "requests": [LEAK]
            + [
                {
                    "request_id": f"r{i}",
                    "model": "m",
                    "status": 200,
                    "prompt_tokens": 1000 * (i + 1),
                    "ttft_ms": 100 + 60 * i,
                }
                for i in range(40)
            ]
        },
    )
    found = detect(con)
    assert set(found["mechanism"]) <= {"stale_pages"}
    assert _mechanisms(con) == [
        ("prefix_reuse", False, False, ["requests.cached_tokens", "kv_events or requests.cache_salt"]),
        ("stale_pages", False, True, []),
    ]
    assert set(con.execute("SELECT DISTINCT mechanism FROM findings").fetchall()) <= {("stale_pages",)}

    found = detect(con, mechanisms=["prefix_reuse"])
    prefix_rules = {r.id for r in load_rules() if r.mechanism == "prefix_reuse"}
    assert set(found["rule_id"]) <= prefix_rules
    assert _mechanisms(con) == [
        ("prefix_reuse", True, True, ["requests.cached_tokens", "kv_events or requests.cache_salt"]),
        ("stale_pages", False, False, []),
    ]


def test_an_old_evidence_database_gains_the_mechanism_column(tmp_path):
    path = tmp_path / "old.duckdb"
    old = duckdb.connect(str(path))
    old.execute(
        "CREATE TABLE findings (request_id VARCHAR NOT NULL, rule_id VARCHAR NOT NULL, rule_version VARCHAR "
        "NOT NULL, confidence VARCHAR NOT NULL, strength VARCHAR, parameters JSON, evidence JSON)"
    )
    old.execute("INSERT INTO findings VALUES ('a', 'prefill_too_fast', 'v', 'possible', 'weak', '{}', '{}')")
    old.close()
    con = connect(path)
    try:
        assert con.execute("SELECT request_id, mechanism FROM findings").fetchall() == [("a", None)]
    finally:
        con.close()


def test_the_choice_shows_in_scope_json_and_the_report(sample_run):
    scope = json.loads((sample_run / "scope.json").read_text())
    assert scope["mechanisms"] == [
        {"id": "stale_pages", "title": "Stale KV pages read after a prompt exceeded the KV pool"}
    ]
    assert scope["mechanisms_not_investigated"] == [
        {
            "id": "prefix_reuse",
            "title": "Prefix-cache blocks reused across tenants",
            "missing_inputs": ["kv_events or requests.cache_salt"],
        }
    ]
    con = connect(sample_run / "evidence.duckdb", read_only=True)
    try:
        assert con.execute("SELECT DISTINCT mechanism FROM findings").fetchall() == [("stale_pages",)]
    finally:
        con.close()
    stale = {m.id: m for m in load_mechanisms()}["stale_pages"]
    for name, text in (("report.html", lambda t: str(escape(t))), ("report.md", str)):
        report = (sample_run / name).read_text()
        assert "How the data was exposed" in report and "Root cause" not in report
        assert text(stale.title) in report and text(stale.summary.split(",")[0]) in report
        assert "Not investigated, for want of its inputs: Prefix-cache blocks reused across tenants" in report


def test_a_named_mechanism_without_its_inputs_makes_the_run_inconclusive(tmp_path):
    from tests.conftest import INCIDENT, write_mini

    incident = write_mini(tmp_path / "mini", incident='mechanisms = ["stale_pages", "prefix_reuse"]\n' + INCIDENT)
    result = run(incident, tmp_path / "out", progress=False, pdf=False)
    assert not result.conclusive
    scope = json.loads((tmp_path / "out" / "scope.json").read_text())
    assert [m["id"] for m in scope["mechanisms"]] == ["prefix_reuse", "stale_pages"]
    assert [r["code"] for r in scope["inconclusive_reasons"]] == ["mechanism_inputs_missing"]
    assert scope["inconclusive_reasons"][0]["evidence"]["mechanism"] == "prefix_reuse"
    assert "lacks kv_events or requests.cache_salt" in scope["inconclusive_reasons"][0]["message"]
    assert "mechanism_inputs_missing" in conclusive.codes()
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### Prefix-cache blocks reused across tenants" in report and "Not investigated" not in report
    assert scope["affected_responses"] >= 1  # stale_pages still finds the leak


def test_readme_lists_every_mechanism_and_each_rules_mechanism():
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    mechanisms_section = text.split("## Exposure mechanisms", 1)[1].split("\n## ", 1)[0]
    rules_section = text.split("## Detection rules", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in mechanisms_section.splitlines() if line.startswith("| `")]
    assert {r[1].strip().strip("`") for r in rows} == {m.id for m in load_mechanisms()}
    rows = [line.split("|") for line in rules_section.splitlines() if line.startswith("| `")]
    assert {r[1].strip().strip("`"): r[4].strip().strip("`") for r in rows} == {r.id: r.mechanism for r in load_rules()}


def test_a_prefix_cache_incident_selects_prefix_reuse_by_its_inputs_and_needs_no_pool_window(tmp_path):
    """Simulated L3 store dropping the salt: kv_events and cache_salt select prefix_reuse without naming it,
    and its affected responses, served far from any exceeded pool, do not make the run inconclusive."""
    from kvforensics.cli import main

    assert (
        main(
            [
                "simulate",
                "--seed",
                "5",
                "--out",
                str(tmp_path / "in"),
                "--requests",
                "1500",
                "--mechanism",
                "prefix_reuse",
                "--prefix-scenario",
                "prefix-l3-unsalted",
            ]
        )
        == 0
    )
    truth = json.loads((tmp_path / "in" / "ground_truth.json").read_text())
    result = run(tmp_path / "in" / "incident.toml", tmp_path / "out", progress=False, pdf=False)
    scope = json.loads((tmp_path / "out" / "scope.json").read_text())
    assert [m["id"] for m in scope["mechanisms"]] == ["prefix_reuse", "stale_pages"]
    assert scope["mechanisms_not_investigated"] == []
    assert result.conclusive, scope["inconclusive_reasons"]
    assert truth["recipients"] and scope["affected_responses"] > 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### Prefix-cache blocks reused across tenants" in report
