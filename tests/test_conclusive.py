"""The conclusiveness gate: each reason on its own, exit code 3, and where the verdict is shown.

Each reason is provoked on the small hand-built incident of ``conftest.py`` (which is conclusive as
it stands) by one change of its inputs; the observations of issue 12 are reproduced on copies of the
bundled sample.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import INCIDENT, PREFILL_LOG, mini_requests, write_mini

from kvforensics.cli import main
from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS, REQUIRED_REQUEST_FIELDS
from kvforensics.mechanisms import load_mechanisms
from kvforensics.stages import conclusive
from kvforensics.stages.detect import load_rules

REQUIRED_CODES = {
    "quarantine_share",
    "rule_field_missing",
    "window_without_requests",
    "model_without_capacity",
    "unknown_instances",
    "affected_outside_window",
    "truncated_file",
    "no_requests",
    "kv_event_gap",
}


def run(incident: Path, out: Path, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, dict]:
    code = main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf"])
    return code, json.loads((out / "scope.json").read_text())


def codes(scope: dict) -> set[str]:
    return {r["code"] for r in scope["inconclusive_reasons"]}


def mini(tmp_path: Path, rows: list[dict] | None = None, incident: str = INCIDENT) -> Path:
    return write_mini(tmp_path / "mini", rows, incident)


# --- the gate as data ---------------------------------------------------------------------------------


def test_every_check_has_a_code_and_the_required_reasons_exist():
    got = conclusive.codes()
    assert len(got) == len(set(got)), "a reason code is used twice"
    assert REQUIRED_CODES <= set(got)
    assert all(re.fullmatch(r"[a-z_]+", c) for c in got)


def test_rule_fields_cover_every_optional_field_a_rule_reads():
    """A rule that starts reading another optional request field must say whether it needs it."""
    optional = set(CANONICAL_REQUEST_FIELDS) - set(REQUIRED_REQUEST_FIELDS)
    mechanisms = {m.id: m for m in load_mechanisms()}
    for rule in load_rules():
        read = {f for f in optional if re.search(rf"\b{f}\b", re.sub(r"--[^\n]*", "", rule.sql))}
        declared = {f for group in conclusive.RULE_FIELDS.get(rule.id, ()) for f in group}
        # a field the rule's mechanism requires is checked by the mechanism's selection (mechanism_inputs_missing)
        declared |= {i.split(".", 1)[1] for i in mechanisms[rule.mechanism].required if i.startswith("requests.")}
        fallback = set(conclusive.RULE_FIELDS_WITH_FALLBACK.get(rule.id, ()))
        assert read == declared | fallback, (rule.id, read, declared, fallback)


def test_the_mini_incident_is_conclusive(tmp_path):
    code, scope = run(mini(tmp_path), tmp_path / "out")
    assert (code, scope["conclusive"], scope["inconclusive_reasons"]) == (0, True, [])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["conclusive"] is True and manifest["inconclusive_reasons"] == []
    assert not (tmp_path / "out" / "report.md").read_text().startswith("**INCONCLUSIVE")


# --- each reason on its own -----------------------------------------------------------------------------


def test_quarantine_share_and_its_setting(tmp_path, capsys):
    rows = mini_requests()
    for r in rows[:10]:  # 10 of 402 records (2.5%) have a status that is not an HTTP code
        r["http_status"] = "success"
    code, scope = run(mini(tmp_path, rows), tmp_path / "out")
    assert code == 3 and codes(scope) == {"quarantine_share"}
    (reason,) = scope["inconclusive_reasons"]
    assert reason["evidence"]["source"] == "gateway"
    assert (reason["evidence"]["records_read"], reason["evidence"]["quarantined"]) == (402, 10)
    assert reason["evidence"]["top_reason"] == "status is not an HTTP status code"
    assert "10 of 402 records quarantined" in reason["message"]
    printed = capsys.readouterr().out
    assert printed.startswith("INCONCLUSIVE:") and "[quarantine_share]" in printed.splitlines()[1]
    assert printed.index("INCONCLUSIVE") < printed.index("affected responses")
    # the same loss is accepted when the incident file allows 5%
    allowed = INCIDENT + "\n[settings]\nmax_quarantine_fraction = 0.05\n"
    code, scope = run(mini(tmp_path / "allowed", rows, allowed), tmp_path / "out-allowed")
    assert (code, scope["conclusive"]) == (0, True)


def test_max_quarantine_fraction_is_validated(tmp_path, capsys):
    bad = INCIDENT + "\n[settings]\nmax_quarantine_fraction = \"1%\"\n"
    assert main(["run", str(mini(tmp_path, incident=bad)), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "max_quarantine_fraction must be a number from 0 to 1" in capsys.readouterr().err


KV_SOURCE = """
[[sources]]
name = "kv"
kind = "kv_events"
path = "kv/*.jsonl"
columns = { ts = "batch.0", events = "batch.1", dp_rank = "batch.2", instance = "instance", seq = "seq" }
"""


def with_kv_events(incident: Path, messages: list[tuple[int, str]], extra: str = "") -> Path:
    """The mini incident with a KV-event archive of prefill instance p0: one message per (seq, time of
    2026-08-28), each storing one page, as a subscriber writes them (tests/fixtures/kv_events/README.md)."""
    from datetime import datetime

    (incident.parent / "kv").mkdir()
    with (incident.parent / "kv" / "p0.jsonl").open("w") as fh:
        for seq, hhmm in messages:
            ts = datetime.fromisoformat(f"2026-08-28T{hhmm}:00+00:00").timestamp()
            fh.write(
                json.dumps(
                    {
                        "instance": "p0",
                        "topic": "kv-events",
                        "seq": seq,
                        "batch": [ts, [["BlockStored", [1000 + seq], None, [seq, 2, 3, 4], 4, None, "GPU"]], 0],
                    }
                )
                + "\n"
            )
    incident.write_text(incident.read_text() + KV_SOURCE + extra)
    return incident


def test_quarantine_share_of_a_kv_events_source_and_its_limit_per_kind(tmp_path):
    """Every kind of source counts, each with its own limit: a KV-event archive read without its mapping
    loses every event, which made no reason before."""
    messages = [(i, f"{9 + i // 60:02d}:{i % 60:02d}") for i in range(20)]
    unmapped = KV_SOURCE.replace(
        'columns = { ts = "batch.0", events = "batch.1", dp_rank = "batch.2", instance = "instance", seq = "seq" }\n',
        "",
    )
    incident = with_kv_events(mini(tmp_path), messages)
    incident.write_text(incident.read_text().replace(KV_SOURCE, unmapped))
    code, scope = run(incident, tmp_path / "out")
    assert code == 3 and "quarantine_share" in codes(scope)
    (reason,) = [r for r in scope["inconclusive_reasons"] if r["code"] == "quarantine_share"]
    assert {
        k: reason["evidence"][k]
        for k in ("source", "kind", "records_read", "quarantined", "fraction", "max_quarantine_fraction")
    } == {
        "source": "kv",
        "kind": "kv_events",
        "records_read": 20,
        "quarantined": 20,
        "fraction": 1,
        "max_quarantine_fraction": 0.01,
    }
    assert reason["message"].startswith(
        "kv_events source 'kv': 20 of 20 records quarantined (100.0%, above its limit "
        "1.0%), most often \"the batch's events are null, not a list (key 'events'; "
    )
    assert "or raise [quarantine] kv_events (default: [settings] max_quarantine_fraction)" in reason["message"]
    # a limit of its own for the kind; the requests' limit is still the default one
    allowed = incident.read_text() + "\n[quarantine]\nkv_events = 1.0\n"
    (tmp_path / "allowed").mkdir()
    shutil.copytree(incident.parent, tmp_path / "allowed", dirs_exist_ok=True)
    (tmp_path / "allowed" / "incident.toml").write_text(allowed)
    code, scope = run(tmp_path / "allowed" / "incident.toml", tmp_path / "out-allowed")
    assert "quarantine_share" not in codes(scope)


def test_quarantine_limits_per_kind_are_validated(tmp_path, capsys):
    for table, message in (
        (
            "[quarantine]\nkv_event = 0.1\n",
            "incident.toml: [quarantine]: unknown source kind 'kv_event'; did you mean 'kv_events'?",
        ),
        ("[quarantine]\nrequests = 2\n", "incident.toml: [quarantine]: requests must be a number from 0 to 1"),
    ):
        incident = mini(tmp_path / table[14:18], incident=INCIDENT + "\n" + table)
        assert main(["run", str(incident), "--out", str(tmp_path / "o"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_kv_event_gap_over_prefix_cache_hits(tmp_path):
    """The p0 publisher's messages 11 to 18 are lost between 09:10 and 09:30, when p0 served two prefix-cache
    hits: which blocks they reused and whose they were cannot be read from the events."""
    rows = mini_requests()
    for r in rows:
        if r["rid"] in ("r75", "r76", "r200"):  # 09:15, 09:16; 11:20, outside the gap
            r["cached_tokens"] = 64
    messages = [(i, f"09:{i:02d}") for i in range(11)] + [(19, "09:30"), (20, "09:31")]
    code, scope = run(with_kv_events(mini(tmp_path, rows), messages), tmp_path / "out")
    assert code == 3 and "kv_event_gap" in codes(scope)
    (reason,) = [r for r in scope["inconclusive_reasons"] if r["code"] == "kv_event_gap"]
    assert reason["evidence"] == {
        "instance": "p0",
        "dp_rank": 0,
        "gaps": 1,
        "missing": 8,
        "first": "2026-08-28T09:10:00Z",
        "last": "2026-08-28T09:30:00Z",
        "responses": 2,
        "flagged": 0,
        "hits": 2,
    }
    assert reason["message"].startswith(
        "KV events of instance 'p0' (dp rank 0): 8 message(s) lost in 1 break(s) of "
        "the publisher's sequence (the first from seq 10 to 19), from "
        "2026-08-28T09:10:00Z to 2026-08-28T09:30:00Z, a span holding 2 response(s)"
    )
    assert "replay buffer" in reason["message"] and "subscriber's other copy" in reason["message"]
    # the same archive without the gap; a gap over no hit is only an ingest warning
    whole = [(i, f"09:{i:02d}") for i in range(21)]
    code, scope = run(with_kv_events(mini(tmp_path / "whole", rows), whole), tmp_path / "out-whole")
    assert "kv_event_gap" not in codes(scope)
    later = [(i, f"12:{i:02d}") for i in range(11)] + [(19, "12:30")]
    code, scope = run(with_kv_events(mini(tmp_path / "later", rows), later), tmp_path / "out-later")
    assert "kv_event_gap" not in codes(scope)


def test_no_requests(tmp_path):
    code, scope = run(mini(tmp_path, []), tmp_path / "out")
    assert code == 3 and {"no_requests", "window_without_requests"} <= codes(scope)
    assert scope["affected_responses"] == 0


def test_truncated_file(tmp_path):
    incident = mini(tmp_path, incident=INCIDENT.replace('path = "gateway/*.jsonl"', 'path = "gateway/*.jsonl.gz"'))
    plain = incident.parent / "gateway" / "day1.jsonl"
    data = gzip.compress(plain.read_bytes())
    plain.unlink()
    (incident.parent / "gateway" / "day1.jsonl.gz").write_bytes(data[: len(data) * 9 // 10])
    code, scope = run(incident, tmp_path / "out")
    assert code == 3 and "truncated_file" in codes(scope)
    (reason,) = [r for r in scope["inconclusive_reasons"] if r["code"] == "truncated_file"]
    assert reason["evidence"]["source"] == "gateway" and "day1.jsonl.gz" in reason["message"]


def test_truncated_engine_log(tmp_path):
    incident = mini(tmp_path)
    log = incident.parent / "engine" / "p0.log"
    data = gzip.compress(log.read_bytes())  # recognised by its magic bytes, whatever the name
    log.write_bytes(data[: len(data) * 3 // 4])
    code, scope = run(incident, tmp_path / "out")
    assert code == 3 and "truncated_file" in codes(scope)
    (reason,) = [r for r in scope["inconclusive_reasons"] if r["code"] == "truncated_file"]
    assert (reason["evidence"]["source"], reason["evidence"]["kind"]) == ("engines", "engine_log")


def test_model_without_capacity(tmp_path):
    rows = mini_requests() + [
        {
            "rid": f"x{i}",
            "received_at": "2026-08-28T09:00:00Z",
            "account_id": "acct-1",
            "model": "@cf/other/model",
            "http_status": 200,
            "prompt_tokens": 1000,
        }
        for i in range(3)
    ]
    code, scope = run(mini(tmp_path, rows), tmp_path / "out")
    assert code == 3 and codes(scope) == {"model_without_capacity"}
    (reason,) = scope["inconclusive_reasons"]
    assert reason["evidence"] == {"model": "@cf/other/model", "requests": 3, "largest_prompt": 1000}


def test_startup_incomplete(tmp_path):
    """Also observation 5 of issue 12: a start-up without a KV pool broke the report template."""
    incident = mini(tmp_path)
    (incident.parent / "engine" / "p1.log").write_text(
        "[2026-08-27 14:00:00] server_args=ServerArgs(model_path='zai-org/GLM-5.3-FP8', context_length=1048576, "
        "disaggregation_mode='prefill')\n"
    )
    code, scope = run(incident, tmp_path / "out")
    assert code == 3 and codes(scope) == {"startup_incomplete"}
    (reason,) = scope["inconclusive_reasons"]
    assert reason["evidence"]["instance"] == "p1" and reason["evidence"]["missing"] == ["KV pool size"]


def test_window_without_requests(tmp_path):
    incident = mini(tmp_path)
    later = PREFILL_LOG.replace("2026-08-27", "2026-10-01").replace("2026-08-28", "2026-10-02")
    (incident.parent / "engine" / "p9.log").write_text(later.split("[2026-09-09")[0])
    code, scope = run(incident, tmp_path / "out")
    assert code == 3 and codes(scope) == {"window_without_requests"}
    (reason,) = scope["inconclusive_reasons"]
    assert (reason["evidence"]["instance"], reason["evidence"]["start"]) == ("p9", "2026-10-01T14:00:00Z")


def test_rule_field_missing(tmp_path):
    rows = mini_requests()
    for r in rows:
        r.pop("ttft_ms", None)
        r.pop("latency_ms", None)
    code, scope = run(mini(tmp_path, rows), tmp_path / "out")
    assert code == 3 and codes(scope) == {"rule_field_missing"}
    (reason,) = scope["inconclusive_reasons"]
    assert reason["evidence"]["rule"] == "prefill_too_fast"
    assert reason["evidence"]["fields"] == ["ttft_ms", "latency_ms"]
    # one of the two is enough
    for r in rows:
        r["latency_ms"] = 5000.0
    code, scope = run(mini(tmp_path / "e2e", rows), tmp_path / "out-e2e")
    assert (code, codes(scope)) == (0, set())


def test_unknown_instances(tmp_path):
    rows = mini_requests()
    for r in rows[:5]:
        r["prefill_instance"] = "zz-unlogged-9"
    code, scope = run(mini(tmp_path, rows), tmp_path / "out")
    assert code == 3 and codes(scope) == {"unknown_instances"}
    (reason,) = scope["inconclusive_reasons"]
    assert reason["evidence"]["field"] == "prefill_instance"
    assert (reason["evidence"]["requests"], reason["evidence"]["examples"]) == (5, ["zz-unlogged-9"])


def test_affected_outside_window_on_a_shifted_engine_clock(tmp_path):
    """The engine logs a day late: r-leak is still affected (its abort is found by request id), but no
    exposure window of its model holds it."""
    shifted = INCIDENT.replace('format = "sglang"', 'format = "sglang"\nclock_offset_s = 86400')
    code, scope = run(mini(tmp_path, incident=shifted), tmp_path / "out")
    assert code == 3 and "affected_outside_window" in codes(scope)
    (reason,) = [r for r in scope["inconclusive_reasons"] if r["code"] == "affected_outside_window"]
    assert reason["evidence"]["responses"] == 1 and reason["evidence"]["first"] == "2026-08-28T10:00:00Z"
    assert "timezone" in reason["message"]


def test_requests_outside_startups(tmp_path):
    rows = mini_requests()
    rows[0]["received_at"] = "2026-08-20T08:00:00Z"  # p0's log starts on 08-27
    code, scope = run(mini(tmp_path, rows), tmp_path / "out")
    assert code == 3 and codes(scope) == {"requests_outside_startups"}
    assert scope["inconclusive_reasons"][0]["evidence"]["instance"] == "p0"


def test_gateway_gap_inside_an_exposure_window(tmp_path):
    rows = [r for r in mini_requests() if not r["received_at"].startswith("2026-08-28T11")]
    code, scope = run(mini(tmp_path, rows), tmp_path / "out")
    assert code == 3 and codes(scope) == {"gateway_gap"}
    assert scope["inconclusive_reasons"][0]["evidence"]["start"] == "2026-08-28T11:00:00Z"


def test_each_check_runs_on_its_own(tmp_path):
    rows = mini_requests()
    for r in rows[:5]:
        r["prefill_instance"] = "zz-unlogged-9"
    run(mini(tmp_path, rows), tmp_path / "out")
    from kvforensics.core.db import connect

    con = connect(tmp_path / "out" / "evidence.duckdb")
    try:
        for code in conclusive.codes():
            got = conclusive.evaluate(con, only=(code,))
            assert {r.code for r in got} <= {code}
            assert bool(got) == (code == "unknown_instances")
    finally:
        con.close()


# --- where the verdict shows ------------------------------------------------------------------------------


def test_stage_commands_exit_3_and_verify_checks_the_verdict(tmp_path, capsys):
    rows = mini_requests()
    for r in rows[:5]:
        r["prefill_instance"] = "zz-unlogged-9"
    incident, out = mini(tmp_path, rows), tmp_path / "out"
    assert main(["ingest", str(incident), "--out", str(out), "--quiet"]) == 0
    assert main(["detect", str(incident), "--out", str(out), "--quiet"]) == 0
    assert main(["scope", str(incident), "--out", str(out), "--quiet"]) == 3
    assert main(["report", str(incident), "--out", str(out), "--quiet", "--no-pdf"]) == 3
    assert "[unknown_instances]" in capsys.readouterr().out
    report = (out / "report.html").read_text()
    assert report.index('id="inconclusive"') < report.index("<header>")
    notice = next((out / "notices").rglob("*.md")).read_text()
    # a draft says so first (no [notice] in the mini incident), then that it is provisional
    assert notice.startswith("> **DRAFT, not ready to send:**") and "\n> **Provisional:**" in notice
    code, _ = run(incident, out)
    assert code == 3 and main(["verify", str(out)]) == 0
    scope = json.loads((out / "scope.json").read_text())
    scope["conclusive"] = True
    (out / "scope.json").write_text(json.dumps(scope))
    assert main(["verify", str(out)]) == 1


def test_unexpected_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """The last resort: a bug ends in one line and exit 2, the traceback only with --debug."""
    import kvforensics.investigation as investigation

    def broken(self):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(investigation.Investigation, "detect", broken)
    incident = mini(tmp_path)
    assert main(["run", str(incident), "--out", str(tmp_path / "o"), "--quiet", "--no-pdf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("Error: unexpected ZeroDivisionError") and "--debug" in err
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "run", str(incident), "--out", str(tmp_path / "o"), "--quiet", "--no-pdf"])


def test_a_full_disk_is_one_line_that_says_so(tmp_path, capsys, monkeypatch):
    """DuckDB spilling into a full disk (its IOException) or a write failing with ENOSPC: exit 2, one
    line naming the disk and where DuckDB spills, not "a kvforensics bug"."""
    import errno

    import duckdb

    import kvforensics.investigation as investigation

    incident = mini(tmp_path)
    for i, error in enumerate(
        (
            duckdb.IOException(
                'IO Error: Could not write file "x/evidence.spill/duckdb_temp_1.tmp": No space left on device'
            ),
            OSError(errno.ENOSPC, "No space left on device"),
        )
    ):

        def full(self, error=error):
            raise error

        monkeypatch.setattr(investigation.Investigation, "scope", full)
        assert main(["run", str(incident), "--out", str(tmp_path / f"o{i}"), "--quiet", "--no-pdf"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("Error: out of disk space") and "evidence.spill" in err
        assert "kvforensics bug" not in err


# --- the observations of issue 12 on the bundled sample -----------------------------------------------------


def sample_copy(sample_incident: Path, dst: Path, rewrite=None, incident_text=None) -> Path:
    shutil.copytree(sample_incident.parent, dst, ignore=shutil.ignore_patterns("ground_truth.json"))
    if rewrite is not None:
        for f in sorted((dst / "gateway").glob("*.jsonl.gz")):
            with gzip.open(f, "rt", encoding="utf-8") as fh:
                records = [json.loads(line) for line in fh]
            with gzip.open(f, "wt", encoding="utf-8") as fh:
                for i, rec in enumerate(records):
                    fh.write(json.dumps(rewrite(i, rec)) + "\n")
    if incident_text is not None:
        (dst / "incident.toml").write_text(incident_text((dst / "incident.toml").read_text()))
    return dst / "incident.toml"


def first_line(out: Path) -> str:
    return (out / "report.md").read_text().splitlines()[0]


@pytest.mark.slow
def test_sample_mapped_correctly_exits_0_with_the_same_figures(sample_incident, sample_run, tmp_path):
    code, scope = run(sample_incident, tmp_path / "out")
    assert (code, scope["conclusive"], scope["inconclusive_reasons"], scope["affected_responses"]) == (0, True, [], 155)
    assert first_line(tmp_path / "out").startswith("# ")
    library = json.loads((sample_run / "scope.json").read_text())
    assert scope == library


@pytest.mark.slow
def test_observation_1_status_as_text_is_inconclusive(sample_incident, tmp_path):
    def as_text(_i: int, rec: dict) -> dict:
        rec["http_status"] = "success" if rec["http_status"] < 400 else "failure"
        return rec

    code, scope = run(sample_copy(sample_incident, tmp_path / "s", as_text), tmp_path / "out")
    assert code == 3 and scope["affected_responses"] == 0
    assert {"quarantine_share", "no_requests", "window_without_requests"} <= codes(scope)
    line = first_line(tmp_path / "out")
    assert line.startswith("**INCONCLUSIVE") and "quarantined" in line and "status is not an HTTP status code" in line
    assert "not an all-clear" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.slow
def test_observation_2_blank_ttft_is_inconclusive(sample_incident, tmp_path):
    def blank_ttft(i: int, rec: dict) -> dict:
        if i % 3 == 0:
            rec["ttft_ms"] = ""
        return rec

    code, scope = run(sample_copy(sample_incident, tmp_path / "s", blank_ttft), tmp_path / "out")
    assert code == 3 and codes(scope) == {"quarantine_share"}
    assert scope["affected_responses"] < 155
    line = first_line(tmp_path / "out")
    assert line.startswith("**INCONCLUSIVE") and "ttft_ms is not a non-negative number" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("zone", "outside_last"), [("America/New_York", "2026-08-27T17:15:16Z"), ("Europe/Berlin", "2026-09-09T12:44:49Z")]
)
def test_observation_7_wrong_engine_timezone_is_inconclusive(sample_incident, tmp_path, zone, outside_last):
    """The engine logs are UTC; read as New York time the windows open 4 h late, as Berlin time they
    close 2 h early (12:05Z, before the last affected response at 12:44:49Z)."""

    def wrong_zone(text: str) -> str:
        engines = 'format = "sglang"\ntimezone = "UTC"'
        assert engines in text
        return text.replace(engines, f'format = "sglang"\ntimezone = "{zone}"')

    code, scope = run(sample_copy(sample_incident, tmp_path / "s", incident_text=wrong_zone), tmp_path / "out")
    assert code == 3 and "affected_outside_window" in codes(scope)
    (reason,) = [r for r in scope["inconclusive_reasons"] if r["code"] == "affected_outside_window"]
    assert reason["evidence"]["model"] == "@cf/zai-org/glm-5.3" and reason["evidence"]["last"].startswith(
        outside_last[:-1]
    )
    line = first_line(tmp_path / "out")
    assert line.startswith("**INCONCLUSIVE") and "outside every exposure window" in line


@pytest.mark.slow
def test_a_total_mapped_to_prompt_tokens_contradicts_the_engines_counts(sample_incident, tmp_path):
    """A mapping mistake that quarantines nothing: prompt_tokens mapped to the total with the completion. The
    engines' own counts (ReqTimeStats input_len) of the requests the incident does not explain disagree, and the
    report still renders although thousands of requests are now flagged (its chart draws a sample)."""

    def total(text: str) -> str:
        return text.replace(
            'status = "http_status" }', 'status = "http_status", prompt_tokens = "prompt_tokens + completion_tokens" }'
        )

    incident = sample_copy(sample_incident, tmp_path / "s", incident_text=total)
    code, scope = run(incident, tmp_path / "out")
    assert code == 3 and codes(scope) == {"prompt_tokens_disagree"}
    (reason,) = scope["inconclusive_reasons"]
    assert reason["message"].startswith(
        "prompt_tokens: the gateway's count and the engines' own count (ReqTimeStats "
        "input_len) differ by more than 64 tokens and 5% for "
    )
    assert reason["evidence"]["fraction"] > 0.3 and reason["evidence"]["max_fraction"] == 0.01
    assert "flagged requests drawn: confirmed first" in (tmp_path / "out" / "report.html").read_text()
    # the rule's own tolerance, set by the incident, is the check's: a tolerance that accepts the completion
    # lengths accepts the mapping too
    loose = total(incident.read_text()) + "\n[rules.engine_token_count_mismatch]\nmin_abs_diff = 100000\n"
    incident.write_text(loose)
    code, scope = run(incident, tmp_path / "out2")
    assert "prompt_tokens_disagree" not in codes(scope)


def test_prompt_tokens_disagree_leaves_out_what_the_incident_explains(sample_run):
    """On the sample, the 155 engine counts that differ (the rejected prompts' 1-token stubs) are aborted and
    flagged by other rules: the gateway's counts agree with the engines' on every other request."""
    from kvforensics.core.db import connect

    con = connect(sample_run / "evidence.duckdb", read_only=True)
    try:
        assert conclusive.evaluate(con, only=("prompt_tokens_disagree",)) == []
        mismatched = con.execute(
            "SELECT count(*) FROM findings WHERE rule_id = 'engine_token_count_mismatch'"
        ).fetchall()
        assert mismatched == [(155,)]
    finally:
        con.close()


def test_verify_of_a_folder_that_is_no_run_output_is_one_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    (tmp_path / "manifest.json").write_text("{")
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("manifest.json is missing: name the output folder of a `kvforensics run`")
    assert "manifest.json is not the JSON `kvforensics run` writes" in err[1] and len(err) == 2
