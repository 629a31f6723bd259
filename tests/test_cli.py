"""The command line end to end on a small incident, with exact exit codes and messages."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvforensics.cli import EXIT_INCONCLUSIVE, EXIT_PIPE_CLOSED, build_parser, main


def test_run_end_to_end(mini_incident, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(mini_incident), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("1 affected responses, 1 accounts received foreign data")
    scope = json.loads((out / "scope.json").read_text())
    assert scope["affected_responses"] == 1
    assert scope["windows"] == [
        {
            "model": "@cf/zai-org/glm-5.3",
            "first": "2026-08-28T10:00:00Z",
            "last": "2026-08-28T10:00:00Z",
            "responses": 1,
        }
    ]
    assert [(w["instance"], w["pool_tokens"], w["start"], w["end"]) for w in scope["exposure_windows"]] == [
        ("p0", 681280, "2026-08-27T14:00:00Z", "2026-09-09T12:00:00Z")
    ]
    rows = list(csv.DictReader((out / "affected_requests.csv").open()))
    assert [(r["request_id"], r["confidence"], r["rules"]) for r in rows] == [
        ("r-leak", "confirmed", "engine_abort_but_success prefill_too_fast prompt_exceeds_kv_pool")
    ]
    # the correctly rejected oversize request is not affected
    assert "r-400" not in (out / "affected_requests.csv").read_text()
    assert main(["verify", str(out)]) == 0


def test_rerun_is_idempotent(mini_incident, tmp_path):
    out = tmp_path / "out"
    assert main(["run", str(mini_incident), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    first = json.loads((out / "scope.json").read_text())
    assert main(["run", str(mini_incident), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    second = json.loads((out / "scope.json").read_text())
    assert first == second
    manifest = json.loads((out / "manifest.json").read_text())
    gw = [i for i in manifest["inputs"] if i["source"] == "gateway"][0]
    assert gw["records_read"] == 402 and gw["loaded"] == 402
    import duckdb

    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM requests").fetchall() == [(402,)]
    assert con.execute("SELECT count(*) FROM load_report WHERE source = 'gateway'").fetchall() == [(1,)]


def test_missing_incident_file_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"Error: incident file not found: {tmp_path / 'missing.toml'}\n"


def test_no_matching_files_exits_2(mini_incident, tmp_path, capsys):
    text = mini_incident.read_text().replace('path = "gateway/*.jsonl"', 'path = "nowhere/*.jsonl"')
    mini_incident.write_text(text)
    assert main(["run", str(mini_incident), "--out", str(tmp_path / "o"), "--quiet", "--no-pdf"]) == 2
    assert capsys.readouterr().err == (
        f"Error: source 'gateway': no file matches path 'nowhere/*.jsonl' (looked in {mini_incident.parent}); "
        "check the path, which is relative to the incident file\n"
    )


def test_strict_fails_on_first_bad_record(mini_incident, tmp_path, capsys):
    with (mini_incident.parent / "gateway" / "day1.jsonl").open("a") as fh:
        fh.write("{broken\n")
    assert main(["run", str(mini_incident), "--out", str(tmp_path / "o"), "--quiet", "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and err.rstrip().endswith(
        "day1.jsonl:403: malformed JSON (--strict stops at the first record that would be quarantined)"
    )


def test_unknown_model_is_reported(mini_incident, tmp_path):
    with (mini_incident.parent / "gateway" / "day1.jsonl").open("a") as fh:
        fh.write(
            json.dumps(
                {
                    "rid": "x1",
                    "received_at": "2026-08-28T10:00:00Z",
                    "account_id": "a",
                    "model": "@cf/unknown/model",
                    "http_status": 200,
                    "prompt_tokens": 5,
                }
            )
            + "\n"
        )
    out = tmp_path / "out"
    # completed, but inconclusive: a model with requests and no engine capacity
    assert main(["run", str(mini_incident), "--out", str(out), "--quiet", "--no-pdf"]) == 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert [r["code"] for r in manifest["inconclusive_reasons"]] == ["model_without_capacity"]
    assert (
        "unknown model '@cf/unknown/model': no engine log covers it, so the pool rule cannot judge its 1 request(s)"
    ) in manifest["warnings"]


def test_python_dash_m(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvforensics", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("kvforensics ")


def test_log_gaps_are_called_out(tmp_path):
    from conftest import mini_requests, write_mini

    rows = mini_requests()
    for r in rows[:5]:
        r["prefill_instance"] = "p9"  # an instance whose engine log we do not have
    path = write_mini(tmp_path / "data", rows)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-pdf"]) == 3  # inconclusive: unknown instance
    gaps = json.loads((out / "scope.json").read_text())["log_gaps"]
    engine = [g for g in gaps if g["source"] == "engine_log"]
    assert [(g["instance"], g["requests"]) for g in engine] == [("p9", 5)]
    assert "no start-up in its engine log covers them" in (out / "report.html").read_text()


def test_physical_bound_in_report(tmp_path):
    from conftest import INCIDENT, write_mini

    hw = (
        INCIDENT
        + '''
[models.hardware."@cf/zai-org/glm-5.3"]
active_params = 32e9
layers = 78
hidden_size = 6144
n_gpus = 8
gpu = "H200_SXM"
precision = "fp8"
'''
    )
    path = write_mini(tmp_path / "data", incident=hw)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    md = (out / "report.md").read_text()
    # 700,000 uncached tokens on 8 x H200 (FP8, 100% of peak) need >= 32.5 s; the leak took 150 ms
    assert (
        "no prefill of these prompts can take less than 32.5 s; the 1 affected responses took a median 150 ms, "
        "at least 217 times faster than the hardware allows"
    ) in md
    assert "times faster than the hardware allows" in md


def test_bad_hardware_spec_is_a_config_error(tmp_path, capsys):
    from conftest import INCIDENT, write_mini

    path = write_mini(tmp_path / "data", incident=INCIDENT + '[models.hardware."m"]\ngpu = "TPUv9"\n')
    assert main(["run", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        "Error: incident.toml: [models.hardware.\"m\"]: gpu must be one of ['A100_SXM', 'B200_HGX', 'H100_SXM', 'H200_SXM'] "
        "(or give peak_flops_per_gpu)\n"
    )


def test_adding_a_new_days_file_loads_only_what_is_new(mini_incident, tmp_path):
    out = tmp_path / "out"
    assert main(["ingest", str(mini_incident), "--out", str(out), "--quiet"]) == 0
    day2 = mini_incident.parent / "gateway" / "day2.jsonl"
    day2.write_text(
        json.dumps(
            {
                "rid": "d2-1",
                "received_at": "2026-08-29T10:00:00Z",
                "account_id": "a",
                "model": "@cf/zai-org/glm-5.3",
                "http_status": 200,
                "prompt_tokens": 5,
            }
        )
        + "\n"
    )
    before = (mini_incident.parent / "gateway" / "day1.jsonl").read_bytes()
    from kvforensics.investigation import Investigation

    inv = Investigation.open(mini_incident, out, progress=False, append=True)  # --append
    result = inv.ingest()
    inv.close()
    gateway = {Path(f.file).name: f for f in result.files if f.source == "gateway"}
    assert "already loaded (same SHA-256): not read again" in gateway["day1.jsonl"].notes
    assert (gateway["day2.jsonl"].records_read, gateway["day2.jsonl"].loaded) == (1, 1)
    assert (mini_incident.parent / "gateway" / "day1.jsonl").read_bytes() == before, "inputs are never modified"


def test_help_says_what_the_tool_is_its_commands_and_exit_codes_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    parser = build_parser()
    for text in (parser.description, parser.epilog):
        flat = " ".join(text.split())
        assert flat[:1].isupper() and flat.endswith("."), flat
        assert flat in printed  # shown whole, not cut at its first line
    (commands,) = [a.choices for a in parser._subparsers._group_actions]  # the subcommands argparse knows
    for name in commands:
        assert f" {name} " in " " + " ".join(f"{parser.description} {parser.epilog}".replace(",", " ").split()) + " ", (
            name
        )
    exit_codes = parser.epilog[parser.epilog.index("Exit codes:") :]
    for code in (0, 1, 2, EXIT_INCONCLUSIVE, EXIT_PIPE_CLOSED):
        assert f" {code} " in exit_codes, code


def test_absurd_timings_are_drawn_at_the_edge_of_the_scatter(tmp_path):
    """A subnormal TTFT (a logging fault) once asked the log axis for 300 decades and stopped vl-convert: the scatter
    draws such points at its edge and says what they were (found by test_pipeline_properties)."""
    from conftest import mini_requests, write_mini

    rows = mini_requests()
    rows[3]["ttft_ms"], rows[4]["ttft_ms"] = 2.2250738585e-313, 1e300
    out = tmp_path / "out"
    assert main(["run", str(write_mini(tmp_path / "data", rows)), "--out", str(out), "--quiet", "--no-pdf"]) in (0, 3)
    html = (out / "report.html").read_text()
    assert "<svg" in html and "drawn at the edge" in html
    # a TTFT beyond 1e12 ms (31 years) is quarantined, not added to a timestamp (which overflowed)
    assert "ttft_ms is out of range (over 1e12 ms)" in (out / "quarantine.csv").read_text()
