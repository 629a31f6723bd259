"""What the report says when an input is missing, that no output holds a missing-value marker (nan, None, NaT),
that the exploitation table and its conclusion agree, and that the progress names only the files written."""

from __future__ import annotations

import json
import math
import re
from html import unescape
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from conftest import INCIDENT, mini_requests, write_mini
from pages import markup_outside_scripts

from kvforensics.cli import main
from kvforensics.investigation import run
from kvforensics.report import charts
from kvforensics.report.data import exploitation_verdicts, set_apart_note
from kvforensics.report.views import account_frames, timeline_frames

ENGINE_SOURCE = '''[[sources]]
name = "engines"
kind = "engine_log"
path = "engine/*.log"
format = "sglang"
'''
# an incident built without one input each: (request fields dropped, incident file)
VARIANTS = {
    "no_ttft": (("ttft_ms",), INCIDENT),
    "no_timings": (("ttft_ms", "latency_ms", "cached_tokens", "completion_tokens"), INCIDENT),
    "no_engine_logs": ((), INCIDENT.replace(ENGINE_SOURCE, "")),
}
# a value a data frame or SQL NULL turns into when printed as it is
MISSING_MARKERS = ("nan", "NaN", "NaT", "None", "<NA>", "&lt;NA&gt;", "&lt;NA>", "\\<NA\\>", "null", "inf")


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory) -> dict[str, Path]:
    assert ENGINE_SOURCE in INCIDENT
    runs = {}
    for name, (dropped, incident) in VARIANTS.items():
        root = tmp_path_factory.mktemp(name)
        rows = [{k: v for k, v in r.items() if k not in dropped} for r in mini_requests()]
        out = root / "out"
        run(write_mini(root / "data", rows, incident), out, progress=False, pdf=False)
        runs[name] = out
    return runs


def report(out: Path) -> tuple[str, str]:
    return markup_outside_scripts((out / "report.html").read_text(encoding="utf-8")), (out / "report.md").read_text(
        encoding="utf-8"
    )


def missing_notes(html: str, md: str) -> tuple[dict[str, str], list[str]]:
    """The missing-input notes: HTML by section, Markdown as lines."""
    notes = dict(re.findall(r'<div class="missing" data-section="([a-z_]+)" role="note">(.*?)</div>', html))
    return notes, [line for line in md.splitlines() if line.startswith("> **Missing input:**")]


def cells(out: Path) -> list[tuple[str, str]]:
    """Every table cell, CSV cell and JSON value of every output file (notices included), with its file."""
    found: list[tuple[str, str]] = []
    for path in sorted(p for p in out.rglob("*") if p.suffix in (".html", ".md", ".csv", ".json")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(out).as_posix()
        if path.suffix == ".html":
            found += [
                (name, c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", markup_outside_scripts(text), re.DOTALL)
            ]
        elif path.suffix == ".md":
            found += [
                (name, c)
                for line in text.splitlines()
                if line.startswith("|")
                for c in line.strip().strip("|").split(" | ")
            ]
        elif path.suffix == ".csv":
            found += [(name, c) for line in text.splitlines()[1:] for c in line.split(",")]
        elif path.suffix == ".json":
            found += [(name, v) for v in _json_values(json.loads(text))]
    return found


def _json_values(value):  # noqa: ANN001, ANN202 - any JSON value
    if isinstance(value, dict):
        for v in value.values():
            yield from _json_values(v)
    elif isinstance(value, list):
        for v in value:
            yield from _json_values(v)
    elif isinstance(value, float) and not math.isfinite(value):
        yield str(value)
    elif isinstance(value, str):
        yield value


def assert_no_missing_markers(out: Path) -> None:
    found = cells(out)
    assert len(found) > 100
    bad = [(name, c) for name, c in found if c.strip() in MISSING_MARKERS]
    assert bad == []
    for path in [out / "report.md", out / "report.html", *sorted((out / "notices").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        assert (
            re.search(r"\b(nan|NaN|NaT)\b", markup_outside_scripts(text) if path.suffix == ".html" else text) is None
        ), path


def test_no_output_of_the_sample_holds_a_missing_value_marker(sample_run):
    assert_no_missing_markers(sample_run)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_output_of_an_incident_with_missing_fields_holds_a_missing_value_marker(variant_runs, variant):
    assert_no_missing_markers(variant_runs[variant])


def test_without_any_timing_the_latency_section_says_what_is_missing_and_which_rule_could_not_judge(variant_runs):
    html, md = report(variant_runs["no_timings"])
    notes, md_notes = missing_notes(html, md)
    assert "neither time to first token (ttft_ms) nor end-to-end latency (latency_ms)" in notes["latency"]
    assert "<code>prefill_too_fast</code>" in notes["latency"]
    assert any("neither time to first token" in n and "`prefill_too_fast`" in n for n in md_notes)
    # no empty latency table, no blank chart in its place
    assert "<th>usable</th>" not in html and "| model | usable |" not in md
    assert 'id="chart-money-' not in html


def test_with_latency_but_no_ttft_the_report_says_so(variant_runs):
    html, md = report(variant_runs["no_ttft"])
    notes, md_notes = missing_notes(html, md)
    assert "no time to first token (ttft_ms), only end-to-end latency" in notes["latency"]
    assert any("no time to first token" in n for n in md_notes)


def test_without_engine_logs_the_exposure_audit_and_rules_say_why_they_are_empty(variant_runs):
    html, md = report(variant_runs["no_engine_logs"])
    notes, md_notes = missing_notes(html, md)
    assert "no engine start-up was read: the incident file names no engine_log source" in notes["engine"]
    for rule in ("prompt_exceeds_kv_pool", "engine_abort_but_success", "transfer_integrity"):
        assert f"<code>{rule}</code>" in notes["engine"]
        assert any(f"`{rule}`" in n for n in md_notes)
    assert "audit" not in notes  # nothing to audit: the engine note says why
    assert "Nothing audited" in html and "All verdicts" not in html
    assert "None read: see the missing input" in html
    assert "| none | | | | | | | | | |" in md  # the exposure windows table says none


def test_missing_content_and_changes_are_explained_and_present_ones_are_not(variant_runs, sample_run):
    html, md = report(variant_runs["no_ttft"])  # the mini incident has no content and no changes source
    notes, md_notes = missing_notes(html, md)
    assert "no content source" in notes["content"] and "notified as possibly exposed" in notes["content"]
    assert "no record of configuration changes" in notes["changes"]
    assert "--manifest" in notes["audit"]  # the run's audit has no deployment manifest
    assert len(md_notes) == len(notes)
    html, md = report(sample_run)  # the sample has every input
    notes, md_notes = missing_notes(html, md)
    assert set(notes) == {"audit"} and len(md_notes) == 1


def test_the_provider_s_load_tests_are_not_deliberate_exploitation():
    behaviour = pd.DataFrame(
        {
            "account_id": ["c1", "c2", "lt", "bug"],
            "account_class": ["customer", "customer", "internal", "reporter"],
            "looks_deliberate": [True, False, True, True],
        }
    )
    rows = exploitation_verdicts(behaviour).set_index("account_id")
    assert rows.loc["c1", "deliberate"] == "yes" and rows.loc["c1", "pattern"].startswith("probing")
    assert rows.loc["c2", "deliberate"] == "no" and rows.loc["c2", "pattern"] == "ordinary long-context use"
    assert rows.loc["lt", "deliberate"] == "no" and rows.loc["lt", "pattern"].startswith("load test (internal)")
    assert rows.loc["bug", "deliberate"] == "no" and rows.loc["bug", "pattern"].startswith("reproduction")
    assert set_apart_note(behaviour) == (
        "The same pattern came from 1 internal account (lt): the provider's own load tests; and from 1 reporter "
        "account (bug): the reporter's reproduction. They are set apart: not deliberate exploitation."
    )
    assert set_apart_note(behaviour[behaviour["account_class"] == "customer"]) == ""


def test_the_sample_s_exploitation_table_agrees_with_its_conclusion(sample_run):
    scope = json.loads((sample_run / "scope.json").read_text())
    html, md = report(sample_run)
    table = html.split('<table id="t-exploitation">', 1)[1].split("</table>", 1)[0]
    rows = {cols[0]: cols for cols in (re.findall(r"<td[^>]*>(.*?)</td>", r) for r in table.split("<tr>")[2:])}
    deliberate = sorted(a for a, cols in rows.items() if cols[-1] == "yes")
    assert deliberate == sorted(a for a in scope["exploitation"]["accounts_looking_deliberate"] if a in rows)
    internal = [cols for cols in rows.values() if cols[1] == "internal"]
    assert internal and all(cols[-1] == "no" for cols in internal)
    assert any(cols[-2].startswith("load test (internal)") for cols in internal)
    if not scope["exploitation"]["accounts_looking_deliberate"]:
        assert "no sign of deliberate exploitation" in scope["exploitation"]["conclusion"]
        section = md.split("## Exploitation assessment", 1)[1].split("\n## ", 1)[0]
        assert not deliberate and not [line for line in section.splitlines() if line.endswith("| yes |")]
    conclusion = unescape(html.split('id="exploitation-conclusion"', 1)[1].split("</p>", 1)[0])
    load_tests = sorted(cols[0] for cols in internal if cols[-2].startswith("load test"))
    assert (
        f"internal account{'s' if len(load_tests) > 1 else ''} ({', '.join(load_tests)}): the provider's own load "
        "tests" in conclusion
    )


def test_the_progress_names_report_pdf_only_when_it_is_written(mini_incident, tmp_path, capsys):
    assert main(["run", str(mini_incident), "--out", str(tmp_path / "out"), "--no-pdf"]) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "report:" in x and "report.html" in x]
    assert line.endswith("report: report.html, report.md, notices")
    assert "report.pdf" not in err
    assert not (tmp_path / "out" / "report.pdf").exists()


def test_the_timeline_and_account_views_read_the_evidence_database(variant_runs):
    out = variant_runs["no_ttft"]
    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    try:
        affected = con.execute("SELECT count(*) FROM affected_responses").fetchall()[0][0]
        frames = timeline_frames(con)
        assert frames.affected_total == len(frames.affected) == affected > 0
        assert list(frames.windows["lane"]) == ["p0 (prefill, pool 681,280)"]
        assert {"start-up", "restart"} <= set(frames.events["kind"])  # p0 started, then restarted with a larger pool
        sampled = timeline_frames(con, max_points=0)
        assert sampled.affected.empty and sampled.affected_total == affected
        assert "(0 drawn, a sample by request id)" in charts.timeline_chart(sampled).to_dict()["vconcat"][0]["title"]
        (recipient,) = con.execute("SELECT DISTINCT account_id FROM affected_responses").fetchall()[0]
        one = account_frames(con, account=recipient)
        assert list(one.accounts["account_id"]) == [recipient] and set(one.affected["account_id"]) == {recipient}
        assert account_frames(con, account="no such account").accounts.empty
        spec = charts.account_chart(con, account=recipient).to_dict()
        assert spec["hconcat"][1]["title"] == f"affected responses of {recipient}" and "params" not in spec
        assert charts.timeline_chart(con).to_dict()["vconcat"][0]["title"] == f"{affected} affected responses"
    finally:
        con.close()


def test_an_inferred_version_is_said_once_with_its_basis_even_with_braces_in_it():
    """Issue 27, observation 8: the inferred version's sentence was repeated on every timeline and start-up row; it
    is said once per version and basis, and the basis is the parser's text, braces and all (an SGLang 0.5.20 log's
    basis names a '{...}' feature)."""
    from kvforensics.report.data import engine_label, version_notes

    capacity = pd.DataFrame(
        [
            {"engine": "sglang", "engine_version": ">0.5.9,<0.5.20 (inferred: server_args={...})", "instance": i}
            for i in ("p1", "p0", "p0")
        ]
    )
    assert version_notes(capacity) == ["sglang >0.5.9,<0.5.20 on p0, p1, from server_args={...}"]
    assert engine_label("sglang", ">0.5.9,<0.5.20 (inferred: server_args={...})") == "sglang >0.5.9,<0.5.20 (inferred)"
    assert engine_label("vllm", None) == "vllm, version unknown"


def one_startup_evidence(tmp_path: Path):  # noqa: ANN201 - (connection, incident)
    """An evidence database with one decode start-up, engine logs without a per-request line and one successful
    request without timings; the mini incident."""
    from kvforensics.config import load_incident
    from kvforensics.core.db import connect

    con = connect()
    con.execute(
        "INSERT INTO capacity (instance, role, engine, source, source_file) VALUES ('d-0', 'decode', 'sglang', 'e', 'f')"
    )
    con.execute("CREATE TABLE analysed_requests (model VARCHAR, status INTEGER, ttft_ms DOUBLE, latency_ms DOUBLE)")
    con.execute("INSERT INTO analysed_requests VALUES ('m', 200, NULL, NULL)")
    return con, load_incident(write_mini(tmp_path / "data", mini_requests(), INCIDENT))


def test_a_missing_input_weakens_only_the_rules_of_the_mechanisms_investigated(tmp_path: Path) -> None:
    """Engine logs without per-request lines: under stale_pages the note names the rules left to agree; a
    prefix_reuse investigation reads no engine line and no timing, so neither note is written for it."""
    from kvforensics.report.missing import missing_inputs

    con, incident = one_startup_evidence(tmp_path)

    def notes(investigated: set[str] | None) -> dict[str, str]:
        return {m.section: m.meaning for m in missing_inputs(con, incident, investigated)}

    stale = notes({"stale_pages"})
    assert stale["engine_events"].startswith(
        "the rules that read them found nothing to judge, so a response is confirmed only where the other rules "
        "(prefill_too_fast, prompt_exceeds_kv_pool) agree."
    )
    assert "latency" in stale
    prefix = notes({"prefix_reuse"})
    assert "engine_events" not in prefix and "latency" not in prefix
    assert {"content", "changes", "audit"} <= set(prefix)
    assert notes(None).keys() == stale.keys()


def test_the_audit_note_says_check_5_is_unknown_only_where_it_is(tmp_path: Path) -> None:
    from kvforensics.audit import AuditReport, audit_paths
    from kvforensics.report.missing import missing_inputs

    con, incident = one_startup_evidence(tmp_path)
    pd = audit_paths([Path(__file__).parent / "fixtures" / "engine_logs" / "sglang-0.5.15-pd-decode-tp8.log"])
    unknown = sum(1 for v in pd.verdicts if v.check == 5 and v.status == "unknown")
    assert unknown == 1

    def note(audit: AuditReport) -> str:
        (m,) = [m for m in missing_inputs(con, incident, None, audit) if m.section == "audit"]
        return m.meaning

    assert note(pd).startswith(
        "check 5 (the load balancer does not abort before the first token) stays unknown on 1 start-up(s) here, and "
        "the engine version is the one the log shows or implies."
    )
    # a unified deployment: check 5 is not applicable, and the note does not say it is unknown
    unified = AuditReport([v for v in pd.verdicts if v.check != 5])
    assert note(unified).startswith("the engine version is the one the log shows or implies.")
    assert "check 5" not in note(unified)
