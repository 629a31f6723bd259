"""Per-account notices: one notice per account with only that account's facts, in Markdown and HTML, ready to send.

A notice says what a data-protection notice to an affected person has to say (GDPR Art. 34(2) with Art. 33(3) b-d;
US state breach-notification laws ask the same): who sends it and where to ask (the incident file's ``[notice]``
``provider`` and ``contact``; without them every notice is written as a draft, marked so in its first line), the
incident's dates, what data of the account is concerned, the likely consequences, the measures taken and what the
account can do. Every sentence about the incident is either derived from the evidence (the dates, the responses and
requests, whether the exposure has ended) or declared in ``[notice]`` (the measures taken, further advice); none is a
template constant presented as a fact.

What a notice says about each exposure mechanism is its wording (``notice`` in
``kvforensics/mechanisms/<id>/mechanism.yml``): the responses an account received are told per mechanism whose rules
flagged them, and the requests whose data was confirmably served to other accounts per mechanism of the match's basis
(``content_matches.basis``), with how many other accounts and requests, never which ones.

Who gets which notice (``notice_type``, the folder under ``notices/``):

* ``customer`` (``customers/``): a customer's letter, every role of the account in one notice;
* ``internal`` (``internal/``): the provider's own accounts (``[scope] internal_accounts``): a record for its own
  team, in the same shape, never told "another customer's" of its own traffic;
* ``reporter`` (``reporter/``): the account that reported the problem;
* ``trust_and_safety`` (``trust-and-safety/``): an account suspected of deliberate exploitation (table
  ``suspected_exploiters``) gets no letter; the provider's trust-and-safety team gets a review notice with why, what
  the account received and the notice held back.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
from markdown_it import MarkdownIt
from markupsafe import Markup

from kvforensics.config import Incident
from kvforensics.core.db import has_table
from kvforensics.mechanisms import Mechanism, load_mechanisms
from kvforensics.report.templating import template_env

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
# findings from before mechanisms have none recorded: the stale_pages rules were the only ones
_LEGACY_MECHANISM = "stale_pages"
#: notice type -> folder under notices/
FOLDERS = {
    "customer": "customers",
    "internal": "internal",
    "reporter": "reporter",
    "trust_and_safety": "trust-and-safety",
}


def safe_filename(account_id: str) -> str:
    """A file name for an account id: untrusted text never becomes a path, and two ids never share one. The id
    with every character but ASCII letters, digits, ``.``, ``_`` and ``-`` replaced (at most 60, for reading),
    then the whole SHA-256 of the id: unique as long as SHA-256 has no collision (8 hex digits were not: two ids
    sharing a name were found in 29,386 tries, and a chosen victim's name costs ~2^32 hashes; 64 cost 2^128 for
    any two ids and 2^256 for a chosen one). Lower-case hex: unique on a case-insensitive file system too."""
    cleaned = _SAFE.sub("_", account_id).strip("._")[:60] or "account"
    return f"{cleaned}-{hashlib.sha256(account_id.encode('utf-8', 'surrogatepass')).hexdigest()}.md"


def notice_type(account_class: str, suspected: bool) -> str:
    """Which notice an account gets: a suspect's goes to trust and safety, else one by its class."""
    if suspected:
        return "trust_and_safety"
    return account_class if account_class in ("internal", "reporter") else "customer"


def notice_path(account_id: str, account_class: str, suspected: bool) -> str:
    """The account's notice (Markdown; the HTML one beside it), relative to the output folder."""
    return f"notices/{FOLDERS[notice_type(account_class, suspected)]}/{safe_filename(account_id)}"


def suspected_accounts(con: duckdb.DuckDBPyConnection) -> dict[Any, list[tuple[str, str]]]:
    """Per suspected account, (mechanism, why) for each mechanism whose pattern it has (table ``suspected_exploiters``,
    empty in an evidence database scoped before it existed)."""
    out: dict[Any, list[tuple[str, str]]] = {}
    if not has_table(con, "suspected_exploiters"):
        return out
    for account, mechanism, why in con.execute(
        "SELECT account_id, mechanism, why FROM suspected_exploiters ORDER BY 1, 2"
    ).fetchall():
        out.setdefault(account, []).append((mechanism, why))
    return out


def notice_rows(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    return con.execute(
        "SELECT account_id, account_class, role, responses, first_ts, last_ts, request_ids "
        "FROM notifications ORDER BY account_class, account_id, role"
    ).df()


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """A frame's rows with every missing value (NaN, NA, NaT) as None: a template tests values for truth, and a
    NaN is true (a table column of nothing but NaN was shown, empty)."""
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def _received(con: duckdb.DuckDBPyConnection) -> dict[Any, dict[str, list[dict]]]:
    """Per account and mechanism, the affected responses it received that the mechanism's rules flagged, with
    the tokens of its prompt the prefix cache served from other accounts' blocks (when attributed)."""
    out: dict[Any, dict[str, list[dict]]] = {}
    for rec in _records(
        con.execute(
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
            {"legacy": _LEGACY_MECHANISM},
        ).df()
    ):
        out.setdefault(rec.pop("account_id"), {}).setdefault(rec.pop("mechanism"), []).append(rec)
    return out


def _exposed(
    con: duckdb.DuckDBPyConnection, mechanisms: tuple[Mechanism, ...]
) -> dict[Any, dict[str | None, list[dict]]]:
    """Per source account and mechanism (one whose rules flagged the response and whose notice claims the
    match's basis; None: no such mechanism),
    each of its requests confirmed in other accounts' responses: when it was sent, how many other accounts
    and requests, what the bases mean (``how``), and for reused prefix-cache blocks the most tokens one
    request reused."""
    owners = pd.DataFrame(
        [{"basis": b, "mechanism": m.id} for m in mechanisms for b, _ in m.notice.bases], columns=["basis", "mechanism"]
    )
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
               ORDER BY m.account_id, m.mechanism NULLS LAST, ts, request_id""",
            {"legacy": _LEGACY_MECHANISM},
        ).df()
    finally:
        con.unregister("notice_basis_owners")
    meaning = {b: text for m in mechanisms for b, text in m.notice.bases}
    out: dict[Any, dict[str | None, list[dict]]] = {}
    for rec in _records(frame):
        rec["how"] = "; ".join(meaning.get(b, "a match of its content") for b in rec.pop("bases"))
        mechanism = rec.pop("mechanism")
        out.setdefault(rec.pop("account_id"), {}).setdefault(mechanism, []).append(rec)
    return out


@dataclass
class Possible:
    """An account's requests that possibly fed an affected response: the mechanisms of those responses (their notice
    wording) and each basis on which its requests were listed (``possible_sources.basis``)."""

    mechanisms: list[str] = field(default_factory=list)
    bases: dict[str, str | None] = field(default_factory=dict)  # basis -> the earliest "since" it rests on


def _possible(con: duckdb.DuckDBPyConnection) -> dict[Any, Possible]:
    """Per possible source account, the mechanisms whose rules flagged the responses it possibly fed (the
    stale-pages turnover horizon, the prefix cache's resident blocks) and the bases."""
    tables = [
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_name IN "
            "('possible_sources', 'prefix_possible_sources') ORDER BY 1"
        ).fetchall()
    ]
    if not tables:
        return {}
    has_basis = {
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.columns WHERE column_name = 'basis' AND table_name IN "
            "('possible_sources', 'prefix_possible_sources')"
        ).fetchall()
    }
    sources = " UNION ALL ".join(
        f"SELECT affected_request_id, source_account_id, {'basis' if t in has_basis else chr(39) + 'turnover_horizon' + chr(39)} "
        f"AS basis FROM {t}"
        for t in tables
    )
    out: dict[Any, Possible] = {}
    for account, mechanism, basis, since in con.execute(
        f"""SELECT DISTINCT p.source_account_id, coalesce(f.mechanism, $legacy) AS mechanism, p.basis,
                       (SELECT min(c.valid_from) FROM capacity c JOIN requests a ON a.request_id = p.affected_request_id
                        WHERE c.model = a.model AND c.valid_from <= a.ts AND (c.valid_to IS NULL OR a.ts < c.valid_to))
                FROM ({sources}) p JOIN findings f ON f.request_id = p.affected_request_id
                ORDER BY 1, 2, 3""",
        {"legacy": _LEGACY_MECHANISM},
    ).fetchall():
        entry = out.setdefault(account, Possible())
        if mechanism not in entry.mechanisms:
            entry.mechanisms.append(mechanism)
        seen = entry.bases.get(basis)
        entry.bases[basis] = since if seen is None or (since is not None and since < seen) else seen
    return out


@dataclass(frozen=True)
class IncidentFacts:
    """What every notice of one run says about the incident: declared in ``[notice]`` or derived from the evidence."""

    provider: str | None
    contact: str | None
    reference: str
    measures: tuple[str, ...]
    advice: tuple[str, ...]
    missing: tuple[str, ...]  # [notice] keys a sendable notice needs that are not set: a draft
    conclusive: bool
    first: Any  # the first and last affected response of the run
    last: Any
    models: tuple[str, ...]  # the models with affected responses
    ended: tuple[str, ...]  # derived: how each exposure window ended, or that it had not


def _exposure_ends(con: duckdb.DuckDBPyConnection) -> tuple[str, ...]:
    """Plain sentences, from the evidence, on whether the exposed servers still run as they did: per exposure window
    (stale pages) and prefix-cache path across tenants, the start-up that ended it, or that none had."""
    from kvforensics.report.templating import plural, prose_time

    lines: list[str] = []
    rows = con.execute(
        """SELECT w.instance, w.model, w.valid_to, w.end_reason,
                  n.kv_pool_tokens, n.context_length,
                  EXISTS (SELECT 1 FROM exposure_windows x WHERE x.instance = n.instance AND x.valid_from = n.valid_from)
           FROM exposure_windows w
           LEFT JOIN capacity n ON n.instance = w.instance AND n.valid_from = w.valid_to
           ORDER BY w.valid_to NULLS FIRST, w.instance"""
    ).fetchall()
    open_windows = [r for r in rows if r[2] is None]
    if open_windows:
        lines.append(
            f"{len(open_windows)} of the {plural(len(rows), 'misconfigured model server')} "
            f"({', '.join(sorted({str(r[0]) for r in open_windows}))}) were still running as configured "
            "during the incident when the records we examined end."
        )
    for instance, _model, to, reason, pool, ctx, still in rows:  # noqa: B007 - pool and ctx only tested
        if to is None:
            continue
        if reason == "next_startup" and pool is not None and ctx is not None and not still:
            lines.append(
                f"Model server {instance} was restarted on {prose_time(to)} with enough memory for every "
                "request it accepts."
            )
        elif reason == "next_startup":
            lines.append(f"Model server {instance} was restarted on {prose_time(to)}, still misconfigured.")
        elif reason == "shutdown":
            lines.append(f"Model server {instance} was shut down on {prose_time(to)}.")
        else:
            lines.append(f"Model server {instance} was replaced on {prose_time(to)}.")
    if has_table(con, "prefix_windows"):
        (open_paths,) = con.execute("""SELECT count(DISTINCT instance) FROM prefix_windows
                                       WHERE path NOT IN ('isolated', 'undetermined') AND valid_to IS NULL
                                         AND EXISTS (SELECT 1 FROM findings f WHERE f.mechanism = 'prefix_reuse')""").fetchone()
        if open_paths:
            lines.append(
                f"On {plural(open_paths, 'model server')} the shared prompt cache was still configured as "
                "during the incident when the records we examined end."
            )
    return tuple(lines)


def incident_facts(con: duckdb.DuckDBPyConnection, incident: Incident) -> IncidentFacts:
    first, last = con.execute("SELECT min(ts), max(ts) FROM affected_responses").fetchone() or (None, None)
    models = tuple(m for (m,) in con.execute("SELECT DISTINCT model FROM affected_responses ORDER BY 1").fetchall())
    n = incident.notice
    return IncidentFacts(
        provider=n.provider,
        contact=n.contact,
        reference=n.reference or incident.id,
        measures=n.measures,
        advice=n.advice,
        missing=n.missing,
        conclusive=not con.execute("SELECT count(*) FROM inconclusive_reasons").fetchall()[0][0],
        first=first,
        last=last,
        models=models,
        ended=_exposure_ends(con),
    )


_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
# from this many notices on, they are written by a worker process while the report's pages are drawn (rendering and
# converting the Markdown is ~5 ms a notice, all of it Python); below it the process start costs more than it saves
HTML_WORKER_FROM = 200
_HTML_CHUNK = 32  # notices a worker's task writes
_NOTICE_TEMPLATES = {"letter": "notice.md.j2", "review": "notice_review.md.j2"}


def markdown_to_html(markdown: str, title: str) -> str:
    """A notice's Markdown as one offline HTML page (no script, no request: its Content-Security-Policy says so).
    Raw HTML in the Markdown is not honoured (every untrusted value in it is escaped as Markdown already)."""
    page = template_env(True).get_template("notice.html.j2")
    return page.render(title=title, body=Markup(_MARKDOWN.render(markdown)))


NoticeJob = tuple[str, str, Mapping[str, Any], str]  # the Markdown's path, its template, its facts, the page's title


def write_notice_files(jobs: list[NoticeJob]) -> None:
    """Each notice's Markdown, rendered from its template and facts, and its HTML page beside it (what a worker
    process runs, and this one for what the worker has not begun)."""
    env = template_env(False)
    for path, template, context, title in jobs:
        markdown = env.get_template(_NOTICE_TEMPLATES[template]).render(**context)
        Path(path).write_text(markdown, encoding="utf-8")
        Path(path).with_suffix(".html").write_text(markdown_to_html(markdown, title), encoding="utf-8")


def _ready() -> None:
    """A worker's first task: its imports and compiled templates made while the notices' facts are still read."""
    template_env(False).get_template(_NOTICE_TEMPLATES["letter"])
    template_env(True).get_template("notice.html.j2")


class PendingNotices:
    """Notices being written, by a worker process when there are many: :meth:`wait` returns once every notice is
    written. Waiting, this process takes the tasks the worker has not begun, the last first, and writes one the worker
    could not (it died) itself."""

    def __init__(self, written: list[Path], pool: Any = None) -> None:
        self.written = written
        self._pool = pool
        self._jobs: list[list[NoticeJob]] = []
        self._futures: list[Any] = []

    def submit(self, jobs: list[NoticeJob]) -> None:
        """The notices to write, in tasks of ``_HTML_CHUNK`` for the worker when there is one."""
        self._jobs = [jobs[at : at + _HTML_CHUNK] for at in range(0, len(jobs), _HTML_CHUNK)]
        if self._pool is not None:
            try:
                self._futures = [self._pool.submit(write_notice_files, chunk) for chunk in self._jobs]
            except (OSError, RuntimeError):  # no process to be had: written here at wait()
                self._close()

    def wait(self) -> list[Path]:
        """Every notice written; their Markdown paths."""
        from concurrent.futures.process import BrokenProcessPool

        try:
            if not self._futures:
                for chunk in self._jobs:
                    write_notice_files(chunk)
                return self.written
            tasks = list(zip(self._jobs, self._futures, strict=True))
            while tasks and tasks[-1][1].cancel():  # not begun by the worker: written here, the last first
                write_notice_files(tasks.pop()[0])
            for chunk, future in tasks:
                try:
                    future.result()
                except BrokenProcessPool:  # the worker died (killed, out of memory): its share written here
                    write_notice_files(chunk)
            return self.written
        finally:
            self._close()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._futures = None, []


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def write_notices(con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path) -> list[Path]:
    """One notice per account (Markdown, and HTML beside it) with only that account's facts: customers, the provider's
    own accounts, the reporter, and the suspected exploiters' review notices for trust and safety, kept apart."""
    return start_notices(con, incident, out_dir, worker=False).wait()


def start_notices(
    con: duckdb.DuckDBPyConnection, incident: Incident, out_dir: Path, *, worker: bool = True
) -> PendingNotices:
    """:func:`write_notices`, left to a worker process when there are many (``worker``): the caller goes on with
    other work and calls ``wait()`` on what this returns. The files are the same either way."""
    rows = notice_rows(con)
    roles_by_account: dict[object, list[dict]] = {}
    for rec in _records(rows):
        roles_by_account.setdefault(rec["account_id"], []).append(rec)
    pending = PendingNotices([], _worker() if worker and len(roles_by_account) >= HTML_WORKER_FROM else None)
    facts = incident_facts(con, incident)
    mechanisms = load_mechanisms()
    by_id = {m.id: m for m in mechanisms}
    # every account's facts in one query per role (not one per account), grouped here
    received = _received(con)
    exposed = _exposed(con, mechanisms)
    possible = _possible(con)
    suspects = suspected_accounts(con)
    jobs: list[NoticeJob] = []
    for account_id in sorted(roles_by_account):
        roles = roles_by_account[account_id]
        cls = str(roles[0]["account_class"])
        suspected = suspects.get(account_id, [])
        kind = notice_type(cls, bool(suspected))
        path = out_dir / notice_path(str(account_id), cls, bool(suspected))
        path.parent.mkdir(parents=True, exist_ok=True)
        got = possible.get(account_id, Possible())
        context: Mapping[str, Any] = dict(
            incident=incident,
            facts=facts,
            account_id=account_id,
            account_class=cls,
            kind=kind,
            roles=roles,
            received=[(by_id.get(m), responses) for m, responses in received.get(account_id, {}).items()],
            exposed=[(by_id.get(m) if m else None, requests) for m, requests in exposed.get(account_id, {}).items()],
            possible=[
                by_id[m].notice.possible for m in got.mechanisms if m in by_id and by_id[m].notice.possible is not None
            ],
            possible_bases=got.bases,
            suspected=[(by_id[m].title if m in by_id else m, why) for m, why in suspected],
        )
        template = "review" if kind == "trust_and_safety" else "letter"
        jobs.append((str(path), template, context, f"{incident.title}: notice for account {account_id}"))
        pending.written.append(path)
    pending.submit(jobs)
    return pending


def _worker() -> Any:
    """A process to write the notices in, started now (its imports made while the facts are read), or None on one
    core or where no process can be started."""
    if _cores() < 2:
        return None
    try:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: the worker shares nothing with this process (its DuckDB threads, its locks)
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(_ready)
        return pool
    except (OSError, RuntimeError, ImportError):
        return None
