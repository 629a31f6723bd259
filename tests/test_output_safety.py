"""Outputs opened by people are safe to open: CSV cells a spreadsheet does not run as formulas (OWASP CSV injection,
https://owasp.org/www-community/attacks/CSV_Injection), Markdown in which untrusted text is never a link, and text
files without NUL or other control bytes."""

from __future__ import annotations

import csv
import json
import re
from html import unescape
from pathlib import Path

import pytest
from conftest import INCIDENT, mini_requests, write_mini
from hypothesis import given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from kvforensics.cli import main
from kvforensics.core import escaping
from kvforensics.core.escaping import csv_cell, markdown_text, visible_controls

FORMULA_ACCOUNT = '=HYPERLINK("http://evil.example","x")'
PHISHING_ACCOUNT = "[Verify your account](https://evil.example/login)"
LINK_MODEL = "[m](javascript:alert(7))"
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
BIDI_ACCOUNT = "acct-6\u202etxt.exe\u2066\u200f"


def _evil_incident(root: Path) -> Path:
    rows = mini_requests()
    for r in rows:
        r["model"] = LINK_MODEL
        if r["rid"] == "r-leak":
            r["account_id"] = FORMULA_ACCOUNT
        elif r["account_id"] == "acct-4":
            r["account_id"] = PHISHING_ACCOUNT
        elif r["account_id"] == "acct-5":
            r["account_id"] = "@SUM(1+1)*cmd|' /C calc'!A0"
        elif r["account_id"] == "acct-6":  # shows as "acct-6exe.txt" where bidi controls act (Trojan Source)
            r["account_id"] = BIDI_ACCOUNT
        if r["rid"] == "r119":  # acct-0's last request before the leak: a request id in notifications.csv
            r["rid"] = "+r119"
    incident = INCIDENT.replace('"@cf/zai-org/glm-5.3"', json.dumps(LINK_MODEL))
    path = write_mini(root, rows, incident)
    with (root / "gateway" / "day1.jsonl").open("ab") as fh:  # two lines the loader must quarantine
        fh.write(b'-2+3 not json \x00 with a NUL\n=cmd|"/C calc"!A0 \x1b[31m\n')
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("safety")
    incident = _evil_incident(root / "data")
    outs = {"neutralised": root / "out", "raw": root / "out-raw"}
    for mode, out in outs.items():
        raw = ["--raw-csv"] if mode == "raw" else []
        assert main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf", *raw]) == 0
    return outs


def _cells(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


CSV_FILES = ["affected_requests.csv", "notifications.csv", "quarantine.csv"]


def test_no_csv_cell_starts_a_formula(runs):
    out = runs["neutralised"]
    seen = set()
    for name in CSV_FILES:
        for row in _cells(out / name):
            for column, cell in row.items():
                assert not cell.startswith(FORMULA_STARTS), (name, column, cell)
                seen.add(cell)
    assert "'" + FORMULA_ACCOUNT in seen  # affected_requests.csv and notifications.csv
    assert "'@SUM(1+1)*cmd|' /C calc'!A0" in seen
    assert "'+r119" in seen
    quarantined = {r["raw"] for r in _cells(out / "quarantine.csv")}
    assert "'-2+3 not json \\x00 with a NUL" in quarantined
    assert "'=cmd|\"/C calc\"!A0 \\x1b[31m" in quarantined
    assert json.loads((out / "manifest.json").read_text())["csv_cells"] == "neutralised"


def test_computed_numbers_stay_numbers():
    assert csv_cell(-5) == -5 and csv_cell(-2.0) == -2 and csv_cell(-0.5) == -0.5
    assert csv_cell("-5") == "'-5"  # text from the inputs is untrusted even when it looks like a number
    assert csv_cell(None) == "" and csv_cell("plain") == "plain"
    assert csv_cell("\tx") == "'\tx" and csv_cell("\rx") == "'\rx"


def test_raw_csv_writes_cells_as_read_and_says_so(runs):
    raw, neutral = runs["raw"], runs["neutralised"]
    accounts = {r["account_id"] for r in _cells(raw / "affected_requests.csv")}
    assert FORMULA_ACCOUNT in accounts
    assert "-2+3 not json \\x00 with a NUL" in {r["raw"] for r in _cells(raw / "quarantine.csv")}
    assert json.loads((raw / "manifest.json").read_text())["csv_cells"] == "raw"
    for name in CSV_FILES:  # the same rows, only the leading quote differs
        assert [{k: v.removeprefix("'") for k, v in r.items()} for r in _cells(neutral / name)] == [
            {k: v.removeprefix("'") for k, v in r.items()} for r in _cells(raw / name)
        ]


def test_every_text_file_is_utf8_without_control_bytes(runs):
    for out in runs.values():
        files = [p for p in out.rglob("*") if p.is_file() and p.suffix not in (".duckdb", ".wal", ".pdf")]
        assert any(p.name == "quarantine.csv" for p in files)
        for path in files:
            text = path.read_bytes().decode("utf-8")  # raises when not UTF-8
            assert visible_controls(text) == text, path.name


def test_bidirectional_controls_of_an_account_id_are_shown_not_obeyed(runs):
    """Every file written shows the account id's bidi controls as escapes (none holds one: the test above); the
    id itself is written, escaped, in the report, the notices' headings and the CSVs."""
    shown = "acct-6\\u202etxt.exe\\u2066\\u200f"
    for out in runs.values():
        assert shown in (out / "notifications.csv").read_text(encoding="utf-8")
        headings = [
            line
            for p in (out / "notices").rglob("*.md")
            for line in p.read_text(encoding="utf-8").splitlines()
            if line.startswith("# Notice to account acct-6")
        ]
        assert headings and all("\u202e" not in line and "u202e" in line for line in headings)


def test_evidence_database_keeps_the_raw_line(runs):
    import duckdb

    con = duckdb.connect(str(runs["neutralised"] / "evidence.duckdb"), read_only=True)
    try:
        raws = {r[0] for r in con.execute("SELECT raw FROM quarantine").fetchall()}
    finally:
        con.close()
    assert "-2+3 not json \x00 with a NUL" in raws


def _html(markdown: str) -> str:
    """Markdown as a permissive renderer shows it: tables, strikethrough, and any link scheme (markdown-it drops
    javascript: links by default; a renderer need not)."""
    renderer = MarkdownIt("commonmark").enable(["table", "strikethrough"])
    renderer.validateLink = lambda url: True  # type: ignore[method-assign]
    return renderer.render(markdown)


def test_report_markdown_has_no_link_from_untrusted_text(runs):
    text = (runs["neutralised"] / "report.md").read_text()
    html = _html(text)
    assert "<a " not in html and "javascript:" not in html.replace("[m](javascript:alert(7))", "")
    assert "[m](javascript:alert(7))" in html  # shown as the literal text
    assert "<script" not in html and "<img" not in html


def test_notice_heading_is_not_a_link(runs):
    notices = list((runs["neutralised"] / "notices").rglob("*.md"))
    assert notices
    headings = []
    for path in notices:
        html = _html(path.read_text())
        assert "<a " not in html, path.name
        headings += [line for line in html.splitlines() if line.startswith("<h1>")]
    assert f"<h1>Notice to account {PHISHING_ACCOUNT}</h1>" in headings
    assert "<h1>Notice to account =HYPERLINK(&quot;http://evil.example&quot;,&quot;x&quot;)</h1>" in headings


@pytest.mark.parametrize(
    "text",
    [
        LINK_MODEL,
        PHISHING_ACCOUNT,
        "https://evil.example/x",
        "www.evil.example",
        "someone@evil.example",
        "![img](http://evil.example/p.png)",
        "<a href='http://evil.example'>x</a>",
        "*bold* _em_ `code` ~~del~~ # h",
        "__strong__ x_y_",
        "a_ _b",
        "[ref]: http://evil.example",
        "a | b",
        "line\nbreak",
        "nul\x00byte",
    ],
)
def test_markdown_text_renders_as_the_literal_text(text):
    html = _html(f"# Notice {markdown_text(text)}\n\n| x |\n| --- |\n| {markdown_text(text)} |\n")
    assert "<a " not in html and "<img" not in html and "<em>" not in html and "<code>" not in html
    assert "<del>" not in html and "<strong>" not in html
    heading = re.search("<h1>(.*)</h1>", html)
    assert heading and unescape(heading.group(1)) == "Notice " + visible_controls(text).replace("\n", " ")
    assert html.count("<td>") == 1


def test_markdown_text_keeps_ordinary_identifiers_readable():
    assert markdown_text("ttft_ms of acct-7 (glm-5.3)") == "ttft_ms of acct-7 (glm-5.3)"
    assert markdown_text("@cf/zai-org/glm-5.3") == "@cf/zai-org/glm-5.3"
    assert markdown_text("_x_ a*b") == "\\_x\\_ a\\*b"


def test_verify_re_derives_the_cells_in_the_recorded_mode(runs, tmp_path):
    import shutil

    from kvforensics.evidence.verify import verify

    for out in runs.values():
        assert verify(out) == [], out.name
    copy = shutil.copytree(runs["raw"], tmp_path / "raw")
    path = copy / "affected_requests.csv"  # a neutralised cell in a raw folder is a difference
    quoted = FORMULA_ACCOUNT.replace('"', '""')
    path.write_text(path.read_text().replace(quoted, "'" + quoted))
    assert any(p.startswith("affected_requests.csv") for p in verify(copy))


def test_markdown_text_keeps_comparisons_and_ampersands_readable():
    """Issue 27, observation 9: a version range in a report.md table read "&gt;0.5.9,&lt;0.5.20". "<", ">" and "&"
    stay themselves where no Markdown reading takes them for markup, and still render as the literal text."""
    assert markdown_text("sglang >0.5.9,<0.5.20 (inferred) & co") == "sglang >0.5.9,<0.5.20 (inferred) & co"
    assert (
        markdown_text("<script>x</script> &amp; <https://e.example>")
        == "&lt;script>x&lt;/script> &amp;amp; &lt;https\\://e.example>"
    )
    for text in (">0.5.9,<0.5.20", "a < b > c", "&lt;", "<!-- x -->", "x<y"):
        assert (
            unescape(re.search("<td>(.*)</td>", _html(f"| x |\n| --- |\n| {markdown_text(text)} |\n")).group(1)) == text
        )


def _markdown_every_rule(value: object) -> str:
    """markdown_text without its shortcut: every rule applied to every text."""
    text = visible_controls(str(value))
    text = escaping._MD_ENTITY.sub("&amp;", text)
    text = escaping._MD_TAG_START.sub("&lt;", text)
    text = escaping._MD_SPECIAL.sub(r"\\\1", text)
    text = re.sub(r"^(\s*)>", r"\1\\>", text)
    text = escaping._MD_AUTOLINK.sub(r"\\\1", text)
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("aZ09 -_/()'\"=+\\`*[]!#|~{}<>&:.@;\r\n\t\x00\x1b\x85\ufffe\ud800wW"))))
def test_markdown_text_shortcut_changes_nothing(text):
    """A text written as it is (none of the characters a rule acts on) is what every rule would have made of it."""
    assert markdown_text(text) == _markdown_every_rule(text)
    assert markdown_text(f"acct-{len(text)}") == _markdown_every_rule(f"acct-{len(text)}")


@pytest.mark.parametrize(
    "text", ["WWW.example", "www.x", "a@b", "@cf/x", "http://x", "x:y", "a.b", "2026-08-27T17:15:16Z", "  > q", "a_b"]
)
def test_markdown_text_shortcut_changes_nothing_on_links_and_times(text):
    assert markdown_text(text) == _markdown_every_rule(text)
