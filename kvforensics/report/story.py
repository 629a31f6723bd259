"""The report's sentences about the deployment, the breach, its consequences and the measures: each derived from the
evidence (the exposure windows the audit's check 1 gives, the start-ups' engines, versions and ends, which rules
flagged what, the sources' bases) or declared in the incident file's ``[notice]``, and absent otherwise. No sentence
here is a constant describing one deployment shape: an incident without a disaggregated deployment is never told it
had one, one still running is never told it was restarted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import duckdb

from kvforensics.config import Incident
from kvforensics.core.db import has_table
from kvforensics.report.data import engine_label
from kvforensics.report.notices import incident_facts
from kvforensics.report.templating import plural, prose_span, prose_time, words

# what each basis of a possible source means, for the report (possible_sources / prefix_possible_sources.basis)
POSSIBLE_BASES = {
    "turnover_horizon": "requests freed on the same instance within the turnover horizon before it "
    "(horizon_factor x the pool's tokens of writes)",
    "no_horizon_since_startup": "every request of other accounts the model served since the earliest start-up then "
    "in force: no decode pool is known (no decode engine log), so the turnover horizon "
    "cannot be computed; pages older than that start-up may still have been held by a "
    "decode node no log shows",
    "resident_on_instance": "the owners of the prefix-cache blocks the instance held when a collision of unknown "
    "source was served",
}


# the prefix_reuse rule whose matched block can hold other content than the recipient's prompt (a hash collision)
COLLISION_RULE = "block_hash_collision"


@dataclass(frozen=True)
class Story:
    """The sentences the report prints in its Impact, How, Measures and Notification sections."""

    nature: str
    deployment: tuple[str, ...]
    consequences: tuple[str, ...]
    measures: tuple[str, ...]  # declared in [notice]
    ended: tuple[str, ...]  # derived: how each exposure window ended, or that it had not
    operator_checks: tuple[str, ...]  # derived: the audit checks that fail
    # derived: per mechanism investigated (its id), what its rules found in this evidence
    found: dict[str, str]
    # derived: the mechanisms whose rules flagged affected responses (the others get one line: nothing was found)
    flagged: frozenset[str]
    possible_bases: tuple[str, ...]
    # derived: the sentence above the exposure-window table (check 1), true of the windows the table lists
    windows_note: str
    notice_missing: tuple[str, ...]
    provider: str | None
    contact: str | None
    reference: str


def _deployment(con: duckdb.DuckDBPyConnection, investigated: set[str], audit: Any = None) -> tuple[str, ...]:
    """Per group of exposure windows with the same audit sentence: which instances, role, engine and version, when,
    and the audit's sentence (check 1, what the engine does with a prompt beyond the pool there; check 6, the path
    across tenants' prefix-cache namespaces); for an investigated mechanism with none, that there was none."""
    lines = _stale_windows(con)
    if "stale_pages" in investigated and not lines:
        lines += (
            "No start-up's KV pool was below its context length on a role that serves a prompt past it (audit "
            "check 1).",
        )
    if "stale_pages" in investigated and audit is not None:
        lines += _unexposed_notes(audit)
    if "prefix_reuse" in investigated:
        paths = _prefix_paths(con)
        lines += paths or ("No start-up had a path across tenants' prefix-cache namespaces (audit check 6).",)
    return lines


def _unexposed_notes(audit: Any) -> tuple[str, ...]:
    """Start-ups whose check 1 is neither a pass nor an exposure (a unified server whose pool is below its context,
    a pool reading in doubt, a start-up the engine refused): what the audit says of each, grouped by sentence."""
    groups: dict[tuple[str | None, str, str | None, str], list[str]] = {}
    for v in audit.verdicts:
        if v.check == 1 and v.status in ("unknown", "not_applicable") and not v.exposed:
            groups.setdefault((v.model, v.role, v.engine, v.detail), []).append(v.instance)
    return tuple(
        f"{model or 'model unknown'} on {words(dict.fromkeys(instances))} ({role}"
        f"{', ' + engine if engine else ''}): {detail} (audit check 1: not exposed)."
        for (model, role, engine, detail), instances in groups.items()
    )


def _prefix_paths(con: duckdb.DuckDBPyConnection) -> tuple[str, ...]:
    if not has_table(con, "prefix_windows"):
        return ()
    rows = con.execute("""
        SELECT model, engine, engine_version, sentence, list(DISTINCT instance ORDER BY instance), min(valid_from),
               max(valid_to), bool_or(valid_to IS NULL)
        FROM prefix_windows WHERE path <> 'isolated'
        GROUP BY model, engine, engine_version, sentence
        ORDER BY min(valid_from) NULLS FIRST, model""").fetchall()
    return tuple(
        f"{model or 'model unknown'} on {words(instances)} ({engine_label(engine, version)}), from "
        f"{prose_time(first) or 'its first start-up'} to "
        f"{'the end of the records (still running)' if running else prose_time(last)}: {sentence}."
        for model, engine, version, sentence, instances, first, last, running in rows
    )


def _stale_windows(con: duckdb.DuckDBPyConnection) -> tuple[str, ...]:
    rows = con.execute("""
        SELECT model, role, engine, engine_version, sentence, list(instance ORDER BY valid_from, instance),
               min(valid_from), max(valid_to), bool_or(valid_to IS NULL)
        FROM exposure_windows
        GROUP BY model, role, engine, engine_version, sentence
        ORDER BY min(valid_from) NULLS FIRST, model""").fetchall()
    out = []
    for model, role, engine, version, sentence, instances, first, last, running in rows:
        names = words(dict.fromkeys(instances))
        until = "the end of the records (still running)" if running else prose_time(last)
        where = "role unknown: no line of its log says" if role == "unknown" else f"{role}"
        out.append(
            f"{model or 'model unknown'} on {names} ({where}, {engine_label(engine, version)}), from "
            f"{prose_time(first) or 'an unknown time'} to {until}: {sentence}."
        )
    return tuple(out)


def _as_phrase(title: str) -> str:
    """A rule's title inside a sentence: its first letter lower-cased."""
    return title[:1].lower() + title[1:]


def _rule_phrases(rules: list[dict[str, Any]], mechanism: str) -> str:
    """What a mechanism's rules flagged among the affected responses, each rule in its own words with its count."""
    counted = [r for r in rules if r.get("mechanism") == mechanism and r["flagged_affected"]]
    return "; ".join(
        f"{_as_phrase(r['title'])} ({plural(r['flagged_affected'], 'response')}, rule {r['id']})"
        for r in sorted(counted, key=lambda r: (-r["flagged_affected"], r["id"]))
    )


def _flagged(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Per mechanism whose rules flagged affected responses, how many (a finding without a mechanism is a stale_pages
    rule's)."""
    return dict(
        con.execute(
            """SELECT coalesce(f.mechanism, 'stale_pages'), count(DISTINCT a.request_id) FROM findings f
               JOIN affected_responses a USING (request_id) GROUP BY 1"""
        ).fetchall()
    )


def _found(con: duckdb.DuckDBPyConnection, mechanisms: list[Any], rules: list[dict[str, Any]]) -> dict[str, str]:
    """Per mechanism investigated: how many affected responses its rules flagged and what each rule found, or that
    they flagged none."""
    counts = _flagged(con)
    out = {}
    for m in mechanisms:
        if not counts.get(m.id):
            out[m.id] = "its rules flagged no affected response."
            continue
        phrases = _rule_phrases(rules, m.id)
        out[m.id] = f"its rules flagged {plural(counts[m.id], 'affected response')}" + (
            f": {phrases}." if phrases else "."
        )
    return out


def _windows_note(s: dict[str, Any]) -> str:
    """The sentence above the check-1 exposure-window table: what the windows are, when there are any."""
    windows = s.get("exposure_windows") or []
    if not windows:
        return (
            "No start-up in this evidence fails audit check 1 (a KV pool below the context length on a role that "
            "serves a prompt past it): no window of this kind is shown."
        )
    return (
        "Start-ups whose audit check 1 fails: a KV pool below the context length on a role that serves a prompt "
        f"past it. The deployment was exposed in {'this window' if len(windows) == 1 else 'these windows'} whether "
        "or not a request hit it."
    )


def _nature(
    con: duckdb.DuckDBPyConnection,
    s: dict[str, Any],
    mechanisms: list[Any],
    rules: list[dict[str, Any]],
    split: tuple[int, int],
) -> str:
    n = s["affected_responses"]
    if n:
        first = min(w["first"] for w in s["windows"])
        last = max(w["last"] for w in s["windows"])
        flagged = _flagged(con)
        # what the evidence shows of each mechanism found, in its rules' words; the mechanism's summary (which
        # lists every way it can arise) stays in "How the data was exposed"
        how = " ".join(
            f"{m.title}: {phrase}." if (phrase := _rule_phrases(rules, m.id)) else f"{m.title}."
            for m in mechanisms
            if m.id in flagged
        )
        return (
            f"A confidentiality breach: {plural(n, 'response')} sent to {plural(s['affected_accounts'], 'account')} "
            f"{prose_span(first, last)} "
            + (
                "may carry other accounts' data. "
                if split[0]
                else "were computed on prefix-cache blocks other accounts had stored for the same leading text. "
            )
            + how
        )
    if s["conclusive"]:
        return (
            "No affected response was found: this evidence shows no breach of confidentiality through the "
            "mechanisms investigated."
        )
    return (
        "Not established: no affected response was found, but the evidence cannot support that answer (see the "
        "reasons at the top of this report)."
    )


def _confirmed_by_text(con: duckdb.DuckDBPyConnection, confirmed: int) -> int:
    """Of the *confirmed* source accounts, those whose text a response to another account repeated (basis
    'output_shingles'); the others are confirmed by the prefix-cache blocks a response reused (sql/notifications.sql).
    All of them where the evidence has no content_matches table to tell."""
    if not has_table(con, "content_matches"):
        return confirmed
    return con.execute(
        "SELECT count(DISTINCT source_account_id) FROM content_matches "
        "WHERE confirmed AND basis = 'output_shingles' AND source_account_id <> recipient_account_id"
    ).fetchall()[0][0]


def _content_split(con: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """Of the accounts that received affected responses: how many received one computed on another account's content
    (stale pages, a colliding block), which may carry it, and how many one computed on another account's cached blocks
    of the same text (every other prefix_reuse rule: the blocks matched on their tokens), which carries nothing of
    theirs but whose speed showed that the text had been sent."""
    [(foreign, same_text)] = con.execute(
        """SELECT count(DISTINCT account_id) FILTER (WHERE foreign_content),
                  count(DISTINCT account_id) FILTER (WHERE NOT foreign_content)
           FROM (SELECT a.request_id, any_value(a.account_id) AS account_id,
                        bool_or(coalesce(f.mechanism, 'stale_pages') <> 'prefix_reuse'
                                OR f.rule_id = $collision) AS foreign_content
                 FROM affected_responses a JOIN findings f USING (request_id) GROUP BY a.request_id)""",
        {"collision": COLLISION_RULE},
    ).fetchall()
    return foreign, same_text


def _consequences(con: duckdb.DuckDBPyConnection, s: dict[str, Any], split: tuple[int, int]) -> tuple[str, ...]:
    if not s["affected_responses"]:
        return ()
    src = s["source_accounts"]
    foreign, same_text = split
    lines = []
    if foreign:
        lines.append(
            f"{plural(foreign, 'account')} received responses that may contain fragments of other accounts' "
            "prompts or generated text, possibly personal data or confidential information."
        )
    if same_text:
        lines.append(
            f"{plural(same_text, 'account')} received responses computed on prefix-cache blocks another account "
            f"had stored for the same leading text as their prompts{' (no colliding block)' if not foreign else ''}: "
            "what those responses say is what their own prompts would have given, but how fast they came back (and "
            "the cached tokens their usage counts) showed that another account had sent that text."
        )
    by_text = min(_confirmed_by_text(con, src["confirmed"]), src["confirmed"])
    if by_text:
        lines.append(
            f"The text of {plural(by_text, 'account')} was found in responses sent to other "
            "accounts: it was disclosed to them."
        )
    if src["confirmed"] > by_text:
        lines.append(
            f"Responses sent to other accounts were computed on prefix-cache blocks stored from the requests of "
            f"{plural(src['confirmed'] - by_text, 'more account' if by_text else 'account')}: "
            + (
                "those responses were conditioned on their text, which was disclosed to that extent."
                if foreign
                else "the recipients' prompts held the same text, so what was disclosed to them is that these "
                "accounts had sent it, by the speed of the responses."
            )
        )
    if src["possible"]:
        lines.append(
            f"The requests of {plural(src['possible'], 'more account')} could have been read by an affected "
            "response; no disclosure of them is confirmed."
        )
    deliberate = s["exploitation"]["accounts_looking_deliberate"]
    lines.append(
        f"{plural(len(deliberate), 'account')} looked like deliberate exploitation (see the exploitation assessment)."
        if deliberate
        else "No account's traffic looked like deliberate exploitation."
    )
    return tuple(lines)


def _operator_checks(audit: Any) -> tuple[str, ...]:
    """Each audit check that fails, on which start-ups: what the operator must fix (the table says how)."""
    out = []
    for check in sorted({v.check for v in audit.verdicts if v.status == "fail"}):
        failing = [v for v in audit.verdicts if v.check == check and v.status == "fail"]
        live = sum(1 for v in failing if v.in_force)
        names = sorted({v.instance for v in failing})
        instances = (", ".join(names[:5]) + f" and {len(names) - 5:,} more") if len(names) > 5 else words(names)
        out.append(
            f"Check {check}, {failing[0].check_name}: fails on {plural(len(failing), 'start-up')} "
            f"({instances}), {live:,} still in force; the deployment exposure audit (How the data was exposed) says what to set."
        )
    return tuple(out)


def _possible_bases(con: duckdb.DuckDBPyConnection) -> tuple[str, ...]:
    tables = [
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_name IN "
            "('possible_sources', 'prefix_possible_sources') ORDER BY 1"
        ).fetchall()
    ]
    with_basis = {
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.columns WHERE column_name = 'basis'"
        ).fetchall()
    }
    union = " UNION ALL ".join(
        f"SELECT affected_request_id, source_account_id, basis FROM {t}" for t in tables if t in with_basis
    )
    if not union:
        return ()
    # the accounts counted are those notified as possibly exposed (not the recipient, not a confirmed source)
    rows = con.execute(f"""SELECT basis, count(DISTINCT affected_request_id),
                                  count(DISTINCT source_account_id) FILTER (WHERE source_account_id IN (
                                      SELECT account_id FROM notifications WHERE role = 'data_exposed_possible'))
                           FROM ({union}) GROUP BY basis ORDER BY basis""").fetchall()
    return tuple(
        f"{plural(n, 'affected response')}: {POSSIBLE_BASES.get(b, b)} ({plural(k, 'account')})" for b, n, k in rows
    )


def incident_story(
    con: duckdb.DuckDBPyConnection,
    incident: Incident,
    s: dict[str, Any],
    mechanisms: list[Any],
    rules: list[dict[str, Any]],
    audit: Any,
) -> Story:
    facts = incident_facts(con, incident)
    split = _content_split(con)  # accounts that received foreign content, and those that received their own text
    return Story(
        nature=_nature(con, s, mechanisms, rules, split),
        deployment=_deployment(con, {m.id for m in mechanisms}, audit),
        consequences=_consequences(con, s, split),
        measures=facts.measures,
        ended=facts.ended,
        operator_checks=_operator_checks(audit) if audit.verdicts else (),
        found=_found(con, mechanisms, rules),
        flagged=frozenset(_flagged(con)),
        possible_bases=_possible_bases(con),
        windows_note=_windows_note(s),
        notice_missing=facts.missing,
        provider=facts.provider,
        contact=facts.contact,
        reference=facts.reference,
    )
