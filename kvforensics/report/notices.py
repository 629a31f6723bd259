"""Per-account notices: one Markdown file per account with only that account's facts.

What a notice says about each role of an account is its exposure mechanism's wording (``notice`` in
``kvforensics/mechanisms/<id>/mechanism.yml``): the responses an account received are told per mechanism
whose rules flagged them, and the requests whose data was confirmably served to other accounts per
mechanism of the match's basis (``content_matches.basis``: output shingles for stale pages, block
fingerprints or a colliding block for the prefix cache), with how many other accounts and requests, never
which ones, and for reused prefix-cache blocks how many of the prompt's tokens they held.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from kvforensics.config import Incident
from kvforensics.mechanisms import Mechanism, load_mechanisms
from kvforensics.report.templating import template_env

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
# findings from before mechanisms have none recorded: the stale_pages rules were the only ones
_LEGACY_MECHANISM = "stale_pages"


def safe_filename(account_id: str) -> str:
    """A file name for an account id: untrusted text never becomes a path, and two ids never share one. The id
    with every character but ASCII letters, digits, ``.``, ``_`` and ``-`` replaced (at most 60, for reading),
    then the whole SHA-256 of the id: unique as long as SHA-256 has no collision (8 hex digits were not: two ids
    sharing a name were found in 29,386 tries, and a chosen victim's name costs ~2^32 hashes; 64 cost 2^128 for
    any two ids and 2^256 for a chosen one). Lower-case hex: unique on a case-insensitive file system too."""
    cleaned = _SAFE.sub("_", account_id).strip("._")[:60] or "account"
    return f"{cleaned}-{hashlib.sha256(account_id.encode('utf-8', 'surrogatepass')).hexdigest()}.md"


def notice_rows(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    return con.execute("SELECT account_id, account_class, role, responses, first_ts, last_ts, request_ids "
                       "FROM notifications ORDER BY account_class, account_id, role").df()


def _received(con: duckdb.DuckDBPyConnection) -> dict[Any, dict[str, list[dict]]]:
    """Per account and mechanism, the affected responses it received that the mechanism's rules flagged, with
    the tokens of its prompt the prefix cache served from other accounts' blocks (when attributed)."""
    out: dict[Any, dict[str, list[dict]]] = {}
    for rec in con.execute(
            """WITH flagged AS (
                   SELECT DISTINCT request_id, coalesce(mechanism, $legacy) AS mechanism FROM findings
               ), reused AS (
                   SELECT p.request_id, sum(b.num_tokens) AS tokens
                   FROM (SELECT DISTINCT request_id, position_from, position_to FROM prefix_sources) p
                   JOIN request_blocks b ON b.request_id = p.request_id
                                        AND b.position BETWEEN p.position_from AND p.position_to
                   GROUP BY p.request_id
               )
               SELECT a.account_id, f.mechanism, a.request_id, a.ts, a.model, a.prompt_tokens, a.confidence,
                      u.tokens AS reused_tokens
               FROM affected_responses a JOIN flagged f ON f.request_id = a.request_id
               LEFT JOIN reused u ON u.request_id = a.request_id
               ORDER BY a.account_id, f.mechanism, a.ts, a.request_id""",
            {"legacy": _LEGACY_MECHANISM}).df().to_dict("records"):
        out.setdefault(rec.pop("account_id"), {}).setdefault(rec.pop("mechanism"), []).append(rec)
    return out


def _exposed(con: duckdb.DuckDBPyConnection, mechanisms: tuple[Mechanism, ...]) -> dict[Any, dict[str | None, list[dict]]]:
    """Per source account and mechanism (one whose rules flagged the response and whose notice claims the
    match's basis; None: no such mechanism),
    each of its requests confirmed in other accounts' responses: when it was sent, how many other accounts
    and requests, what the bases mean (``how``), and for reused prefix-cache blocks the most tokens one
    request reused."""
    owners = pd.DataFrame([{"basis": b, "mechanism": m.id} for m in mechanisms for b, _ in m.notice.bases],
                          columns=["basis", "mechanism"])
    con.register("notice_basis_owners", owners)
    try:
        frame = con.execute(
            """WITH claimed AS (
                   SELECT DISTINCT f.request_id, o.basis, o.mechanism
                   FROM findings f JOIN notice_basis_owners o ON o.mechanism = coalesce(f.mechanism, $legacy)
               ), m AS (
                   SELECT DISTINCT c.source_account_id AS account_id, c.source_request_id, c.affected_request_id,
                          c.recipient_account_id, c.basis, o.mechanism
                   FROM content_matches c
                   LEFT JOIN claimed o ON o.request_id = c.affected_request_id AND o.basis = c.basis
                   WHERE c.confirmed AND c.source_account_id <> c.recipient_account_id
               ), reused AS (
                   SELECT p.request_id, p.source_request_id, sum(b.num_tokens) AS tokens
                   FROM (SELECT DISTINCT request_id, source_request_id, position_from, position_to
                         FROM prefix_sources) p
                   JOIN request_blocks b ON b.request_id = p.request_id
                                        AND b.position BETWEEN p.position_from AND p.position_to
                   GROUP BY p.request_id, p.source_request_id
               )
               SELECT m.account_id, m.mechanism, m.source_request_id AS request_id, any_value(r.ts) AS ts,
                      count(DISTINCT m.recipient_account_id) AS other_accounts,
                      count(DISTINCT m.affected_request_id) AS other_requests, max(u.tokens) AS tokens,
                      list(DISTINCT m.basis ORDER BY m.basis) AS bases
               FROM m JOIN requests r ON r.request_id = m.source_request_id
               LEFT JOIN reused u ON u.request_id = m.affected_request_id AND u.source_request_id = m.source_request_id
               GROUP BY m.account_id, m.mechanism, m.source_request_id
               ORDER BY m.account_id, m.mechanism NULLS LAST, ts, request_id""", {"legacy": _LEGACY_MECHANISM}).df()
    finally:
        con.unregister("notice_basis_owners")
    meaning = {b: text for m in mechanisms for b, text in m.notice.bases}
    out: dict[Any, dict[str | None, list[dict]]] = {}
    for rec in frame.to_dict("records"):
        rec["how"] = "; ".join(meaning.get(b, "a match of its content") for b in rec.pop("bases"))
        mechanism = rec.pop("mechanism")
        out.setdefault(rec.pop("account_id"), {}).setdefault(None if pd.isna(mechanism) else mechanism, []).append(rec)
    return out


def _possible(con: duckdb.DuckDBPyConnection) -> dict[Any, list[str]]:
    """Per possible source account, the mechanisms whose rules flagged the responses it possibly fed (the
    stale-pages turnover horizon, the prefix cache's resident blocks), for their notice wording."""
    tables = [t for (t,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_name IN "
        "('possible_sources', 'prefix_possible_sources') ORDER BY 1").fetchall()]
    if not tables:
        return {}
    sources = " UNION ALL ".join(f"SELECT affected_request_id, source_account_id FROM {t}" for t in tables)
    out: dict[Any, list[str]] = {}
    for account, mechanism in con.execute(
            f"""SELECT DISTINCT p.source_account_id, coalesce(f.mechanism, $legacy) AS mechanism
                FROM ({sources}) p JOIN findings f ON f.request_id = p.affected_request_id
                ORDER BY 1, 2""", {"legacy": _LEGACY_MECHANISM}).fetchall():
        out.setdefault(account, []).append(mechanism)
    return out


def write_notices(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> list[Path]:
    """One Markdown notice per account with only that account's facts; internal/reporter kept apart."""
    env = template_env(False)
    template = env.get_template("notice.md.j2")
    rows = notice_rows(con)
    conclusive = not con.execute("SELECT count(*) FROM inconclusive_reasons").fetchall()[0][0]
    mechanisms = load_mechanisms()
    by_id = {m.id: m for m in mechanisms}
    # every account's facts in one query per role (not one per account), grouped here
    received = _received(con)
    exposed = _exposed(con, mechanisms)
    possible = _possible(con)
    roles_by_account: dict[object, list[dict]] = {}
    for rec in rows.to_dict("records"):
        roles_by_account.setdefault(rec["account_id"], []).append(rec)
    written = []
    for account_id in sorted(roles_by_account):
        roles = roles_by_account[account_id]
        cls = str(roles[0]["account_class"])
        folder = out_dir / "notices" / ("customers" if cls == "customer" else cls)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / safe_filename(str(account_id))
        path.write_text(template.render(
            incident=incident, conclusive=conclusive, account_id=account_id, account_class=cls, roles=roles,
            received=[(by_id.get(m), responses) for m, responses in received.get(account_id, {}).items()],
            exposed=[(by_id.get(m) if m else None, requests) for m, requests in exposed.get(account_id, {}).items()],
            possible=[by_id[m].notice.possible for m in possible.get(account_id, [])
                      if m in by_id and by_id[m].notice.possible is not None]), encoding="utf-8")
        written.append(path)
    return written
