"""The report says how each engine start-up ended (capacity.end_reason and its evidence), in words a
responder reads, in both formats, with an instance name from the evidence escaped like any other."""

from __future__ import annotations

import duckdb
import pytest
from conftest import write_mini
from pages import markup_outside_scripts

from kvforensics.config import load_incident
from kvforensics.investigation import run
from kvforensics.report.data import how_it_ended
from kvforensics.report.render import render_report

EVIL_SUCCESSOR = '<img src=x onerror=alert(1)>|p1'


@pytest.fixture(scope="module")
def mini_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifetimes")
    incident = write_mini(root / "data")
    out = root / "out"
    run(incident, out, progress=False, pdf=False)
    return incident, out


def rerender(incident, out, end: str = "") -> tuple[str, str]:
    """The report again after the exposed start-up (p0's first) is given another end."""
    con = duckdb.connect(str(out / "evidence.duckdb"))
    try:
        if end:
            con.execute(f"UPDATE capacity SET {end} WHERE instance = 'p0' AND kv_pool_tokens = 681280")
        render_report(con, load_incident(incident), out)
    finally:
        con.close()
    return (out / "report.html").read_text(encoding="utf-8"), (out / "report.md").read_text(encoding="utf-8")


def exposure_rows(html: str, md: str) -> tuple[str, str]:
    table = html.split('<table id="t-exposure">', 1)[1].split("</table>", 1)[0]
    (row,) = [
        line
        for line in md.split("### Exposure windows", 1)[1].split("###", 1)[0].splitlines()
        if line.startswith("| p0 ")
    ]
    return table, row


def test_a_restart_and_a_log_that_merely_stops_are_told_apart(mini_run):
    html, md = rerender(*mini_run)
    table, row = exposure_rows(html, md)
    # p0's first start-up ended where its next start-up began (line 8 of p0.log): the file is named (issue 27)
    assert "<td>restarted (p0.log line 8)</td>" in table
    assert "| restarted (p0.log line 8) |" in row
    # the start-ups without an end: still running, or their log stops (the start-up table, HTML)
    starts = html.split("<h3>Engine start-ups</h3>", 1)[1]
    assert "<td>still running / log stops at 2026-08-27T14:01:06Z</td>" in starts  # d0
    assert "<td>still running / log stops at 2026-09-09T12:01:06Z</td>" in starts  # p0's second


def test_a_shutdown_names_its_line(mini_run):
    html, md = rerender(*mini_run, "end_reason = 'shutdown', end_line = 7")
    table, row = exposure_rows(html, md)
    assert "<td>shut down (p0.log line 7)</td>" in table and "| shut down (p0.log line 7) |" in row


def test_a_retired_pods_successor_is_escaped(mini_run):
    html, md = rerender(*mini_run, f"end_reason = 'log_end', end_line = 7, successor = '{EVIL_SUCCESSOR}'")
    table, row = exposure_rows(html, md)
    assert (
        "<td>retired: replaced by &lt;img src=x onerror=alert(1)&gt;|p1 (its log ends at p0.log line 7)</td>" in table
    )
    assert "| retired: replaced by &lt;img src=x onerror=alert(1)>\\|p1 (its log ends at p0.log line 7) |" in row
    assert "<img" not in markup_outside_scripts(html) and "<img" not in md


@pytest.mark.parametrize(
    ("startup", "words"),
    [
        (
            {"end_reason": "shutdown", "end_file": "/x/p0.log", "end_line": 7.0, "source_file": "/x/p0.log"},
            "shut down (p0.log line 7)",
        ),
        (
            {"end_reason": "next_startup", "end_file": "/x/p0.2.log", "end_line": 1, "source_file": "/x/p0.log"},
            "restarted (p0.2.log line 1)",
        ),
        ({"end_reason": "log_end", "end_line": None, "successor": None}, "retired: replaced by another instance"),
        ({"end_reason": None, "last_ts": None, "last_line": 12}, "still running / log stops at line 12"),
        ({"end_reason": None}, "still running / log stops after its start"),
    ],
)
def test_how_a_startup_ended_in_words(startup, words):
    assert how_it_ended(startup) == words
