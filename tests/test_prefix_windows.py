"""The prefix_reuse exposure windows (table prefix_windows) and the gate reasons that bound its findings.

The start-ups are SGLang 0.5.x server logs as the audit fixtures write them (tests/fixtures/audit_prefix,
SGLang's documented server arguments: https://docs.sglang.ai/advanced_features/hicache.html): a rolling
restart adds a HiCache storage backend (`hicache_storage_backend='mooncake'`), a later one removes it.
SGLang's logs name no version here, so the build comes from `[prefix_cache] engine_version`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvforensics.audit.isolation import write_prefix_windows
from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "audit_prefix" / "sglang-0.5.15-hicache-mooncake.log"
STARTS = ("2026-09-01 08:00:00", "2026-09-03 10:00:00", "2026-09-06 12:00:00")


def _startup(at: str, store: bool) -> str:
    """One start-up of the fixture at *at*, with or without its storage backend, without the version line."""
    lines = [ln for ln in FIXTURE.read_text().splitlines() if not ln.startswith("sglang version")]
    day, hour = at.split()
    h = int(hour[:2])
    text = "\n".join(lines).replace("2026-08-26", day)
    for old in ("21:10", "21:12", "21:13"):
        text = text.replace(f"{old}:", f"{h:02d}:{int(old[3:]):02d}:")
    if not store:
        text = text.replace("hicache_storage_backend='mooncake'", "hicache_storage_backend=None")
    return text + "\n"


def _write(root: Path, isolation: str) -> Path:
    engines = root / "engines"
    for n in range(2):
        folder = engines / f"sglang-{n}"
        folder.mkdir(parents=True)
        (folder / "sglang.log").write_text(
            _startup(STARTS[0], False) + _startup(STARTS[1], True) + _startup(STARTS[2], False)
        )
    (root / "gateway.jsonl").write_text(
        json.dumps(
            {
                "request_id": "r1",
                "ts": "2026-09-04T10:00:00Z",
                "account_id": "a",
                "model": "zai-org/GLM-5.3",
                "status": 200,
                "prompt_tokens": 100,
                "cached_tokens": 64,
                "prefill_instance": "sglang-1",
                "cache_salt": "sa",
            }
        )
        + "\n"
    )
    path = root / "incident.toml"
    path.write_text(f"""[incident]
id = "windows"
title = "windows"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"

[[sources]]
name = "engines"
kind = "engine_log"
path = "engines/*/sglang.log"
format = "sglang"
timezone = "UTC"
instance = "{{parent}}"

{isolation}""")
    return path


def _windows(tmp_path: Path, isolation: str) -> list[tuple]:
    incident = load_incident(_write(tmp_path, isolation))
    from kvforensics.stages.ingest import ingest

    con = connect()
    try:
        ingest(con, incident)
        write_prefix_windows(con, incident)
        return con.execute("""SELECT instance, strftime(valid_from, '%m-%d %H:%M'), strftime(valid_to, '%m-%d %H:%M'),
                                     path, reach, status, engine_version
                              FROM prefix_windows ORDER BY instance, valid_from, path""").fetchall()
    finally:
        con.close()


def test_a_rolling_restart_that_adds_a_salt_blind_store_opens_a_window_and_the_next_closes_it(tmp_path):
    rows = _windows(tmp_path, '[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\nengine_version = "0.5.18"\n')
    assert rows == [
        (i, *span, *what, "0.5.18")
        for i in ("sglang-0", "sglang-1")
        for span, what in (
            (("09-01 08:10", "09-03 10:10"), ("isolated", "none", "pass")),
            (("09-03 10:10", "09-06 12:10"), ("salt_blind_store", "shared_store", "fail")),
            (("09-06 12:10", None), ("isolated", "none", "pass")),
        )
    ]


def test_a_build_after_the_fix_is_unknown_and_a_declared_false_key_is_a_failure(tmp_path):
    rows = _windows(
        tmp_path / "a", '[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\nengine_version = "0.5.22"\n'
    )
    assert {(r[3], r[5]) for r in rows if r[1].startswith("09-03")} == {("salt_blind_store", "unknown")}
    rows = _windows(
        tmp_path / "b",
        '[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\n'
        'engine_version = "0.5.22"\nkv_store_keys_salt = false\n',
    )
    assert {(r[3], r[5]) for r in rows if r[1].startswith("09-03")} == {("salt_blind_store", "fail")}


def test_without_isolation_facts_every_startup_is_undetermined_and_a_single_tenant_is_isolated(tmp_path):
    rows = _windows(tmp_path / "a", "")
    assert {(r[3], r[4], r[5]) for r in rows} == {("undetermined", "any", "unknown")}
    rows = _windows(tmp_path / "b", '[prefix_cache]\ntenants = "single"\n')
    assert {r[3] for r in rows} == {"isolated"}
    rows = _windows(tmp_path / "c", '[prefix_cache]\ntenants = "multi"\ncache_salt = "none"\n')
    assert {r[3] for r in rows if not r[1].startswith("09-03")} == {"no_salt"}
    assert {r[3] for r in rows if r[1].startswith("09-03")} == {"no_salt", "salt_blind_store"}


def test_isolation_facts_are_checked_and_alone_do_not_cut_prompts_into_word_blocks(tmp_path):
    incident = load_incident(
        _write(
            tmp_path / "a",
            '[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\nshared_namespaces = ["playground*"]\n',
        )
    )
    assert incident.prefix_shared_namespaces == ("playground*",) and not incident.prefix_word_blocks
    for text, message in (
        ('tenants = "many"', "tenants = 'many'; use one of 'multi', 'single'"),
        ('engine_version = 5', "engine_version = 5; write the engine's version as text"),
        ('shared_namespaces = "x"', "shared_namespaces must be a list"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_incident(_write(tmp_path / text[:5], f"[prefix_cache]\n{text}\n"))


def test_a_declared_version_never_overrides_a_logged_one(tmp_path):
    from kvforensics.audit.api import declare_versions
    from kvforensics.audit.isolation import incident_manifest
    from kvforensics.audit.startups import Startup

    incident = load_incident(_write(tmp_path, '[prefix_cache]\ntenants = "multi"\nengine_version = "0.5.18"\n'))
    logged = Startup(
        "i", None, None, None, "sglang", "0.5.22", "log", "unified", None, None, None, None, None, None, {}, {}
    )
    unlogged = Startup(
        "j", None, None, None, "sglang", None, None, "unified", None, None, None, None, None, None, {}, {}
    )
    declare_versions([logged, unlogged], incident_manifest(incident))
    assert (logged.version, logged.version_source) == ("0.5.22", "log")
    assert (unlogged.version, unlogged.version_source) == ("0.5.18", "declared")


def test_the_audit_manifest_takes_the_same_keys(tmp_path, capsys):
    manifest = tmp_path / "deploy.toml"
    manifest.write_text('[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\nengine_version = "0.5.18"\n')
    logs = sorted((_write(tmp_path / "inc", "").parent / "engines").glob("*/sglang.log"))
    main(["audit", "--json", "--manifest", str(manifest), *map(str, logs)])
    verdicts = [v for v in json.loads(capsys.readouterr().out)["verdicts"] if v["check"] == 6]
    assert [v["status"] for v in verdicts] == ["pass", "fail", "pass"] * 2
    assert "SGLang 0.5.18 keys stored pages by tokens only" in verdicts[1]["detail"]
