"""Exploitation of a shared prefix cache: which accounts probed it, per account, with the signals and why.

A prefix-cache timing attack (PromptPeek, NDSS 2025; "The Early Bird Catches the Leak", arXiv 2409.20002;
InputSnatch, arXiv 2411.18191) sends many short requests over a long prefix it guesses another tenant
cached, varies the continuation a little at a time and reads the time to first token back before the
next guess. ``sql/prefix_probing.sql`` measures each of these per account and gives a tier (``likely`` /
``possible`` / ``no``) with the signals that were met; this module gathers its inputs, whichever of them
the evidence holds (request blocks, the prefix_reuse findings and attributions), and runs it.

The benign look-alikes stay out by construction: an evaluation harness sends one template with many
different questions (long answers; questions longer than a block end in different prefix chains), a
retrying client repeats identical requests after errors (one continuation), a chat client grows its own
conversation (long answers, turn-sized steps), and the provider's load tests are internal accounts,
which the report sets apart as it does for the stale-pages exploitation table.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

import duckdb
import pandas as pd

from kvforensics.core.db import has_table, one
from kvforensics.core.errors import ConfigError
from kvforensics.engines.portable import run_duckdb_script
from kvforensics.stages.rulebook import load_rules

MECHANISM = "prefix_reuse"

PROBING_PARAMETERS: dict[str, int | float] = {
    "probe_max_output_tokens": 4,  # a probe needs a first token back, a few at most
    "probe_min_requests": 20,  # many short requests: at least this many, and
    "probe_min_short_share": 0.3,  #   this share of the account's requests
    "probe_min_cached_fraction": 0.5,  # a long shared prefix: cached_tokens >= this x prompt_tokens, in
    "probe_min_cached_share": 0.5,  #   this share of the short requests
    "probe_min_continuations": 5,  # varied: this many different last blocks after one prefix (or lengths)
    "probe_max_length_step": 4,  # without blocks: consecutive prompt lengths within this many tokens, in
    "probe_min_small_step_share": 0.5,  #   this share of consecutive short requests
    "probe_max_gap_seconds": 30,  # read back: next request after the previous first token, within this, in
    "probe_min_read_back_share": 0.5,  #   this share of consecutive short requests
    "probe_min_foreign_hits": 3,  # on other tenants' content: this many short requests reused it
    "probe_min_rises": 2,  # a growing prefix: the prompt grew by more than a length step this often,
    "probe_min_rising_share": 0.9,  #   and never shrank in this share of consecutive short requests
}
TIERS = ("likely", "possible", "no")


def probing_parameters(overrides: Mapping[str, Any] | None = None) -> dict[str, int | float]:
    """The defaults with ``overrides`` applied (the incident file's ``[prefix_cache.probing]``, checked with
    it by :mod:`kvforensics.config`); an unknown name or a value of the wrong kind is refused."""
    params = dict(PROBING_PARAMETERS)
    for key, value in (overrides or {}).items():
        if key not in PROBING_PARAMETERS:
            near = difflib.get_close_matches(str(key), list(PROBING_PARAMETERS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown probing parameter {key!r}{hint}; known: {', '.join(PROBING_PARAMETERS)}")
        default = PROBING_PARAMETERS[key]
        kinds: tuple[type, ...] = (int,) if isinstance(default, int) else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
            kind = "a whole number" if isinstance(default, int) else "a number"
            raise ConfigError(f"probing parameter {key} must be {kind} >= 0, got {value!r}")
        if isinstance(default, float) and key.endswith(("_share", "_fraction")) and value > 1:
            raise ConfigError(f"probing parameter {key} is a share between 0 and 1, got {value!r}")
        params[key] = value
    return params


def probing_inputs(con: duckdb.DuckDBPyConnection) -> None:
    """The script's inputs as temporary views: the analysed requests (all requests before scope has run),
    account classes (every account a customer before scope), request blocks and the prefix_reuse hits
    (none when the evidence has no such table)."""
    requests = "analysed_requests" if has_table(con, "analysed_requests") else "requests"
    con.execute(
        f"CREATE OR REPLACE TEMP VIEW probe_requests AS SELECT request_id, ts, account_id, status, "
        f"prompt_tokens, completion_tokens, cached_tokens, ttft_ms, latency_ms FROM {requests}"
    )
    con.execute(
        "CREATE OR REPLACE TEMP VIEW probe_accounts AS "
        + (
            "SELECT account_id, account_class FROM account_classes"
            if has_table(con, "account_classes")
            else "SELECT DISTINCT account_id, 'customer' AS account_class FROM probe_requests"
        )
    )
    con.execute(
        "CREATE OR REPLACE TEMP VIEW probe_blocks AS "
        + (
            "SELECT request_id, position, block_fp, chain_fp FROM request_blocks"
            if has_table(con, "request_blocks")
            else "SELECT CAST(NULL AS VARCHAR) AS request_id, CAST(NULL AS BIGINT) AS position, "
            "CAST(NULL AS BIGINT) AS block_fp, CAST(NULL AS BIGINT) AS chain_fp WHERE false"
        )
    )
    con.execute("CREATE OR REPLACE TEMP TABLE probe_rules (rule_id VARCHAR)")
    rules = [r.id for r in load_rules() if r.mechanism == MECHANISM]
    if rules:
        con.executemany("INSERT INTO probe_rules VALUES (?)", [[r] for r in rules])
    hits = [
        "SELECT request_id, CAST(NULL AS VARCHAR) AS source_account FROM findings "
        "WHERE rule_id IN (SELECT rule_id FROM probe_rules)"
    ]
    if has_table(con, "prefix_sources"):
        hits.append("SELECT request_id, source_account FROM prefix_sources")
    con.execute("CREATE OR REPLACE TEMP VIEW probe_hits AS " + " UNION ALL ".join(hits))


def probing_assessment(con: duckdb.DuckDBPyConnection, params: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Per account with probe-shaped requests or prefix hits: the features, the signals met, the tier
    (``probing``: likely / possible / no) and ``why``; also left in the table ``probing_assessment``.
    Accounts in tier order (likely first), then by short requests."""
    probing_inputs(con)
    run_duckdb_script(con, "prefix_probing", probing_parameters(params))
    return con.execute("""SELECT * FROM probing_assessment
                          ORDER BY CASE probing WHEN 'likely' THEN 0 WHEN 'possible' THEN 1 ELSE 2 END,
                                   short_requests DESC, account_id""").df()


def probing_selected(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the investigation runs the prefix_reuse mechanism (the ``mechanisms`` table detect writes)."""
    return has_table(con, "mechanisms") and bool(
        one(con, "SELECT count(*) FROM mechanisms WHERE id = $m AND selected", {"m": MECHANISM})[0]
    )


def probing_summary(con: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """For ``scope.json``: the accounts probing likely or possibly, with their class, signals and why,
    and the customers among the likely ones (deliberate exploitation); None when the assessment did not run."""
    if not has_table(con, "probing_assessment"):
        return None
    rows = con.execute("""SELECT account_id, account_class, probing, signals, short_requests, cross_tenant_hits, why
                          FROM probing_assessment WHERE probing <> 'no'
                          ORDER BY probing = 'likely' DESC, signals DESC, account_id""").fetchall()
    accounts = [
        {
            "account_id": a,
            "account_class": c,
            "probing": t,
            "signals": n,
            "short_requests": short,
            "cross_tenant_hits": hits,
            "why": why,
        }
        for a, c, t, n, short, hits, why in rows
    ]
    return {
        "accounts": accounts,
        "likely_customers": [
            a["account_id"] for a in accounts if a["probing"] == "likely" and a["account_class"] == "customer"
        ],
    }


__all__ = [
    "PROBING_PARAMETERS",
    "TIERS",
    "probing_assessment",
    "probing_inputs",
    "probing_parameters",
    "probing_selected",
    "probing_summary",
]
