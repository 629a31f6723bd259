"""One output folder holds one evidence set: re-runs with changed inputs rebuild it (or refuse, or
append when asked), outputs are put in place whole, --out never reads as input, one run at a time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import INCIDENT, mini_requests, write_mini

from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core.errors import ConfigError
from kvforensics.evidence.output_folder import LOCK_NAME, STAGING_NAME, check_out_dir
from kvforensics.investigation import Investigation

GENERATED = re.compile(rb"Generated \S+Z")


def run(incident: Path, out: Path, *flags: str) -> int:
    return main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf", *flags])


def outputs(out: Path) -> dict[str, bytes]:
    """Every output file, with what differs between two fresh runs of the same inputs (the run's times,
    the report's generation time and the hashes of the files holding it) taken out."""
    found: dict[str, bytes] = {}
    for path in sorted(out.rglob("*")):
        name = path.relative_to(out).as_posix()
        if path.is_dir() or name.startswith("evidence."):
            continue
        data = GENERATED.sub(b"Generated <time>", path.read_bytes())
        if name == "manifest.json":
            manifest = json.loads(data)
            manifest.pop("run")
            for report in ("report.html", "report.md"):  # their hashes: the files carry their generation time
                manifest.get("outputs", {}).pop(report, None)
            data = json.dumps(manifest, indent=2).encode()
        found[name] = data
    return found


def second_leak() -> dict:
    """Another request the exposed prefill instance served past its pool, from another account."""
    return dict(mini_requests()[-2], rid="r-leak-2", account_id="second-recipient", received_at="2026-08-28T10:00:30Z")


def notice_names(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in (out / "notices").rglob("*.md")}


def write_gateway(incident: Path, name: str, rows: list[dict]) -> Path:
    path = incident.parent / "gateway" / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_changed_account_rebuilds_to_what_a_fresh_folder_holds(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    assert "victim-recipient" in (tmp_path / "out" / "affected_requests.csv").read_text()
    rows = [dict(r, account_id="victim-renamed") if r["rid"] == "r-leak" else r for r in mini_requests()]
    write_gateway(incident, "day1.jsonl", rows)
    capsys.readouterr()
    assert main(["run", str(incident), "--out", str(tmp_path / "out"), "--no-pdf"]) == 0
    assert "evidence built afresh: 1 file(s) modified: gateway/day1.jsonl" in " ".join(capsys.readouterr().err.split())
    assert run(incident, tmp_path / "fresh") == 0
    assert outputs(tmp_path / "out") == outputs(tmp_path / "fresh")
    text = (tmp_path / "out" / "affected_requests.csv").read_text()
    assert "victim-renamed" in text and "victim-recipient" not in text
    assert not any("victim-recipient" in p.name for p in (tmp_path / "out" / "notices").rglob("*"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [i["file"] for i in manifest["inputs"]].count("gateway/day1.jsonl") == 1
    assert manifest["run"]["evidence"] == "rebuilt: the inputs changed (1 file(s) modified: gateway/day1.jsonl)"
    assert main(["verify", str(tmp_path / "out")]) == 0  # the rebuilt folder checks out against its inputs


def test_deleted_input_takes_its_responses_with_it(tmp_path: Path) -> None:
    incident = write_mini(tmp_path / "mini")
    leak2 = second_leak()
    day2 = write_gateway(incident, "day2.jsonl", [leak2])
    assert run(incident, tmp_path / "out") == 0
    assert "r-leak-2" in (tmp_path / "out" / "affected_requests.csv").read_text()
    day2.unlink()
    assert run(incident, tmp_path / "out") == 0
    assert "r-leak-2" not in (tmp_path / "out" / "affected_requests.csv").read_text()
    assert "day2" not in json.dumps(outputs(tmp_path / "out")["manifest.json"].decode())
    assert run(incident, tmp_path / "fresh") == 0
    assert outputs(tmp_path / "out") == outputs(tmp_path / "fresh")


def test_same_incident_id_from_another_folder_is_fresh_evidence(tmp_path: Path) -> None:
    first = write_mini(tmp_path / "first")
    second = write_mini(tmp_path / "second", rows=[r for r in mini_requests() if r["rid"] != "r-leak"])
    assert run(first, tmp_path / "out") == 0
    assert run(second, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "a different incident file" in manifest["run"]["evidence"]
    assert str(tmp_path / "first") not in outputs(tmp_path / "out")["manifest.json"].decode()
    assert run(second, tmp_path / "fresh") == 0
    assert outputs(tmp_path / "out") == outputs(tmp_path / "fresh")


def test_a_smaller_rerun_leaves_no_stale_notice(tmp_path: Path) -> None:
    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    before = notice_names(tmp_path / "out")
    assert any(n.startswith("notices/customers/victim-recipient") for n in before)
    write_gateway(incident, "day1.jsonl", [r for r in mini_requests() if r["rid"] != "r-leak"])
    assert run(incident, tmp_path / "out") == 0
    after = notice_names(tmp_path / "out")
    assert len(after) < len(before)
    assert run(incident, tmp_path / "fresh") == 0
    assert after == notice_names(tmp_path / "fresh")


def test_no_rebuild_refuses_changed_inputs(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    assert run(incident, tmp_path / "out", "--no-rebuild") == 0  # unchanged inputs: nothing to refuse
    write_gateway(incident, "day1.jsonl", mini_requests(seed=2))
    capsys.readouterr()
    assert run(incident, tmp_path / "out", "--no-rebuild") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"Error: the inputs changed since {tmp_path / 'out'} was built "
        "(1 file(s) modified: gateway/day1.jsonl): run without --no-rebuild"
    )


def test_append_adds_new_files_and_refuses_anything_else(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    leak2 = second_leak()
    write_gateway(incident, "day2.jsonl", [leak2])
    assert run(incident, tmp_path / "out", "--append") == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["run"]["evidence"] == "appended: 1 file(s) added: gateway/day2.jsonl"
    assert [i["file"] for i in manifest["inputs"]].count("gateway/day1.jsonl") == 1
    assert "r-leak-2" in (tmp_path / "out" / "affected_requests.csv").read_text()
    assert run(incident, tmp_path / "fresh") == 0
    assert json.loads(outputs(tmp_path / "out")["scope.json"]) == json.loads(outputs(tmp_path / "fresh")["scope.json"])
    write_gateway(incident, "day1.jsonl", mini_requests(seed=3))
    capsys.readouterr()
    assert run(incident, tmp_path / "out", "--append") == 2
    assert "Error: --append only adds files, but the inputs changed" in capsys.readouterr().err
    assert "r-leak-2" in (tmp_path / "out" / "affected_requests.csv").read_text()  # nothing was touched


@pytest.mark.parametrize("inside", ["gateway", "gateway/../gateway", "engine"])
def test_out_inside_the_inputs_is_refused(tmp_path: Path, capsys, inside: str) -> None:
    incident = write_mini(tmp_path / "mini")
    assert run(incident, incident.parent / inside) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is inside the inputs of source" in err
    assert not list((incident.parent / "gateway").glob("*.csv"))


def test_out_beside_the_inputs_is_accepted(tmp_path: Path) -> None:
    incident = write_mini(tmp_path / "mini")
    check_out_dir(incident.parent / "out", load_incident(incident))  # gateway/*.jsonl cannot reach it
    check_out_dir(incident.parent / "gateway" / "run1", load_incident(incident))  # nor files one folder deeper
    assert run(incident, incident.parent / "out") == 0
    assert run(incident, incident.parent / "out", "--no-rebuild") == 0  # the next run reads the same inputs


@pytest.mark.parametrize(
    ("path", "out"),
    [("logs", "logs/out"), ("logs/**/*.log", "logs/a/b"), ("*/*.log", "logs"), ("**", "logs/out"), ("*.log", ".")],
)
def test_out_that_a_source_path_reaches_is_refused(tmp_path: Path, path: str, out: str) -> None:
    incident = write_mini(tmp_path / "mini", incident=INCIDENT.replace('path = "engine/*.log"', f'path = "{path}"'))
    (incident.parent / "logs").mkdir()
    with pytest.raises(ConfigError, match="source 'engines'"):
        check_out_dir(incident.parent / out, load_incident(incident))


def test_out_naming_a_file_is_refused(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    target = tmp_path / "report.txt"
    target.write_text("keep me")
    assert run(incident, target) == 2
    assert capsys.readouterr().err == (
        f"Error: --out {target} is a file, not a folder: name a folder (it is created if missing)\n"
    )
    assert target.read_text() == "keep me"


def test_a_second_run_into_the_same_folder_is_refused(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(f"{holder.pid} {os.uname().nodename}\n")
        assert run(incident, out) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.startswith(f"Error: another kvforensics run (pid {holder.pid}) is writing to {out}")
        assert not (out / "evidence.duckdb").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run(incident, out) == 0  # its process is gone: the lock is stale and taken over
    assert not (out / LOCK_NAME).exists()


def test_a_live_run_holds_the_lock_against_another_process(tmp_path: Path) -> None:
    incident = write_mini(tmp_path / "mini")
    inv = Investigation.open(incident, tmp_path / "out", progress=False)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvforensics.cli",
                "run",
                str(incident),
                "--out",
                str(tmp_path / "out"),
                "--quiet",
                "--no-pdf",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert f"another kvforensics run (pid {os.getpid()})" in done.stderr
    finally:
        inv.close()
    assert not (tmp_path / "out" / LOCK_NAME).exists()


def test_an_interrupted_report_leaves_the_previous_outputs_whole(tmp_path: Path, monkeypatch) -> None:
    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    before = outputs(tmp_path / "out")
    from kvforensics.report import render

    def broken(out_dir: Path) -> None:
        (out_dir / "report.html").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(render, "render_pdf", broken)
    with pytest.raises(KeyboardInterrupt):
        Investigation.open(incident, tmp_path / "out", progress=False).run()
    assert outputs(tmp_path / "out") == before
    assert not (tmp_path / "out" / STAGING_NAME).exists() and not (tmp_path / "out" / LOCK_NAME).exists()


def test_outputs_are_renamed_into_place(tmp_path: Path) -> None:
    """Each output is written under the staging folder and renamed: a file open before the re-run
    keeps its old contents (a new inode replaced it), the folder ends with no staging left."""
    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    scope = tmp_path / "out" / "scope.json"
    inode = scope.stat().st_ino
    assert run(incident, tmp_path / "out") == 0
    assert scope.stat().st_ino != inode
    assert not (tmp_path / "out" / STAGING_NAME).exists()


def test_fresh_never_empties_a_folder_another_run_holds(tmp_path: Path) -> None:
    from kvforensics.investigation import run as run_investigation

    incident = write_mini(tmp_path / "mini")
    assert run(incident, tmp_path / "out") == 0
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "out" / LOCK_NAME).write_text(f"{holder.pid} {os.uname().nodename}\n")
        with pytest.raises(ConfigError, match="another kvforensics run"):
            run_investigation(incident, tmp_path / "out", fresh=True, progress=False, pdf=False)
        assert (tmp_path / "out" / "evidence.duckdb").exists() and (tmp_path / "out" / "scope.json").exists()
    finally:
        holder.kill()
        holder.wait()
