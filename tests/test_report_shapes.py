"""The report and notices read back on incidents of each shape (unified and PD, vLLM and SGLang, prefix-cache, none
affected, still running; tests/incidents.py SHAPES): no statement contradicts the evidence tables it rests on, and
report.md parses as the Markdown it means to be (issue 27)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
from incidents import SHAPES
from markdown_it import MarkdownIt

MD = MarkdownIt("commonmark", {"html": False}).enable("table")
SECTIONS = [
    "Summary",
    "Impact",
    "Timeline",
    "How the data was exposed",
    "How we know",
    "Exploitation assessment",
    "Measures taken and advice to customers",
    "Notification",
    "Data quality",
    "Provenance",
]


def section(md: str, heading: str) -> str:
    """The text under a heading of report.md, up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = md.split(f"\n{heading}\n", 1)[1]
    stop = re.search(rf"^#{{1,{len(level)}}} ", body, re.M)
    return body[: stop.start()] if stop else body


def outside_tables(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("|"))


def evidence(out: Path) -> dict:
    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    try:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        return {
            "windows": q("SELECT instance, valid_from, valid_to, end_reason FROM exposure_windows ORDER BY 1, 2"),
            "roles": {r for (r,) in q("SELECT DISTINCT role FROM capacity")},
            "engines": {e for (e,) in q("SELECT DISTINCT engine FROM capacity")},
            "startups": q("SELECT instance, valid_from, kv_pool_tokens, context_length FROM capacity"),
            "prefix_paths": {i for (i,) in q("SELECT DISTINCT instance FROM prefix_windows WHERE path <> 'isolated'")},
            "suspects": {a for (a,) in q("SELECT DISTINCT account_id FROM suspected_exploiters")},
            "mechanisms": {m for (m,) in q("SELECT id FROM mechanisms WHERE selected")},
            "flagging": {
                r for (r,) in q("SELECT DISTINCT rule_id FROM findings JOIN affected_responses USING (request_id)")
            },
        }
    finally:
        con.close()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_no_statement_of_the_report_or_the_notices_contradicts_the_evidence(shapes, shape):
    code, out = shapes[shape]
    scope = json.loads((out / "scope.json").read_text())
    ev = evidence(out)
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    assert code == (0 if scope["conclusive"] else 3)
    assert md.startswith("**INCONCLUSIVE") == (not scope["conclusive"])
    # the headline figures are scope.json's
    summary = section(md, "## Summary")
    assert f"**{scope['affected_responses']:,}** affected responses" in summary
    assert f"**{scope['affected_accounts']:,}** accounts received" in summary
    # the breach and its consequences are stated only when there are affected responses
    nature = section(md, "### Nature of the breach")
    assert ("A confidentiality breach" in nature) == (scope["affected_responses"] > 0)
    assert ("No affected response was found" in nature or "Not established" in nature) == (
        scope["affected_responses"] == 0
    )
    consequences = section(md, "### Likely consequences")
    assert ("- " in consequences) == (scope["affected_responses"] > 0)
    # the exposure windows are the evidence's, and the audit's check-1 FAILs are exactly them
    windows = {w[0] for w in ev["windows"]}
    table = [line for line in section(md, "### Exposure windows").splitlines() if line.startswith("| ")][2:]
    assert {line.split(" | ")[0][2:] for line in table} == (windows or {"none"})
    # the sentence above the table is true of it: exposed windows are claimed only when there are some
    above = section(md, "### Exposure windows")
    assert ("No start-up in this evidence fails audit check 1" in above) == (not windows)
    assert ("was exposed in" in above) == bool(windows)
    assert {w["instance"] for w in scope["exposure_windows"]} == windows
    check1 = [line for line in md.splitlines() if "| 1. KV pool vs context length |" in line]
    assert {line.split(" | ")[0][2:] for line in check1 if "| FAIL" in line} == windows
    assert all("| FAIL (exposed) |" in line for line in check1 if "| FAIL" in line)
    # the deployment is described from the evidence: no role, engine or instance it does not hold
    deployment = section(md, "### In this deployment")
    assert "disaggregated mode" not in md and "the decode node generated" not in md
    if not ev["roles"] & {"prefill", "decode"}:
        assert "(prefill," not in deployment and "(decode," not in deployment
    for engine in ("sglang", "vllm"):
        assert (f", {engine} " not in deployment) or engine in ev["engines"], engine
    named = set(re.findall(r"\bon ([\w.-]+(?:, [\w.-]+)*(?: and [\w.-]+)?) \(", deployment))
    instances = {i for group in named for i in re.split(r", | and ", group)}
    assert instances <= windows | ev["prefix_paths"]
    # what the rules flagged is stated once, in the mechanisms' "In this evidence" lines, each rule with its count
    exposed = section(md, "## How the data was exposed")
    for rule in ev["flagging"]:
        assert len(re.findall(rf"\(\d[\d,]* responses?, rule {rule}\)", exposed)) == 1, rule
        assert len(re.findall(rf"\b{rule}\b", exposed)) == 1, rule
    if "stale_pages" in ev["mechanisms"] and not windows:
        assert "No start-up's KV pool was below its context length" in deployment
    # measures: what the evidence shows about the windows' ends, never a restart that did not happen
    measures = section(md, "## Measures taken and advice to customers")
    restarted = set(re.findall(r"Model server ([\w.-]+) was restarted on", measures))
    assert restarted == {w[0] for w in ev["windows"] if w[3] == "next_startup"}
    assert ("still running as configured" in measures) == any(w[2] is None for w in ev["windows"])
    assert ("0.5.22" in outside_tables(measures)) <= ("sglang" in ev["engines"])
    assert "Exposed deployments restarted" not in md and "run SGLang >= 0.5.22" not in md
    # who gets which notice: suspects go to trust and safety; every notice names the sender and contact or is a draft
    declared = "[notice]" in (out.parent / "data" / "incident.toml").read_text()
    assert set(scope["exploitation"]["accounts_looking_deliberate"]) == ev["suspects"]
    for account in ev["suspects"]:
        assert list((out / "notices" / "trust-and-safety").glob(f"{re.sub(r'[^A-Za-z0-9._-]+', '_', account)}-*.md"))
    for path in (out / "notices").rglob("*.md"):
        text = path.read_text()
        if declared:
            assert "Example Inference Ltd" in text and "privacy\\@example.com" in text, path
            assert not text.startswith("> **DRAFT"), path
        else:
            assert text.startswith("> **DRAFT, not ready to send:**"), path
        for server in re.findall(r"Model server ([\w.-]+) was restarted on", text):
            assert server in restarted, path
    assert ("The notices are drafts" in html) == (not declared)


@pytest.mark.parametrize("shape", [*sorted(SHAPES), "sample"])
def test_report_md_parses_as_markdown_with_every_heading_and_table(shapes, sample_run, shape):
    """Observation 9: a heading glued to the text before it was not rendered, and the Notification section the HTML
    lists was missing. Every line starting with '#' is a heading, every line starting with '|' a table row, the
    sections are the HTML report's, and no entity hides a comparison."""
    out = sample_run if shape == "sample" else shapes[shape][1]
    md = (out / "report.md").read_text()
    tokens = MD.parse(md)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert len(headings) == sum(1 for line in md.splitlines() if line.startswith("#"))
    rows = sum(1 for t in tokens if t.type == "tr_open")
    assert rows == sum(1 for line in md.splitlines() if line.startswith("|")) - sum(
        1 for line in md.splitlines() if re.fullmatch(r"\|( ?-+:? ?\|)+|\|(---\|)+", line)
    )
    assert [h for h in headings if h in SECTIONS] == SECTIONS
    nav = re.findall(r'<li><a href="#[\w-]+">([^<]+)</a></li>', (out / "report.html").read_text())
    assert nav == SECTIONS
    assert "&gt;" not in md and not re.search(r"&lt;(?![A-Za-z/!?])", md)


@pytest.mark.parametrize("shape", ["sglang-pd", "vllm-pd-running"])
def test_the_scatter_draws_every_exposed_pool_of_its_model(shapes, shape):
    """Observation 8: the prompt-vs-time-to-first-token scatter had no line at the pool the prompts exceeded. Each
    exposure window's pool of the model (whatever its role) is a line."""
    from kvforensics.report.data import money_frames

    out = shapes[shape][1]
    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    try:
        frames = money_frames(con)
        assert frames
        for model, (_points, pools, _curve) in frames.items():
            windows = {
                p
                for (p,) in con.execute(
                    "SELECT kv_pool_tokens FROM exposure_windows WHERE model = $m", {"m": model}
                ).fetchall()
            }
            assert windows and windows <= set(pools["kv_pool_tokens"]), model
            assert all(label.startswith("KV pool ") for label in pools["label"])
    finally:
        con.close()


CHECK_CONTRACT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "check-contract"


@pytest.mark.skipif(not CHECK_CONTRACT.is_file(), reason="../shared/tools/check-contract is not beside this checkout")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_s_output_folder_follows_the_contract(shapes, shape):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(CHECK_CONTRACT), str(shapes[shape][1])], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
