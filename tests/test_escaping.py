"""Untrusted strings (account ids, model names) are escaped in every output, never executed."""

from __future__ import annotations

import json

import pytest
from conftest import INCIDENT, mini_requests, write_mini
from pages import allowed_scripts, markup_outside_scripts

from kvforensics.investigation import run

EVIL_ACCOUNT = '<script>alert("acct")</script>'
EVIL_MODEL = '"><img src=x onerror=alert(1)>\'model'


@pytest.fixture(scope="module")
def evil_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("evil")
    rows = mini_requests()
    for r in rows:
        r["model"] = EVIL_MODEL
        if r["rid"] == "r-leak":
            r["account_id"] = EVIL_ACCOUNT
        elif r["account_id"] == "acct-3":
            r["account_id"] = "acct-3 | ` ' \" & <b>"
    alias = json.dumps(EVIL_MODEL)  # a valid TOML basic string
    incident = INCIDENT.replace('"@cf/zai-org/glm-5.3"', alias)
    path = write_mini(root / "data", rows, incident)
    out = root / "out"
    run(path, out, progress=False, pdf=False)
    return out


def test_html_report_escapes_untrusted_strings(evil_run):
    page = (evil_run / "report.html").read_text()
    html = markup_outside_scripts(page)
    assert "<script>" not in html and "onerror=alert(1)>" not in html.replace("&gt;", "")
    assert "&lt;script&gt;alert(&#34;acct&#34;)&lt;/script&gt;" in html or "&lt;script&gt;" in html
    assert "<img" not in html
    assert json.loads((evil_run / "scope.json").read_text())["affected_responses"] == 1
    # in the live charts' data the same strings are JSON that cannot close its script or open markup
    loader = allowed_scripts(page)[-1]
    assert "\\u003cscript\\u003ealert" in loader and "\\u003cimg src=x" in loader
    assert "<script" not in loader and "<img" not in loader


def test_markdown_and_notices_escape_html(evil_run):
    for path in [evil_run / "report.md", *(evil_run / "notices").rglob("*.md")]:
        text = path.read_text()
        assert "<script>" not in text and "<img" not in text, path.name
    names = [p.name for p in (evil_run / "notices").rglob("*.md")]
    assert all("/" not in n and "<" not in n and '"' not in n for n in names)
    assert any(n.startswith("script_alert_acct_script-") for n in names)


def test_svg_charts_carry_no_markup_from_data(evil_run):
    html = markup_outside_scripts((evil_run / "report.html").read_text())
    body = html.split("<body>", 1)[1]
    assert "<script" not in body
