"""Issue 28, observation 7: a user's regular expression ([instances] match) hung the run with no output
(``^(?P<instance>(a+)+)$`` against 40 ``a`` and ``!`` was killed after 500 s). It runs in the ``regex`` module with a
time budget; running over is a configuration error naming the key."""

from __future__ import annotations

import time

import pytest
from conftest import INCIDENT, mini_requests, write_mini

from kvforensics.cli import main
from kvforensics.core.errors import ConfigError
from kvforensics.stages import instances
from kvforensics.stages.instances import InstanceMatching, match_instance_names

HOSTILE_NAME = "a" * 40 + "!"


@pytest.mark.parametrize(
    "pattern, name",
    [
        (r"^(?P<instance>(a+)+)$", HOSTILE_NAME),  # the issue's: nested quantifiers
        (r"(?P<instance>([a-z0-9]+-?)+)\.svc", "abcdefghijklmnopqrst"),  # the plausible one that took 47 s
    ],
)
def test_the_issues_patterns_finish_at_once(pattern, name):
    started = time.monotonic()
    (found,) = match_instance_names([name], ["p0"], InstanceMatching(match=pattern))
    assert found.matched_by == "unmatched" and time.monotonic() - started < 1


def test_a_pattern_over_its_time_budget_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as caught:
        match_instance_names(
            ["p0", HOSTILE_NAME],
            ["p0"],
            InstanceMatching(match=r"(?P<instance>(a|aa)+)$"),
            where="incident.toml: [instances]",
            budget_s=0.2,
        )
    message = str(caught.value)
    assert message.startswith(
        "incident.toml: [instances].match: match takes more than 0.2 s to search the instance names (at 'aaaa"
    )
    assert "'(a|aa)+'" in message and "simplify it" in message


def test_the_cli_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(instances, "MATCH_BUDGET_S", 0.2)
    rows = mini_requests()[:40]
    rows[0]["prefill_instance"] = HOSTILE_NAME
    path = write_mini(tmp_path / "mini", rows, INCIDENT + "\n[instances]\nmatch = '(?P<instance>(a|aa)+)$'\n")
    code = main(["ingest", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("Error: ") and "[instances].match: match takes more than 0.2 s" in err


def test_the_pattern_is_checked_by_the_same_engine_that_runs_it():
    with pytest.raises(ConfigError, match=r"\[instances\]\.match: match is not a valid regular expression"):
        instances.instances_from_config({"match": "(?P<instance>[a-"}, "[instances]")
