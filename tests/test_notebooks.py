"""The notebooks are the responder's runbook: stored clean, each runs on its own on a fresh output folder, they
read the sample's investigation top to bottom, every number their text quotes is one a cell computes, and
their exported HTML needs no network."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvforensics.evidence.output_folder import LOCK_NAME

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
STAGES = {"01-ingest": "ingest", "02-detect": "detect", "03-scope": "scope", "04-report": "report"}


def cells(nb_path: Path, kind: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(nb_path.read_text())["cells"] if c["cell_type"] == kind]


def execute(nb_path: Path, incident: Path | None, out_dir: Path | None, executed: Path) -> dict:
    """Run a notebook with papermill; without *incident* and *out_dir* its first cell's defaults apply (the
    environment's KVFORENSICS_INCIDENT and KVFORENSICS_OUT, else the sample)."""
    import papermill

    parameters = {"incident": str(incident), "out_dir": str(out_dir)} if incident is not None else {}
    papermill.execute_notebook(
        str(nb_path),
        str(executed),
        kernel_name="python3",
        parameters=parameters,
        cwd=str(nb_path.parent),
        progress_bar=False,
    )
    return json.loads(executed.read_text())


def cell_outputs(nb: dict, source: str) -> str:
    """The outputs (plain and HTML) of the code cell whose last line is *source*."""
    (cell,) = [
        c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip().splitlines()[-1] == source
    ]
    return outputs_text({"cells": [cell]})


def outputs_text(nb: dict) -> str:
    """Every output of an executed notebook as text (plain and HTML)."""
    parts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            for mime in ("text/plain", "text/html"):
                parts.append("".join(out.get("data", {}).get(mime, "")))
    return "\n".join(parts)


def test_notebooks_are_stored_clean():
    assert [p.stem for p in NOTEBOOKS] == list(STAGES)
    for nb_path in NOTEBOOKS:
        nb = json.loads(nb_path.read_text())
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{nb_path.name}: exactly one parameters cell"
        assert {"incident", "out_dir"} <= set(re.findall(r"^(\w+) =", "".join(tagged[0]["source"]), re.M))
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs"), f"{nb_path.name} is stored with outputs"
                assert "def " not in "".join(cell["source"]), f"{nb_path.name} defines functions"


def test_each_notebook_opens_or_builds_its_stage_and_pastes_no_sql():
    for nb_path in NOTEBOOKS:
        code = cells(nb_path, "code")
        first = code[1]  # after the parameters
        assert f'Investigation.open_or_build(incident, out_dir, through="{STAGES[nb_path.stem]}"' in first
        assert "explore.offline_charts()" in first, "charts drawn offline from the first cell on"
        assert code[-1].strip() == "inv.close()"
        for source in code:
            assert not re.search(r"\b(SELECT|FROM|JOIN)\b|\.query\(|\.execute\(", source), (
                f"{nb_path.name}: SQL in a cell ({source[:60]!r}); drill-downs belong in kvforensics.explore"
            )


def test_the_runbook_explains_each_stage():
    for nb_path in NOTEBOOKS:
        text = "\n".join(cells(nb_path, "markdown"))
        assert len(cells(nb_path, "markdown")) >= len(cells(nb_path, "code")) // 2, f"{nb_path.name}: little prose"
        assert "How to read it" in text and "## Next" in text, nb_path.name
    scope = "\n".join(cells(ROOT / "notebooks" / "03-scope.ipynb", "markdown"))
    assert "which of our customers received foreign data, when, and whose data could it have been" in scope


@pytest.fixture(scope="module")
def executed_on_sample(sample_run, sample_incident, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The four notebooks executed in order on a copy of the sample's built output folder (they only read it)."""
    base = tmp_path_factory.mktemp("notebooks")
    folder = base / "out"
    shutil.copytree(sample_run, folder)
    runs = {}
    for nb_path in NOTEBOOKS:
        executed = base / nb_path.name
        runs[nb_path.stem] = (executed, execute(nb_path, sample_incident, folder, executed))
    return runs


@pytest.mark.slow
def test_notebooks_read_the_sample(executed_on_sample, sample_run):
    scope = json.loads((sample_run / "scope.json").read_text())
    for name, (_, nb) in executed_on_sample.items():
        errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, name
    answer = outputs_text(executed_on_sample["03-scope"][1])
    headline = f"{scope['affected_accounts']} accounts received {scope['affected_responses']:,} affected responses"
    assert headline in answer
    # 04 shows every model's money chart, the whole report and the output files
    report = outputs_text(executed_on_sample["04-report"][1])
    models = [m for m, n in scope["responses_by_model"].items() if n]
    assert all(json.dumps(m)[1:-1] in report for m in models)
    assert "srcdoc=" in report and "report.html" in report and "manifest.json" in report


@pytest.mark.slow
def test_numbers_the_text_quotes_are_computed(executed_on_sample):
    for name, (_, nb) in executed_on_sample.items():
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        shown = outputs_text(nb)
        for number in re.findall(r"\*\*([\d,.]+)\*\*", text):
            assert re.search(rf"(?<![\d,]){re.escape(number)}(?![\d,])", shown), (
                f"{name} quotes {number} but no cell output shows it"
            )


@pytest.mark.slow
def test_exported_html_loads_nothing_from_the_network(executed_on_sample, tmp_path):
    from kvforensics.explore import export_html

    for name, (executed, nb) in executed_on_sample.items():
        assert "cdn.jsdelivr" not in outputs_text(nb) and not re.search(r"<script[^>]*\ssrc=", outputs_text(nb))
        html = export_html(executed, tmp_path / f"{name}.html").read_text()
        assert not re.search(r"<script[^>]*\ssrc=", html), f"{name}: a script loaded from elsewhere"
        assert not re.search(r"""import\s*\(?\s*["']https?:|<link[^>]+href=["']https?:""", html), name
        assert "window.vegaEmbed" in html


@pytest.mark.slow
def test_exported_charts_draw_offline_in_chromium(executed_on_sample, tmp_path):
    from kvforensics.explore import export_html
    from kvforensics.report.pdf import OFFLINE_FLAGS, find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    html = export_html(executed_on_sample["03-scope"][0], tmp_path / "03-scope.html")
    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        args = [a for a in OFFLINE_FLAGS if a != "--headless"]
        browser = p.chromium.launch(executable_path=chromium, args=args)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(html.resolve().as_uri(), wait_until="load")
        page.wait_for_function("document.querySelectorAll('div[id^=kvf-chart-] svg').length >= 3", timeout=30_000)
        charts = page.query_selector_all("div[id^=kvf-chart-]")
        assert len(charts) >= 3 and all(len(c.query_selector_all("svg path")) > 5 for c in charts)
        browser.close()
    assert errors == [] and requests == [html.resolve().as_uri()]


def test_section_references_name_their_sections():
    """Issue 27, observation 10: "section 7" was cited where notify is section 8. Every "section N" of a notebook is
    one of its "## N." headings, and one cited for notifying, exploitation or drilling is that section."""
    topics = {"notify": "notify", "exploitation": "Exploitation", "account": "account"}
    for nb_path in NOTEBOOKS:
        text = "\n".join(cells(nb_path, "markdown") + cells(nb_path, "code"))
        headings = dict(re.findall(r"^## (\d+)\. (.*)$", text, re.M))
        for before, number in re.findall(r"(\w+)\W{1,3}\(?section (\d+)", text):
            assert number in headings, f"{nb_path.name}: section {number} does not exist"
            if before in topics:
                assert topics[before] in headings[number], f"{nb_path.name}: {before} (section {number})"


def test_the_first_cell_reads_the_incident_and_folder_from_the_environment():
    """Observation 10: out_dir could only be set through papermill or by editing a cell."""
    for nb_path in NOTEBOOKS:
        (first,) = [
            c for c in json.loads(nb_path.read_text())["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])
        ]
        namespace: dict = {}
        import os

        env = {"KVFORENSICS_INCIDENT": "/cases/x/incident.toml", "KVFORENSICS_OUT": "/cases/x/out"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            exec("".join(first["source"]), namespace)  # noqa: S102 - the notebook's own first cell
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert (namespace["incident"], namespace["out_dir"]) == ("/cases/x/incident.toml", "/cases/x/out")
        namespace = {}
        exec("".join(first["source"]), namespace)  # noqa: S102
        assert (namespace["incident"], namespace["out_dir"]) == ("../data/sample/incident.toml", "../reports/sample")


@pytest.mark.slow
def test_notebook_outputs_are_short_and_clean(executed_on_sample, sample_run):
    """Observation 10: the inv cell printed ~18,000 characters and the audit cell ~100,000, counts showed as
    floats (23.0), cells as None or NaN, and the first source of a response was the recipient's own request."""
    ingest = executed_on_sample["01-ingest"][1]
    assert len(cell_outputs(ingest, "inv")) < 1000
    assert len(cell_outputs(ingest, "audit")) < 25_000
    assert not re.search(
        r"<td>\d+\.0</td>", cell_outputs(ingest, "explore.loaded(inv.con, inv.incident.max_quarantine_fraction)")
    )
    for name, (_, nb) in executed_on_sample.items():
        html = outputs_text(nb)
        assert not re.findall(r"<td>(None|NaN|nan|NaT|&lt;NA&gt;)</td>", html), name
    scope_nb = executed_on_sample["03-scope"][1]
    sources = cell_outputs(scope_nb, "explore.response_sources(inv.con, example.response)")
    recipient = re.search(r"other than the recipient ([\w-]+);", sources).group(1)
    assert f"<td>{recipient}</td>" not in sources


@pytest.mark.slow
@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_notebook_runs_alone_on_a_fresh_folder(nb_path, mini_incident, tmp_path, monkeypatch):
    """Each notebook on its own, the incident and folder given by the environment (no papermill parameter)."""
    out_dir = tmp_path / "fresh"
    monkeypatch.setenv("KVFORENSICS_INCIDENT", str(mini_incident))
    monkeypatch.setenv("KVFORENSICS_OUT", str(out_dir))
    nb = execute(nb_path, None, None, tmp_path / nb_path.name)
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert (out_dir / "evidence.duckdb").is_file()
    assert (out_dir / "scope.json").is_file() == (STAGES[nb_path.stem] in ("scope", "report"))
    assert (out_dir / "report.html").is_file() == (STAGES[nb_path.stem] == "report")
    assert not (out_dir / LOCK_NAME).exists(), "the last cell releases the folder"
