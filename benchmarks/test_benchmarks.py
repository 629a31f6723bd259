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

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from measure import run_measured  # noqa: E402


def test_a_later_run_of_the_day_replaces_only_the_stages_it_ran(tmp_path: Path) -> None:
    from run import write_results

    write_results(5, {"runs": {"parquet": {"dataset": {"n": 1}, "ingest": {"steps": "first"}}}}, tmp_path)
    path = write_results(5, {"runs": {"parquet": {"dataset": {"n": 2}, "pipeline": {"steps": "second"}}}}, tmp_path)
    assert json.loads(path.read_text())["runs"]["parquet"] == {
        "dataset": {"n": 2}, "ingest": {"steps": "first"}, "pipeline": {"steps": "second"}}


def test_peak_rss_is_the_childs_own(tmp_path: Path) -> None:
    big = run_measured([sys.executable, "-c", "x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096])"],
                       log_path=tmp_path / "log")
    small = run_measured([sys.executable, "-c", "pass"], log_path=tmp_path / "log")
    assert big.ok and small.ok
    assert big.peak_rss_mb > 300
    assert small.peak_rss_mb < 100


def test_a_step_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    m = run_measured([sys.executable, "-c", "import time; time.sleep(30)"], log_path=tmp_path / "log", timeout_s=1)
    assert m.returncode == -9
    assert m.wall_s < 10


@pytest.mark.slow
def test_small_run_completes_and_pandas_agrees(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--requests", "20000", "--format", "both", "--pandas-baseline",
         "--workdir", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*-20000.json")
    doc = json.loads(path.read_text(encoding="utf-8"))
    for fmt in ("jsonl", "parquet"):
        run = doc["runs"][fmt]
        steps = run["ingest"]["steps"] + run["pipeline"]["steps"]
        assert [s["step"] for s in steps if not s["ok"]] == []
        assert all(s["peak_rss_mb"] > 0 and s["rows"] > 0 for s in steps)
        assert run["pipeline"]["agreement"]["all_same"], run["pipeline"]["agreement"]
        assert run["pipeline"]["agreement"]["same"]["affected"]
