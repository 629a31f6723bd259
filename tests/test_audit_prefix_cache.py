"""Audit check 6, prefix-cache isolation (issue 15): prefix caching on/off, the block hash, who sets the
salt, and whether an external KV store keeps it; every verdict with the line it rests on."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import INCIDENT

from kvforensics.audit import (
    CHECKS,
    AuditReport,
    Verdict,
    audit_database,
    audit_incident,
    audit_paths,
    audit_startups,
    read_manifest,
)
from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core.errors import InputError
from kvforensics.investigation import Investigation
from kvforensics.sources.engine_logs.contract import StartupRecord

FIXTURES = Path(__file__).parent / "fixtures"
PREFIX = FIXTURES / "audit_prefix"
LOGS = sorted(PREFIX.glob("*.log"))


def check6(report: AuditReport, instance: str) -> Verdict:
    (v,) = [v for v in report.verdicts if v.check == 6 and v.instance == instance]
    return v


def at(v: Verdict) -> tuple[str, str, int | None]:
    return v.status, Path(v.evidence_file or "").name, v.evidence_line


@pytest.fixture(scope="module")
def gateway() -> AuditReport:
    return audit_paths(LOGS, manifest=PREFIX / "multi-gateway.toml")


def test_the_check_is_numbered_and_named() -> None:
    assert CHECKS[6] == "prefix-cache isolation between tenants"


def test_an_unsalted_multi_tenant_deployment_fails_on_the_manifest_line() -> None:
    report = audit_paths(LOGS, manifest=PREFIX / "multi-none.toml")
    for instance in ("sglang-0.5.22-radix", "vllm-0.11.0-offloading"):
        v = check6(report, instance)
        assert at(v) == ("fail", "multi-none.toml", 7)  # cache_salt = "none"
        assert "multi-tenant with no cache_salt" in v.detail
        assert f"{instance}.log:" in v.detail  # and the log line showing the cache is on
        assert v.exposed  # a prefix cache one tenant reads another's KV from is an exposure, as check 1's is
    # a cache that is off shares nothing, whatever the tenancy
    assert at(check6(report, "sglang-0.5.22-radix-off")) == ("pass", "sglang-0.5.22-radix-off.log", 2)


def test_salted_deployments_whose_store_drops_the_salt_fail_on_the_store_line(gateway: AuditReport) -> None:
    v = check6(gateway, "vllm-0.11.0-lmcache")
    assert at(v) == ("fail", "vllm-0.11.0-lmcache.log", 2)  # the non-default args with kv_transfer_config
    assert "LMCacheConnectorV1" in v.detail and "LMCache/LMCache#2878" in v.detail
    v = check6(gateway, "sglang-0.5.15-hicache-mooncake")
    assert at(v) == ("fail", "sglang-0.5.15-hicache-mooncake.log", 2)
    assert "HiCache storage backend mooncake" in v.detail and "0.5.15" in v.detail
    v = check6(gateway, "sglang-0.5.22-lmcache")
    assert at(v) == ("fail", "sglang-0.5.22-lmcache.log", 2) and "--enable-lmcache" in v.detail


def test_salted_deployments_with_salt_keeping_stores_pass(gateway: AuditReport) -> None:
    v = check6(gateway, "vllm-0.11.0-offloading")
    assert at(v) == ("pass", "vllm-0.11.0-offloading.log", 3)  # the engine config: enable_prefix_caching=True
    assert "salted block hashes" in v.detail and "sha256, the default of vLLM 0.11.0" in v.detail
    v = check6(gateway, "sglang-0.5.22-radix")
    assert at(v) == ("pass", "sglang-0.5.22-radix.log", 2)
    assert "cache_salt set per tenant by the gateway" in v.detail


def test_weak_block_hashes_and_engines_without_salts_fail(gateway: AuditReport) -> None:
    v = check6(gateway, "vllm-0.10.1-builtin")
    assert at(v) == ("fail", "vllm-0.10.1-builtin.log", 1)  # the version line: builtin was its default
    assert "block hash builtin" in v.detail and "not cryptographic" in v.detail
    v = check6(gateway, "vllm-0.8.5-namespace-sha256")
    assert at(v) == ("fail", "vllm-0.8.5-namespace-sha256.log", 1)
    assert "predates cache_salt (0.9.0)" in v.detail
    assert "block hash" not in v.detail  # sha256 from the args line: only the failure is told


def test_a_single_tenant_instance_passes_and_overrides_apply_key_by_key() -> None:
    report = audit_paths(LOGS, manifest=PREFIX / "overrides.yaml")
    v = check6(report, "sglang-0.5.22-radix")
    assert at(v) == ("pass", "overrides.yaml", 11)
    assert "single-tenant deployment (setting for instance sglang-0.5.22-radix)" in v.detail
    # the model table sets only cache_salt; tenants = "multi" still comes from [prefix_cache]
    v = check6(report, "vllm-0.11.0-offloading")
    assert v.status == "pass" and "(setting for model llama-3.1-8b)" in v.detail
    v = check6(report, "sglang-0.5.22-lmcache")  # another model: the client's salt
    assert at(v) == ("fail", "overrides.yaml", 5)
    assert "a tenant can send another tenant's salt" in v.detail


def test_without_a_manifest_the_tenancy_is_unknown_never_a_pass() -> None:
    report = audit_paths(LOGS)
    for v in report.verdicts:
        if v.check == 6 and v.instance != "sglang-0.5.22-radix-off":
            assert v.status == "unknown", v
            assert "no deployment manifest with a [prefix_cache] table" in v.detail
    # a manifest with only the load balancer says nothing about tenants either
    v = check6(audit_paths(LOGS, manifest=FIXTURES / "audit" / "manifest.toml"), "sglang-0.5.22-radix")
    assert v.status == "unknown"


def test_unknown_tenancy_and_salt_owner(tmp_path: Path) -> None:
    m = tmp_path / "m.toml"
    m.write_text('[prefix_cache]\ncache_salt = "gateway"\n')
    v = check6(audit_paths(LOGS, manifest=m), "sglang-0.5.22-radix")
    assert v.status == "unknown" and "does not say whether several tenants share it" in v.detail
    m.write_text('[prefix_cache]\ntenants = "multi"\n')
    v = check6(audit_paths(LOGS, manifest=m), "sglang-0.5.22-radix")
    assert at(v) == ("unknown", "m.toml", None) and "who sets cache_salt" in v.detail


def startup(engine: str, version: str | None, flags: dict[str, str], evidence: dict[str, int]) -> StartupRecord:
    return StartupRecord(
        instance="node",
        ts=None,
        line=1,
        engine=engine,
        engine_version=version,
        version_source="log" if version else None,
        role="unified",
        model="m",
        kv_pool_tokens=None,
        pool_source_line=None,
        context_length=None,
        page_size=None,
        tp_size=None,
        dp_size=None,
        flags=flags,
        evidence=evidence,
    )


def sglang(version: str | None, **args: str) -> StartupRecord:
    """An SGLang start-up whose server_args line (line 4) holds *args*, radix cache on."""
    return startup("sglang", version, {"disable_radix_cache": "false", **args}, {"server_args": 4})


def vllm(version: str, **args: str) -> StartupRecord:
    """A vLLM start-up: its version on line 1, each of *args* on line 2."""
    return startup("vllm", version, dict(args), {"engine_version": 1, **{k: 2 for k in args}})


def judge(rec: StartupRecord, manifest: Path) -> Verdict:
    return check6(audit_startups([rec], source_file="node.log", manifest=manifest), "node")


@pytest.fixture
def salted() -> Path:
    return PREFIX / "multi-gateway.toml"


def test_hicache_storage_after_the_token_only_releases_is_unknown_saying_what_to_check(salted: Path) -> None:
    v = judge(sglang("0.5.22", enable_hierarchical_cache="true", hicache_storage_backend="hf3fs"), salted)
    assert (v.status, v.evidence_line) == ("unknown", 4)
    assert "sgl-project/sglang#38577" in v.detail and "kv_store_keys_salt" in v.detail
    # without a version, whether the radix tree itself keys on the salt is unknown too
    v = judge(sglang(None, enable_hierarchical_cache="true", hicache_storage_backend="hf3fs"), salted)
    assert v.status == "unknown" and "sgl-project/sglang#38577" in v.detail
    assert "SGLang (version not logged): the radix tree keys on the salt in builds with" in v.detail
    # HiCache without a storage backend keeps pages in host memory, inside the salted radix tree
    assert judge(sglang("0.5.22", enable_hierarchical_cache="true"), salted).status == "pass"


def test_the_manifest_settles_what_the_store_does(tmp_path: Path) -> None:
    m = tmp_path / "m.toml"
    m.write_text('[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\nkv_store_keys_salt = false\n')
    v = judge(sglang("0.5.22", hicache_storage_backend="hf3fs"), m)
    assert (v.status, v.evidence_line) == ("fail", 4) and "line 4" in v.detail
    m.write_text('[prefix_cache]\ntenants = "multi"\ncache_salt = "gateway"\nkv_store_keys_salt = true\n')
    lmcache = "KVTransferConfig(kv_connector='LMCacheConnectorV1')"
    rec = vllm("0.11.0", enable_prefix_caching="true", kv_transfer_config=lmcache)
    v = judge(rec, m)
    assert v.status == "pass" and "the manifest says its keys include the salt" in v.detail


def test_vllm_hash_algorithms_and_versions(salted: Path) -> None:
    v = judge(vllm("0.7.1", enable_prefix_caching="true"), salted)
    assert v.status == "fail" and "CVE-2025-25183" in v.detail
    v = judge(vllm("0.12.0", enable_prefix_caching="true", prefix_caching_hash_algo="xxhash"), salted)
    assert (v.status, v.evidence_line) == ("fail", 2) and "prefix_caching_hash_algo=xxhash" in v.detail
    v = judge(vllm("0.12.0", enable_prefix_caching="true", prefix_caching_hash_algo="sha256_cbor"), salted)
    assert v.status == "pass"
    mp = "{'kv_connector': 'LMCacheMPConnector'}"
    v = judge(vllm("0.12.0", enable_prefix_caching="true", kv_transfer_config=mp), salted)
    assert v.status == "unknown" and "vllm-project/vllm#39837" in v.detail
    v = judge(vllm("0.12.0", enable_prefix_caching="true", kv_offloading_backend="lmcache"), salted)
    assert (v.status, v.evidence_line) == ("fail", 2) and "LMCache" in v.detail
    # prefill/decode connectors move one request's KV: not a shared store
    rec = vllm("0.12.0", enable_prefix_caching="true", kv_transfer_config="{'kv_connector': 'NixlConnector'}")
    assert judge(rec, salted).status == "pass"


def test_vllm_prefix_caching_defaults_by_engine(salted: Path) -> None:
    assert judge(vllm("0.11.0"), salted).status == "pass"  # V1 only: on by default; salted and sha256
    v = judge(vllm("0.7.3"), salted)
    assert v.status == "pass" and "off (vLLM 0.7.3: the V0 engine's default)" in v.detail
    v = judge(vllm("0.9.2"), salted)  # V1 by default, V0 on request: the log must say
    assert v.status == "unknown" and "does not say which engine ran" in v.detail
    v = judge(vllm("0.9.2", enable_prefix_caching="false"), salted)
    assert (v.status, v.evidence_line) == ("pass", 2)


def test_the_engine_that_ran_gives_the_default_in_every_version(salted: Path) -> None:
    # issue 29, observation 2: 'Initializing a V1 LLM engine (vX)' / 'a V0 LLM engine' (vllm/v1/engine/core.py,
    # vllm/engine/llm_engine.py) says which engine ran, whatever the version's default engine
    def ran(version: str, generation: str) -> StartupRecord:
        rec = vllm(version)
        return replace(
            rec, flags={**rec.flags, "engine_generation": generation}, evidence={**rec.evidence, "engine_generation": 3}
        )

    v = judge(ran("0.9.2", "V1"), salted)
    assert (v.status, v.evidence_line) == ("fail", 1)  # on, and 0.9.2 hashes with builtin by default
    assert v.detail.startswith(
        "prefix caching on (vLLM 0.9.2 ran the V1 engine, 'Initializing a V1 LLM engine': its default) (node.log:3)"
    )
    v = judge(ran("0.9.2", "V0"), salted)
    assert (v.status, v.evidence_line) == ("pass", 3) and "ran the V0 engine" in v.detail
    v = judge(ran("0.7.3", "V1"), salted)  # VLLM_USE_V1=1 before V1 became the default
    assert v.detail.startswith("prefix caching on (vLLM 0.7.3 ran the V1 engine")


def test_a_terminal_wrapped_engine_config_is_read_on() -> None:
    # issue 29, observation 2: vLLM 0.10.1.1's engine config line (vllm/v1/engine/core.py: "Initializing a V1
    # LLM engine (v%s) with config: %s", VllmConfig.__str__ of vllm/config/__init__.py) cut every 200
    # characters by a terminal, enable_prefix_caching=True on the fifth piece (line 9)
    name = "vllm-0.10.1-v1-wrapped-config.log"
    report = audit_paths([FIXTURES / "engine_logs" / name], year=2026, manifest=PREFIX / "multi-gateway.toml")
    v = check6(report, name.removesuffix(".log"))
    assert v.status == "fail"  # on, salted by the gateway, and 0.10.1.1 hashes blocks with builtin
    assert v.detail.startswith(f"prefix caching on (enable_prefix_caching=true) ({name}:9); block hash builtin")


LMCACHE_MP = FIXTURES / "engine_logs" / "vllm-0.33.0-lmcache-mp-no-prefix-caching.log"


def test_an_lmcache_mp_connector_reuses_kv_with_the_prefix_cache_off_and_its_line_is_cited(salted: Path) -> None:
    # issue 29, observation 6. The fixture is written from vLLM 0.33's lines (reference §2) and the connector
    # factory's "Creating v1 connector with name: %s and engine_id: %s"
    # (vllm/distributed/kv_transfer/kv_connector/factory.py), after a public CPU run of vLLM with
    # --no-enable-prefix-caching and LMCacheMPConnector: the scheduler still asks the connector for the
    # tokens it holds (vllm/v1/engine/core.py hashes blocks when "enable_prefix_caching or kv_connector is
    # not None"), so the off switch does not keep tenants apart
    v = check6(audit_paths([LMCACHE_MP], year=2026, manifest=salted), LMCACHE_MP.stem)
    assert (v.status, v.evidence_line) == ("unknown", 2)
    assert v.detail.startswith(
        "prefix caching off (enable_prefix_caching=false), yet LMCacheMPConnector stores KV and loads it into "
        f"later requests: vLLM consults a KV connector whatever enable_prefix_caching says ({LMCACHE_MP.name}:2)"
    )
    assert v.detail.endswith(f"; the engine built LMCacheMPConnector ({LMCACHE_MP.name}:6)")
    v = check6(audit_paths([LMCACHE_MP], year=2026, manifest=PREFIX / "multi-none.toml"), LMCACHE_MP.stem)
    assert v.status == "fail" and "multi-tenant with no cache_salt" in v.detail


def test_a_connector_only_the_engines_build_line_names_is_judged(tmp_path: Path, salted: Path) -> None:
    # an excerpt without the args: the factory line alone says which connector ran
    lines = LMCACHE_MP.read_text().splitlines(keepends=True)
    log = tmp_path / "node.log"
    log.write_text("".join(line for line in lines if "non-default args" not in line))
    v = check6(audit_paths([log], year=2026, manifest=salted), "node")
    assert (v.status, v.evidence_line) == ("unknown", 5)  # the first "Creating v1 connector" line
    assert "LMCacheMPConnector: the salt reaches LMCache's keys only with vllm-project/vllm#39837" in v.detail


def test_existing_v0_fixture_has_prefix_caching_off() -> None:
    report = audit_paths([FIXTURES / "audit" / "vllm-0.6.3-v0.log"], manifest=PREFIX / "multi-none.toml")
    v = check6(report, "vllm-0.6.3-v0")
    assert at(v) == ("pass", "vllm-0.6.3-v0.log", 3) and "enable_prefix_caching=false" in v.detail


def test_the_other_checks_do_not_change_with_the_prefix_cache_table() -> None:
    def others(report: AuditReport) -> list[tuple[object, ...]]:
        return [(v.instance, v.check, v.status, v.detail, v.evidence_line) for v in report.verdicts if v.check < 5]

    assert others(audit_paths(LOGS)) == others(audit_paths(LOGS, manifest=PREFIX / "overrides.yaml"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[prefix_cache]\ntenants = "many"\n', "prefix_cache.tenants = 'many'; use one of 'multi', 'single'"),
        ('[prefix_cache]\ncache_salt = "header"\n', "use one of 'gateway', 'client', 'none'"),
        ('[prefix_cache]\nkv_store_keys_salt = "yes"\n', "kv_store_keys_salt = 'yes'; write true or false"),
        ('[prefix_cache]\nsalt = "gateway"\n', "unknown key 'salt'; the keys are tenants, cache_salt"),
        ('prefix_cache = "multi"\n', "prefix_cache must be a table"),
        ('[prefix_cache.instances]\nnode = "single"\n', "prefix_cache.instances.node must be a table"),
        ('[prefix_cache.models."m"]\ntenants = 2\n', "prefix_cache.models.m.tenants = 2"),
    ],
)
def test_bad_manifest_keys_are_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    m = tmp_path / "m.toml"
    m.write_text(text)
    with pytest.raises(InputError) as e:
        read_manifest(m)
    assert message in str(e.value)


def test_cli_bad_manifest_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = tmp_path / "m.toml"
    m.write_text('[prefix_cache]\ntenants = "many"\n')
    assert main(["audit", "--manifest", str(m), str(LOGS[0])]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tenants" in err and "Traceback" not in err


def test_cli_shows_the_check_in_table_markdown_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    manifest, log = PREFIX / "multi-gateway.toml", PREFIX / "vllm-0.11.0-lmcache.log"
    args = ["audit", "--manifest", str(manifest), str(log)]
    main(args)
    table = capsys.readouterr().out
    assert "6. prefix-cache isolation between tenants" in table and "vllm-0.11.0-lmcache.log:2" in table
    main([*args[:1], "--markdown", *args[1:]])
    md = capsys.readouterr().out
    row = next(line for line in md.splitlines() if "6. prefix-cache isolation" in line)
    assert "| FAIL (exposed) |" in row and "LMCacheConnectorV1" in row
    main([*args[:1], "--json", *args[1:]])
    doc = json.loads(capsys.readouterr().out)
    assert doc["checks"]["6"] == "prefix-cache isolation between tenants"
    (v,) = [v for v in doc["verdicts"] if v["check"] == 6]
    assert (v["status"], v["evidence_line"], v["exposed"]) == ("fail", 2, True)
    assert doc["summary"]["exit_code"] == 1 and doc["now"]["shared_cache_startups"] == 1


def test_the_evidence_database_keeps_what_the_check_reads(tmp_path: Path) -> None:
    engine = tmp_path / "data" / "engine"
    engine.mkdir(parents=True)
    for log in PREFIX.glob("sglang-*.log"):
        (engine / log.name).write_bytes(log.read_bytes())
    (tmp_path / "data" / "gateway").mkdir()
    (tmp_path / "data" / "gateway" / "day.jsonl").write_text(
        json.dumps(
            {
                "rid": "r1",
                "received_at": "2026-09-10T09:00:00+00:00",
                "account_id": "a",
                "model": "qwen3-32b",
                "http_status": 200,
                "prompt_tokens": 1000,
                "completion_tokens": 10,
            }
        )
        + "\n"
    )
    incident = tmp_path / "data" / "incident.toml"
    incident.write_text(INCIDENT)
    manifest = PREFIX / "multi-gateway.toml"
    inv = Investigation.open(incident, tmp_path / "out")
    try:
        inv.ingest()
        from_db = audit_database(inv.con, manifest=manifest)
    finally:
        inv.close()
    from_logs = audit_incident(load_incident(incident), manifest=manifest)

    def statuses(r: AuditReport) -> list[tuple[str, str]]:
        return sorted((v.instance, v.status) for v in r.verdicts if v.check == 6)

    assert (
        statuses(from_db)
        == statuses(from_logs)
        == [
            ("sglang-0.5.15-hicache-mooncake", "fail"),
            ("sglang-0.5.22-lmcache", "fail"),
            ("sglang-0.5.22-radix", "pass"),
            ("sglang-0.5.22-radix-off", "pass"),
        ]
    )


def test_the_headline_counts_start_ups_failing_isolation(gateway: AuditReport) -> None:
    """A check-6 fail is an exposure: the headline, the answer for now and the exit codes say so (the logs
    show no end for these start-ups, so they are in force), and no check-1 window is made of it."""
    failing = {v.instance for v in gateway.verdicts if v.check == 6 and v.status == "fail"}
    assert len(failing) == 5
    assert gateway.headline().startswith("EXPOSED: prefix-cache isolation fails on 5 start-up(s) (check 6). ")
    assert gateway.now() == (
        f"EXPOSED NOW: 5 start-up(s) still in force share their prefix cache across tenants (check 6: "
        f"{', '.join(sorted(failing))})."
    )
    assert (gateway.exposed, gateway.exposed_now, gateway.exit_code, gateway.exit_code_now) == (True, True, 1, 1)
    assert gateway.exposure_windows == []  # check 1's windows (stale pages) only
    assert json.loads(gateway.to_json())["now"]["shared_cache_startups"] == 5
    # without a manifest check 6 is unknown: not exposed, and the answer for now says what it could not judge
    plain = audit_paths(LOGS)
    assert plain.headline().startswith("Not exposed. ") and "prefix-cache" not in plain.headline()
    unknown = sum(1 for v in plain.verdicts if v.check == 6 and v.status == "unknown")
    assert unknown > 0
    assert plain.now() == (
        "Not exposed now: no start-up serves prompts beyond its KV pool; prefix-cache isolation is unknown on "
        f"{unknown} start-up(s) (check 6)."
    )
    assert (plain.exit_code, plain.exit_code_now) == (0, 0)


def test_a_shared_cache_that_has_ended_is_not_exposed_now(gateway: AuditReport) -> None:
    ended = AuditReport(
        [replace(v, end_reason="shutdown", startup_to=v.startup_from) for v in gateway.verdicts],
        notes=[],
        inputs=[],
    )
    assert (ended.exposed, ended.exposed_now, ended.exit_code, ended.exit_code_now) == (True, False, 1, 0)
    assert ended.now() == "Not exposed now: every exposed start-up has ended (5 shut down)."


def test_sglang_builds_before_extra_key_ignore_the_salt(salted: Path) -> None:
    v = judge(sglang("0.5.1"), salted)
    assert v.status == "fail" and "predates the radix key's extra_key" in v.detail
    v = judge(sglang("0.5.10"), salted)
    assert v.status == "unknown" and "confirm the build" in v.detail
    assert judge(sglang("0.5.18"), salted).status == "pass"
    # a version range inferred from the log's format counts when it is wholly on one side
    rec = sglang(None, engine_version_spec=">=0.5.20")
    assert judge(rec, salted).status == "pass"
    v = judge(sglang(None, engine_version_spec="<0.4.0", hicache_storage_backend="file"), salted)
    assert v.status == "fail" and "SGLang <0.4.0 (inferred from the log's format)" in v.detail
    assert "keys stored pages by tokens only" in v.detail


@pytest.mark.parametrize("manifest", [None, "multi-gateway.toml", "multi-none.toml", "overrides.yaml"])
def test_every_verdict_has_its_evidence_and_exactly_the_fails_are_exposed(manifest: str | None) -> None:
    report = audit_paths(LOGS, manifest=PREFIX / manifest if manifest else None)
    assert len(report.verdicts) == len(CHECKS) * report.startups == len(CHECKS) * len(LOGS)
    for v in report.verdicts:
        if v.check == 6:
            assert v.exposed == (v.status == "fail") and v.evidence_file is not None
            if v.status in ("pass", "fail"):
                assert v.evidence_line is not None, v


def test_the_documented_manifest_example_reads(tmp_path: Path) -> None:
    doc = (Path(__file__).parent.parent / "docs" / "incident-config.md").read_text(encoding="utf-8")
    section = doc[doc.index("#### Check 6: prefix-cache isolation") :]
    fence = "```toml manifest\n"  # fenced as a deployment manifest, not an incident file (tests/test_docs.py)
    start = section.index(fence) + len(fence)
    example = section[start : section.index("```\n", start)]
    m = tmp_path / "deploy.toml"
    m.write_text(example)
    policy = read_manifest(m).prefix_cache
    assert policy is not None
    said = policy.for_startup("qwen3-0", ["llama-3.1-8b"])
    assert {k: (v.value, v.scope) for k, v in said.items()} == {
        "tenants": ("single", "instance qwen3-0"),
        "cache_salt": ("client", "model llama-3.1-8b"),
    }
    line = said["cache_salt"].line
    assert line is not None and example.splitlines()[line - 1] == 'cache_salt = "client"'


def test_a_weak_hash_says_how_to_get_a_strong_one(salted: Path) -> None:
    v = judge(vllm("0.8.1", enable_prefix_caching="true"), salted)  # builtin only, before sha256 existed
    assert v.status == "fail" and "upgrade to vLLM >= 0.10.2 (sha256 by default; 0.8.1 has no other" in v.detail
    v = judge(vllm("0.9.2", enable_prefix_caching="true", prefix_caching_hash_algo="builtin"), salted)
    assert (v.status, v.evidence_line) == ("fail", 2) and "use --prefix-caching-hash-algo sha256" in v.detail
