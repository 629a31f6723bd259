"""Stage commands one at a time: each writes the outputs of the stages it has, and one run out of order
says which command to run first (issue 13, observation 11)."""

from __future__ import annotations

import json
from pathlib import Path

from kvforensics.cli import main


def _cmd(name: str, incident: Path, out: Path, *extra: str) -> int:
    return main([name, str(incident), "--out", str(out), "--quiet", *extra])


def test_stages_out_of_order_say_which_command_to_run_first(mini_incident, tmp_path, capsys):
    out = tmp_path / "out"
    assert _cmd("detect", mini_incident, out) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"holds no output of 'ingest' yet: run `kvforensics ingest {mini_incident.name} --out {out}` first" in err
    assert _cmd("scope", mini_incident, out) == 2
    assert "holds no output of 'detect' yet" in capsys.readouterr().err
    assert _cmd("report", mini_incident, out, "--no-pdf") == 2
    assert "holds no output of 'detect' yet" in capsys.readouterr().err
    assert _cmd("ingest", mini_incident, out) == 0
    assert _cmd("scope", mini_incident, out) == 2  # ingested, not yet detected
    assert "run `kvforensics detect" in capsys.readouterr().err


def test_scope_writes_its_outputs_and_report_adds_the_report(mini_incident, tmp_path):
    out = tmp_path / "out"
    for stage in ("ingest", "detect"):
        assert _cmd(stage, mini_incident, out) == 0
    assert not (out / "scope.json").exists()
    assert _cmd("scope", mini_incident, out) == 0
    for name in ("scope.json", "affected_requests.csv", "notifications.csv", "quarantine.csv", "manifest.json"):
        assert (out / name).is_file(), name
    assert not (out / "report.html").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert "scope.json" in json.dumps(manifest["outputs"])
    assert _cmd("report", mini_incident, out, "--no-pdf") == 0
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    assert main(["verify", str(out)]) == 0
    # the same figures as a whole run into a fresh folder
    fresh = tmp_path / "fresh"
    assert main(["run", str(mini_incident), "--out", str(fresh), "--quiet", "--no-pdf"]) == 0
    assert json.loads((out / "scope.json").read_text()) == json.loads((fresh / "scope.json").read_text())
    assert (out / "affected_requests.csv").read_bytes() == (fresh / "affected_requests.csv").read_bytes()


def test_scope_alone_removes_a_report_of_an_earlier_scope(mini_incident, tmp_path):
    out = tmp_path / "out"
    assert main(["run", str(mini_incident), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    assert (out / "report.html").is_file()
    assert _cmd("scope", mini_incident, out) == 0
    assert not (out / "report.html").exists() and not (out / "notices").exists()
