"""report.html in a real headless Chromium: renders, no console errors, no network, prints to PDF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import INCIDENT, mini_requests, write_mini

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
        # every chart rendered as an SVG with marks in it (the live ones drawn in place of their static SVG)
        page.wait_for_selector("#chart-timeline.live", timeout=20_000)
        page.wait_for_selector("#chart-accounts.live", timeout=20_000)
        charts = page.query_selector_all("div.chart")
        assert charts, "no charts in the report"
        for chart in charts:
            (svg,) = [s for s in chart.query_selector_all("svg") if s.is_visible()]
            assert svg.bounding_box()["width"] > 200
            assert len(svg.query_selector_all("path, rect, line")) > 5
        ids = page.eval_on_selector_all("[id]", "els => els.map(e => e.id)")
        assert sorted(ids) == sorted(set(ids)), "duplicate ids: a chart's clip path would resolve to another's"
        check_timeline_zooms_and_brushes(page)
        check_account_picker_filters(page)
        # the headline numbers are on the page
        assert page.inner_text("#fig-affected-responses").replace(",", "") == str(scope["affected_responses"])
        assert page.inner_text("#fig-affected-accounts").replace(",", "") == str(scope["affected_accounts"])
        assert console_errors == [] and requests == [url]
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        page.emulate_media(media="print")  # printed: the static charts, not the live ones
        assert page.is_visible("#chart-timeline .static-view svg")
        assert not page.is_visible("#chart-timeline .live-view")
        page.pdf(path=str(ARTIFACTS / "report.pdf"))
        browser.close()
    assert (ARTIFACTS / "report.pdf").stat().st_size > 10_000
    assert (sample_run / "report.pdf").exists(), "the run writes report.pdf when Chromium is available"


def _axis_labels(page, selector: str) -> list[str]:
    return page.eval_on_selector_all(
        f"{selector} .live-view svg .role-axis-label text", "els => els.map(e => e.textContent)"
    )


def check_timeline_zooms_and_brushes(page) -> None:
    """Scrolling over the timeline zooms its time axis (a selection bound to scales); dragging across the
    hourly bars draws the brush (the interval selection ``period``)."""
    live = page.query_selector("#chart-timeline .live-view svg")
    live.scroll_into_view_if_needed()
    box = live.bounding_box()
    before = _axis_labels(page, "#chart-timeline")
    page.mouse.move(box["x"] + box["width"] * 0.45, box["y"] + 80)
    page.mouse.wheel(0, -400)
    page.wait_for_timeout(300)
    assert _axis_labels(page, "#chart-timeline") != before, "scrolling did not zoom the timeline"
    page.dblclick("#chart-timeline .live-view svg", position={"x": box["width"] * 0.45, "y": 80})  # reset
    brush = page.query_selector("#chart-timeline .live-view svg g.period_brush path")
    assert brush is not None, "no brush (selection 'period') on the hourly bars"
    y = box["y"] + box["height"] - 70  # inside the hourly bars' plot
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
    page.mouse.up()
    assert brush.bounding_box() is not None and brush.bounding_box()["width"] > 20, "dragging drew no brush"


def check_account_picker_filters(page) -> None:
    """Picking an account in the per-account view's list leaves only that account's responses drawn."""
    dots = "#chart-accounts .live-view svg g.mark-symbol.role-mark path"  # the responses (not legend symbols)
    all_dots = len(page.query_selector_all(dots))
    options = page.eval_on_selector_all("#chart-accounts .live-view select option", "os => os.map(o => o.text)")
    assert options[0] == "all listed accounts" and len(options) > 2
    page.select_option("#chart-accounts .live-view select", label=options[2])  # the second most affected
    page.wait_for_timeout(300)
    assert 0 < len(page.query_selector_all(dots)) < all_dots
    page.select_option("#chart-accounts .live-view select", label=options[0])


@pytest.mark.slow
def test_untrusted_strings_stay_text_in_the_live_charts(tmp_path):
    """An account id and a model name written as markup are shown as text by the live charts (list,
    axis, tooltips): no element, script or request comes from them."""
    from playwright.sync_api import sync_playwright

    from kvforensics.investigation import run

    evil_account, evil_model = '<img data-evil src=x onerror="alert(1)">', "</script><b data-evil>m</b>"
    rows = mini_requests()
    for r in rows:
        r["model"] = evil_model
        if r["rid"] == "r-leak":
            r["account_id"] = evil_account
    out = tmp_path / "out"
    run(
        write_mini(tmp_path / "data", rows, INCIDENT.replace('"@cf/zai-org/glm-5.3"', json.dumps(evil_model))),
        out,
        progress=False,
        pdf=False,
    )
    events: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[a for a in OFFLINE_FLAGS if a != "--headless"])
        page = browser.new_page()
        page.on("console", lambda m: events.append(f"console {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: events.append(f"error {e}"))
        page.on("dialog", lambda d: (events.append(f"dialog {d.message}"), d.dismiss()))
        url = (out / "report.html").resolve().as_uri()
        page.on("request", lambda r: events.append(f"request {r.url}") if r.url != url else None)
        page.goto(url, wait_until="load")
        page.wait_for_selector("#chart-accounts.live", timeout=20_000)
        page.wait_for_selector("#chart-timeline.live", timeout=20_000)
        options = page.eval_on_selector_all("#chart-accounts .live-view select option", "os => os.map(o => o.text)")
        assert evil_account in options
        page.select_option("#chart-accounts .live-view select", label=evil_account)
        for mark in page.query_selector_all(".live-view svg g.mark-symbol.role-mark path")[:5]:  # tooltips
            mark.scroll_into_view_if_needed()
            mark.hover(force=True)
        assert page.query_selector_all("img, [data-evil]") == [] and events == []
        browser.close()


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["vllm-unified", "sglang-pd"])
def test_the_report_reads_back_in_a_browser_as_the_evidence_says(shapes, shape):
    """Issue 27: report.html read back as a reader sees it. Every section of the navigation is there and reachable,
    the headline figures and the exposure windows are scope.json's, the text about the deployment is the evidence's
    (no disaggregated story for a unified server, no restart that did not happen), and nothing is fetched."""
    from playwright.sync_api import sync_playwright

    code, out = shapes[shape]
    scope = json.loads((out / "scope.json").read_text())
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[a for a in OFFLINE_FLAGS if a != "--headless"])
        page = browser.new_page()
        page.on("request", lambda r: requests.append(r.url))
        url = (out / "report.html").resolve().as_uri()
        page.goto(url, wait_until="load")
        targets = page.eval_on_selector_all("nav a", "as => as.map(a => a.getAttribute('href'))")
        assert len(targets) == 10
        for target in targets:  # every section the navigation lists exists and has a visible heading
            assert page.is_visible(f"{target} h2"), target
        text = page.inner_text("body")
        assert page.inner_text("#fig-affected-responses").replace(",", "") == str(scope["affected_responses"])
        rows = page.eval_on_selector_all("#t-exposure tbody tr", "rs => rs.map(r => r.cells[0].innerText)")
        assert rows == ([w["instance"] for w in scope["exposure_windows"]] or ["none"])
        deployment = page.inner_text("#deployment")
        if shape == "vllm-unified":
            assert code == 3 and page.is_visible("#inconclusive") and "admission_contradicted" in text
            assert "prefill" not in deployment and "No start-up's KV pool was below" in deployment
            assert "Model server" not in page.inner_text("#measures")  # no derived restart: none happened
            assert "vllm" in text and "0.5.22" not in page.inner_text("#measures")
        else:
            assert "p0 (prefill, sglang" in deployment
            assert "Model server p0 was restarted on 9 Sep 2026 12:00 UTC" in page.inner_text("#measures")
            assert "Notices are sent by Example Inference Ltd" in page.inner_text("#notification")
        assert requests == [url]
        browser.close()
