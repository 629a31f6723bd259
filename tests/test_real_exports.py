"""Real exports, no preprocessing: a LiteLLM proxy's spend-log CSV plus SGLang pod logs from
``kubectl logs --timestamps`` and a Grafana Loki export, with pods replaced in rolling restarts.

The simulator writes one incident in those formats (``kvforensics simulate --export litellm-loki``,
``kvforensics/simulate/exports.py``, which cites each format's documentation); the incident file
below is what a responder writes for it: a preset for the gateway and a few lines per engine
source. The run must give exactly the simulated affected responses, close the exposure windows of
the pods the rollouts retired, and, when the spend logs are mapped without the preset (``status``
holds ``success`` / ``failure``), end inconclusive (exit 3) instead of a false all-clear.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import pytest

from kvforensics.cli import main
from kvforensics.simulate.cli import main as simulate_main
from kvforensics.simulate.exports import SIGTERM_LINE, SPEND_LOG_COLUMNS

pytestmark = pytest.mark.slow

SCENARIO = """\
[scenario]
seed = 13
requests = 4000
accounts = 150
affected = 21
affected_customer_accounts = 8
internal_affected = 5
reporter_affected = 1
engine_timezone = "America/Los_Angeles"
"""

ENGINE_SOURCES = """\
[[sources]]
name = "loki"
kind = "engine_log"
path = "engine/loki/*.jsonl"
format = "sglang"
timezone = "America/Los_Angeles"
instance = "{label:pod}"

[[sources]]
name = "kubectl"
kind = "engine_log"
path = "engine/kubectl/*.log"
format = "sglang"
timezone = "America/Los_Angeles"

[scope]
internal_accounts = ["loadtest-*"]
reporter_accounts = ["bounty-4471"]

[models]
aliases = { "zai-org/GLM-5.3-FP8" = "@cf/zai-org/glm-5.3", "zai-org/GLM-5.2-FP8" = "@cf/zai-org/glm-5.2", \
"meta-llama/Llama-3.3-70B-Instruct" = "@cf/meta/llama-3.3-70b-instruct" }
"""

WITH_PRESET = (
    """\
[incident]
id = "litellm-loki"
title = "GLM-5.3 KV-cache exposure, from the production exports"

[[sources]]
name = "litellm"
kind = "requests"
path = "gateway/LiteLLM_SpendLogs.csv"
preset = "litellm"

"""
    + ENGINE_SOURCES
)

#: The same spend logs mapped column by column, as a user without the preset would.
WITHOUT_PRESET = (
    """\
[incident]
id = "litellm-loki-unmapped"
title = "GLM-5.3 KV-cache exposure, spend logs mapped by hand"

[[sources]]
name = "litellm"
kind = "requests"
path = "gateway/LiteLLM_SpendLogs.csv"
format = "csv"
columns = { ts = "startTime", account_id = "team_id", model = "model_group" }

"""
    + ENGINE_SOURCES
)

KUBECTL_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: TP\d+)?\] ")
PG_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,3})?$")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("litellm-loki")
    scenario = root / "scenario.toml"
    scenario.write_text(SCENARIO)
    argv = ["--out", str(root / "data"), "--scenario-file", str(scenario), "--export", "litellm-loki",
            "--logcli-timezone", "Europe/Berlin"]  # fmt: skip
    assert simulate_main(argv) == 0
    return root / "data", json.loads((root / "data" / "ground_truth.json").read_text())


def investigate(data: Path, incident: str, out: Path) -> int:
    path = data / f"{out.name}.toml"
    path.write_text(incident)
    return main(["run", str(path), "--out", str(out), "--quiet", "--no-pdf"])


@pytest.fixture(scope="module")
def investigated(exported: tuple[Path, dict]) -> tuple[int, Path, dict]:
    data, truth = exported
    code = investigate(data, WITH_PRESET, data.parent / "with-preset")
    return code, data.parent / "with-preset", truth


def affected_ids(out: Path) -> set[str]:
    with (out / "affected_requests.csv").open() as fh:
        return {row["request_id"] for row in csv.DictReader(fh)}


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_the_exports_are_shaped_as_the_upstream_tools_write_them(exported: tuple[Path, dict]) -> None:
    data, truth = exported
    with (data / "gateway" / "LiteLLM_SpendLogs.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == SPEND_LOG_COLUMNS
    assert {r["status"] for r in rows} == {"success", "failure"}
    assert all(PG_TIMESTAMP.match(r[c]) for r in rows for c in ("startTime", "endTime", "completionStartTime"))
    failed = [r for r in rows if r["status"] == "failure"]
    assert {json.loads(r["metadata"])["error_information"]["error_code"] for r in failed} >= {"400", "429"}
    assert all((json.loads(r["metadata"])["user_api_key_team_id"] or "") == r["team_id"] for r in rows)
    teamless = {r["user"] for r in rows if r["team_id"] == ""}  # load tests: a service user's key, no team
    assert teamless and all(user.startswith("loadtest-") for user in teamless)
    ends = [r["endTime"] for r in rows]
    assert ends == sorted(ends) and [r["startTime"] for r in rows] != sorted(r["startTime"] for r in rows)

    loki = [json.loads(line) for line in (data / "engine" / "loki" / "glm53.jsonl").read_text().splitlines()]
    assert all(list(e) == ["labels", "line", "timestamp"] for e in loki)
    times = [utc(e["timestamp"]) for e in loki]
    assert times == sorted(times, reverse=True)  # logcli's default direction: newest first
    assert all(e["timestamp"].endswith(("+02:00", "+01:00")) for e in loki)
    first_pods = {e["labels"]["pod"] for e in loki[:300]}
    assert len(first_pods) >= 3  # pods interleaved

    for path in (data / "engine" / "kubectl").glob("*.log"):
        assert all(KUBECTL_LINE.match(line) for line in path.read_text().splitlines()), path.name

    pods = truth["pods"]
    loki_pods = {e["labels"]["pod"] for e in loki}
    assert loki_pods == {p["pod"] for p in pods if p["collector"] == "loki"}
    for collector in ("loki", "kubectl"):  # both ends of a retired pod occur in both collections
        assert {p["end"] for p in pods if p["collector"] == collector} == {"shutdown", "log_end", "running"}
    for pod in pods:  # a replaced pod's successor has a new name and starts after it ends
        if pod["successor_start"]:
            assert utc(pod["last_line"]) < utc(pod["successor_start"])
    shutdowns = {e["labels"]["pod"] for e in loki if e["line"].endswith(SIGTERM_LINE)}
    assert shutdowns == {p["pod"] for p in pods if p["collector"] == "loki" and p["end"] == "shutdown"}


def test_a_preset_and_a_few_lines_give_exactly_the_simulated_affected_set(
    investigated: tuple[int, Path, dict],
) -> None:
    code, out, truth = investigated
    scope = json.loads((out / "scope.json").read_text())
    assert (code, scope.get("conclusive"), scope.get("inconclusive_reasons")) == (0, True, [])
    assert affected_ids(out) == {a["request_id"] for a in truth["affected"]}
    assert scope["affected_responses"] == len(truth["affected"])
    assert scope["affected_accounts"] == len(truth["affected_accounts"])
    by_class = Counter({"exploiter": "customer"}.get(a["kind"], a["kind"]) for a in truth["affected"])
    assert {c: v["responses"] for c, v in scope["by_account_class"].items()} == {
        c: by_class[c] for c in ("customer", "internal", "reporter")
    }


def test_nothing_is_lost_and_the_outputs_verify(investigated: tuple[int, Path, dict]) -> None:
    _, out, _ = investigated
    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM quarantine").fetchone() == (0,)
    notes = [n for (n,) in con.execute("SELECT note FROM ingest_notes").fetchall()]
    assert not [n for n in notes if "engine timestamps differ" in n]  # timezone declared right
    assert main(["verify", str(out)]) == 0


def test_a_wrong_engine_timezone_is_reported_and_the_envelope_clock_decides(
    exported: tuple[Path, dict],
) -> None:
    data, truth = exported
    out = data.parent / "engine-zone-wrong"
    assert investigate(data, WITH_PRESET.replace('"America/Los_Angeles"', '"UTC"'), out) == 0
    assert affected_ids(out) == {a["request_id"] for a in truth["affected"]}
    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    notes = [n for (n,) in con.execute("SELECT note FROM ingest_notes").fetchall()]
    # the pods print Pacific daylight time (UTC-7) that the source declares UTC: off by +7 h
    assert {"loki", "kubectl"} <= {n.split(":")[0] for n in notes if "differ from the" in n and "+7.00 h" in n}


def test_traps_are_not_counted(investigated: tuple[int, Path, dict]) -> None:
    _, out, truth = investigated
    flagged = affected_ids(out)
    for kind, ids in truth["traps"].items():
        assert not flagged & set(ids), kind


def test_rollouts_retire_pods_and_close_their_exposure_windows(investigated: tuple[int, Path, dict]) -> None:
    _, out, truth = investigated
    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    ends = dict(con.execute("SELECT instance, end_reason FROM capacity").fetchall())
    expected = {"shutdown": "shutdown", "log_end": "log_end", "running": None}
    assert ends == {p["pod"]: expected[p["end"]] for p in truth["pods"]}
    # the retired dark-launch pods (safe pools) no longer count: every prefill pool in force is exceeded
    pool_rule = dict(
        con.execute("SELECT request_id, strength FROM findings WHERE rule_id = 'prompt_exceeds_kv_pool'").fetchall()
    )
    assert {pool_rule.get(a["request_id"]) for a in truth["affected"]} == {"strong"}
    scope = json.loads((out / "scope.json").read_text())
    got = {w["instance"]: w for w in scope["exposure_windows"]}
    want = {w["instance"]: w for w in truth["exposure_windows"]}
    assert set(got) == set(want)
    for pod, window in want.items():
        assert got[pod]["pool_tokens"] == window["pool_tokens"]
        assert timedelta(0) <= utc(got[pod]["start"]) - utc(window["start"]) < timedelta(seconds=1), pod
        assert got[pod]["end"] is not None, f"{pod}: retired in a rollout, yet its window never closes"
        end = utc(got[pod]["end"])
        # closed by its SIGTERM line or last line, at the latest when its successor started
        assert utc(window["stopped"]) - timedelta(seconds=1) <= end <= utc(window["end"]), pod


def test_mapped_without_the_preset_the_run_is_inconclusive(exported: tuple[Path, dict]) -> None:
    data, _ = exported
    out = data.parent / "without-preset"
    assert investigate(data, WITHOUT_PRESET, out) == 3
    scope = json.loads((out / "scope.json").read_text())
    assert scope["conclusive"] is False
    assert "quarantine_share" in {r["code"] for r in scope["inconclusive_reasons"]}
    first = (out / "report.md").read_text().lstrip().splitlines()[0]
    assert "inconclusive" in first.lower() and "quarantine" in first.lower()


def test_export_refuses_what_it_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--out", str(tmp_path), "--export", "litellm-loki", "--requests", "3000000"]
    assert simulate_main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Error: scenario: --export writes every request row by row; use requests <= 2000000" in err
    assert simulate_main(["--out", str(tmp_path), "--export", "litellm-loki", "--logcli-timezone", "Mars/Base"]) == 2
    assert "Error: export: unknown IANA time zone 'Mars/Base'" in " ".join(capsys.readouterr().err.split())
