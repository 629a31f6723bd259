"""Notices a provider can send as they are (issue 27, observations 5 and 6): who sends them and where to ask, the
incident's dates, the data concerned, the likely consequences and the measures taken, per role, in Markdown and
HTML; a suspected exploiter's notice goes to trust and safety, never the victim's letter; drafts say so first."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

MD = MarkdownIt("commonmark", {"html": False}).enable("table")
JARGON = (
    "KV",
    "pool's worth",
    "request(s)",
    "response(s)",
    "account(s)",
    "turnover",
    "horizon",
    "prefill",
    "stale page",
    "T0",
    "0Z",
)  # "0Z": an ISO stamp with milliseconds in prose would end so too


@pytest.fixture(scope="module")
def runs(shapes) -> dict[str, Path]:
    """The mini incident with a suspected exploiter, a load test and the reporter among the recipients: declared
    ([notice]) and not (drafts)."""
    outs = {}
    for name, shape in (("declared", "sglang-pd"), ("draft", "sglang-pd-draft")):
        code, outs[name] = shapes[shape]
        assert code == 0
    return outs


def rows(out: Path) -> list[dict[str, str]]:
    with (out / "notifications.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


def notices(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted((out / "notices").rglob("*.md"))}


def prose(markdown: str) -> str:
    """The notice's sentences: everything but its tables and code."""
    return "\n".join(line for line in markdown.splitlines() if not line.startswith("|"))


def test_a_suspected_exploiter_gets_a_trust_and_safety_review_not_the_victims_letter(runs):
    """Observation 5: an account whose traffic looks deliberate got the ordinary notice ("delete these responses")
    and notifications.csv did not say it was suspected."""
    out = runs["declared"]
    by_account = {r["account_id"]: r for r in rows(out)}
    prober = by_account["acct-prober"]
    assert (prober["suspected_exploiter"], prober["notice_type"]) == ("true", "trust_and_safety")
    assert prober["notice"].startswith("notices/trust-and-safety/acct-prober-")
    assert {r["suspected_exploiter"] for a, r in by_account.items() if a != "acct-prober"} == {"false"}
    review = (out / prober["notice"]).read_text()
    assert "**Do not send this to the account.**" in review and "## Why it is suspected" in review
    assert "12 prompts at or beyond an exposed KV pool" in review and "12 affected responses" in review
    assert "Delete the responses" not in review
    assert not [p for p in notices(out) if "acct-prober" in p and not p.startswith("notices/trust-and-safety/")]
    for r in rows(out):  # every row names a notice that was written, Markdown and HTML
        assert (out / r["notice"]).is_file() and (out / r["notice"]).with_suffix(".html").is_file()


def test_every_notice_names_the_provider_its_contact_dates_data_consequences_and_measures(runs):
    """Observation 6: no provider, contact, reference, dates, categories of data, consequences or measures."""
    for path, text in notices(runs["declared"]).items():
        assert not text.startswith("> **DRAFT"), path
        assert "Example Inference Ltd" in text and "privacy\\@example.com" in text and "INC-2026-0913" in text, path
        if "trust-and-safety" in path:
            continue
        for heading in ("## What happened", "## What we have done", "## What you can do", "## Contact"):
            assert heading in text, (path, heading)
        assert "**Data concerned:**" in text and "**Likely consequences:**" in text, path
        assert "On 9 September we restarted the affected servers" in text, path  # declared
        assert "Model server p0 was restarted on 9 Sep 2026 12:00 UTC" in text, path  # derived from the evidence
        assert re.search(r"affected (on|between) \d+ Aug 2026", text), path


def test_notices_speak_plain_words_to_their_reader(runs):
    """Observation 6: jargon, "between X and X", "1 of your request(s)", and the provider's own load test told of
    "another customer's response"."""
    texts = notices(runs["declared"])
    for path, text in texts.items():
        words = prose(text)
        assert not [j for j in JARGON if j in words and "trust-and-safety" not in path], (path, words)
        for a, b in re.findall(
            r"between (\d+ \w+ \d{4} \d\d:\d\d UTC|\d\d:\d\d) and (\d+ \w+ \d{4} \d\d:\d\d UTC|\d\d:\d\d)", words
        ):
            assert a != b, path
        assert not re.search(r"\b1 (requests|responses)\b", words), path
    (internal,) = [t for p, t in texts.items() if p.startswith("notices/internal/")]
    assert "customer" not in prose(internal).replace("not a customer notice", "")
    assert "Internal record for account loadtest-1" in internal


def test_headings_stand_on_their_own_and_no_table_column_is_always_empty(runs):
    """Observation 6: a heading glued to the line before it did not render; a column of the mechanism was always
    empty. Every line starting with '#' renders as a heading, and every column of every table has a value."""
    for path, text in notices(runs["declared"]).items():
        tokens = MD.parse(text)
        headings = [t for t in tokens if t.type == "heading_open"]
        assert len(headings) == sum(1 for line in text.splitlines() if line.startswith("#")), path
        for table in re.findall(r"((?:^\|.*\|\n)+)", text, re.M):
            cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table.splitlines()[2:]]
            for column in zip(*cells, strict=True):
                assert any(column), (path, table)


def test_html_notices_are_the_markdown_rendered_offline(runs):
    out = runs["declared"]
    for path in sorted((out / "notices").rglob("*.html")):
        html = path.read_text()
        assert "default-src 'none'" in html and "<script" not in html and "<a " not in html
        assert "<h1>" in html and "Example Inference Ltd" in html


def test_without_a_declared_provider_and_contact_every_notice_is_a_draft_saying_so_first(runs):
    texts = notices(runs["draft"])
    assert texts
    for path, text in texts.items():
        first = text.splitlines()[0]
        assert first.startswith("> **DRAFT, not ready to send:**") and "provider, contact and measures" in first, path
    html = next((runs["draft"] / "notices").rglob("*.html")).read_text()
    assert "<blockquote>\n<p><strong>DRAFT, not ready to send:</strong>" in html


def test_possible_tier_responses_are_listed_with_why_each_is_only_possible(runs):
    """Observation 7: a response with a single weak signal was listed nowhere a reviewer could read (only as a chart
    point); possible_responses.csv lists it with why it is not counted, and it is not an affected response."""
    out = runs["declared"]
    with (out / "possible_responses.csv").open(newline="") as fh:
        possible = {r["request_id"]: r for r in csv.DictReader(fh)}
    fast = possible["r-fast"]
    assert (fast["account_id"], fast["rules"], fast["prompt_tokens"], fast["ttft_ms"]) == (
        "acct-3",
        "prefill_too_fast",
        "400000",
        "60",
    )
    assert fast["why_only_possible"].startswith("only one weak signal from prefill_too_fast (")
    assert "observed_ms 60.0" in fast["why_only_possible"] and "counted as affected with" in fast["why_only_possible"]
    assert "r-fast" not in (out / "affected_requests.csv").read_text()
