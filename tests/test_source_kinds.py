"""Source kinds as units: each ``kvforensics/sources/<kind>/kind.yml`` is read and checked by the registry, what it
declares exists (tables in the schema, reasons in the gate, an entry ingest can call), the incident file is
checked with it, and a kind or a mechanism that declares what nothing provides is refused on load."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvforensics.config import ENGINE_ENVELOPES, SOURCE_KINDS
from kvforensics.core.db import sql
from kvforensics.core.errors import ConfigError
from kvforensics.mechanisms import MECHANISMS_DIR, load_mechanisms, read_mechanism
from kvforensics.sources import SOURCES_DIR, input_tables, load_kinds, read_kind
from kvforensics.sources.engine_logs.envelopes.formats import ENVELOPES


def test_the_five_kinds_are_loaded_in_their_order():
    assert SOURCE_KINDS == ("requests", "engine_log", "changes", "content", "kv_events")
    assert [k.path.name for k in load_kinds()] == ["requests", "engine_logs", "changes", "content", "kv_events"]
    assert ENGINE_ENVELOPES == ("auto", "none", *ENVELOPES)  # the envelopes engine_log declares are the readers'


def test_what_a_kind_declares_exists():
    tables = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", sql("schema")))
    reasons = set(re.findall(r"^-- reason: (\w+)", sql("conclusive"), flags=re.M))
    for kind in load_kinds():
        assert set(kind.tables) <= tables, kind.name
        assert set(kind.conclusive) <= reasons, kind.name
        assert callable(kind.entry_module().load), kind.name
        assert kind.entry_module().__name__.startswith(f"kvforensics.sources.{kind.path.name}."), kind.name


def test_every_input_the_mechanisms_name_is_offered_by_a_kind():
    offered = input_tables()
    named = {i.partition(".")[0] for m in load_mechanisms() for i in (*m.required, *m.any_of, *m.strengthens)}
    assert named and named <= set(offered)


def copy_kinds(tmp_path: Path) -> Path:
    folder = tmp_path / "sources"
    for kind in load_kinds():
        (folder / kind.path.name).mkdir(parents=True)
        shutil.copy(kind.path / "kind.yml", folder / kind.path.name / "kind.yml")
    return folder


def edit(path: Path, change) -> None:
    meta = yaml.safe_load(path.read_text(encoding="utf-8"))
    change(meta)
    path.write_text(yaml.safe_dump(meta, sort_keys=False), encoding="utf-8")


def test_a_copy_of_the_kinds_loads_as_the_shipped_ones(tmp_path):
    folder = copy_kinds(tmp_path)
    assert [k.name for k in load_kinds(folder)] == list(SOURCE_KINDS)


@pytest.mark.parametrize("field", ["tables", "inputs", "formats", "entry", "quarantine_fix", "conclusive"])
def test_a_kind_missing_a_declared_field_is_refused_naming_it(tmp_path, field):
    folder = copy_kinds(tmp_path)
    edit(folder / "changes" / "kind.yml", lambda meta: meta.pop(field))
    with pytest.raises(ConfigError, match=rf"missing field\(s\) \['{field}'\]") as refused:
        read_kind(folder / "changes")
    assert "changes/kind.yml" in str(refused.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(inputs={"changes": ["no_such_table"]}), "inputs name tables the kind does not fill"),
        (lambda m: m.update(default_format="xml"), "default_format 'xml' must be one of its formats"),
        (lambda m: m.update(canonical="CHANGE_FIELDS"), "must name a CANONICAL_..._FIELDS tuple"),
        (lambda m: m.update(keys={"region": "where"}), "'refused_elsewhere' must name each of its own keys"),
        (lambda m: m.update(ingest="sometime"), "'ingest' must be one of"),
        (lambda m: m.update(colour="blue"), r"unknown field\(s\) \['colour'\]"),
    ],
)
def test_a_kind_declaring_what_does_not_hold_is_refused(tmp_path, change, message):
    folder = copy_kinds(tmp_path)
    edit(folder / "changes" / "kind.yml", change)
    with pytest.raises(ConfigError, match=message):
        read_kind(folder / "changes")


def test_two_kinds_offering_one_input_are_refused(tmp_path):
    folder = copy_kinds(tmp_path)
    edit(folder / "content" / "kind.yml", lambda m: m.update(inputs={"changes": ["content_stats"]}))
    with pytest.raises(ConfigError, match=r"the same input twice: \['changes'\]"):
        load_kinds(folder)


def test_a_mechanism_naming_an_input_no_kind_offers_is_refused_on_load(tmp_path):
    folder = tmp_path / "stale_pages"
    shutil.copytree(MECHANISMS_DIR / "stale_pages", folder)
    edit(folder / "mechanism.yml", lambda m: m["inputs"]["strengthens"].append("gpu_telemetry"))
    with pytest.raises(ConfigError, match="unknown input 'gpu_telemetry'; an input is one a source kind offers") as e:
        read_mechanism(folder)
    assert "requests, engine_log, changes, content, kv_events" in str(e.value)
    edit(folder / "mechanism.yml", lambda m: m["inputs"]["strengthens"].remove("gpu_telemetry"))
    assert read_mechanism(folder).id == "stale_pages"


def test_a_source_setting_another_kinds_key_is_told_what_that_kind_says(tmp_path):
    (tmp_path / "incident.toml").write_text(
        """[incident]
id = "kinds"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"

[[sources]]
name = "changes"
kind = "changes"
path = "changes.csv"
envelope = "kubectl"
""",
        encoding="utf-8",
    )
    from kvforensics.config import load_incident

    with pytest.raises(ConfigError, match='envelope applies to kind "engine_log" only'):
        load_incident(tmp_path / "incident.toml")


def test_the_registry_is_read_from_the_package_folder():
    assert SOURCES_DIR == Path(load_kinds()[0].path).parent
