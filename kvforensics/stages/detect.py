"""Detect: run the rules of the selected exposure mechanisms and combine their findings into confidence tiers.

The mechanisms run are the ones the incident file names, else every mechanism whose inputs the
evidence holds (``kvforensics.mechanisms.select``); the choice is kept in the ``mechanisms`` table.
A rule is two files in its mechanism's folder, ``rules/<id>.sql`` and ``rules/<id>.yml`` (read by
``kvforensics.stages.rulebook``): the SQL returns ``request_id, strength, evidence`` for the requests it flags.

Confidence tiers per request (documented in the report's method section):
  * ``confirmed``: at least one strong signal and at least two rules agree;
  * ``probable``:  one strong signal alone, or two or more weak signals from different rules;
  * ``possible``:  a single weak signal. ``possible`` never counts as affected.
Strong signals: the prompt exceeded the pool of the instance that served it (or of every prefill
instance of the model), the engine logged an abort for a request the client got 2xx for, a KV
checksum / corruption finding. Weak: too fast for a real prefill, engine/gateway token-count
mismatch, a bare transfer failure, exceeding only the smallest of several pools.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import duckdb
import pandas as pd

from kvforensics import latency
from kvforensics.core.db import MemoryGovernor, connect
from kvforensics.core.errors import ConfigError
from kvforensics.mechanisms import Selection, load_mechanisms, present_inputs, select
from kvforensics.stages.rulebook import Rule, load_rules, rule_parameters

if TYPE_CHECKING:
    from kvforensics.engines.spark import SparkEngine

__all__ = [
    "AFFECTED_TIERS",
    "Rule",
    "detect",
    "evaluate_case",
    "load_case_tables",
    "load_rules",
    "rule_parameters",
    "run_rule",
    "select_mechanisms",
]

AFFECTED_TIERS = ("confirmed", "probable")


def run_rule(con: duckdb.DuckDBPyConnection, rule: Rule, params: Mapping[str, Any]) -> pd.DataFrame:
    """The rule's flagged requests: ``request_id, strength, evidence``."""
    used = rule.used_parameters()
    args = {k: v for k, v in params.items() if k in used}
    return con.execute(rule.sql, args or None).df()


def select_mechanisms(con: duckdb.DuckDBPyConnection, named: Sequence[str] | None = None) -> tuple[Selection, ...]:
    """Choose the mechanisms to run (*named*, else those whose inputs are present) and record the choice
    in the ``mechanisms`` table."""
    known = load_mechanisms()
    present = present_inputs(con, {i for m in known for i in (*m.required, *m.any_of)})
    chosen = select(named, present, known)
    con.execute("DELETE FROM mechanisms").fetchall()
    for s in chosen:
        con.execute(
            "INSERT INTO mechanisms VALUES ($id, $title, $named, $selected, $missing)",
            {
                "id": s.mechanism.id,
                "title": s.mechanism.title,
                "named": s.named,
                "selected": s.selected,
                "missing": list(s.missing),
            },
        ).fetchall()
    return chosen


def detect(
    con: duckdb.DuckDBPyConnection,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    rules: tuple[Rule, ...] | None = None,
    spark: SparkEngine | None = None,
    mechanisms: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Run the selected mechanisms' rules (*mechanisms*: the incident file's list, None: every mechanism
    whose inputs are present; *rules*: exactly these instead), fit the latency model in between, write
    ``mechanisms``, ``findings`` and ``request_tiers``.

    With ``spark`` (a :class:`kvforensics.engines.spark.SparkEngine` holding the canonical tables),
    the rules run on Spark; the latency fit (an aggregate over ``requests``) and the combination of
    the collected findings into tiers run on the evidence database either way.
    """
    overrides = overrides or {}
    unknown = set(overrides) - {r.id for r in (rules or load_rules())}
    if unknown:
        raise ConfigError(f"[rules] names unknown rule(s) {sorted(unknown)}")
    selected = {s.mechanism.id for s in select_mechanisms(con, mechanisms) if s.selected}
    rules = rules or tuple(r for r in load_rules() if r.mechanism in selected)
    with MemoryGovernor(con) as governor:  # ticked before each rule
        found = _findings(con, rules, overrides, spark, governor)
    con.register("raw_findings", found)
    con.execute("""
        CREATE OR REPLACE TABLE request_tiers AS
        SELECT request_id,
               CASE WHEN count(*) FILTER (WHERE strength = 'strong') >= 1 AND count(*) >= 2 THEN 'confirmed'
                    WHEN count(*) FILTER (WHERE strength = 'strong') >= 1 OR count(*) >= 2 THEN 'probable'
                    ELSE 'possible' END AS confidence,
               string_agg(rule_id, ' ' ORDER BY rule_id) AS rules
        FROM raw_findings GROUP BY request_id""").fetchall()
    con.execute("DELETE FROM findings").fetchall()
    con.execute("""
        INSERT INTO findings (request_id, rule_id, rule_version, confidence, parameters, evidence, strength,
                              mechanism)
        SELECT f.request_id, f.rule_id, f.rule_version, t.confidence, CAST(f.parameters AS JSON),
               CAST(f.evidence AS JSON), f.strength, f.mechanism
        FROM raw_findings f JOIN request_tiers t USING (request_id)
        ORDER BY f.request_id, f.rule_id""").fetchall()
    con.unregister("raw_findings")
    return found


def _findings(
    con: duckdb.DuckDBPyConnection,
    rules: Sequence[Rule],
    overrides: Mapping[str, Mapping[str, Any]],
    spark: SparkEngine | None,
    governor: MemoryGovernor,
) -> pd.DataFrame:
    """Every rule's flagged requests: the rules that need no latency model, the latency fit (without the
    requests they flagged), then the rules that need it."""
    frames = []
    con.execute("CREATE OR REPLACE TEMP TABLE flagged_before_latency (request_id VARCHAR)").fetchall()
    for rule in [r for r in rules if not r.needs_latency_model]:
        frames.append(governor.run(lambda rule=rule: _collect(con, rule, overrides.get(rule.id), spark)))
    if frames:
        ids = pd.DataFrame({"request_id": pd.concat([f["request_id"] for f in frames]).astype(str).unique()})
        con.register("flagged_ids", ids)
        con.execute("INSERT INTO flagged_before_latency SELECT request_id FROM flagged_ids").fetchall()
        con.unregister("flagged_ids")
    governor.tick()
    latency.fit_models(con, exclude_table="flagged_before_latency")
    if spark is not None:
        spark.push_tables(con, ["latency_model"])
    for rule in [r for r in rules if r.needs_latency_model]:
        frames.append(governor.run(lambda rule=rule: _collect(con, rule, overrides.get(rule.id), spark)))
    return (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(
            columns=["request_id", "strength", "evidence", "rule_id", "rule_version", "parameters", "mechanism"]
        )
    )


def _collect(
    con: duckdb.DuckDBPyConnection, rule: Rule, overrides: Mapping[str, Any] | None, spark: SparkEngine | None = None
) -> pd.DataFrame:
    params = rule_parameters(rule, overrides)
    df = spark.run_rule(con, rule, params) if spark is not None else run_rule(con, rule, params)
    df["request_id"] = df["request_id"].astype(str)
    df["evidence"] = df["evidence"].astype(str)
    df["strength"] = df["strength"].astype(str)
    df["rule_id"] = rule.id
    df["rule_version"] = rule.version
    df["mechanism"] = rule.mechanism
    df["parameters"] = json.dumps(params, sort_keys=True)
    return df


# --- rule test cases -------------------------------------------------------------------------------

_DEFAULTS: dict[str, dict[str, Any]] = {
    "requests": {
        "ts": "2026-08-28T00:00:00Z",
        "account_id": "acct",
        "model": "m",
        "status": 200,
        "prompt_tokens": 0,
        "source": "test",
        "source_file": "test",
        "source_line": 0,
    },
    "capacity": {"engine": "sglang", "source": "test", "source_file": "test"},
    "engine_events": {"source": "test", "source_file": "test", "source_line": 0, "detail": ""},
    "latency_model": {"usable": True},
}


def load_case_tables(con: duckdb.DuckDBPyConnection, tables: Mapping[str, list[Mapping[str, Any]]]) -> None:
    """Insert a test case's rows into the canonical tables (unspecified columns get defaults or NULL)."""
    for table, rows in tables.items():
        if not rows:
            continue
        df = pd.DataFrame([{**_DEFAULTS.get(table, {}), **row} for row in rows])
        con.register("case_rows", df)
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM case_rows").fetchall()
        con.unregister("case_rows")


def evaluate_case(rule: Rule, case: Mapping[str, Any]) -> pd.DataFrame:
    """Run one of a rule's test cases in a fresh in-memory evidence database."""
    con = connect()
    try:
        load_case_tables(con, case.get("tables", {}))
        return run_rule(con, rule, rule_parameters(rule, case.get("parameters")))
    finally:
        con.close()
