"""Inputs the evidence lacks, and what each absence means for the report's conclusions.

A section of the report whose input is missing says so where a reader looks for it (an empty table or a
blank chart says nothing): what is missing, which conclusions it weakens, which rules could not judge a
single response because of it, and what to add. A rule's needs are read from the rule itself: the
canonical tables its SQL reads (``capacity``, ``engine_events``, ``latency_model``) and the request fields
``conclusive.RULE_FIELDS`` lists for it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

import duckdb

from kvforensics.audit import AuditReport
from kvforensics.config import Incident
from kvforensics.core.db import has_table
from kvforensics.stages.conclusive import RULE_FIELDS
from kvforensics.stages.detect import Rule, load_rules


@dataclass(frozen=True)
class MissingInput:
    """One absent input. ``section``: the part of the report that explains it (``engine``, ``engine_events``,
    ``latency``, ``content``, ``changes``, ``audit``); ``rules``: the rules it left with nothing to judge."""

    section: str
    what: str
    meaning: str
    rules: tuple[str, ...] = ()


def reads_table(rule: Rule, table: str) -> bool:
    """Whether the rule's SQL reads this canonical table."""
    return re.search(rf"\b(?:FROM|JOIN)\s+{re.escape(table)}\b", rule.sql, re.IGNORECASE) is not None


def _count(con: duckdb.DuckDBPyConnection, query: str) -> int:
    return int(con.execute(query).fetchall()[0][0] or 0)


def _names(sources: list) -> str:
    return ", ".join(s.name for s in sources)


def missing_inputs(
    con: duckdb.DuckDBPyConnection,
    incident: Incident,
    investigated: Collection[str] | None = None,
    audit: AuditReport | None = None,
) -> list[MissingInput]:
    """Every input of the investigation that is absent or empty, in the order the report's sections come. What an
    absence weakens is said of the rules of the *investigated* mechanisms (ids; None: every mechanism's): an input
    none of them reads weakens no finding and is not listed (the engine logs' start-ups and the changes are).
    *audit*: the report's audit, whose check-5 verdicts say whether the load balancer's setting is still unknown."""
    rules = [r for r in load_rules() if investigated is None or r.mechanism in investigated]
    found: list[MissingInput] = []
    engine_sources = incident.sources_of("engine_log")
    startups = _count(con, "SELECT count(*) FROM capacity")
    if startups == 0:
        found.append(
            MissingInput(
                "engine",
                "no engine start-up was read: "
                + (
                    f"the engine logs ({_names(engine_sources)}) hold no start-up line"
                    if engine_sources
                    else "the incident file names no engine_log source"
                ),
                "the KV pool of every instance is unknown, so no exposure window can be found, no response can be judged "
                "against a pool and the deployment audit has nothing to check; an answer of no affected response is not "
                "an all-clear. Add the engine logs of the period: their start-up lines give each instance's pool",
                tuple(r.id for r in rules if reads_table(r, "capacity") or reads_table(r, "engine_events")),
            )
        )
    elif any(reads_table(r, "engine_events") for r in rules) and _count(con, "SELECT count(*) FROM engine_events") == 0:
        others = [r.id for r in rules if not reads_table(r, "engine_events")]
        found.append(
            MissingInput(
                "engine_events",
                "the engine logs hold no per-request line (scheduler aborts, KV transfer failures, request statistics)",
                "the rules that read them found nothing to judge, so a response is confirmed only where the other rules "
                + (f"({', '.join(others)}) " if others else "")
                + "agree. If the engines logged requests (SGLang --log-requests, vLLM request logging), add those logs",
                tuple(r.id for r in rules if reads_table(r, "engine_events")),
            )
        )
    found += _latency(con, rules)
    if _count(con, "SELECT count(*) FROM content_fingerprints") == 0:
        content = incident.sources_of("content")
        # sources confirmed without text: who stored the prefix-cache blocks a response reused (notifications.sql)
        confirmed = (
            _count(con, "SELECT count(*) FROM notifications WHERE role = 'data_exposed_confirmed'")
            if has_table(con, "notifications")
            else 0
        )
        found.append(
            MissingInput(
                "content",
                "no content fingerprints: "
                + (
                    f"the content sources ({_names(content)}) held no text"
                    if content
                    else "the incident file names no content source"
                ),
                "no exposure can be confirmed or ruled out by matching text: "
                + (
                    f"the {confirmed:,} account(s) notified as confirmed sources rest on other evidence (who stored "
                    "the prefix-cache blocks a response reused); every other account whose data could have been read "
                    "by an affected response is notified as possibly exposed. "
                    if confirmed
                    else "every account whose data could have been read by an affected response is notified as "
                    "possibly exposed, none as confirmed. "
                )
                + "A content source (prompts and outputs, fingerprinted as they are read, never stored) confirms "
                "exposures",
            )
        )
    if _count(con, "SELECT count(*) FROM changes") == 0:
        found.append(
            MissingInput(
                "changes",
                "no record of configuration changes (no changes source, or an empty one)",
                "exposure windows are bounded by engine start-ups alone: the deploy that opened or closed each is not "
                "named, and the timeline shows no config change. A changes source (deploy log or change tickets) names "
                "them",
            )
        )
    if startups:
        unknown = None if audit is None else sum(1 for v in audit.verdicts if v.check == 5 and v.status == "unknown")
        lb = (
            "check 5 (the load balancer does not abort before the first token) stays unknown here, and "
            if unknown is None
            else f"check 5 (the load balancer does not abort before the first token) stays unknown on {unknown:,} "
            "start-up(s) here, and "
            if unknown
            else ""
        )
        found.append(
            MissingInput(
                "audit",
                "the audit reads the engine logs and the incident file's [prefix_cache] only: the rest of a deployment "
                "manifest and /get_server_info dumps are not inputs of a run",
                f"{lb}the engine version is the one the log shows or implies"
                + (" or the incident file's [prefix_cache] declares" if incident.prefix_isolation is not None else "")
                + ". Run kvforensics audit --incident <incident.toml> --manifest <deployment manifest> --server-info "
                "<dump.json> to answer " + ("them" if lb else "it"),
            )
        )
    return found


def _latency(con: duckdb.DuckDBPyConnection, rules: list[Rule]) -> list[MissingInput]:
    """Missing timings: the fields ``RULE_FIELDS`` names absent from every successful request, or models left
    without a usable latency model."""
    timed = [r for r in rules if reads_table(r, "latency_model") or r.id in RULE_FIELDS]
    if not timed:
        return []
    ttft, latency = con.execute(
        "SELECT count(ttft_ms), count(latency_ms) FROM analysed_requests WHERE status BETWEEN 200 AND 299"
    ).fetchall()[0]
    unfitted = [
        m
        for (m,) in con.execute(
            """SELECT DISTINCT r.model FROM analysed_requests r
           WHERE r.status BETWEEN 200 AND 299
             AND NOT EXISTS (SELECT 1 FROM latency_model l WHERE l.model = r.model AND l.usable)
           ORDER BY 1"""
        ).fetchall()
    ]
    ids = tuple(r.id for r in timed)
    if not ttft and not latency:
        return [
            MissingInput(
                "latency",
                "the gateway records have neither time to first token (ttft_ms) nor end-to-end latency (latency_ms)",
                "no latency model could be fitted, so no response could be found too fast for a real prefill and the chart "
                "of prompt size against time to first token cannot be drawn; the findings rest on the other rules. Map "
                "the gateway's timing field in the requests source's columns if its logs have one",
                ids,
            )
        ]
    if not ttft:
        return [
            MissingInput(
                "latency",
                "the gateway records have no time to first token (ttft_ms), only end-to-end latency",
                (
                    "no latency model could be fitted without it, so no response could be found too fast for a real prefill; "
                    if unfitted
                    else "end-to-end latency (an upper bound of time to first token) stands in for it, which "
                    "finds fewer too-fast responses; "
                )
                + "map the gateway's time-to-first-token field if its logs have one",
                ids if unfitted else (),
            )
        ]
    if unfitted:
        return [
            MissingInput(
                "latency",
                f"no usable latency model for {', '.join(unfitted)}",
                "no response of these models could be found too fast for a real prefill (the table below says why each "
                "fit was refused)",
                ids,
            )
        ]
    return []
