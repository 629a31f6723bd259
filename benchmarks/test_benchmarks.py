"""The benchmark harness works and the pandas baseline answers what kvforensics answers.

Not part of ``make test`` (its test path is ``tests/``); run with ``pytest benchmarks/``. Nothing
here asserts a timing: only that steps complete, peak RSS is per step, and the answers agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvforensics.core.fingerprint import WINNOW_WINDOW

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from measure import run_measured  # noqa: E402


def test_a_later_run_of_the_day_replaces_only_the_stages_it_ran(tmp_path: Path) -> None:
    from run import write_results

    write_results(5, {"runs": {"parquet": {"dataset": {"n": 1}, "ingest": {"steps": "first"}}}}, tmp_path)
    path = write_results(5, {"runs": {"parquet": {"dataset": {"n": 2}, "pipeline": {"steps": "second"}}}}, tmp_path)
    assert json.loads(path.read_text())["runs"]["parquet"] == {
        "dataset": {"n": 2},
        "ingest": {"steps": "first"},
        "pipeline": {"steps": "second"},
    }


def test_a_prefix_scenario_is_measured_in_the_pipeline_stage_into_its_own_results_file(tmp_path: Path) -> None:
    from run import parse_args, write_results

    args = parse_args(["--requests", "20000,100000", "--prefix-scenario", "prefix-l3-unsalted"])
    assert (args.stages, args.formats, args.requests) == (["pipeline"], ["jsonl"], [20000, 100000])
    path = write_results(
        20000, {"runs": {"prefix-l3-unsalted": {"pipeline": {"steps": []}}}}, tmp_path, "prefix-l3-unsalted"
    )
    assert path.name.endswith("-20000-prefix-l3-unsalted.json")
    assert list(json.loads(path.read_text())["runs"]) == ["prefix-l3-unsalted"]
    for refused in (["--stages", "ingest,pipeline"], ["--pandas-baseline"], ["--format", "parquet"]):
        with pytest.raises(SystemExit):
            parse_args(["--prefix-scenario", "prefix-l3-unsalted", *refused])


_LEAN_PARENT = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from measure import run_measured
log = Path(sys.argv[2])
big = run_measured([sys.executable, "-c", "x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096])"], log_path=log)
small = run_measured([sys.executable, "-c", "pass"], log_path=log)
print(json.dumps([big.ok, big.peak_rss_mb, small.ok, small.peak_rss_mb]))
"""


def test_peak_rss_is_the_childs_own(tmp_path: Path) -> None:
    """Measured from a parent as lean as the harness (this test process is not: Linux keeps a
    parent's RSS at the start in its child's high-water mark, see measure.py)."""
    done = subprocess.run(
        [sys.executable, "-c", _LEAN_PARENT, str(BENCH), str(tmp_path / "log")],
        check=True,
        capture_output=True,
        text=True,
    )
    big_ok, big, small_ok, small = json.loads(done.stdout)
    assert big_ok and small_ok
    assert big > 300
    assert small < 100


def test_a_step_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    m = run_measured([sys.executable, "-c", "import time; time.sleep(30)"], log_path=tmp_path / "log", timeout_s=1)
    assert m.returncode == -9
    assert m.wall_s < 10


def test_each_source_is_measured_against_its_own_floor() -> None:
    from run import stage_rows

    def step(name: str, seconds: float) -> dict:
        return {
            "step": name,
            "ok": True,
            "seconds": seconds,
            "rows": 10,
            "peak_rss_mb": 1.0,
            "other_cpu_seconds": 0,
            "process_seconds": seconds,
            "details": {},
        }

    pandas = step("pandas-sources", 9.0)
    pandas["details"] = {"phases": {"engine_lines": 4.0, "content": 5.0}}
    result = {
        "floors": ["floor-engine", "floor-content"],
        "floor_of": {"ingest-engine": "floor-engine", "ingest-content": "floor-content"},
        "steps": [
            step("floor-engine", 1.0),
            step("ingest-engine", 2.0),
            step("floor-content", 4.0),
            step("ingest-content", 10.0),
            pandas,
        ],
    }
    rows = {r["step"]: r for r in stage_rows("sources", result)}
    assert rows["ingest-engine"]["x"] == {"floor-engine": 2.0, "floor-content": None}
    assert rows["ingest-content"]["x"] == {"floor-engine": None, "floor-content": 2.5}
    assert rows["ingest-engine"]["pandas_x"] == 2.0 and rows["ingest-content"]["pandas_x"] == 0.5
    assert rows["pandas-sources"]["x"] == {"floor-engine": None, "floor-content": None}


def test_floors_and_pandas_do_the_same_work_on_engine_lines_and_content(tmp_path: Path) -> None:
    """On a streamed data set (every source written chunk by chunk), the floors extract as many
    per-request engine lines and hash as many shingles as the pandas baseline reads, and the pandas
    baseline keeps as many fingerprints as the content ingest (winnowing) and, with a window of 1, all."""
    from kvforensics.simulate import Scenario, simulate

    data = tmp_path / "data"
    simulate(Scenario(seed=5, requests=4_000, affected=12, page_simulation_max_requests=2_000), data)
    reports = {}
    for step, *extra in (
        ("floor-engine",),
        ("floor-content",),
        ("pandas-sources",),
        ("ingest", "--kinds", "content"),
        ("ingest", "--kinds", "content", "--winnow-window", "1"),
    ):
        label = "-".join([step, *extra[3:]])
        report = tmp_path / f"{label}.json"
        m = run_measured(
            [
                sys.executable,
                str(BENCH / "steps.py"),
                step,
                "--incident",
                str(data / "incident.toml"),
                "--report",
                str(report),
                "--out",
                str(tmp_path / label),
                *extra,
            ],
            log_path=tmp_path / "log",
        )
        assert m.ok, m.stderr_tail
        reports[label] = json.loads(report.read_text())
    engine, content, pandas = reports["floor-engine"], reports["floor-content"], reports["pandas-sources"]
    winnowed, every = reports["ingest"], reports["ingest-1"]
    truth = json.loads((data / "ground_truth.json").read_text())
    assert engine["abort_lines"] == pandas["engine_aborted_requests"] == len(truth["affected"]) == 12
    assert engine["stats_lines"] == pandas["engine_req_time_stats"] > 500
    assert engine["lines"] == pandas["engine_lines_read"]
    assert content["rows"] == pandas["content_records"] == engine["stats_lines"]  # one record per served request
    assert content["shingles"] == pandas["content_shingles"] == every["content_fingerprints"]  # no 8-word repeats
    assert winnowed["content_fingerprints"] == pandas["content_fingerprints"] < 0.6 * pandas["content_shingles"]
    assert winnowed["winnow_window"] == WINNOW_WINDOW > 1 and every["winnow_window"] == 1
    assert content["seconds"] > 0 and content["noncrypto_seconds"] > 0


@pytest.mark.slow
def test_small_run_completes_and_pandas_agrees(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--requests",
            "20000",
            "--format",
            "both",
            "--pandas-baseline",
            "--workdir",
            str(tmp_path / "work"),
            "--results-dir",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*-20000.json")
    doc = json.loads(path.read_text(encoding="utf-8"))
    for fmt in ("jsonl", "parquet"):
        run = doc["runs"][fmt]
        steps = run["ingest"]["steps"] + run["sources"]["steps"] + run["pipeline"]["steps"]
        assert [s["step"] for s in run["sources"]["steps"]] == [
            "floor-engine",
            "ingest-engine",
            "floor-content",
            "ingest-content",
            "pandas-sources",
        ]
        assert [s["step"] for s in steps if not s["ok"]] == []
        assert all(s["peak_rss_mb"] > 0 and s["rows"] > 0 for s in steps)
        assert run["pipeline"]["agreement"]["all_same"], run["pipeline"]["agreement"]
        assert run["pipeline"]["agreement"]["same"]["affected"]
        assert run["pipeline"]["agreement"]["same"]["content_fingerprints"]
