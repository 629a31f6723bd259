"""Issue 28, "also seen": a source file that resolves outside the incident folder ('..', a symbolic link among the
evidence) was read and its lines landed in quarantine.csv; a forged duplicate request id in an earlier file won
over the genuine one, silently. Files outside the folder need --allow-outside (or [settings] allow_outside) and are
listed in the manifest; conflicting duplicates where either copy decides a finding make the run inconclusive."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import INCIDENT, mini_requests, write_mini

from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core.errors import ConfigError


def _case(tmp_path: Path, incident: str = INCIDENT) -> tuple[Path, Path]:
    """The mini incident, and beside its folder a file its gateway folder links to (day0.jsonl, read first): a
    forged copy of the affected response r-leak with a small prompt, and of r-400 (no 2xx, flagged by no rule)."""
    rows = mini_requests()
    path = write_mini(tmp_path / "case", rows, incident)
    forged = [dict(r, prompt_tokens=1000) for r in rows if r["rid"] in ("r-leak", "r-400")]
    outside = tmp_path / "elsewhere" / "forged.jsonl"
    outside.parent.mkdir()
    outside.write_text("".join(json.dumps(r) + "\n" for r in forged))
    os.symlink(outside, tmp_path / "case" / "gateway" / "day0.jsonl")
    return path, outside


def test_a_file_outside_the_incident_folder_is_refused_unless_allowed(tmp_path, capsys):
    path, outside = _case(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"source 'gateway': 1 file\(s\) resolve outside the incident folder .* "
        r"allow it with --allow-outside or \[settings\] allow_outside = true",
    ):
        load_incident(path).source_files()
    assert main(["ingest", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    allowed = load_incident(write_mini(tmp_path / "case", None, INCIDENT + "\n[settings]\nallow_outside = true\n"))
    assert outside in [f.resolve() for _, files in allowed.source_files() for f in files]


def test_an_absolute_source_path_names_its_own_place(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "p0.log").write_text("x\n")
    incident = INCIDENT.replace('path = "engine/*.log"', f'path = "{tmp_path / "logs"}/*.log"')
    files = dict((s.name, f) for s, f in load_incident(write_mini(tmp_path / "case", None, incident)).source_files())
    assert files["engines"] == [tmp_path / "logs" / "p0.log"]


def test_allowed_outside_files_are_in_the_manifest_and_a_forged_duplicate_is_a_reason(tmp_path):
    path, outside = _case(tmp_path)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-pdf", "--allow-outside"]) == 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["outside_incident_folder"] == [str(outside.resolve())]
    reasons = {r["code"]: r for r in json.loads((out / "scope.json").read_text())["inconclusive_reasons"]}
    assert set(reasons) == {"conflicting_duplicate"}
    assert reasons["conflicting_duplicate"]["message"].startswith(
        "1 request id(s) logged more than once with different values where a copy decides a finding (first 'r-leak' "
        "at day1.jsonl line 401, kept the record at day0.jsonl:1)"
    )  # r-400's copies decide nothing
    assert reasons["conflicting_duplicate"]["evidence"]["request_ids"] == ["r-leak"]
