"""Everything the report shows, read from the evidence database (aggregated in DuckDB)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import duckdb
import pandas as pd

from kvforensics.config import Incident
from kvforensics.report.templating import file_labels
from kvforensics.stages.detect import AFFECTED_TIERS, load_rules
from kvforensics.stages.scope import iso, summarise

MAX_POINTS = 4000  # requests drawn per model in the prompt-vs-TTFT chart (Altair embeds at most 5,000 rows)
MIN_CONTEXT_POINTS = 1000  # of them, at least this many unflagged requests, the background the findings stand out from


@dataclass
class ReportData:
    incident: Incident
    scope: dict[str, Any]
    manifest: dict[str, Any]
    timeline: pd.DataFrame
    accounts: pd.DataFrame
    models: pd.DataFrame
    latency: pd.DataFrame
    rules: list[dict[str, Any]]
    behaviour: pd.DataFrame
    load_report: pd.DataFrame
    quarantine_reasons: pd.DataFrame
    capacity: pd.DataFrame
    sources_per_response: pd.DataFrame
    exploitation_note: str = ""
    # the behaviour rows with the probing pattern (deliberate or set apart): the rest is ordinary long-context use,
    # counted in a sentence rather than listed row by row
    behaviour_notable: pd.DataFrame = field(default_factory=pd.DataFrame)
    behaviour_ordinary: pd.DataFrame = field(default_factory=pd.DataFrame)
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    # (instance, start as in scope.json) -> how that start-up ended, in words (see how_it_ended)
    endings: dict[tuple[str, str | None], str] = field(default_factory=dict)


def _df(con: duckdb.DuckDBPyConnection, q: str, params: dict | None = None) -> pd.DataFrame:
    return con.execute(q, params).df() if params else con.execute(q).df()


def without_na(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with every missing value (NA, NaN, NaT) as None: templates test values for truth,
    and ``bool(pd.NA)`` raises where ``bool(None)`` is simply false."""
    return df.astype(object).where(df.notna(), None)


def how_it_ended(startup: Mapping[str, Any]) -> str:
    """How a start-up (a ``capacity`` row) stopped being in force, in a responder's words, with its
    evidence: its own shutdown line, the next start-up of the instance, the successor that took over
    when its log ended, or, with no end recorded, how far its log goes."""
    reason = startup.get("end_reason")
    line = _evidence_line(startup.get("end_file"), startup.get("end_line"), startup.get("source_file"))
    if reason == "shutdown":
        return f"shut down ({line})" if line else "shut down"
    if reason == "next_startup":
        return f"restarted ({line})" if line else "restarted"
    if reason == "log_end":
        return f"retired: replaced by {startup.get('successor') or 'another instance'}" + (
            f" (its log ends at {line})" if line else ""
        )
    if reason is None:
        last = _iso(startup.get("last_ts"))
        if last is None and startup.get("last_line") is not None:
            last = f"line {int(startup['last_line'])}"
        return f"still running / log stops at {last}" if last else "still running / log stops after its start"
    return str(reason)  # a reason this report does not know: as recorded


def engine_label(engine: Any, version: Any, source: Any = None) -> str:
    """An engine and its version in a few words (``sglang >0.5.9,<0.5.20 (inferred)``): where an inferred version
    came from is said once, in the report's notes on the start-ups, not on every row that names it."""
    name = str(engine) if engine else "engine"
    if not version:
        return f"{name}, version unknown"
    text = str(version).split(" (inferred", 1)[0].strip()
    inferred = " (inferred)" if " (inferred" in str(version) or str(source or "").startswith("inferred") else ""
    return f"{name} {text}{inferred}"


def version_notes(capacity: pd.DataFrame) -> list[str]:
    """Each distinct inferred engine version with the format features it was inferred from, once."""
    notes: dict[tuple[str, str], list[str]] = {}
    for rec in capacity.to_dict("records"):
        version = str(rec.get("engine_version") or "")
        if " (inferred" in version:
            basis = version.split(" (inferred", 1)[1].lstrip(":").strip().rstrip(")")
            head = f"{rec.get('engine') or 'engine'} {version.split(' (', 1)[0]}"
            notes.setdefault((head, basis), []).append(str(rec["instance"]))
    # the inference basis is the parser's text (it may hold braces): joined, never formatted
    return [
        f"{head} on {', '.join(sorted(set(instances)))}, from {basis}"
        for (head, basis), instances in sorted(notes.items())
    ]


def _iso(value: Any) -> str | None:
    """A timestamp of a frame (pandas) as the outputs write it (None stays None)."""
    return None if value is None else iso(pd.Timestamp(value).to_pydatetime())


def _evidence_line(end_file: str | None, end_line: Any, source_file: str | None) -> str:
    """``<file> line N``: the file named always, so a reader finds the line without knowing which log the row came
    from (the start-up's own file when the end has none recorded)."""
    if end_line is None:
        return ""
    name = (end_file or source_file or "").split("/")[-1]
    return f"{name} line {int(end_line)}" if name else f"line {int(end_line)}"


# what a probing pattern (account_behaviour.looks_deliberate) is, by account class, and whether it is exploitation:
# the provider's own load tests and the reporter's reproduction send the same prompts, and are not
PATTERNS = {
    "customer": ("probing: many oversize prompts, near the pool, in bursts or of one length", "yes"),
    "internal": ("load test (internal): the provider's own traffic", "no"),
    "reporter": ("reproduction by the reporter", "no"),
}
ORDINARY = ("ordinary long-context use", "no")


def exploitation_verdicts(behaviour: pd.DataFrame) -> pd.DataFrame:
    """``account_behaviour`` rows with ``pattern`` and ``deliberate`` (yes / no) in the words the conclusion uses:
    only a customer's probing pattern is deliberate exploitation (as ``scope.json``'s
    ``accounts_looking_deliberate``)."""
    verdicts = [
        PATTERNS.get(str(cls), PATTERNS["customer"]) if bool(looks) else ORDINARY
        for cls, looks in zip(behaviour["account_class"], behaviour["looks_deliberate"], strict=True)
    ]
    return behaviour.assign(pattern=[v[0] for v in verdicts], deliberate=[v[1] for v in verdicts])


def set_apart_note(behaviour: pd.DataFrame) -> str:
    """A sentence naming the internal and reporter accounts whose traffic has the probing pattern and is not
    exploitation ("" when there are none)."""
    parts = []
    for cls, words in (("internal", "the provider's own load tests"), ("reporter", "the reporter's reproduction")):
        ids = sorted(
            behaviour.loc[
                (behaviour["account_class"] == cls) & behaviour["looks_deliberate"].fillna(False).astype(bool),
                "account_id",
            ].astype(str)
        )
        if ids:
            parts.append(f"{len(ids)} {cls} {'account' if len(ids) == 1 else 'accounts'} ({', '.join(ids)}): {words}")
    return (
        (
            "The same pattern came from "
            + "; and from ".join(parts)
            + ". They are set apart: not deliberate exploitation."
        )
        if parts
        else ""
    )


def timeline_events(con: duckdb.DuckDBPyConnection, incident: Incident) -> pd.DataFrame:
    """One table of events from every source, UTC, in time order."""
    rows: list[dict[str, Any]] = []
    for ev in incident.events:
        rows.append({"ts": ev.ts, "kind": "incident file", "title": ev.title, "detail": ev.description})
    for ts, model, inst, desc, det in con.execute(
        "SELECT ts, model, instance, description, details FROM changes ORDER BY ts"
    ).fetchall():
        rows.append(
            {"ts": ts, "kind": "config change", "title": desc, "detail": " ".join(filter(None, [model, inst, det]))}
        )
    for inst, role, model, vf, pool, ctx, engine, ver, how, exposed in con.execute(
        """SELECT instance, role, model, valid_from, kv_pool_tokens, context_length, engine, engine_version,
                      version_source,
                      EXISTS (SELECT 1 FROM exposure_windows w WHERE w.instance = c.instance
                                                               AND w.valid_from IS NOT DISTINCT FROM c.valid_from)
               FROM capacity c WHERE valid_from IS NOT NULL ORDER BY valid_from, instance"""
    ).fetchall():
        rows.append(
            {
                "ts": vf,
                "kind": "engine start-up",
                "title": f"{inst} ({role}) started: KV pool {pool:,} tokens, context {ctx:,}"
                if pool and ctx
                else f"{inst} ({role}) started",
                "detail": f"{model or 'model unknown'}; {engine_label(engine, ver, how)}"
                + ("; EXPOSED: audit check 1 fails (pool smaller than context)" if exposed else ""),
            }
        )
    for model, first, last, n in con.execute(
        "SELECT model, min(ts), max(ts), count(*) FROM affected_responses GROUP BY 1 ORDER BY 2"
    ).fetchall():
        rows.append(
            {
                "ts": first,
                "kind": "finding",
                "title": f"first affected response ({model})",
                "detail": f"{n} affected responses for this model",
            }
        )
        rows.append({"ts": last, "kind": "finding", "title": f"last affected response ({model})", "detail": ""})
    df = pd.DataFrame(rows, columns=["ts", "kind", "title", "detail"])
    if not df.empty:
        df["ts"] = pd.to_datetime(df["ts"], utc=True)
        df = df.sort_values(["ts", "kind"], kind="stable").reset_index(drop=True)
    return df


MIN_DRAWN_MS, MAX_DRAWN_MS = 0.001, 1e10


def money_frames(con: duckdb.DuckDBPyConnection) -> dict[str, tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]]:
    """Per model with affected responses: request points, pool limits and the prefill curve."""
    out = {}
    models = [r[0] for r in con.execute("SELECT DISTINCT model FROM affected_responses ORDER BY 1").fetchall()]
    for model in models:
        requests = f"""
            SELECT q.request_id, q.account_id, q.prompt_tokens,
                   -- drawn on a log axis between 1 us and about four months: a subnormal or absurd timing (a
                   -- logging fault) would otherwise ask the axis for hundreds of decades and stop the renderer
                   least(greatest(coalesce(q.ttft_ms, q.latency_ms), {MIN_DRAWN_MS}), {MAX_DRAWN_MS}) AS observed_ms,
                   CASE WHEN q.ttft_ms IS NOT NULL THEN 'ttft' ELSE 'e2e latency' END
                   || CASE WHEN coalesce(q.ttft_ms, q.latency_ms) < {MIN_DRAWN_MS}
                                OR coalesce(q.ttft_ms, q.latency_ms) > {MAX_DRAWN_MS}
                           THEN ' (' || CAST(coalesce(q.ttft_ms, q.latency_ms) AS VARCHAR) || ' ms, drawn at the edge)'
                           ELSE '' END AS measure,
                   coalesce(t.confidence, 'not flagged') AS confidence
            FROM analysed_requests q LEFT JOIN request_tiers t USING (request_id)
            WHERE q.model = $m AND q.status BETWEEN 200 AND 299 AND coalesce(q.ttft_ms, q.latency_ms) > 0"""
        # every flagged request when they fit; beyond that confirmed, then probable, then possible (by request
        # id), and the rest of the dots unflagged requests, long prompts first
        flagged = _df(
            con,
            f"""
            SELECT * FROM ({requests}) r WHERE confidence <> 'not flagged'
            ORDER BY CASE confidence WHEN 'confirmed' THEN 0 WHEN 'probable' THEN 1 ELSE 2 END,
                     hash(request_id), request_id
            LIMIT {MAX_POINTS - MIN_CONTEXT_POINTS}""",
            {"m": model},
        )
        unflagged = _df(
            con,
            f"""
            SELECT * FROM ({requests}) r WHERE confidence = 'not flagged'
            ORDER BY (prompt_tokens >= 100000) DESC, hash(request_id), request_id
            LIMIT {MAX_POINTS - len(flagged)}""",
            {"m": model},
        )
        points = pd.concat([flagged, unflagged], ignore_index=True) if not flagged.empty else unflagged
        points.attrs["flagged_total"] = con.execute(
            f"SELECT count(*) FROM ({requests}) r WHERE confidence <> 'not flagged'", {"m": model}
        ).fetchall()[0][0]
        # a line per KV pool a prompt on the chart may have exceeded: every exposure window's (any role), and a
        # pool below the model's largest prompt on a server the audit does not call exposed (a unified one: the
        # responses beyond it are the gate's admission_contradicted)
        pools = _df(
            con,
            """SELECT kv_pool_tokens,
                                   'KV pool ' || format('{:,}', kv_pool_tokens) || ' (' ||
                                   string_agg(DISTINCT role, ', ' ORDER BY role) || ')' AS label
                            FROM (SELECT kv_pool_tokens, role FROM exposure_windows
                                  WHERE model = $m AND kv_pool_tokens IS NOT NULL
                                  UNION ALL
                                  SELECT kv_pool_tokens, role FROM capacity
                                  WHERE model = $m AND kv_pool_tokens IS NOT NULL
                                    AND kv_pool_tokens < (SELECT max(prompt_tokens) FROM analysed_requests
                                                          WHERE model = $m AND status BETWEEN 200 AND 299))
                            GROUP BY kv_pool_tokens ORDER BY 1""",
            {"m": model},
        )
        lm = con.execute(
            "SELECT a_ms, b_ms_per_token, c_ms_per_token2, max_tokens FROM latency_model WHERE model = $m AND usable",
            {"m": model},
        ).fetchall()
        curve = pd.DataFrame(columns=["prompt_tokens", "expected_ms"])
        if lm and not points.empty:
            a, b, c, max_t = lm[0]
            hi = int(points["prompt_tokens"].max())
            xs = [int(hi * i / 60) for i in range(1, 61)]
            curve = pd.DataFrame(
                {"prompt_tokens": xs, "expected_ms": [a + b * min(x, max_t) + c * min(x, max_t) ** 2 for x in xs]}
            )
        out[model] = (points, pools, curve)
    return out


def build(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> ReportData:
    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    scope = summarise(con, incident)
    accounts = _df(
        con,
        """SELECT account_class, role, count(*) AS accounts, sum(responses) AS records
                           FROM notifications GROUP BY 1, 2 ORDER BY 2 DESC, 1""",
    )
    models = _df(
        con,
        """
        SELECT r.model, count(*) AS requests, count(a.request_id) AS affected,
               count(*) FILTER (WHERE r.status BETWEEN 200 AND 299) AS successful,
               max(r.prompt_tokens) AS largest_prompt
        FROM analysed_requests r LEFT JOIN affected_responses a USING (request_id)
        GROUP BY 1 ORDER BY 1""",
    )
    latency = _df(con, "SELECT * FROM latency_model ORDER BY model")
    rule_counts = dict(con.execute("SELECT rule_id, count(*) FROM findings GROUP BY 1").fetchall())
    affected_counts = dict(
        con.execute(f"""SELECT rule_id, count(*) FROM findings
                                            WHERE confidence IN {AFFECTED_TIERS} GROUP BY 1""").fetchall()
    )
    rules = [
        {
            "id": r.id,
            "title": r.title,
            "severity": r.severity,
            "version": r.version,
            "description": r.description,
            "parameters": r.parameters,
            "flagged": rule_counts.get(r.id, 0),
            "flagged_affected": affected_counts.get(r.id, 0),
            "mechanism": r.mechanism,
        }
        for r in load_rules()
    ]
    behaviour = exploitation_verdicts(
        _df(
            con,
            """
        SELECT * FROM account_behaviour
        ORDER BY looks_deliberate AND account_class = 'customer' DESC, looks_deliberate DESC, oversize_requests DESC,
                 account_id""",
        )
    )
    load_report = _df(
        con,
        "SELECT source, kind, file, records_read, loaded, quarantined, duplicates, sha256, notes "
        "FROM load_report ORDER BY source, file",
    )
    load_report["label"] = file_labels(load_report["file"])  # a file's name, with its folders where names repeat
    qreasons = _df(con, "SELECT source, reason, count(*) AS records FROM quarantine GROUP BY 1, 2 ORDER BY 3 DESC")
    capacity = _df(
        con,
        """SELECT instance, role, model, valid_from, valid_to, kv_pool_tokens, context_length,
                                  page_size, engine, engine_version, version_source,
                                  EXISTS (SELECT 1 FROM exposure_windows w WHERE w.instance = capacity.instance AND w.valid_from IS NOT DISTINCT FROM capacity.valid_from) AS exposed, source_file, source_line,
                                  end_reason, end_file, end_line, successor, last_ts, last_line
                           FROM capacity ORDER BY model, instance, valid_from""",
    )
    capacity = without_na(capacity)
    startups = capacity.to_dict("records")
    capacity["ended"] = [how_it_ended(row) for row in startups]
    capacity["engine_label"] = [
        engine_label(row["engine"], row["engine_version"], row["version_source"]) for row in startups
    ]
    # keyed as scope.json's exposure_windows name a start-up: instance and start
    endings = {(row["instance"], _iso(row["valid_from"])): how_it_ended(row) for row in startups}
    per_response = _df(
        con,
        """
        SELECT a.request_id, count(DISTINCT p.source_request_id) AS candidate_requests,
               count(DISTINCT p.source_account_id) FILTER (WHERE p.source_account_id <> p.recipient_account_id) AS candidate_accounts,
               (SELECT count(DISTINCT m.source_account_id) FROM content_matches m
                 WHERE m.affected_request_id = a.request_id AND m.confirmed
                   AND m.source_account_id <> m.recipient_account_id) AS confirmed_accounts
        FROM affected_responses a
        LEFT JOIN (SELECT affected_request_id, source_request_id, source_account_id, recipient_account_id
                   FROM possible_sources
                   UNION ALL SELECT affected_request_id, source_request_id, source_account_id, recipient_account_id
                   FROM prefix_possible_sources) p ON p.affected_request_id = a.request_id
        GROUP BY a.request_id ORDER BY a.request_id""",
    )
    notable = behaviour["looks_deliberate"].fillna(False).astype(bool)
    return ReportData(
        incident=incident,
        scope=scope,
        manifest=manifest,
        timeline=timeline_events(con, incident),
        accounts=without_na(accounts),
        models=without_na(models),
        latency=without_na(latency),
        rules=rules,
        behaviour=without_na(behaviour),
        load_report=without_na(load_report),
        quarantine_reasons=without_na(qreasons),
        capacity=capacity,
        sources_per_response=without_na(per_response),
        endings=endings,
        exploitation_note=set_apart_note(behaviour),
        behaviour_notable=without_na(behaviour[notable]),
        behaviour_ordinary=without_na(behaviour[~notable]),
    )


__all__ = ["ReportData", "build", "money_frames", "timeline_events", "iso"]
