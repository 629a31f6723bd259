"""Scope: affected responses, recipients, possible and confirmed sources, windows, exploitation.

All of it is portable SQL (``sql/scope.sql``, ``sql/exploitation.sql``, ``sql/notifications.sql``,
``sql/gaps.sql``); this module runs it with the investigation's parameters, on the evidence database
or, with ``spark``, on Spark with the result tables written back, and gathers the headline numbers of
``scope.json`` from the evidence database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import duckdb

from kvforensics.config import Incident
from kvforensics.core.db import has_table, one
from kvforensics.core.fingerprint import SHINGLE_WORDS, guaranteed_words
from kvforensics.core.timestamps import iso
from kvforensics.engines.portable import run_duckdb_script
from kvforensics.stages.conclusive import gate, recorded
from kvforensics.stages.probing import (
    PROBING_PARAMETERS,
    probing_assessment,
    probing_parameters,
    probing_selected,
    probing_summary,
)

if TYPE_CHECKING:
    from kvforensics.engines.spark import SparkEngine

SCOPE_PARAMETERS: dict[str, Any] = {
    "horizon_factor": 1.5,  # x pool: pages can outlive a pool's worth of writes while held
    "min_matching_shingles": 1,  # fingerprints (kept 8-word shingles) an output must share with a text to confirm it
    "max_accounts_per_shingle": 3,  # shingles seen in this many accounts' texts are boilerplate
    "long_fraction": 0.5,  # long-context request: prompt >= this x the engine limit
    "near_pool_fraction": 0.02,  # probing: oversize prompts within 2% above the limit
    "min_oversize": 10,  # deliberate: at least this many oversize prompts, and
    "burst_per_hour": 10,  #   a burst of this many in an hour, or
    "repeat_threshold": 5,  #   the same prompt length this often, or most of them near the pool
    "min_hourly": 10,  # an empty hour is a log gap when the source's median hour has this many
}
CLASSES = ("customer", "internal", "reporter")


@dataclass
class ScopeResult:
    summary: dict[str, Any]
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def conclusive(self) -> bool:
        """Whether the evidence supports the answer (``kvforensics.stages.conclusive``; exit code 3 when not)."""
        return bool(self.summary.get("conclusive", True))

    def _repr_html_(self) -> str:
        from html import escape

        s = self.summary
        warning = "".join(
            f"<li><code>{escape(r['code'])}</code>: {escape(r['message'])}</li>"
            for r in s.get("inconclusive_reasons", [])
        )
        warning = (
            f"<p><b>INCONCLUSIVE</b>: the evidence cannot support this answer.</p><ul>{warning}</ul>" if warning else ""
        )
        rows = "".join(
            f"<tr><td>{escape(c)}</td><td>{v['responses']}</td><td>{v['accounts']}</td></tr>"
            for c, v in s["by_account_class"].items()
        )
        return (
            f"{warning}<p><b>{s['affected_responses']}</b> affected responses, <b>{s['affected_accounts']}</b> "
            f"accounts received foreign data; source accounts: {s['source_accounts']['confirmed']} "
            f"confirmed, {s['source_accounts']['possible']} possible.</p>"
            f"<table><tr><th>class</th><th>responses</th><th>accounts</th></tr>{rows}</table>"
        )


# prefix_sources (the prefix_reuse attribution; empty unless its rules flagged a response) runs before
# notifications, which joins every mechanism's confirmed sources in content_matches
SCOPE_SCRIPTS = ("scope", "prefix_sources", "exploitation", "notifications", "gaps")
# sql/prefix_sources.sql reads these parameters of the prefix_reuse rules whose findings it attributes
PREFIX_RULE_PARAMETERS = {
    "block_hash_collision": ("store_window_s",),
    "cross_tenant_store_load": ("load_window_s", "clock_skew_s"),
}


def prefix_rule_parameters(incident: Incident) -> dict[str, Any]:
    """The prefix_reuse rules' parameters prefix_sources.sql needs, as detect ran them ([rules] overrides)."""
    from kvforensics.stages.rulebook import load_rules, rule_parameters

    out: dict[str, Any] = {}
    for rule in load_rules():
        if rule.id in PREFIX_RULE_PARAMETERS:
            params = rule_parameters(rule, incident.rule_parameters.get(rule.id))
            out.update({k: params[k] for k in PREFIX_RULE_PARAMETERS[rule.id]})
    return out


def scope(
    con: duckdb.DuckDBPyConnection,
    incident: Incident,
    overrides: Mapping[str, Any] | None = None,
    spark: SparkEngine | None = None,
) -> ScopeResult:
    params = {**SCOPE_PARAMETERS, **(overrides or {})}
    period = {"start": incident.scope.start, "end": incident.scope.end}
    scripts = [(name, {**params, **period, **prefix_rule_parameters(incident)}) for name in SCOPE_SCRIPTS]
    if spark is not None:
        spark.run_scripts(con, scripts)
    else:
        for name, script_params in scripts:
            run_duckdb_script(con, name, script_params)
    # prefix-cache probing, when the prefix_reuse mechanism is investigated: the incident file's
    # [prefix_cache.probing] thresholds, then the overrides
    probing = probing_parameters(
        {**incident.probing_parameters, **{k: v for k, v in (overrides or {}).items() if k in PROBING_PARAMETERS}}
    )
    if probing_selected(con):
        probing_assessment(con, probing)
        params = {**params, "prefix_probing": probing}
    else:
        con.execute("DROP TABLE IF EXISTS probing_assessment")
    # how the content was fingerprinted (at ingest, [settings] winnow_window) and what that guarantees
    params = {
        **params,
        "content_fingerprints": fingerprint_parameters(incident.winnow_window, params["min_matching_shingles"]),
    }
    suspects(con, params)
    gate(con, incident.max_quarantine_fraction, incident.rule_parameters, incident.max_quarantine_fractions())
    return ScopeResult(summary=summarise(con, incident, probing, params["min_matching_shingles"]), parameters=params)


def fingerprint_parameters(window: int, min_matching: int) -> dict[str, int]:
    """How the content was fingerprinted and what that guarantees (kvforensics/core/fingerprint.py): the shingle
    width, the winnowing window, and the shortest passage an affected output must share with another
    request's text to be sure to be matched (one fingerprint in common) and confirmed (*min_matching* in
    common), when the passage's 8-word shingles are distinct and none of them is boilerplate."""
    return {
        "shingle_words": SHINGLE_WORDS,
        "winnow_window": window,
        "matched_from_words": guaranteed_words(window),
        "confirmed_from_words": guaranteed_words(window, min_matching),
    }


def content_matching(window: int, min_matching: int, boilerplate_accounts: int) -> dict[str, Any]:
    """scope.json's ``content_matching``: :func:`fingerprint_parameters` and the guarantee in words."""
    params = fingerprint_parameters(window, min_matching)
    kept = (
        "every 8-word shingle of a text is fingerprinted"
        if window == 1
        else f"of every {window} consecutive 8-word shingles of a text, the one of least keyed fingerprint is kept "
        f"(winnowing, window {window})"
    )
    shingles = "one whole 8-word shingle" if min_matching == 1 else f"{min_matching} whole 8-word shingles"
    return {
        **params,
        "min_matching_shingles": min_matching,
        "guarantee": (
            f"{kept[0].upper()}{kept[1:]}. Any passage of at least "
            f"{params['matched_from_words']} words an affected response shares with another request's prompt or output "
            f"gives them a fingerprint in common, and any passage of at least {params['confirmed_from_words']} words "
            f"confirms that request's account as a source, unless its shingles repeat or appear in the texts of "
            f"{boilerplate_accounts} or more accounts (boilerplate). A shorter passage may confirm too; a confirmation "
            f"always rests on at least {shingles} in common."
        ),
    }


def suspects(con: duckdb.DuckDBPyConnection, params: Mapping[str, Any]) -> None:
    """Table ``suspected_exploiters`` (``sql/suspects.sql``): customers whose traffic looks deliberate, with why, per
    mechanism; the prefix-cache probing verdict joins it when that assessment ran."""
    run_duckdb_script(con, "suspects", dict(params))
    if has_table(con, "probing_assessment"):
        con.execute("""INSERT INTO suspected_exploiters
                       SELECT account_id, 'prefix_reuse', why FROM probing_assessment
                       WHERE probing = 'likely' AND account_class = 'customer'""").fetchall()


def _nearest_change(con: duckdb.DuckDBPyConnection, instance: str, model: str | None, at: str | None) -> str | None:
    """The config change that explains a window's edge: same instance (or model), within 6 h before it
    to 1 h after it (deployment tools log the change before the engine finishes starting)."""
    if at is None:
        return None
    rows = con.execute(
        """SELECT description FROM changes
           WHERE (instance = $i OR (instance IS NULL AND model = $m))
             AND ts BETWEEN CAST($t AS TIMESTAMPTZ) - INTERVAL 6 HOUR AND CAST($t AS TIMESTAMPTZ) + INTERVAL 1 HOUR
           ORDER BY abs(epoch(ts) - epoch(CAST($t AS TIMESTAMPTZ))), instance NULLS LAST LIMIT 1""",
        {"i": instance, "m": model, "t": at},
    ).fetchall()
    return rows[0][0] if rows else None


def prefix_windows_summary(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """The start-ups with a path across tenants (prefix_windows), in time order, each with the prefix_reuse
    responses affected on its instance while it ran."""
    rows = con.execute(
        """SELECT w.instance, w.model, w.path, w.status, w.valid_from, w.valid_to, w.end_reason, w.sentence,
                  w.evidence_file, w.evidence_line,
                  (SELECT count(*) FROM affected_responses a
                   WHERE a.prefill_instance = w.instance
                     AND (w.valid_from IS NULL OR a.ts >= w.valid_from) AND (w.valid_to IS NULL OR a.ts < w.valid_to)
                     AND EXISTS (SELECT 1 FROM findings f WHERE f.request_id = a.request_id
                                                            AND f.mechanism = 'prefix_reuse')) AS responses
           FROM prefix_windows w WHERE w.path <> 'isolated'
           ORDER BY w.valid_from NULLS FIRST, w.instance, w.path"""
    ).fetchall()
    return [
        {
            "instance": i,
            "model": m,
            "path": path,
            "status": st,
            "start": iso(f),
            "end": iso(t),
            "end_reason": why,
            "sentence": sentence,
            "evidence_file": ef,
            "evidence_line": el,
            "responses": n,
        }
        for i, m, path, st, f, t, why, sentence, ef, el, n in rows
    ]


def summarise(
    con: duckdb.DuckDBPyConnection,
    incident: Incident,
    probing_params: Mapping[str, Any] | None = None,
    min_matching: int | None = None,
) -> dict[str, Any]:
    """scope.json's content; *probing_params*: the probing thresholds scope used (default: the incident file's);
    *min_matching*: the fingerprints in common that confirm a source (default: ``SCOPE_PARAMETERS``')."""
    reasons = recorded(con)
    by_class = {c: {"responses": 0, "accounts": 0} for c in CLASSES}
    for cls, responses, accounts in con.execute(
        "SELECT account_class, count(*), count(DISTINCT account_id) FROM affected_responses GROUP BY 1"
    ).fetchall():
        by_class[cls] = {"responses": responses, "accounts": accounts}
    affected, accounts = one(con, "SELECT count(*), count(DISTINCT account_id) FROM affected_responses")
    windows = [
        {"model": m, "first": iso(f), "last": iso(last), "responses": n}
        for m, f, last, n in con.execute(
            "SELECT model, min(ts), max(ts), count(*) FROM affected_responses GROUP BY 1 ORDER BY 1"
        ).fetchall()
    ]
    by_model = {
        m: n
        for m, n in con.execute(
            """SELECT r.model, count(a.request_id) FROM (SELECT DISTINCT model FROM analysed_requests) r
           LEFT JOIN affected_responses a ON a.model = r.model GROUP BY 1 ORDER BY 1"""
        ).fetchall()
    }
    # "end" is null while the start-up still runs; "end_reason" says what closed it (kvforensics/stages/instances.py)
    exposure = [
        {
            "instance": i,
            "role": role,
            "model": m,
            "start": iso(s),
            "end": iso(e),
            "end_reason": why,
            "pool_tokens": p,
            "context_length": c,
            "engine_version": v,
        }
        for i, role, m, s, e, why, p, c, v in con.execute(
            """SELECT instance, role, model, valid_from, valid_to, end_reason, kv_pool_tokens, context_length,
                              engine_version
                       FROM exposure_windows
                       ORDER BY valid_from NULLS LAST, instance"""
        ).fetchall()
    ]
    for w in exposure:
        w["opened_by_change"] = _nearest_change(con, w["instance"], w["model"], w["start"])
        w["closed_by_change"] = _nearest_change(con, w["instance"], w["model"], w["end"])
    prefix = prefix_windows_summary(con) if probing_selected(con) else None
    confirmed, possible = (
        one(con, "SELECT count(DISTINCT account_id) FROM notifications WHERE role = $r", {"r": r})[0]
        for r in ("data_exposed_confirmed", "data_exposed_possible")
    )
    tiers = {t: n for t, n in con.execute("SELECT confidence, count(*) FROM affected_responses GROUP BY 1").fetchall()}
    suspects = one(con, "SELECT count(*) FROM suspect_responses")[0]
    deliberate = [
        r[0] for r in con.execute("SELECT DISTINCT account_id FROM suspected_exploiters ORDER BY 1").fetchall()
    ]
    probing = probing_summary(con)
    if probing is not None:
        probing["parameters"] = probing_parameters(
            incident.probing_parameters if probing_params is None else probing_params
        )
    period = one(con, "SELECT min(ts), max(ts), count(*) FROM analysed_requests")
    mechanisms = con.execute("SELECT id, title, selected, missing_inputs FROM mechanisms ORDER BY id").fetchall()
    gaps = [
        {"source": src, "instance": inst, "start": iso(a), "end": iso(b), "requests": n, "description": d}
        for src, inst, a, b, n, d in con.execute(
            "SELECT source, instance, start, \"end\", requests, description FROM log_gaps ORDER BY start"
        ).fetchall()
    ]
    return {
        "incident": incident.id,
        "conclusive": not reasons,
        "inconclusive_reasons": reasons,
        # the exposure mechanisms whose rules ran (kvforensics/mechanisms), and the others with the inputs they lack
        "mechanisms": [{"id": i, "title": t} for i, t, chosen, _ in mechanisms if chosen],
        "mechanisms_not_investigated": [
            {"id": i, "title": t, "missing_inputs": list(m)} for i, t, chosen, m in mechanisms if not chosen
        ],
        "affected_responses": affected,
        "affected_accounts": accounts,
        "by_account_class": by_class,
        "by_confidence": {"confirmed": tiers.get("confirmed", 0), "probable": tiers.get("probable", 0)},
        "possible_responses_not_counted": suspects,
        "responses_by_model": by_model,
        "windows": windows,
        "exposure_windows": exposure,
        # the prefix_reuse mechanism's windows (table prefix_windows), when it ran: each start-up's path
        # across tenants, with the affected responses served through it
        **({"prefix_windows": prefix} if prefix is not None else {}),
        "source_accounts": {"confirmed": confirmed, "possible": possible},
        # what the content fingerprints guarantee about the confirmed sources (kvforensics/core/fingerprint.py)
        **(
            {
                "content_matching": content_matching(
                    incident.winnow_window,
                    SCOPE_PARAMETERS["min_matching_shingles"] if min_matching is None else min_matching,
                    SCOPE_PARAMETERS["max_accounts_per_shingle"],
                )
            }
            if incident.sources_of("content")
            else {}
        ),
        "exploitation": {
            "accounts_looking_deliberate": deliberate,
            "conclusion": "signs of deliberate exploitation" if deliberate else "no sign of deliberate exploitation",
            # prefix-cache probing per account (kvforensics/stages/probing.py), when prefix_reuse ran
            **({"prefix_probing": probing} if probing else {}),
        },
        "log_gaps": gaps,
        "analysed_period": {
            "first_request": iso(period[0]),
            "last_request": iso(period[1]),
            "requests": period[2],
            "start": iso(incident.scope.start),
            "end": iso(incident.scope.end),
        },
    }
