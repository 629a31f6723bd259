"""report.html in a real headless Chromium: renders, no console errors, no network, prints to PDF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvforensics.report.pdf import OFFLINE_FLAGS, find_chromium

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.mark.slow
def test_report_renders_offline_in_chromium(sample_run):
    from playwright.sync_api import sync_playwright

    scope = json.loads((sample_run / "scope.json").read_text())
    ARTIFACTS.mkdir(exist_ok=True)
    console_errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[a for a in OFFLINE_FLAGS if a != "--headless"])
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console_errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        url = (sample_run / "report.html").resolve().as_uri()
        page.goto(url, wait_until="load")
        assert console_errors == []
        assert requests == [url], "the report fetched something besides itself"
        # every chart rendered as an SVG with marks in it
        charts = page.query_selector_all("div.chart")
        assert charts, "no charts in the report"
        for chart in charts:
            svg = chart.query_selector("svg")
            assert svg is not None and svg.bounding_box()["width"] > 200
            assert len(chart.query_selector_all("path, rect, line")) > 5
        # the headline numbers are on the page
        assert page.inner_text("#fig-affected-responses").replace(",", "") == str(scope["affected_responses"])
        assert page.inner_text("#fig-affected-accounts").replace(",", "") == str(scope["affected_accounts"])
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        page.pdf(path=str(ARTIFACTS / "report.pdf"))
        browser.close()
    assert (ARTIFACTS / "report.pdf").stat().st_size > 10_000
    assert (sample_run / "report.pdf").exists(), "the run writes report.pdf when Chromium is available"
