"""What `kvforensics audit` exits with: 1 when a start-up in the logs was exposed (now or before), and with
``--now`` only while an exposed start-up is still in force; 0 clean; 2 nothing to audit."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforensics.audit import audit_paths
from kvforensics.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
RESTARTED = [FIXTURES / "audit" / "glm53-prefill-0.log", FIXTURES / "audit" / "glm53-decode-0.log"]
IN_FORCE = [FIXTURES / "engine_logs" / "sglang-0.5.15-pd-prefill-tp8.log"]
CLEAN = [FIXTURES / "engine_logs" / "sglang-0.5.23-ray-post-capture.log"]


def audit(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    code = main(["audit", *map(str, args)])
    out, err = capsys.readouterr()
    assert err == ""
    return code, out


def test_exposure_that_has_ended_exits_1_and_0_with_now(capsys: pytest.CaptureFixture[str]) -> None:
    report = audit_paths(RESTARTED)
    windows = report.exposure_windows
    assert windows and not any(w.in_force for w in windows)
    code, out = audit(capsys, *RESTARTED)
    assert code == 1  # exposed in the audited period
    assert "Not exposed now: every exposed start-up has ended (2 restarted)." in out
    assert out.count("FAIL (exposed)") == len(windows)  # the past windows are listed
    code, now_out = audit(capsys, "--now", *RESTARTED)
    assert code == 0 and now_out == out  # the deploy gate passes; the table is the same


def test_exposure_still_in_force_exits_1_either_way(capsys: pytest.CaptureFixture[str]) -> None:
    assert audit_paths(IN_FORCE).exposed_now
    for args in ([], ["--now"], ["--now", "--json"]):
        code, out = audit(capsys, *args, *IN_FORCE)
        assert code == 1 and "EXPOSED NOW" in out


def test_clean_exits_0_and_nothing_to_audit_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert audit(capsys, *CLEAN)[0] == 0
    assert audit(capsys, "--now", *CLEAN)[0] == 0
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert audit(capsys, empty)[0] == 2
    assert audit(capsys, "--now", empty)[0] == 2


@pytest.mark.parametrize(
    "path",
    sorted((FIXTURES / "engine_logs").glob("*.log")) + sorted((FIXTURES / "audit").glob("*.log")),
    ids=lambda p: p.name,
)
def test_a_check_1_fail_is_never_under_not_exposed(capsys: pytest.CaptureFixture[str], path: Path) -> None:
    """Issue 27, observation 4: the audit's table and its headline tell one story. A start-up whose check 1
    FAILs is exposed: the headline says EXPOSED, the exit status is 1, and with --now 1 while it is in force;
    a start-up that is not exposed has no check-1 FAIL (a unified server's pool below its context is n/a)."""
    code, out = audit(capsys, "--year", "2026", path)
    report = audit_paths([path], year=2026)
    fails = [v for v in report.verdicts if v.check == 1 and v.status == "fail"]
    assert all(v.exposed for v in fails)
    if fails:
        assert "Not exposed." not in out and "EXPOSED:" in out and code == 1
        now_code, _ = audit(capsys, "--now", "--year", "2026", path)
        assert now_code == (1 if any(v.in_force for v in fails) else 0)
    else:
        assert code == 0 and "Not exposed." in out
