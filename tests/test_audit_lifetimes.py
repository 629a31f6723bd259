"""The audit ends start-ups by the ingest's lifetime rule (kvforensics/stages/instances.py): a pod that shut down
or was replaced in a rollout is not exposed now; a log that merely stops, with no successor, stays in
force. "Exposed now" counts only start-ups still in force; every output says how each start-up ended."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pytest
from conftest import INCIDENT
from rich.console import Console
from test_lifetimes import LARGE, SMALL, sglang_pod

from kvforensics.audit import CHECKS, AuditReport, Verdict, audit_database, audit_incident, audit_paths
from kvforensics.cli import main
from kvforensics.config import load_incident
from kvforensics.core import db
from kvforensics.core.errors import InputError
from kvforensics.investigation import Investigation

SIGTERM = "SIGTERM received. signum=None frame=None. Draining requests and shutting down..."
T0 = datetime(2026, 8, 20, 10, 0, tzinfo=UTC)
AUDIT = Path(__file__).parent / "fixtures" / "audit"


def pod_log(start: datetime, pool: int, *, until: datetime, sigterm: bool = False, role: str = "prefill") -> str:
    """An SGLang pod (tests/test_lifetimes.py): start-up on lines 1-4, a batch line every hour until
    *until*, then SGLang's SIGTERM lines or nothing."""
    text = sglang_pod(start, pool, serve_until=until, role=role)
    if not sigterm:
        return text
    stamp = (until + timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S")
    return text + f"[{stamp}] {SIGTERM}\n[{stamp}] INFO:     Shutting down\n"


def rollout(folder: Path, *, sigterm: bool, successor: bool = True) -> list[Path]:
    """Pod a (pool below the context) serves 5 h; pod b (safe pool) replaces it under a new name 30 min
    before a's log ends and keeps logging. Line 10 of a is its SIGTERM line, or line 9 its last line."""
    folder.mkdir(parents=True, exist_ok=True)
    pods = {"glm-prefill-a": pod_log(T0, SMALL, until=T0 + timedelta(hours=5), sigterm=sigterm)}
    if successor:
        pods["glm-prefill-b"] = pod_log(T0 + timedelta(hours=4, minutes=30), LARGE, until=T0 + timedelta(hours=10))
    else:  # another role does not take over
        pods["glm-decode-0"] = pod_log(T0, 4 * LARGE, until=T0 + timedelta(hours=10), role="decode")
    for name, text in pods.items():
        (folder / f"{name}.log").write_text(text)
    return sorted(folder.glob("*.log"))


def pool_check(report: AuditReport, instance: str) -> Verdict:
    (v,) = [v for v in report.verdicts if v.check == 1 and v.instance == instance]
    return v


def pool_check_nth(report: AuditReport, instance: str, n: int) -> Verdict:
    return [v for v in report.verdicts if v.check == 1 and v.instance == instance][n]


def test_a_pod_shut_down_in_a_rollout_is_exposed_until_its_sigterm_and_not_now(tmp_path: Path) -> None:
    report = audit_paths(rollout(tmp_path, sigterm=True))
    old, new = pool_check(report, "glm-prefill-a"), pool_check(report, "glm-prefill-b")
    assert (old.status, old.exposed, old.in_force) == ("fail", True, False)
    assert (old.startup_from, old.startup_to) == (T0, T0 + timedelta(hours=5, minutes=1))
    assert (old.end_reason, Path(old.end_file or "").name, old.end_line) == ("shutdown", "glm-prefill-a.log", 10)
    assert (new.status, new.exposed, new.in_force, new.end_reason, new.startup_to) == ("pass", False, True, None, None)
    assert report.exposed and not report.exposed_now
    assert report.now() == "Not exposed now: every exposed start-up has ended (1 shut down)."
    (window,) = report.exposure_windows
    assert (window.instance, window.end, window.end_reason, window.end_line, window.in_force) == (
        "glm-prefill-a",
        T0 + timedelta(hours=5, minutes=1),
        "shutdown",
        10,
        False,
    )

    doc = json.loads(report.to_json())
    assert doc["now"] == {
        "exposed": False,
        "exposed_startups": 0,
        "shared_cache_startups": 0,
        "answer": report.now(),
    }
    assert [(w["end"], w["end_reason"], w["end_line"]) for w in doc["exposure_windows"]] == [
        ("2026-08-20T15:01:00Z", "shutdown", 10)
    ]
    assert {(v["instance"], v["end_reason"]) for v in doc["verdicts"]} == {
        ("glm-prefill-a", "shutdown"),
        ("glm-prefill-b", None),
    }

    md = report.to_markdown()
    assert "**Not exposed now: every exposed start-up has ended (1 shut down).**" in md
    assert (
        "| glm-prefill-a | prefill | zai-org/GLM-5.3-FP8 | 2026-08-20 10:00 → 2026-08-20 15:01 | 1. KV pool "
        "vs context length | FAIL (exposed) |"
    ) in md
    assert md.count("| shut down (glm-prefill-a.log:10) |") == len(CHECKS)  # every check of that start-up
    assert md.count("| in force: the log shows no end |") == len(CHECKS)
    console = Console(record=True, width=400, color_system=None)
    report.render_terminal(console)
    text = console.export_text()
    assert "Not exposed now: every exposed start-up has ended" in text and "shut down (glm-prefill-a.log:10)" in text
    assert "shut down (glm-prefill-a.log:10)" in report._repr_html_()


def test_a_pod_replaced_without_shutdown_lines_is_retired_at_its_last_line(tmp_path: Path) -> None:
    report = audit_paths(rollout(tmp_path, sigterm=False))
    old = pool_check(report, "glm-prefill-a")
    assert (old.exposed, old.in_force, old.end_reason, old.end_line, old.successor) == (
        True,
        False,
        "log_end",
        9,
        "glm-prefill-b",
    )
    assert old.startup_to == T0 + timedelta(hours=5)  # its last line: the successor started before it
    assert not report.exposed_now
    assert report.now() == "Not exposed now: every exposed start-up has ended (1 replaced by a successor)."
    assert "| retired: its log ends (glm-prefill-a.log:9) and 'glm-prefill-b' took over |" in report.to_markdown()


def test_a_log_that_merely_stops_without_a_successor_stays_in_force(tmp_path: Path) -> None:
    report = audit_paths(rollout(tmp_path, sigterm=False, successor=False))
    old = pool_check(report, "glm-prefill-a")
    assert (old.exposed, old.in_force, old.end_reason, old.startup_to) == (True, True, None, None)
    assert report.exposed_now and report.exit_code == 1
    assert report.now() == (
        "EXPOSED NOW: 1 start-up(s) still in force serve prompts beyond their KV pool (glm-prefill-a)."
    )
    md = report.to_markdown()
    assert "| 2026-08-20 10:00 → running | 1. KV pool vs context length | FAIL (exposed) |" in md
    assert json.loads(report.to_json())["now"]["exposed"] is True


def test_a_restart_under_the_same_name_ends_at_the_next_start_up() -> None:
    report = audit_paths([AUDIT / "glm53-prefill-0.log", AUDIT / "glm53-decode-0.log"])
    first = pool_check_nth(report, "glm53-prefill-0", 0)
    assert (first.exposed, first.end_reason, first.end_line) == (True, "next_startup", 13)
    assert report.now() == "Not exposed now: every exposed start-up has ended (2 restarted)."
    assert report.exit_code == 1  # exposed in the audited period: the exit code still says so


def test_the_incident_handover_window_decides_who_took_over(tmp_path: Path) -> None:
    rollout(tmp_path / "engine", sigterm=False)
    (tmp_path / "incident.toml").write_text(INCIDENT + "\n[instances]\nhandover_s = 0\n")
    report = audit_incident(load_incident(tmp_path / "incident.toml"))
    # b started 30 min before a's last line: with no handover window it is a sibling, not a successor
    assert pool_check(report, "glm-prefill-a").in_force and report.exposed_now


# --- the evidence database ---------------------------------------------------------------------


def ingest_and_audit(tmp_path: Path, request_at: datetime, capacity_sql: str) -> tuple[Path, AuditReport, list]:
    """Ingest ``tmp_path/data`` (its engine logs, one gateway request at *request_at*): the incident file, the
    audit of the evidence database and what *capacity_sql* selects from it."""
    (tmp_path / "data" / "gateway").mkdir()
    (tmp_path / "data" / "gateway" / "day.jsonl").write_text(
        json.dumps(
            {
                "rid": "r1",
                "received_at": request_at.isoformat(),
                "account_id": "a",
                "model": "@cf/zai-org/glm-5.3",
                "http_status": 200,
                "prompt_tokens": 1000,
                "completion_tokens": 10,
            }
        )
        + "\n"
    )
    incident = tmp_path / "data" / "incident.toml"
    incident.write_text(INCIDENT)
    inv = Investigation.open(incident, tmp_path / "out")
    try:
        inv.ingest()
        return incident, audit_database(inv.con), inv.con.execute(capacity_sql).fetchall()
    finally:
        inv.close()


def test_audit_database_agrees_with_audit_paths_on_how_start_ups_ended(tmp_path: Path) -> None:
    rollout(tmp_path / "data" / "engine", sigterm=True)
    (tmp_path / "data" / "engine" / "glm-prefill-c.log").write_text(  # replaced by b without shutdown lines
        pod_log(T0 + timedelta(hours=1), SMALL, until=T0 + timedelta(hours=5))
    )
    incident, from_db, capacity = ingest_and_audit(
        tmp_path,
        T0 + timedelta(hours=2),
        "SELECT instance, valid_to, end_reason, end_line, successor FROM capacity ORDER BY instance",
    )
    from_logs = audit_incident(load_incident(incident))

    def ends(r: AuditReport) -> list[tuple[object, ...]]:
        return sorted(
            (v.instance, v.startup_to, v.end_reason, v.end_line, v.successor, v.exposed, v.in_force)
            for v in r.verdicts
            if v.check == 1
        )

    assert ends(from_db) == ends(from_logs)
    assert [(i, to, why, line, succ) for i, to, why, line, succ, _exposed, _live in ends(from_db)] == [
        (i, to.astimezone(UTC) if to else None, why, line, succ) for i, to, why, line, succ in capacity
    ]
    assert {(i, why) for i, _to, why, *_ in ends(from_db)} == {
        ("glm-prefill-a", "shutdown"),
        ("glm-prefill-b", None),
        ("glm-prefill-c", "log_end"),
    }
    assert not from_db.exposed_now and from_db.now() == from_logs.now() == (
        "Not exposed now: every exposed start-up has ended (1 shut down, 1 replaced by a successor)."
    )


def test_a_database_row_without_an_end_reason_is_ended_when_it_has_an_end(tmp_path: Path) -> None:
    con = db.connect()
    con.execute(
        "INSERT INTO capacity (instance, role, model, valid_from, valid_to, kv_pool_tokens, context_length, "
        "engine, flags, source, source_file, source_line) VALUES "
        "('p0', 'prefill', 'm', ?, ?, 100, 200, 'sglang', '{}', 'engines', 'p0.log', 1)",
        [T0, T0 + timedelta(hours=1)],
    )
    report = audit_database(con)
    v = pool_check(report, "p0")
    assert (v.exposed, v.in_force) == (True, False) and not report.exposed_now
    assert "| ended (the evidence database does not say how) |" in report.to_markdown()


def test_an_old_database_opened_read_only_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    old = duckdb.connect(str(path))
    old.execute("CREATE TABLE capacity (instance VARCHAR, role VARCHAR, valid_from TIMESTAMPTZ)")
    old.close()
    con = db.connect(path, read_only=True)
    with pytest.raises(InputError, match="no capacity table with start-up ends .* run 'kvforensics ingest' again"):
        audit_database(con)


# --- the command line --------------------------------------------------------------------------


def test_cli_audit_envelope(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = rollout(tmp_path / "plain", sigterm=True)
    wrapped = []
    for path in (a, b):  # kubectl logs --timestamps: the envelope's clock in front of each line
        out = tmp_path / path.name
        out.write_text(
            "".join(f"{line[1:11]}T{line[12:20]}.000000000Z {line}\n" for line in path.read_text().splitlines())
        )
        wrapped.append(str(out))
    assert main(["audit", "--envelope", "kubectl", "--json", *wrapped]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["summary"]["startups"], doc["now"]["exposed"]) == (2, False)
    assert [(w["end_reason"], w["end_line"]) for w in doc["exposure_windows"]] == [("shutdown", 10)]
    assert main(["audit", "--envelope", "journald", str(a)]) == 2  # not journalctl JSON
    assert capsys.readouterr().err.startswith(f"Error: {a}: no ")
    assert main(["audit", "--envelope", "none", "--json", str(a), str(b)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["now"]["exposed"] is False
    assert [w["end_reason"] for w in doc["exposure_windows"]] == ["shutdown"]
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "--envelope", "fluentd", str(a)])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fluentd'" in capsys.readouterr().err


def test_the_audit_and_the_capacity_table_read_one_role_from_sglang_logs_without_server_args(tmp_path: Path) -> None:
    """Issue 29, observation 5: an SGLang log without a server_args line. SGLang's scheduler adds its PD queue
    counts to every batch line of a prefill or decode server (log_prefill_stats / log_decode_stats, "if
    self.disaggregation_mode == DisaggregationMode.PREFILL"): a batch line without them shows a unified server;
    with no batch line either, no line says, and both the audit and the capacity table say unknown; a restart
    that logs no server_args keeps the role of the start-up before it in both."""
    engine = tmp_path / "data" / "engine"
    engine.mkdir(parents=True)
    end = T0 + timedelta(hours=2)

    def bare(text: str) -> str:
        return "".join(line for line in text.splitlines(keepends=True) if "server_args=" not in line)

    (engine / "plain-0.log").write_text(bare(pod_log(T0, LARGE, until=end)))  # batch lines, no PD counts
    (engine / "quiet-0.log").write_text(bare(pod_log(T0, LARGE, until=T0)))  # start-up lines only
    restart = pod_log(T0 + timedelta(hours=3), SMALL, until=T0 + timedelta(hours=3))
    (engine / "restart-0.log").write_text(pod_log(T0, LARGE, until=T0) + bare(restart))
    incident, from_db, capacity = ingest_and_audit(
        tmp_path,
        T0 + timedelta(hours=1),
        "SELECT instance, role, json_extract_string(flags, '$.role_source') FROM capacity ORDER BY instance, valid_from",
    )
    from_logs = audit_incident(load_incident(incident))

    def roles(r: AuditReport) -> list[tuple[str, str]]:
        return sorted((v.instance, v.role) for v in r.verdicts if v.check == 1)

    assert (
        roles(from_logs)
        == roles(from_db)
        == sorted((i, role) for i, role, _ in capacity)
        == [("plain-0", "unified"), ("quiet-0", "unknown"), ("restart-0", "prefill"), ("restart-0", "prefill")]
    )
    assert [source for _i, _role, source in capacity] == [
        "inferred from a batch line without the PD queue counts",
        "default (no server_args line)",
        None,
        "assumed from the previous start-up (restart-0.log:1): this one logged no server_args",
    ]
    plain = pool_check(from_logs, "plain-0")
    assert (plain.status, plain.exposed) == ("pass", False)
    restarted = pool_check_nth(from_db, "restart-0", 1)
    assert (restarted.status, restarted.exposed) == ("fail", True)  # its SMALL pool, on the prefill role it kept
    assert restarted.detail.endswith(
        "[role and model assumed from the previous start-up (restart-0.log:1): this one logged no server_args]"
    )
    assert pool_check_nth(from_logs, "restart-0", 1).detail == restarted.detail
