"""Gateway instance names matched to engine instances ([instances], kvforensics/stages/instances.py).

Gateways name pods by address (``glm53-prefill-0.pd.svc.cluster.local:30000``); engine logs are named
by file (``glm53-prefill-0``). Without matching nothing joins and the pool rule flags nothing.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
from pathlib import Path

import duckdb
import pytest
from conftest import INCIDENT, mini_requests, write_mini
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.investigation import run
from kvforensics.stages.ingest import ingest
from kvforensics.stages.instances import (
    InstanceMatching,
    NameMatch,
    instances_from_config,
    match_instance_names,
)

ENGINES = ["glm53-prefill-0", "glm53-prefill-1", "glm53-decode-0"]


def _matched(gateway: list[str], engines: list[str] = ENGINES, **cfg) -> dict[str, tuple[str | None, str]]:
    return {
        m.gateway_name: (m.engine_instance, m.matched_by)
        for m in match_instance_names(gateway, engines, InstanceMatching(**cfg))
    }


def test_builtin_normalisation():
    assert _matched(
        [
            "glm53-prefill-0",
            "glm53-prefill-1.pd.svc.cluster.local:30000",
            "http://GLM53-decode-0:30000/generate",
            "glm53-decode-9.pd:30000",
            "10.0.0.7:30000",
        ]
    ) == {
        "glm53-prefill-0": ("glm53-prefill-0", "exact"),
        "glm53-prefill-1.pd.svc.cluster.local:30000": ("glm53-prefill-1", "first_label"),
        "http://GLM53-decode-0:30000/generate": ("glm53-decode-0", "host"),
        "glm53-decode-9.pd:30000": (None, "unmatched"),
        "10.0.0.7:30000": (None, "unmatched"),
    }


def test_short_and_long_names_of_one_pod_both_match():
    assert _matched(["glm53-prefill-0:30000", "glm53-prefill-0.pd.svc:30000"]) == {
        "glm53-prefill-0:30000": ("glm53-prefill-0", "host"),
        "glm53-prefill-0.pd.svc:30000": ("glm53-prefill-0", "first_label"),
    }


def test_first_label_is_not_used_when_it_names_pods_in_two_domains():
    got = match_instance_names(
        ["prefill-0.cluster-a:30000", "prefill-0.cluster-b:30000"], ["prefill-0"], InstanceMatching()
    )
    assert got == [
        NameMatch("prefill-0.cluster-a:30000", None, "ambiguous", ("prefill-0",)),
        NameMatch("prefill-0.cluster-b:30000", None, "ambiguous", ("prefill-0",)),
    ]


def test_first_label_never_joins_two_domains():
    assert _matched(["prefill-0.cluster-b:30000"], ["prefill-0.cluster-a"]) == {
        "prefill-0.cluster-b:30000": (None, "unmatched")
    }


def test_two_engine_instances_with_one_host_are_ambiguous():
    got = match_instance_names(["pod-1:8000"], ["pod-1.a", "pod-1.b"], InstanceMatching())
    assert got == [NameMatch("pod-1:8000", None, "ambiguous", ("pod-1.a", "pod-1.b"))]


def test_regex_and_map():
    got = _matched(
        ["sglang-glm53-prefill-0-7f9c", "gw-decode"],
        match=r"(?P<instance>glm53-\w+-\d+)",
        map={"gw-decode": "glm53-decode-0"},
    )
    assert got == {"sglang-glm53-prefill-0-7f9c": ("glm53-prefill-0", "match"), "gw-decode": ("glm53-decode-0", "map")}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"match": "(unclosed"}, "match is not a valid regular expression"),
        ({"match": "glm53-.*"}, "match needs a named group (?P<instance>...)"),
        ({"map": {"a": 3}}, 'map must be a table of "<gateway name>" = "<engine instance>" strings'),
        ({"handover_s": -1}, "handover_s must be a number of seconds >= 0"),
        ({"regex": "x"}, "unknown key(s) ['regex']"),
    ],
)
def test_bad_instances_config(raw, message):
    with pytest.raises(ConfigError) as e:
        instances_from_config(raw, "incident.toml: [instances]")
    assert message in str(e.value)


def test_instances_table_is_read_from_the_incident_file(tmp_path):
    path = write_mini(
        tmp_path,
        incident=INCIDENT + '\n[instances]\nmatch = "^(?P<instance>[^.:]+)"\n'
        'map = { "gw-0" = "p0" }\nhandover_s = 600\n',
    )
    assert load_incident(path).instances == InstanceMatching(
        match="^(?P<instance>[^.:]+)", map={"gw-0": "p0"}, handover_s=600.0
    )


# --- ingest ------------------------------------------------------------------------------------


def test_unknown_instance_names_are_a_loud_warning(tmp_path):
    rows = mini_requests()
    for r in rows[:25]:
        r["prefill_instance"] = "p9.pool:30000"
    con = connect(tmp_path / "e.duckdb")
    result = ingest(con, load_incident(write_mini(tmp_path, rows)))
    (warning,) = [w for w in result.warnings if "no engine log knows" in w]
    assert warning.startswith("25 request(s) name 1 instance(s) no engine log knows ('p9.pool:30000')")
    assert '[instances] map = { "p9.pool:30000" = "<engine instance>" }' in warning
    # requests keep the unknown name, so a query for names absent from capacity finds them
    assert con.execute(
        "SELECT count(*) FROM requests WHERE prefill_instance NOT IN (SELECT instance FROM capacity)"
    ).fetchone() == (25,)
    assert con.execute(
        "SELECT matched_by, requests FROM instance_names WHERE gateway_name = 'p9.pool:30000'"
    ).fetchall() == [("unmatched", 25)]


def test_the_warning_reaches_the_console_with_its_config_line(tmp_path, capsys):
    from kvforensics.cli import main

    rows = mini_requests()
    rows[0]["prefill_instance"] = "p9.pool:30000"
    main(["run", str(write_mini(tmp_path, rows)), "--out", str(tmp_path / "out"), "--no-pdf"])
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "warning: 1 request(s) name 1 instance(s) no engine log knows ('p9.pool:30000'): the pool rule "
        'cannot judge them by instance; add [instances] map = { "p9.pool:30000" = "<engine instance>" }'
    ) in err


def _fqdn(name: str | None) -> str | None:
    return None if name is None else f"{name}.pd.svc.cluster.local:30000"


def _sample_with_fqdn_names(sample_incident: Path, root: Path) -> Path:
    """A copy of the sample whose gateway names instances as the cluster's DNS does."""
    shutil.copytree(sample_incident.parent, root, ignore=shutil.ignore_patterns("ground_truth.json"))
    for path in sorted((root / "gateway").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        for r in records:
            for key in ("prefill_instance", "decode_instance"):
                if key in r:
                    r[key] = _fqdn(r[key])
        with gzip.open(path, "wt") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)
    return root / "incident.toml"


@pytest.fixture(scope="module")
def fqdn_run(tmp_path_factory, sample_incident) -> Path:
    root = tmp_path_factory.mktemp("fqdn")
    incident = _sample_with_fqdn_names(sample_incident, root / "data")
    run(incident, root / "out", progress=False, pdf=False)
    return root / "out"


def _affected_ids(out: Path) -> set[str]:
    with (out / "affected_requests.csv").open() as fh:
        return {r["request_id"] for r in csv.DictReader(fh)}


@pytest.mark.slow
def test_fqdn_gateway_names_give_the_sample_figures(fqdn_run, sample_run):
    got, want = (json.loads((d / "scope.json").read_text()) for d in (fqdn_run, sample_run))
    assert got["affected_responses"] == want["affected_responses"] == 155
    assert got["source_accounts"] == want["source_accounts"]
    assert want["source_accounts"]["possible"] > 0
    assert _affected_ids(fqdn_run) == _affected_ids(sample_run)
    assert got["log_gaps"] == want["log_gaps"]


@pytest.mark.slow
def test_fqdn_names_are_mapped_with_a_note(fqdn_run):
    con = duckdb.connect(str(fqdn_run / "evidence.duckdb"), read_only=True)
    names = con.execute("SELECT gateway_name, engine_instance, matched_by FROM instance_names ORDER BY 1").fetchall()
    assert len(names) == 8
    assert all(g == _fqdn(e) and how == "first_label" for g, e, how in names)
    assert con.execute(
        "SELECT count(*) FROM requests WHERE prefill_instance LIKE '%:30000' OR decode_instance LIKE '%:30000'"
    ).fetchone() == (0,)
    notes = [n for (n,) in con.execute("SELECT note FROM ingest_notes").fetchall()]
    assert any(n.startswith("8 gateway instance name(s) matched to engine instances by first_label") for n in notes)
    assert not [n for n in notes if "no engine log knows" in n]
    manifest = json.loads((fqdn_run / "manifest.json").read_text())
    assert "first_label" in json.dumps(manifest)


def test_reingest_keeps_names_and_compares_redelivered_records_with_the_gateways_values(tmp_path):
    rows = mini_requests()
    for i, r in enumerate(rows):  # p0 under two names (mapped back per request), d0 under one (by name)
        if r.get("prefill_instance"):
            r["prefill_instance"] = "p0:30000" if i % 2 else _fqdn("p0")
            r["decode_instance"] = _fqdn("d0")
    incident = load_incident(write_mini(tmp_path, rows))
    con = connect(tmp_path / "e.duckdb")
    ingest(con, incident)
    named = sum(1 for r in rows if r.get("prefill_instance"))
    assert con.execute("SELECT count(*) FROM instance_renames").fetchone() == (named,)
    # a later export delivers some of the same records again (at-least-once shipping)
    with (tmp_path / "gateway" / "day2.jsonl").open("w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows[:10])
    result = ingest(con, incident)
    day2 = next(f for f in result.files if f.file.endswith("day2.jsonl"))
    assert (day2.duplicates, day2.quarantined) == (10, 0)
    assert con.execute(
        "SELECT DISTINCT prefill_instance, decode_instance FROM requests WHERE prefill_instance IS NOT NULL"
    ).fetchall() == [("p0", "d0")]
    assert con.execute(
        "SELECT gateway_name, engine_instance, matched_by FROM instance_names ORDER BY 1"
    ).fetchall() == [(_fqdn("d0"), "d0", "first_label"), (_fqdn("p0"), "p0", "first_label"), ("p0:30000", "p0", "host")]
    assert con.execute("SELECT count(*) FROM instance_renames").fetchone() == (named,)


_NAMES = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda pod, domain, port: pod + domain + port,
        st.sampled_from(["p0", "P0", "p1", "10.0.0.1", "[::1]", "http://p0", ""]),
        st.sampled_from(["", ".ns", ".ns.svc", ".other"]),
        st.sampled_from(["", ":30000", ":x", "/v1"]),
    ),
)


@settings(max_examples=int(os.environ.get("KVF_EXAMPLES", 200)), deadline=None)
@given(
    gateway=st.lists(_NAMES, max_size=8),
    engines=st.lists(_NAMES, max_size=6),
    regex=st.sampled_from([None, r"(?P<instance>[^.:]+)", r"^(?P<instance>p\d)", r"(?P<instance>)"]),
)
def test_matching_any_names_never_fails_and_never_invents_an_instance(gateway, engines, regex):
    got = match_instance_names(gateway, engines, InstanceMatching(match=regex))
    assert sorted(m.gateway_name for m in got) == sorted(set(gateway))
    for m in got:
        assert (
            (m.engine_instance in engines)
            if m.engine_instance is not None
            else m.matched_by in ("ambiguous", "unmatched")
        )
        assert (m.matched_by == "exact") == (m.gateway_name in engines)
        assert not m.candidates or m.matched_by == "ambiguous"
