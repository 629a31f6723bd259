"""What each stage left in the evidence database, as the notebooks show it: one function per question a
responder asks at that stage (what was loaded, what was quarantined and why, which rules flagged what, who
received foreign data, whose data it could have been, who to notify). Every value comes from the database
through a fixed query; nothing the inputs hold is spliced into SQL."""

from __future__ import annotations

import duckdb
import pandas as pd

from kvforensics.explore.view import View, read_frame, reads, when
from kvforensics.report.data import how_it_ended, without_na
from kvforensics.stages.detect import load_rules

NOTIFICATION_ROLES = ("received_foreign_data", "data_exposed_confirmed", "data_exposed_possible")


def _share(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole else 0.0


# --- 01 ingest ------------------------------------------------------------------------------------------
@reads
def loaded(con: duckdb.DuckDBPyConnection, max_quarantine_fraction: float | None = None) -> View:
    """Per source: files, records read, loaded, quarantined (and their share), duplicates."""
    frame = read_frame(
        con,
        """
        SELECT source, kind, count(*) AS files, sum(records_read) AS records_read, sum(loaded) AS loaded,
               sum(quarantined) AS quarantined, sum(duplicates) AS duplicates
        FROM load_report GROUP BY source, kind ORDER BY source""",
    )
    frame["quarantined_share"] = [
        _share(q, r) for q, r in zip(frame["quarantined"], frame["records_read"], strict=True)
    ]
    read, quarantined = int(frame["records_read"].sum()), int(frame["quarantined"].sum())
    note = (
        f"{read:,} records read from {int(frame['files'].sum()):,} files of {len(frame)} sources: "
        f"{int(frame['loaded'].sum()):,} loaded, {quarantined:,} quarantined "
        f"({_share(quarantined, read):.2%}), {int(frame['duplicates'].sum()):,} duplicates."
    )
    if max_quarantine_fraction is not None:
        over = frame.loc[frame["quarantined_share"] > max_quarantine_fraction, "source"].tolist()
        frame["above_limit"] = frame["quarantined_share"] > max_quarantine_fraction
        note += (
            f" Sources above the incident's quarantine limit ({max_quarantine_fraction:.2%}): "
            f"{', '.join(over)}: the run will be inconclusive until they are fixed."
            if over
            else f" Every source is within the incident's quarantine limit ({max_quarantine_fraction:.2%})."
        )
    return View("What was loaded, per source", frame, note if not frame.empty else "Nothing was ingested yet.")


@reads
def loaded_files(con: duckdb.DuckDBPyConnection) -> View:
    """Per input file: records read, loaded, quarantined, duplicates, its SHA-256 and what the reader noted."""
    frame = read_frame(
        con,
        """SELECT source, file, records_read, loaded, quarantined, duplicates, bytes, sha256,
                               notes FROM load_report ORDER BY source, file""",
    )
    noted = int(frame["notes"].notna().sum()) if not frame.empty else 0
    return View(
        "Every input file",
        frame,
        f"{len(frame):,} files; {noted:,} with a note from their reader (truncated stream, encoding, line endings...).",
    )


@reads
def quarantine(con: duckdb.DuckDBPyConnection) -> View:
    """Quarantined records per source and reason, with their share of the source and one example line."""
    frame = read_frame(
        con,
        """
        WITH q AS (SELECT source, reason, count(*) AS records,
                          min(file || ':' || coalesce(CAST(line AS VARCHAR), '?')) AS example
                   FROM quarantine GROUP BY source, reason),
             r AS (SELECT source, sum(records_read) AS records_read FROM load_report GROUP BY source)
        SELECT q.source, q.reason, q.records, round(q.records / nullif(r.records_read, 0), 6) AS share_of_source,
               q.example
        FROM q LEFT JOIN r USING (source) ORDER BY q.records DESC, q.source, q.reason""",
    )
    note = (
        "Nothing was quarantined."
        if frame.empty
        else f"{int(frame['records'].sum()):,} records quarantined for {len(frame)} (source, reason) pairs; "
        f"quarantined_records(con, reason) shows the lines themselves."
    )
    return View("Quarantined records, by reason", frame, note)


@reads
def quarantined_records(
    con: duckdb.DuckDBPyConnection, reason: str | None = None, source: str | None = None, limit: int = 20
) -> View:
    """The quarantined lines themselves (file, line, reason, the raw text as read, truncated)."""
    frame = read_frame(
        con,
        """SELECT source, file, line, reason, raw FROM quarantine
                        WHERE ($reason IS NULL OR reason = $reason) AND ($source IS NULL OR source = $source)
                        ORDER BY source, file, line LIMIT $limit""",
        {"reason": reason, "source": source, "limit": int(limit)},
    )
    what = " and ".join(f"{k} {v!r}" for k, v in (("reason", reason), ("source", source)) if v is not None)
    note = (
        f"No quarantined record{' with ' + what if what else ''}."
        if frame.empty
        else f"The first {len(frame)} quarantined records{' with ' + what if what else ''}, in file order."
    )
    return View("Quarantined lines", frame, note)


@reads
def startups(con: duckdb.DuckDBPyConnection) -> View:
    """Every engine start-up: its KV pool and context length, whether it was exposed, how it ended."""
    frame = without_na(
        read_frame(
            con,
            """
        SELECT instance, role, model, valid_from, valid_to, kv_pool_tokens, context_length,
               EXISTS (SELECT 1 FROM exposure_windows w WHERE w.instance = capacity.instance AND w.valid_from IS NOT DISTINCT FROM capacity.valid_from) AS exposed, engine_version, source_file, source_line, end_reason,
               end_file, end_line, successor, last_ts, last_line
        FROM capacity ORDER BY model, instance, valid_from""",
        )
    )
    frame["ended"] = [how_it_ended(row) for row in frame.to_dict("records")]
    frame = frame.drop(columns=["end_reason", "end_file", "end_line", "successor", "last_ts", "last_line"])
    exposed = int(frame["exposed"].fillna(False).astype(bool).sum()) if not frame.empty else 0
    note = (
        f"{len(frame)} start-ups of {frame['instance'].nunique() if not frame.empty else 0} instances; "
        f"{exposed} exposed (audit check 1 fails: a KV pool smaller than the context length on a role that serves past it)."
    )
    return View("Engine start-ups", frame, note)


@reads
def instance_names(con: duckdb.DuckDBPyConnection) -> View:
    """How each instance name the gateway logged was matched to an engine instance."""
    frame = read_frame(con, "SELECT * FROM instance_names ORDER BY engine_instance NULLS LAST, gateway_name")
    unmatched = frame[frame["engine_instance"].isna()] if not frame.empty else frame
    note = (
        "Every gateway instance name matched an engine instance."
        if unmatched.empty
        else f"{len(unmatched)} gateway names matched no engine instance (or several): their requests are not "
        f"joined to a start-up."
    )
    return View("Gateway instance names", frame, note)


@reads
def ingest_notes(con: duckdb.DuckDBPyConnection) -> View:
    frame = read_frame(con, "SELECT kind, note FROM ingest_notes ORDER BY kind, note")
    return View(
        "Warnings and assumptions of the ingest",
        frame,
        "None."
        if frame.empty
        else f"{len(frame)} notes: read each; an assumption is a default the incident file can override.",
    )


# --- 02 detect ------------------------------------------------------------------------------------------
@reads
def rules(con: duckdb.DuckDBPyConnection) -> View:
    """Every rule: what it flags, how many requests, and how many of those are affected responses."""
    counts = {
        r: (n, a)
        for r, n, a in con.execute("""
        SELECT rule_id, count(*), count(*) FILTER (WHERE confidence IN ('confirmed', 'probable'))
        FROM findings GROUP BY rule_id""").fetchall()
    }
    frame = pd.DataFrame(
        [
            {
                "rule_id": r.id,
                "title": r.title,
                "severity": r.severity,
                "flagged": counts.get(r.id, (0, 0))[0],
                "flagged_affected": counts.get(r.id, (0, 0))[1],
                "description": " ".join(r.description.split()),
            }
            for r in load_rules()
        ]
    )
    return View(
        "Rules",
        frame,
        f"{len(frame)} rules; flagged_affected counts the requests each flagged that ended confirmed or probable.",
    )


@reads
def tiers(con: duckdb.DuckDBPyConnection) -> View:
    """Requests per confidence tier and combination of rules that flagged them."""
    frame = read_frame(
        con,
        """SELECT confidence, rules, count(*) AS requests FROM request_tiers
                        GROUP BY confidence, rules
                        ORDER BY CASE confidence WHEN 'confirmed' THEN 0 WHEN 'probable' THEN 1 ELSE 2 END,
                                 requests DESC, rules""",
    )
    by_tier = frame.groupby("confidence")["requests"].sum().to_dict() if not frame.empty else {}
    note = (
        "No rule flagged any request."
        if frame.empty
        else f"confirmed {by_tier.get('confirmed', 0):,}, probable {by_tier.get('probable', 0):,} (together: the "
        f"affected responses), possible {by_tier.get('possible', 0):,} (one weak signal: reviewed, not "
        f"counted)."
    )
    return View("Confidence tiers and the rules behind them", frame, note)


@reads
def latency_model(con: duckdb.DuckDBPyConnection) -> View:
    frame = read_frame(con, "SELECT * FROM latency_model ORDER BY model")
    unusable = frame.loc[~frame["usable"].astype(bool), "model"].tolist() if not frame.empty else []
    note = (
        "No latency model (no request with a time to first token)."
        if frame.empty
        else f"{len(frame)} models; "
        + (
            f"no usable fit for {', '.join(unusable)} (see reason): prefill_too_fast cannot flag their requests."
            if unusable
            else "every fit usable."
        )
    )
    return View("Prefill-latency model per model", frame, note)


@reads
def flagged(con: duckdb.DuckDBPyConnection, confidence: str | None = None, limit: int = 200) -> View:
    """The requests the rules flagged (of one tier, or all), highest tier first, then in time order."""
    frame = read_frame(
        con,
        """
        SELECT t.request_id, r.ts, r.account_id, r.model, r.prompt_tokens, r.status, t.confidence, t.rules
        FROM request_tiers t JOIN requests r USING (request_id)
        WHERE $confidence IS NULL OR t.confidence = $confidence
        ORDER BY CASE t.confidence WHEN 'confirmed' THEN 0 WHEN 'probable' THEN 1 ELSE 2 END, r.ts, t.request_id
        LIMIT $limit""",
        {"confidence": confidence, "limit": int(limit)},
    )
    what = f"{confidence} " if confidence else "flagged "
    return View(
        f"The {what}requests",
        frame,
        f"No {what}request."
        if frame.empty
        else f"The first {len(frame):,} {what}requests; response_evidence(con, request_id) shows one against "
        f"every rule.",
    )


# --- 03 scope -------------------------------------------------------------------------------------------
@reads
def conclusiveness(con: duckdb.DuckDBPyConnection) -> View:
    frame = read_frame(
        con,
        """SELECT code, message, CAST(evidence AS VARCHAR) AS evidence
                               FROM inconclusive_reasons ORDER BY n""",
    )
    note = (
        "Conclusive: every check of the evidence passed."
        if frame.empty
        else f"INCONCLUSIVE: {len(frame)} reasons; the answer below cannot be relied on until each is resolved."
    )
    return View("Does the evidence support the answer?", frame, note)


@reads
def recipients(con: duckdb.DuckDBPyConnection) -> View:
    """The answer: every account that received foreign data (customers first, most affected responses first),
    when, and how many other accounts' data it could have carried (confirmed by content; possible by the
    turnover horizon). ``account_exposure`` and ``response_sources`` name them."""
    frame = read_frame(
        con,
        """
        WITH possible AS (
            SELECT recipient_account_id AS account_id,
                   count(DISTINCT source_account_id) AS possible_source_accounts
            FROM possible_sources WHERE source_account_id <> recipient_account_id GROUP BY 1
        ), confirmed AS (
            SELECT recipient_account_id AS account_id,
                   count(DISTINCT source_account_id) AS confirmed_source_accounts
            FROM content_matches WHERE confirmed AND source_account_id <> recipient_account_id GROUP BY 1
        )
        SELECT a.account_id, a.account_class, count(*) AS responses, min(a.ts) AS first_ts, max(a.ts) AS last_ts,
               string_agg(DISTINCT a.model, ' ' ORDER BY a.model) AS models,
               coalesce(max(c.confirmed_source_accounts), 0) AS confirmed_source_accounts,
               coalesce(max(p.possible_source_accounts), 0) AS possible_source_accounts
        FROM affected_responses a LEFT JOIN confirmed c USING (account_id) LEFT JOIN possible p USING (account_id)
        GROUP BY a.account_id, a.account_class
        ORDER BY a.account_class = 'customer' DESC, responses DESC, a.account_id""",
    )
    if frame.empty:
        return View(
            "Accounts that received foreign data", frame, "No affected response: no account received foreign data."
        )
    classes = frame.groupby("account_class")["account_id"].count().to_dict()
    note = (
        f"{len(frame)} accounts received {int(frame['responses'].sum()):,} affected responses between "
        f"{when(frame['first_ts'].min())} and {when(frame['last_ts'].max())}; by class: "
        + ", ".join(f"{c} {n}" for c, n in sorted(classes.items()))
        + "."
    )
    return View("Accounts that received foreign data", frame, note)


@reads
def exposure_windows(con: duckdb.DuckDBPyConnection) -> View:
    """Start-ups exposed to stale KV pages (audit check 1 fails: table ``exposure_windows``), with the affected
    responses they served."""
    frame = without_na(
        read_frame(
            con,
            """
        SELECT c.instance, c.role, c.model, c.valid_from, c.valid_to, c.kv_pool_tokens, c.context_length,
               c.end_reason, c.end_file, c.end_line, c.successor, c.last_ts, c.last_line, c.source_file,
               (SELECT count(*) FROM affected_responses a
                 WHERE c.instance IN (a.prefill_instance, a.decode_instance, a.pool_instance)
                   AND a.ts >= c.valid_from AND (c.valid_to IS NULL OR a.ts < c.valid_to)) AS affected_responses
        FROM capacity c WHERE EXISTS (SELECT 1 FROM exposure_windows w WHERE w.instance = c.instance AND w.valid_from IS NOT DISTINCT FROM c.valid_from)
        ORDER BY c.valid_from NULLS LAST, c.instance""",
        )
    )
    frame["ended"] = [how_it_ended(row) for row in frame.to_dict("records")]
    frame = frame.drop(
        columns=["end_reason", "end_file", "end_line", "successor", "last_ts", "last_line", "source_file"]
    )
    note = (
        "No start-up was exposed."
        if frame.empty
        else f"{len(frame)} exposed start-ups; a window closes when its start-up ended (ended says how, with "
        f"the log line); an open end means the log stops while it still ran."
    )
    return View("Exposure windows", frame, note)


@reads
def sources_per_response(con: duckdb.DuckDBPyConnection) -> View:
    frame = read_frame(
        con,
        """
        SELECT a.request_id, a.account_id, a.ts,
               count(DISTINCT p.source_request_id) AS candidate_requests,
               count(DISTINCT p.source_account_id) FILTER (WHERE p.source_account_id <> p.recipient_account_id)
                   AS candidate_accounts,
               (SELECT count(DISTINCT m.source_account_id) FROM content_matches m
                 WHERE m.affected_request_id = a.request_id AND m.confirmed
                   AND m.source_account_id <> m.recipient_account_id) AS confirmed_accounts
        FROM affected_responses a LEFT JOIN possible_sources p ON p.affected_request_id = a.request_id
        GROUP BY a.request_id, a.account_id, a.ts ORDER BY confirmed_accounts DESC, candidate_accounts DESC,
                 a.request_id""",
    )
    return View(
        "Possible sources per affected response",
        frame,
        ""
        if frame.empty
        else f"median {frame['candidate_accounts'].median():.0f} candidate source "
        f"accounts per response; {int((frame['confirmed_accounts'] > 0).sum())} "
        f"responses with a source confirmed by content.",
    )


@reads
def exploitation(con: duckdb.DuckDBPyConnection) -> View:
    frame = read_frame(
        con,
        """SELECT * FROM account_behaviour
                        ORDER BY looks_deliberate DESC, oversize_requests DESC, account_id""",
    )
    deliberate = frame[frame["looks_deliberate"].astype(bool)] if not frame.empty else frame
    customers = deliberate[deliberate["account_class"] == "customer"] if not deliberate.empty else deliberate
    note = (
        f"{len(customers)} customer accounts look deliberate: {', '.join(customers['account_id'].astype(str))}."
        if not customers.empty
        else "No customer account looks deliberate."
    )
    if len(deliberate) > len(customers):
        note += (
            f" {len(deliberate) - len(customers)} internal or reporter accounts match the pattern too "
            f"(load tests, the reporter's reproduction): not exploitation by a customer."
        )
    return View("Exploitation: who sent oversize prompts, and how", frame, note)


@reads
def notification_list(con: duckdb.DuckDBPyConnection, role: str) -> View:
    """The accounts to notify in one role (``NOTIFICATION_ROLES``), as ``notifications.csv`` lists them."""
    if role not in NOTIFICATION_ROLES:
        raise ValueError(f"role must be one of {', '.join(NOTIFICATION_ROLES)}, got {role!r}")
    frame = read_frame(
        con,
        """SELECT account_id, account_class, responses, first_ts, last_ts, request_ids
                               FROM notifications WHERE role = $role
                               ORDER BY account_class, responses DESC, account_id""",
        {"role": role},
    )
    return View(f"To notify: {role.replace('_', ' ')}", frame, f"{len(frame)} accounts.")
