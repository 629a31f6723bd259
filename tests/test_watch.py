"""``kvforensics watch`` on small incidents whose files grow between polls: what it loads is what a batch run
loads from the files as they end up (rotation, gzip members, a restart, a malformed line), and it alerts on an
exposed start-up before any response, on the affected response, and on gaps in the evidence."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest
from conftest import DECODE_LOG, INCIDENT, PREFILL_LOG, mini_requests, write_mini

from kvforensics.config import load_incident
from kvforensics.investigation import Investigation
from kvforensics.watch import Watch, WatchOptions, intake

ROOT = Path(__file__).resolve().parent.parent
# every table the requests leave, as the batch ingest leaves them
REQUEST_TABLES = {
    "requests": "SELECT * FROM requests ORDER BY request_id",
    "quarantine": "SELECT source, file, line, reason, raw FROM quarantine ORDER BY ALL",
    "request_conflicts": "SELECT * FROM request_conflicts ORDER BY ALL",
    "load_report": "SELECT * FROM load_report WHERE kind = 'requests' ORDER BY file",
}


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def incident(tmp_path: Path, gateway_path: str = "gateway/*.jsonl*", extra: str = "") -> Path:
    """The mini incident (tests/conftest.py) with an empty gateway folder whose path is *gateway_path*."""
    root = tmp_path / "mini"
    toml = write_mini(
        root, rows=[], incident=INCIDENT.replace('path = "gateway/*.jsonl"', f'path = "{gateway_path}"') + extra
    )
    (root / "gateway" / "day1.jsonl").unlink()
    return toml


def watch(toml: Path, out: Path, **options) -> Watch:
    return Watch(
        load_incident(toml), out, WatchOptions(**{"interval": 0.1, "status": False, "stdout": io.StringIO(), **options})
    )


def tables(db: Path, queries: dict[str, str] = REQUEST_TABLES) -> dict[str, list[tuple]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {name: con.execute(q).fetchall() for name, q in queries.items()}
    finally:
        con.close()


def batch(toml: Path, out: Path) -> dict[str, list[tuple]]:
    """The request tables a batch ingest of the folder gives."""
    inv = Investigation.open(toml, out, progress=False, pdf=False)
    try:
        inv.ingest()
    finally:
        inv.close()
    return tables(out / "evidence.duckdb")


def alerts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]


def started(tmp_path: Path, first: int) -> tuple[Path, list[dict], Path, Watch]:
    """The mini incident whose gateway file holds its first *first* requests, and a watch that polled it once."""
    toml = incident(tmp_path)
    rows = mini_requests()
    live = toml.parent / "gateway" / "day1.jsonl"
    live.write_bytes(jsonl(rows[:first]))
    w = watch(toml, tmp_path / "out")
    w.poll()
    return toml, rows, live, w


def test_rotated_files_are_finished_and_the_new_one_read_from_its_start(tmp_path: Path) -> None:
    toml, rows, live, w = started(tmp_path, 150)
    with live.open("ab") as writer:  # the writer still holds the file when it is renamed
        writer.write(jsonl(rows[150:200]))
        live.rename(live.with_name("day1.jsonl.1"))
        writer.write(jsonl(rows[200:220]))  # written after the rename, into the renamed file
    live.write_bytes(jsonl(rows[220:300]))  # the new file under the old name
    w.poll()
    with live.open("ab") as fh:
        fh.write(jsonl(rows[300:]))
    w.stop()
    got = tables(tmp_path / "out" / "evidence.duckdb")
    assert len(got["requests"]) == len(rows)
    assert got == batch(toml, tmp_path / "batch")
    files = {r[2]: r[5] for r in got["load_report"]}
    assert files == {str(live.with_name("day1.jsonl.1")): 220, str(live): len(rows) - 220}


def test_gzip_members_appended_are_read_whole_and_a_line_across_members_once(tmp_path: Path) -> None:
    toml = incident(tmp_path)
    rows = mini_requests()
    path = toml.parent / "gateway" / "day1.jsonl.gz"
    data = jsonl(rows)
    cut = [0, 5000, 5000 + 123, 40_000, len(data)]  # member boundaries that cut lines in two
    w = watch(toml, tmp_path / "out")
    for a, b in itertools.pairwise(cut):
        member = gzip.compress(data[a:b], mtime=0)
        with path.open("ab") as fh:  # a member half written when the poll comes, then finished
            fh.write(member[: len(member) // 2])
        w.poll()
        with path.open("ab") as fh:
            fh.write(member[len(member) // 2 :])
        w.poll()
    w.stop()
    got = tables(tmp_path / "out" / "evidence.duckdb")
    assert len(got["requests"]) == len(rows) and got == batch(toml, tmp_path / "batch")
    assert [r[5:9] for r in got["load_report"]] == [(len(rows), len(rows), 0, 0)]


def test_a_restart_resumes_at_the_recorded_offsets_and_repeats_no_alert(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(intake, "SPLIT_BYTES", 5000)  # each increment typed in pieces side by side
    toml = incident(tmp_path)
    rows = mini_requests()
    live = toml.parent / "gateway" / "day1.jsonl"
    leak = next(i for i, r in enumerate(rows) if r["rid"] == "r-leak")
    live.write_bytes(jsonl(rows[: leak + 1]))
    out = tmp_path / "out"
    w = watch(toml, out)
    w.poll()
    assert "affected_response:r-leak" in {a["alert_id"] for a in alerts(out)}
    w.close()  # killed: no last poll, nothing settled
    with live.open("ab") as fh:
        fh.write(jsonl(rows[leak + 1 : leak + 3]) + b'{"rid": "half a li')  # a line still being written
    w = watch(toml, out)
    w.poll()
    w.stop()  # stopped and settled
    with live.open("ab") as fh:
        fh.write(b'ne"}\n' + jsonl(rows[leak + 3 :]))
    w = watch(toml, out)
    w.poll()
    w.stop()
    got = tables(out / "evidence.duckdb")
    assert got == batch(toml, tmp_path / "batch")
    assert [r[5:9] for r in got["load_report"]] == [(len(rows) + 1, len(rows), 1, 0)]  # no record read twice
    ids = [a["alert_id"] for a in alerts(out)]
    assert len(ids) == len(set(ids)) and ids.count("affected_response:r-leak") == 1


def test_a_malformed_line_is_quarantined_at_its_line_and_the_rest_loaded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(intake, "SPLIT_BYTES", 5000)  # each increment typed in pieces side by side
    toml, rows, live, w = started(tmp_path, 100)
    with live.open("ab") as fh:
        fh.write(jsonl(rows[100:110]) + b'{"rid": "r-bad", "received_at": \n' + jsonl(rows[110:]))
    w.poll()
    w.stop()
    got = tables(tmp_path / "out" / "evidence.duckdb")
    assert got == batch(toml, tmp_path / "batch")
    (quarantined,) = got["quarantine"]
    assert quarantined[1:3] == (str(live), 111) and "r-bad" in quarantined[4]
    assert len(got["requests"]) == len(rows)


def test_the_exposed_startup_is_alerted_when_its_lines_are_read_before_any_response(tmp_path: Path) -> None:
    toml = incident(tmp_path)
    engine = toml.parent / "engine"
    prefill = PREFILL_LOG.splitlines(keepends=True)
    (engine / "p0.log").write_text(prefill[0])  # the server arguments only: no pool yet
    (engine / "d0.log").write_text(DECODE_LOG)
    out = tmp_path / "out"
    w = watch(toml, out)
    w.poll()
    assert not [a for a in alerts(out) if a["kind"] == "exposed_startup"] if (out / "alerts.jsonl").exists() else True
    with (engine / "p0.log").open("a") as fh:
        fh.writelines(prefill[1:6])  # the KV pool and the context length
    w.poll()
    (exposed,) = [a for a in alerts(out) if a["kind"] == "exposed_startup"]
    assert (
        exposed["instance"],
        exposed["check"],
        exposed["kv_pool_tokens"],
        exposed["context_length"],
        exposed["line"],
    ) == ("p0", "pool_vs_context", 681280, 1048576, 1)
    assert "681,274" in exposed["verdict"] and exposed["start"] == "2026-08-27T14:00:00Z"
    rows = mini_requests()
    (toml.parent / "gateway" / "day1.jsonl").write_bytes(jsonl(rows))
    with (engine / "p0.log").open("a") as fh:
        fh.writelines(prefill[6:])  # the abort of r-leak, then the restart with a large pool
    w.poll()
    affected = [a for a in alerts(out) if a["kind"] == "affected_response"]
    assert [(a["request_id"], a["account_id"], a["instance"], a["ts"], a["confidence"]) for a in affected] == [
        ("r-leak", "victim-recipient", "p0", "2026-08-28T10:00:00Z", "confirmed")
    ]
    assert {"engine_abort_but_success", "prompt_exceeds_kv_pool"} <= set(affected[0]["rules"])
    summary = w.stop()
    assert summary.alerted_not_in_answer == []
    assert [a["alert_id"] for a in alerts(out)].count(
        "exposed_startup:pool_vs_context:p0:" + str(engine / "p0.log") + ":1"
    ) == 1


def test_evidence_gaps_silence_quarantine_share_and_a_kv_event_sequence_gap(tmp_path: Path) -> None:
    kv = (
        '\n[[sources]]\nname = "kv"\nkind = "kv_events"\npath = "events/*.jsonl"\n'
        'columns = { ts = "b.0", events = "b.1", seq = "seq" }\n'
    )
    toml = incident(tmp_path, extra=kv)
    (toml.parent / "events").mkdir()
    events = toml.parent / "events" / "p0.jsonl"
    removed = [["BlockRemoved", [1]]]
    events.write_bytes(jsonl([{"seq": 1, "b": [1.0, removed]}, {"seq": 2, "b": [2.0, removed]}]))
    live = toml.parent / "gateway" / "day1.jsonl"
    live.write_bytes(jsonl(mini_requests()[:200]))
    out = tmp_path / "out"
    w = watch(toml, out, silence=0.5)
    w.poll()
    assert not [a for a in alerts(out) if a["kind"] == "evidence_gap"]
    with events.open("ab") as fh:  # three messages lost, across two pieces of the file
        fh.write(jsonl([{"seq": 6, "b": [6.0, removed]}]))
    with live.open("ab") as fh:  # 20 malformed records of 220: 9% quarantined, above the 1% limit
        fh.write(b"not json\n" * 20)
    time.sleep(0.6)
    w.poll()
    gaps = {a["gap"]: a for a in alerts(out) if a["kind"] == "evidence_gap"}
    assert (
        gaps["kv_event_sequence"]["seq_before"],
        gaps["kv_event_sequence"]["seq_after"],
        gaps["kv_event_sequence"]["missing"],
    ) == (2, 6, 3)
    assert (
        gaps["quarantine_share"]["source"],
        gaps["quarantine_share"]["records_read"],
        gaps["quarantine_share"]["quarantined"],
    ) == ("gateway", 220, 20)
    assert gaps["silent_source"]["source"] == "engines"  # the engine logs did not grow for 0.6 s
    w.poll()
    w.stop()
    ids = [a["alert_id"] for a in alerts(out)]
    assert len(ids) == len(set(ids))


def test_an_increment_splits_at_line_ends_into_pieces_that_resume_where_they_end(tmp_path: Path) -> None:
    from kvforensics.watch.follow import FileState, Increment, split

    data = b"".join(b"line %d\n" % i for i in range(1000))
    inc = Increment(FileState("s", str(tmp_path / "f.jsonl"), 1, 2, lines=10), data, 11, 1000, 500 + len(data), 0)
    parts = split(inc, 3, 100)
    assert b"".join(p.data for p in parts) == data and all(p.data.endswith(b"\n") for p in parts)
    assert [p.first_line for p in parts] == [11, 11 + parts[0].lines, 11 + parts[0].lines + parts[1].lines]
    assert sum(p.lines for p in parts) == 1000 and parts[-1].offset == inc.offset
    assert parts[0].offset == 500 + len(parts[0].data)
    gz = Increment(FileState("s", str(tmp_path / "f.jsonl.gz"), 1, 2), data, 1, 1000, 99, 7)
    assert split(gz, 3, 100) == [gz]  # a place inside a gzip member is no byte of the file


def test_every_per_request_rule_flags_on_part_of_the_requests_what_it_flags_of_them_on_all(
    mini_incident: Path, tmp_path: Path
) -> None:
    """The premise of running a rule on the new rows alone (kvforensics/watch/detection.py)."""
    from kvforensics.stages.detect import run_rule
    from kvforensics.stages.rulebook import load_rules, rule_parameters
    from kvforensics.watch.detection import per_request

    inv = Investigation.open(mini_incident, tmp_path / "out", progress=False, pdf=False)
    try:
        inv.ingest()
        inv.detect()  # the latency model
        con = inv.con
        rules = [r for r in load_rules() if per_request(r)]
        assert {r.id for r in rules} >= {"prompt_exceeds_kv_pool", "engine_abort_but_success", "prefill_too_fast"}
        assert not [r.id for r in load_rules() if r.mechanism == "prefix_reuse" and per_request(r)]
        part = con.cursor()
        part.execute(
            "CREATE TEMP TABLE requests AS SELECT * FROM evidence.main.requests "
            "WHERE hash(request_id) % 3 = 0 OR request_id = 'r-leak'"
        ).fetchall()
        kept = {r for (r,) in part.execute("SELECT request_id FROM requests").fetchall()}
        for rule in rules:
            params = rule_parameters(rule)
            whole = run_rule(con, rule, params)
            some = run_rule(part, rule, params)
            assert sorted(map(tuple, some.values.tolist())) == sorted(
                tuple(r) for r in whole.values.tolist() if r[0] in kept
            ), rule.id
    finally:
        inv.close()


def test_alert_command_gets_each_batch_on_stdin(tmp_path: Path) -> None:
    toml = incident(tmp_path)
    (toml.parent / "gateway" / "day1.jsonl").write_bytes(jsonl(mini_requests()))
    paged = tmp_path / "paged.jsonl"
    command = f"{sys.executable} -c \"import sys; open({str(paged)!r}, 'a').write(sys.stdin.read())\""
    w = watch(toml, tmp_path / "out", alert_command=command)
    w.poll()
    w.stop()
    assert paged.read_text() == (tmp_path / "out" / "alerts.jsonl").read_text() != ""


def test_cli_once_prints_alerts_and_a_batch_folder_is_refused(tmp_path: Path) -> None:
    toml = write_mini(tmp_path / "mini")
    run = [sys.executable, "-m", "kvforensics", "watch", str(toml), "--out", str(tmp_path / "out"), "--once", "--quiet"]
    done = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    printed = [json.loads(line) for line in done.stdout.splitlines()]
    assert printed == alerts(tmp_path / "out") and "affected_response:r-leak" in {a["alert_id"] for a in printed}
    assert all(line.isascii() for line in done.stdout.splitlines())
    done = subprocess.run(
        [sys.executable, "-m", "kvforensics", "run", str(toml), "--out", str(tmp_path / "b"), "--quiet", "--no-pdf"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    done = subprocess.run(
        run[:5] + ["--out", str(tmp_path / "b"), "--once"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: {tmp_path / 'b'} holds the evidence of a batch run, which watch does not continue: watch into a "
        "new --out folder"
    )


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_sigterm_stops_with_exit_0_after_settling_and_scope_verifies(tmp_path: Path) -> None:
    toml = write_mini(tmp_path / "mini")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvforensics", "watch", str(toml), "--out", str(out), "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while not (out / "alerts.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "stopped: 402 requests" in stderr
    scope = subprocess.run(
        [sys.executable, "-m", "kvforensics", "scope", str(toml), "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert scope.returncode == 0, scope.stderr
    verify = subprocess.run(
        [sys.executable, "-m", "kvforensics", "verify", str(out)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert verify.returncode == 0, verify.stdout
