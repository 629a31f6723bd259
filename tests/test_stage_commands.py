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


def test_report_after_scope_reuses_it(mini_incident, tmp_path, monkeypatch, capsys):
    """Issue 26: `report` on a folder whose scope is of the same incident file and evidence writes the report
    without computing the scope again; scope.json, the CSVs and the manifest's scope stay as scope wrote them."""
    import kvforensics.investigation

    out = tmp_path / "out"
    for stage in ("ingest", "detect", "scope"):
        assert _cmd(stage, mini_incident, out) == 0
    scope_json = (out / "scope.json").read_bytes()
    key = json.loads((out / "manifest.json").read_text())["run"]["scope_key"]

    def no_scope(*_args, **_kwargs):
        raise AssertionError("the scope was computed again")

    monkeypatch.setattr(kvforensics.investigation, "scope", no_scope)
    assert main(["report", str(mini_incident), "--out", str(out), "--no-pdf"]) == 0
    printed = " ".join(capsys.readouterr().err.split())  # progress goes to stderr
    assert "scope: reused (the folder's scope is of the same incident file and evidence)" in printed
    assert (out / "report.html").is_file() and (out / "notices").is_dir()
    assert (out / "scope.json").read_bytes() == scope_json
    assert json.loads((out / "manifest.json").read_text())["run"]["scope_key"] == key
    assert main(["verify", str(out)]) == 0  # the manifest covers the report and the reused outputs
    assert _cmd("report", mini_incident, out, "--no-pdf") == 0  # and again, after a report


def test_report_computes_the_scope_again_when_the_evidence_or_incident_changed(mini_incident, tmp_path, monkeypatch):
    import kvforensics.investigation

    out = tmp_path / "out"
    for stage in ("ingest", "detect", "scope"):
        assert _cmd(stage, mini_incident, out) == 0
    runs = []
    real_scope = kvforensics.investigation.scope

    def counted_scope(*args, **kwargs):
        runs.append(1)
        return real_scope(*args, **kwargs)

    monkeypatch.setattr(kvforensics.investigation, "scope", counted_scope)
    analysed = json.loads((out / "scope.json").read_text())["analysed_period"]["requests"]
    # an input file added and loaded (--append): the evidence set changed
    (mini_incident.parent / "gateway" / "day2.jsonl").write_text(
        json.dumps(
            {
                "rid": "r-new",
                "received_at": "2026-08-29T08:00:00Z",
                "account_id": "acct-new",
                "model": "@cf/zai-org/glm-5.3",
                "http_status": 200,
                "prompt_tokens": 1000,
                "completion_tokens": 10,
                "ttft_ms": 400.0,
                "latency_ms": 3000,
                "prefill_instance": "p0",
                "decode_instance": "d0",
            }
        )
        + "\n"
    )
    assert _cmd("ingest", mini_incident, out, "--append") == 0
    assert _cmd("detect", mini_incident, out) == 0
    assert _cmd("report", mini_incident, out, "--no-pdf") == 0
    assert len(runs) == 1
    assert json.loads((out / "scope.json").read_text())["analysed_period"]["requests"] == analysed + 1
    # the analysed period changed in the incident file: the scope follows it (the leak is at 10:00)
    assert json.loads((out / "scope.json").read_text())["affected_responses"] == 1
    mini_incident.write_text(mini_incident.read_text().replace("[scope]\n", '[scope]\nend = "2026-08-28T09:30:00Z"\n'))
    assert _cmd("report", mini_incident, out, "--no-pdf") == 0
    assert len(runs) == 2
    assert json.loads((out / "scope.json").read_text())["affected_responses"] == 0
    assert _cmd("report", mini_incident, out, "--no-pdf") == 0  # that scope is now the folder's
    assert len(runs) == 2
