"""The conclusiveness gate: does this run's evidence support its answer?

An investigation that found nothing because its evidence never arrived (every gateway record
quarantined, engine logs on the wrong clock, instance names that match nothing) must not read as an
all-clear. After scope, every check of ``sql/conclusive.sql`` runs on the evidence database; each
``-- reason: <code>`` statement returns one row per problem, with a one-line ``message`` (what was
seen, what to do) and the numbers behind it. The reasons go to the ``inconclusive_reasons`` table,
``scope.json``, the manifest, the console and the top of the report; ``kvforensics run`` then exits 3.

The checks are data: a new reason is a new statement in the SQL file. ``RULE_FIELDS`` says which
optional request fields each rule cannot do without (a group is missing when all of its fields are);
``PREFIX_NEEDS`` what the prefix_reuse mechanism needs of the requests of the whole period it judges.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, Mapping

import duckdb

from kvforensics.core.db import MemoryGovernor, parameters_used, sql, statements
from kvforensics.core.timestamps import iso
from kvforensics.sources import load_kinds
from kvforensics.stages.rulebook import load_rules, rule_parameters

DEFAULT_MAX_QUARANTINE_FRACTION = 0.01
# quarantine_share: what to fix when a source of each kind quarantined more than its limit allows (the limits:
# [settings] max_quarantine_fraction, or [quarantine] <kind>; kvforensics.config.Incident.max_quarantine_fractions),
# as each kind's declaration says it (quarantine_fix of kvforensics/sources/<kind>/kind.yml)
QUARANTINE_FIXES: dict[str, str] = {k.name: k.quarantine_fix for k in load_kinds()}
# kv_event_gap: the mechanism whose responses lost KV events leave unexplained (its rules' findings are the
# flagged responses; its rules are read from the rule registry)
KV_EVENT_MECHANISM = "prefix_reuse"
# cached_tokens_disagree: the share of the requests both the gateway and the engine count cached tokens for
# on which they may differ before the figures resting on cached tokens are unreliable (fewer: an ingest warning)
MAX_CACHED_TOKENS_DISAGREE_FRACTION = 0.01
# prompt_tokens_disagree: the same for prompt_tokens against the engines' input_len, on the requests the incident
# does not explain (no abort, no other finding), beyond the tolerance of the rule that compares the two
MAX_PROMPT_TOKENS_DISAGREE_FRACTION = 0.01
TOKEN_COUNT_RULE = "engine_token_count_mismatch"
# cache_salt_unlogged: the share of the successful requests on instances with KV events that may log no cache_salt
# although their instance stored their pages under one, when none of them arrived just before a foreign load (the
# window is the store-load rule's: STORE_LOAD_RULE's load_window_s and clock_skew_s)
MAX_CACHE_SALT_UNLOGGED_FRACTION = 0.01
# gateway_requests_missing: the share of the salted device stores on the instances the requests name that may have no
# request of their namespace there that could have made them (the window is the store-load rule's too)
MAX_ORPHAN_STORE_FRACTION = 0.01
STORE_LOAD_RULE = "cross_tenant_store_load"

# Optional canonical request fields each rule needs: one tuple per need, satisfied by any of its
# fields. Fields a rule reads with a fallback are listed in RULE_FIELDS_WITH_FALLBACK instead
# (tests/test_conclusive.py checks that every optional field a rule's SQL reads is in one of them).
RULE_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "prefill_too_fast": (("ttft_ms", "latency_ms"),),  # time to first token, or end-to-end latency bounding it
}
RULE_FIELDS_WITH_FALLBACK: dict[str, tuple[str, ...]] = {
    "prefill_too_fast": ("cached_tokens", "completion_tokens"),  # taken as 0 when missing
    "prompt_exceeds_kv_pool": ("prefill_instance", "decode_instance"),  # the model's prefill pools then
    # prefix_reuse (its mechanism requires cached_tokens): without an instance the model's instances are
    # read as one shared cache; without a request salt the KV events' salt is compared
    "cross_tenant_prefix_hit": ("cache_salt", "prefill_instance", "completion_tokens"),  # 0 when missing
    "prefix_salt_mismatch": ("cache_salt", "prefill_instance"),
    # without a request salt, a block's hash is looked for under every salt its content was stored with
    "block_hash_collision": ("cache_salt", "prefill_instance"),
    # a load from a shared store is a response's when a request of the loading namespace (cache_salt) arrived on
    # that instance just before it; loads no request explains are reason prefix_store_loads_unmatched; a device
    # store goes to a request whose prompt and output hold its pages (completion_tokens taken as 0 when missing)
    "cross_tenant_store_load": ("cache_salt", "prefill_instance", "completion_tokens"),
}
_PREFIX_RULES = "cross_tenant_prefix_hit, prefix_salt_mismatch and block_hash_collision"
_MAP_FIELD = "map the field in the requests source's columns (or a preset), or check its null tokens"
# What the prefix_reuse mechanism needs of the requests it judges, when it is investigated (its rules
# read every successful request of the analysed period, not only exposure windows): `fields` (any of
# them) on the successful requests, or with `hits_only` on its prefix-cache hits; missing for a model
# when empty for all of them or present for fewer than `min_share`; with `when_logged`, only when some
# request carries one of them; with `when_store`, only when a start-up had a store that drops the salt
# (prefix_windows path salt_blind_store). The reason's message is "<fields> empty for N of its M <requests> in the
# analysed period, so <consequence>".
PREFIX_NEEDS: tuple[dict[str, Any], ...] = (
    {
        "rule": "prefix_reuse",
        "fields": ["cached_tokens"],
        "hits_only": False,
        "min_share": 0.5,
        "when_logged": False,
        "when_store": False,
        "consequence": f"rules {_PREFIX_RULES} cannot tell which of them reused another tenant's prefix-cache "
        f"blocks; {_MAP_FIELD} (OpenAI-style usage: prompt_tokens_details.cached_tokens)",
    },
    {
        "rule": "prefix_salt_mismatch",
        "fields": ["cache_salt", "kv_events.salt"],
        "hits_only": True,
        "min_share": 0.0,
        "when_logged": True,
        "when_store": False,
        "consequence": "rule prefix_salt_mismatch cannot compare their salts with the storing requests' although "
        f"other requests carry one; {_MAP_FIELD}",
    },
    {
        "rule": "prefix_reuse",
        "fields": ["request_blocks", "kv_events"],
        "hits_only": True,
        "min_share": 0.5,
        "when_logged": False,
        "when_store": False,
        "consequence": f"rules {_PREFIX_RULES} can flag them from cached_tokens alone, weakly, and name no source; "
        "add the content source with prompt_token_ids (or a [prefix_cache] table for blocks of words) "
        "or the engines' KV events (kind = \"kv_events\") for that period",
    },
    {
        "rule": "cross_tenant_store_load",
        "fields": ["prefill_instance"],
        "hits_only": True,
        "min_share": 0.5,
        "when_logged": False,
        "when_store": True,
        "consequence": "a load from the shared store, which the KV events show per instance, cannot be given to the "
        f"request it served, and none of them can be found; {_MAP_FIELD}",
    },
    {
        "rule": "prefix_probing",
        "fields": ["ttft_ms", "latency_ms"],
        "hits_only": False,
        "min_share": 0.0,
        "when_logged": False,
        "when_store": False,
        "consequence": f"the prefix-cache probing assessment cannot see the timing read back; {_MAP_FIELD}",
    },
)

_REASON = re.compile(r"^--\s*reason:\s*([a-z_]+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Check:
    code: str
    sql: str


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    evidence: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "evidence": self.evidence}


@cache
def _script() -> tuple[tuple[str, ...], tuple[Check, ...]]:
    """The preparing statements and the checks of ``sql/conclusive.sql``, in file order."""
    prelude: list[str] = []
    checks: list[Check] = []
    for stmt in statements(sql("conclusive")):
        m = _REASON.search(stmt)
        if m:
            checks.append(Check(m.group(1), stmt))
        elif checks:
            raise ValueError("sql/conclusive.sql: a statement after the first check has no '-- reason:' line")
        else:
            prelude.append(stmt)
    return tuple(prelude), tuple(checks)


def checks() -> tuple[Check, ...]:
    return _script()[1]


def codes() -> tuple[str, ...]:
    """Every reason code the gate can give, in the order it reports them."""
    return tuple(c.code for c in checks())


def parameters(
    max_quarantine_fraction: float = DEFAULT_MAX_QUARANTINE_FRACTION,
    rule_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    max_quarantine_fractions: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The checks' parameters; *rule_overrides* (the incident's ``[rules.<id>]``) set the tolerance of the
    prompt_tokens comparison as they set the rule's; *max_quarantine_fractions* the quarantine limit of a
    source kind (``[quarantine]``) where it is not *max_quarantine_fraction*."""
    needs = [{"rule": rule, "fields": list(group)} for rule, groups in sorted(RULE_FIELDS.items()) for group in groups]
    rules = load_rules()
    by_id = {r.id: r for r in rules}
    tolerance, store_window = (
        rule_parameters(by_id[rid], (rule_overrides or {}).get(rid)) for rid in (TOKEN_COUNT_RULE, STORE_LOAD_RULE)
    )
    limits = {
        kind: float((max_quarantine_fractions or {}).get(kind, max_quarantine_fraction)) for kind in QUARANTINE_FIXES
    }
    return {
        "max_quarantine_fraction": float(max_quarantine_fraction),
        "needs": needs,
        "quarantine_limits": [
            {"kind": kind, "max_fraction": limits[kind], "fix": QUARANTINE_FIXES[kind]} for kind in sorted(limits)
        ],
        "kv_event_rules": sorted(r.id for r in rules if r.mechanism == KV_EVENT_MECHANISM),
        "kv_event_mechanism": KV_EVENT_MECHANISM,
        "max_cached_tokens_disagree_fraction": MAX_CACHED_TOKENS_DISAGREE_FRACTION,
        "max_prompt_tokens_disagree_fraction": MAX_PROMPT_TOKENS_DISAGREE_FRACTION,
        "token_min_abs_diff": int(tolerance["min_abs_diff"]),
        "token_max_rel_diff": float(tolerance["max_rel_diff"]),
        "max_cache_salt_unlogged_fraction": MAX_CACHE_SALT_UNLOGGED_FRACTION,
        "max_orphan_store_fraction": MAX_ORPHAN_STORE_FRACTION,
        "load_window_s": float(store_window["load_window_s"]),
        "clock_skew_s": float(store_window["clock_skew_s"]),
        "prefix_needs": [dict(n) for n in PREFIX_NEEDS],
    }


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _execute(con: duckdb.DuckDBPyConnection, stmt: str, params: dict[str, Any]) -> duckdb.DuckDBPyConnection:
    used = parameters_used(stmt)
    return con.execute(stmt, {k: v for k, v in params.items() if k in used} or None)


def _described(cur: duckdb.DuckDBPyConnection) -> tuple[list[str], list[tuple]]:
    """A query's column names and rows."""
    return [d[0] for d in cur.description], cur.fetchall()


def evaluate(
    con: duckdb.DuckDBPyConnection, params: dict[str, Any] | None = None, only: tuple[str, ...] | None = None
) -> list[Reason]:
    """Run the checks (``only`` these codes, else all) on a scoped evidence database."""
    params = params or parameters()
    prelude, all_checks = _script()
    reasons: list[Reason] = []
    with MemoryGovernor(con) as governor:  # the checks join the whole period's requests: a long script
        for stmt in prelude:
            governor.run(lambda stmt=stmt: _execute(con, stmt, params).fetchall())
        for check in all_checks:
            if only is not None and check.code not in only:
                continue
            if check.code == "rule_field_missing" and not (params.get("needs") and params.get("prefix_needs")):
                continue
            names, rows = governor.run(lambda check=check: _described(_execute(con, check.sql, params)))
            for row in rows:
                rec = dict(zip(names, row, strict=True))
                message = str(rec.pop("message") or check.code)
                reasons.append(Reason(check.code, message, {k: _plain(v) for k, v in rec.items()}))
    return reasons


def record(con: duckdb.DuckDBPyConnection, reasons: list[Reason]) -> None:
    """Replace the ``inconclusive_reasons`` table's rows with these."""
    con.execute("DELETE FROM inconclusive_reasons").fetchall()
    for i, r in enumerate(reasons, 1):
        con.execute(
            "INSERT INTO inconclusive_reasons VALUES ($n, $c, $m, $e)",
            {"n": i, "c": r.code, "m": r.message, "e": json.dumps(r.evidence)},
        ).fetchall()


def gate(
    con: duckdb.DuckDBPyConnection,
    max_quarantine_fraction: float = DEFAULT_MAX_QUARANTINE_FRACTION,
    rule_overrides: Mapping[str, Mapping[str, Any]] | None = None,
    max_quarantine_fractions: Mapping[str, float] | None = None,
) -> list[Reason]:
    """Evaluate every check and record the reasons; empty when the run is conclusive."""
    reasons = evaluate(con, parameters(max_quarantine_fraction, rule_overrides, max_quarantine_fractions))
    record(con, reasons)
    return reasons


def recorded(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """The reasons recorded by the last gate, as ``scope.json`` lists them."""
    return [
        {"code": c, "message": m, "evidence": json.loads(e) if e else {}}
        for c, m, e in con.execute("SELECT code, message, evidence FROM inconclusive_reasons ORDER BY n").fetchall()
    ]
