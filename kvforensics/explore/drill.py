"""Drill-downs: one account, one engine instance, one affected response, as a responder follows a lead.

Each takes the investigation's connection (``inv.con``) and a name as the evidence holds it (exact, case
and all), passed to DuckDB as a parameter. An unknown name gives an empty view that says so; a name that is
None (no example in this incident) likewise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import duckdb
import pandas as pd

from kvforensics.explore.view import View, read_frame, reads, when
from kvforensics.report.charts import CONFIDENCE_COLOURS, alt
from kvforensics.report.data import how_it_ended, without_na
from kvforensics.stages.detect import load_rules

MAX_CHART_POINTS = 4000  # an account's unflagged requests drawn (every flagged one is)
AFFECTED = ("confirmed", "probable")  # the tiers counted as affected responses


def _known(con: duckdb.DuckDBPyConnection, query: str, limit: int = 12) -> str:
    names = [str(r[0]) for r in con.execute(f"{query} LIMIT {int(limit) + 1}").fetchall()]
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return shown or "none"


@dataclass(frozen=True)
class Examples:
    """Names to start drilling from, picked from the evidence (None where the incident has none): the customer
    account (else any account) that received the most affected responses, its first affected response, the
    exposed instance that served the most affected responses, and the account whose data the most affected
    responses confirmably carried."""

    account: str | None
    response: str | None
    instance: str | None
    source_account: str | None


@reads
def examples(con: duckdb.DuckDBPyConnection) -> Examples:
    def first(query: str) -> str | None:
        row = con.execute(query).fetchone()
        return None if row is None else row[0]

    account = first("""SELECT account_id FROM affected_responses GROUP BY account_id, account_class
                       ORDER BY account_class = 'customer' DESC, count(*) DESC, account_id LIMIT 1""")
    response = (
        None
        if account is None
        else con.execute(
            "SELECT request_id FROM affected_responses WHERE account_id = $a ORDER BY ts, request_id LIMIT 1",
            {"a": account},
        ).fetchone()[0]
    )
    instance = first("""SELECT c.instance FROM capacity c JOIN affected_responses a
                          ON c.instance IN (a.prefill_instance, a.decode_instance, a.pool_instance)
                         AND a.ts >= c.valid_from AND (c.valid_to IS NULL OR a.ts < c.valid_to)
                        WHERE c.kv_pool_tokens < c.context_length
                        GROUP BY c.instance ORDER BY count(*) DESC, c.instance LIMIT 1""")
    source_account = first("""SELECT source_account_id FROM content_matches
                              WHERE confirmed AND source_account_id <> recipient_account_id
                              GROUP BY 1 ORDER BY count(DISTINCT affected_request_id) DESC, 1 LIMIT 1""")
    return Examples(account=account, response=response, instance=instance, source_account=source_account)


@reads
def account_timeline(con: duckdb.DuckDBPyConnection, account_id: str | None) -> View:
    """Every request of one account in time order, with its confidence tier (``not flagged`` when no rule
    flagged it) and whether it is an affected response; ``.chart`` draws them (prompt size over time)."""
    frame = read_frame(
        con,
        """
        SELECT r.ts, r.request_id, r.model, r.status, r.prompt_tokens, r.completion_tokens, r.ttft_ms,
               r.latency_ms, r.prefill_instance, r.decode_instance,
               coalesce(t.confidence, 'not flagged') AS confidence, t.rules,
               a.request_id IS NOT NULL AS affected
        FROM requests r LEFT JOIN request_tiers t USING (request_id)
        LEFT JOIN affected_responses a USING (request_id)
        WHERE r.account_id = $account ORDER BY r.ts, r.request_id""",
        {"account": account_id},
    )
    title = f"Account {account_id}: its requests over time"
    if frame.empty:
        known = _known(con, "SELECT DISTINCT account_id FROM affected_responses ORDER BY 1")
        return View(
            title,
            frame,
            f"No request of account {account_id!r} in the evidence (account ids are "
            f"exact); accounts with affected responses: {known}.",
        )
    affected = frame[frame["affected"]]
    note = f"{len(frame):,} requests from {when(frame['ts'].min())} to {when(frame['ts'].max())}; "
    note += (
        f"{len(affected):,} affected responses (it received foreign data) from {when(affected['ts'].min())} "
        f"to {when(affected['ts'].max())}."
        if not affected.empty
        else "none affected."
    )
    return View(title, frame, note, chart=_account_chart(frame, str(account_id)))


def _account_chart(frame: pd.DataFrame, account_id: str) -> alt.Chart:
    flagged = frame[frame["confidence"] != "not flagged"]
    rest = frame[frame["confidence"] == "not flagged"]
    if len(rest) > MAX_CHART_POINTS:
        rest = rest.sample(MAX_CHART_POINTS, random_state=0)
    points = pd.concat([rest, flagged])[
        ["ts", "request_id", "model", "status", "prompt_tokens", "ttft_ms", "confidence", "affected"]
    ]
    points = points.assign(
        ts=points["ts"].dt.tz_convert("UTC").dt.tz_localize(None),
        outcome=["success" if 200 <= s <= 299 else "error" for s in points["status"]],
    )
    return (
        alt.Chart(points)
        .mark_point(filled=True, size=45, opacity=0.8)
        .encode(
            x=alt.X("ts:T", title="time (UTC)", scale=alt.Scale(type="utc")),
            y=alt.Y("prompt_tokens:Q", title="prompt tokens", axis=alt.Axis(format="~s")),
            color=alt.Color("confidence:N", scale=CONFIDENCE_COLOURS, title="finding"),
            shape=alt.Shape("outcome:N", title="client got"),
            tooltip=["ts:T", "request_id:N", "model:N", "status:Q", "prompt_tokens:Q", "ttft_ms:Q", "confidence:N"],
        )
        .properties(width=640, height=260, title=f"requests of {account_id}")
        .interactive()
    )


@reads
def instance_history(con: duckdb.DuckDBPyConnection, instance: str | None) -> View:
    """One engine instance's start-ups in order: KV pool, context length, exposed or not, how each ended, and
    the requests, affected responses and engine aborts of each."""
    frame = without_na(
        read_frame(
            con,
            """
        SELECT c.valid_from, c.valid_to, c.role, c.model, c.engine_version, c.kv_pool_tokens,
               c.context_length, c.kv_pool_tokens < c.context_length AS exposed, c.source_file, c.source_line,
               c.end_reason, c.end_file, c.end_line, c.successor, c.last_ts, c.last_line,
               (SELECT count(*) FROM requests r WHERE c.instance IN (r.prefill_instance, r.decode_instance)
                  AND r.ts >= c.valid_from AND (c.valid_to IS NULL OR r.ts < c.valid_to)) AS requests,
               (SELECT count(*) FROM affected_responses a
                 WHERE c.instance IN (a.prefill_instance, a.decode_instance, a.pool_instance)
                   AND a.ts >= c.valid_from AND (c.valid_to IS NULL OR a.ts < c.valid_to)) AS affected_responses,
               (SELECT count(*) FROM engine_events e WHERE e.instance = c.instance AND e.kind LIKE 'abort%'
                  AND e.ts >= c.valid_from AND (c.valid_to IS NULL OR e.ts < c.valid_to)) AS engine_aborts
        FROM capacity c WHERE c.instance = $instance ORDER BY c.valid_from NULLS FIRST, c.source_line""",
            {"instance": instance},
        )
    )
    title = f"Instance {instance}: its start-ups"
    if frame.empty:
        return View(
            title,
            frame,
            f"No start-up of instance {instance!r} in the engine logs; instances: "
            f"{_known(con, 'SELECT DISTINCT instance FROM capacity ORDER BY 1')}.",
        )
    frame["ended"] = [how_it_ended(row) for row in frame.to_dict("records")]
    frame = frame.drop(columns=["end_reason", "end_file", "end_line", "successor", "last_ts", "last_line"])
    exposed = int(frame["exposed"].fillna(False).astype(bool).sum())
    note = (
        f"{len(frame)} start-ups, {exposed} exposed (KV pool below the context length); "
        f"{int(frame['affected_responses'].sum()):,} affected responses served."
    )
    return View(title, frame, note)


def _evidence_text(value: str | None) -> str:
    if value is None:
        return ""
    try:
        items = json.loads(value)
    except ValueError:
        return str(value)
    return "; ".join(f"{k}={v}" for k, v in items.items()) if isinstance(items, dict) else str(items)


@reads
def response_evidence(con: duckdb.DuckDBPyConnection, request_id: str | None) -> View:
    """One response against every rule: whether each flagged it, with what strength and evidence (log lines,
    observed vs expected times, the pool it exceeded)."""
    request = read_frame(
        con,
        """SELECT r.ts, r.account_id, r.model, r.status, r.prompt_tokens, r.prefill_instance,
                                 r.decode_instance, t.confidence
                          FROM requests r LEFT JOIN request_tiers t USING (request_id)
                          WHERE r.request_id = $id""",
        {"id": request_id},
    )
    title = f"Response {request_id}: the evidence of every rule"
    if request.empty:
        return View(
            title,
            pd.DataFrame(columns=["rule_id", "title", "flagged", "strength", "evidence"]),
            f"No request {request_id!r} in the evidence (request ids are exact).",
        )
    found = {
        rule: (strength, evidence)
        for rule, strength, evidence in con.execute(
            "SELECT rule_id, strength, CAST(evidence AS VARCHAR) FROM findings WHERE request_id = $id",
            {"id": request_id},
        ).fetchall()
    }
    frame = pd.DataFrame(
        [
            {
                "rule_id": r.id,
                "title": r.title,
                "flagged": r.id in found,
                "strength": found.get(r.id, (None, None))[0],
                "evidence": _evidence_text(found.get(r.id, (None, None))[1]),
            }
            for r in load_rules()
        ]
    )
    row = request.iloc[0]
    tier = row["confidence"] if isinstance(row["confidence"], str) else "not flagged"
    note = (
        f"Account {row['account_id']} at {when(row['ts'])}, {row['model']}, {int(row['prompt_tokens']):,} "
        f"prompt tokens, HTTP {int(row['status'])}, prefill {row['prefill_instance']}, decode "
        f"{row['decode_instance']}: {tier}"
        + (
            " (an affected response when inside the analysed period)."
            if tier in AFFECTED
            else " (not counted as affected)."
        )
    )
    return View(title, frame, note)


# Every mechanism's sources of an affected response, one row per (affected response, source request):
# possible (the stale-pages turnover horizon; a prefix-cache block resident on the instance when a
# collision no event names was served) and confirmed (the output repeats the source's text; the
# response reused prefix-cache blocks the source stored), with the bases that name it.
_SOURCES = """
    WITH possible AS (
        SELECT affected_request_id, recipient_account_id, source_request_id, source_account_id,
               tokens_written_since, pool_tokens, 'turnover_horizon' AS basis
        FROM possible_sources WHERE {where}
        UNION ALL
        SELECT affected_request_id, recipient_account_id, source_request_id, source_account_id,
               tokens_written_since, pool_tokens, basis
        FROM prefix_possible_sources WHERE {where}
    ), horizon AS (
        SELECT affected_request_id, any_value(recipient_account_id) AS recipient_account_id, source_request_id,
               any_value(source_account_id) AS source_account_id, min(tokens_written_since) AS tokens_written_since,
               max(pool_tokens) AS pool_tokens, bool_or(basis = 'turnover_horizon') AS within_horizon,
               string_agg(DISTINCT basis, ' ' ORDER BY basis) AS basis
        FROM possible GROUP BY affected_request_id, source_request_id
    ), confirming AS (
        SELECT affected_request_id, any_value(recipient_account_id) AS recipient_account_id, source_request_id,
               any_value(source_account_id) AS source_account_id, max(matching_shingles) AS matching_shingles,
               max(match_fraction) AS match_fraction, bool_or(confirmed) AS confirmed,
               string_agg(DISTINCT basis, ' ' ORDER BY basis) AS basis
        FROM content_matches WHERE {where} GROUP BY affected_request_id, source_request_id
    )
    SELECT affected_request_id, source_request_id,
           coalesce(h.recipient_account_id, c.recipient_account_id) AS recipient_account_id,
           coalesce(h.source_account_id, c.source_account_id) AS source_account_id,
           h.tokens_written_since, h.pool_tokens, coalesce(h.within_horizon, false) AS within_horizon,
           coalesce(c.matching_shingles, 0) AS matching_shingles, c.match_fraction,
           coalesce(c.confirmed, false) AS confirmed, concat_ws(' ', c.basis, h.basis) AS basis
    FROM horizon h FULL OUTER JOIN confirming c USING (affected_request_id, source_request_id)"""


@reads
def response_sources(con: duckdb.DuckDBPyConnection, request_id: str | None) -> View:
    """Whose data one affected response could have carried, by every investigated mechanism: the requests
    whose KV pages it could have read (freed on its decode instance less than the turnover horizon before
    it), whose prefix-cache blocks were resident when a collision was served, whose text its output shares,
    and whose stored blocks it reused (``confirmed``; ``basis`` says which), with their accounts."""
    frame = read_frame(
        con,
        f"""
        WITH s AS ({_SOURCES.format(where="affected_request_id = $id")})
        SELECT s.source_request_id, s.source_account_id, ac.account_class, r.ts AS source_ts,
               s.tokens_written_since, s.pool_tokens, s.within_horizon, s.matching_shingles, s.match_fraction,
               s.confirmed, s.basis
        FROM s
        LEFT JOIN requests r ON r.request_id = s.source_request_id
        LEFT JOIN account_classes ac ON ac.account_id = s.source_account_id
        ORDER BY s.confirmed DESC, s.matching_shingles DESC, s.tokens_written_since NULLS LAST,
                 s.source_request_id""",
        {"id": request_id},
    )
    title = f"Response {request_id}: whose data it could have carried"
    recipient = con.execute(
        "SELECT account_id FROM affected_responses WHERE request_id = $id", {"id": request_id}
    ).fetchone()
    if recipient is None:
        return View(
            title,
            frame,
            f"{request_id!r} is not an affected response: no sources are computed for it "
            f"(response_evidence shows how the rules saw it).",
        )
    # the recipient's own earlier requests are no source of another account's data: left out, and counted
    own = int((frame["source_account_id"] == recipient[0]).sum())
    others = frame[frame["source_account_id"] != recipient[0]].reset_index(drop=True)
    confirmed = others[others["confirmed"].fillna(False).astype(bool)]
    note = (
        f"{len(others):,} candidate source requests from {others['source_account_id'].nunique():,} accounts "
        f"other than the recipient {recipient[0]}; {confirmed['source_account_id'].nunique():,} accounts "
        f"confirmed (their text is in the output, or the response reused their prefix-cache blocks)."
        + (
            f" {own:,} of the recipient's own earlier requests are left out: its own data is no exposure."
            if own
            else ""
        )
    )
    return View(title, others, note)


@reads
def account_exposure(con: duckdb.DuckDBPyConnection, account_id: str | None) -> View:
    """Where one account's data could have gone: the affected responses of other accounts that could have
    carried it (its request as a possible or confirmed source of any investigated mechanism)."""
    frame = read_frame(
        con,
        f"""
        WITH s AS ({_SOURCES.format(where="source_account_id = $account AND recipient_account_id <> $account")})
        SELECT s.affected_request_id, a.ts, s.recipient_account_id, a.account_class AS recipient_class,
               s.source_request_id, s.tokens_written_since, s.matching_shingles, s.confirmed, s.basis
        FROM s LEFT JOIN affected_responses a ON a.request_id = s.affected_request_id
        ORDER BY s.confirmed DESC, a.ts, s.affected_request_id, s.source_request_id""",
        {"account": account_id},
    )
    title = f"Account {account_id}: where its data could have gone"
    if frame.empty:
        known = con.execute("SELECT count(*) FROM requests WHERE account_id = $a", {"a": account_id}).fetchone()[0]
        return View(
            title,
            frame,
            f"No affected response of another account could have carried data of {account_id!r}."
            if known
            else f"No request of account {account_id!r} in the evidence (account ids are exact).",
        )
    confirmed = frame[frame["confirmed"]]
    note = (
        f"{frame['affected_request_id'].nunique():,} affected responses to "
        f"{frame['recipient_account_id'].nunique()} other accounts could have carried its data; "
        f"{confirmed['affected_request_id'].nunique():,} confirmed (to "
        f"{confirmed['recipient_account_id'].nunique()} accounts)."
    )
    return View(title, frame, note)
