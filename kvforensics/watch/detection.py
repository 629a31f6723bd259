"""The detection rules on what is new: the requests a poll loaded, those new engine events name, all of them when
the start-ups changed.

A rule that reads ``requests`` once (every stale_pages rule) judges each request on its own row and the tables
beside it (capacity, engine events, the latency model): it runs on the new requests alone, through a cursor on
which a temporary table named ``requests`` holds only them (the evidence's own table is untouched; other cursors
never see it). A rule that reads ``requests`` more than once compares a request with others (the prefix_reuse
rules look for the earlier senders of a block) and runs on the whole table at every poll; its cost grows with
the evidence. ``tests/test_watch_detection.py`` checks, for every rule of the first kind, that it flags on a part
of the requests what it flags of that part on the whole.

Findings are kept per request and rule (table ``watch_findings``, dropped when watch stops, when ``detect``'s
own ``findings`` take over) and combined into tiers as ``detect`` combines them. The latency model is fitted
as ``detect`` fits it (without the requests the other rules flagged) when there is none yet and again whenever
the requests have grown by half since the last fit; after a fit, the rules that read it judge again the requests
another rule flagged (a weak finding alone leaves a request possible, never affected; every request when such a
rule can find strong evidence).
"""

from __future__ import annotations

import re
from typing import Sequence

import duckdb
import pandas as pd
import pyarrow as pa

from kvforensics import latency
from kvforensics.config import Incident
from kvforensics.core.db import one
from kvforensics.core.errors import ConfigError
from kvforensics.stages.detect import select_mechanisms
from kvforensics.stages.rulebook import Rule, load_rules, rule_parameters

REFIT_GROWTH = 1.5  # the latency model is fitted again when the requests have grown by this factor
_READS_REQUESTS = re.compile(r"\b(?:FROM|JOIN)\s+requests\b", re.IGNORECASE)
_FINDINGS = "watch_findings"


def _can_be_strong(rule: Rule) -> bool:
    """Whether *rule* may flag a request with strong evidence (its SQL writes the word): one finding of it can
    then make a request affected on its own."""
    return "'strong'" in rule.sql


def per_request(rule: Rule) -> bool:
    """Whether *rule* judges each request on its own row: its SQL reads ``requests`` once."""
    return len(_READS_REQUESTS.findall(rule.sql)) == 1


class LiveDetection:
    """The rules of the selected mechanisms, run at every poll on what the poll brought."""

    def __init__(self, con: duckdb.DuckDBPyConnection, incident: Incident) -> None:
        self.con, self.incident = con, incident
        self.rules = load_rules()
        unknown = set(incident.rule_parameters) - {r.id for r in self.rules}
        if unknown:
            raise ConfigError(f"[rules] names unknown rule(s) {sorted(unknown)}")
        self.params = {r.id: rule_parameters(r, incident.rule_parameters.get(r.id)) for r in self.rules}
        self.catalog = one(con, "SELECT current_database()")[0]
        self.cursor = con.cursor()  # holds the temporary `requests` of the new rows
        self.watermark = -1  # the requests up to this rowid have been judged
        self.fitted_at = 0  # requests when the latency model was last fitted
        self.judged: set[str] = set()  # rules that have judged every request so far
        con.execute(
            f"CREATE OR REPLACE TABLE {_FINDINGS} (request_id VARCHAR, rule_id VARCHAR, strength VARCHAR)"
        ).fetchall()

    def close(self) -> None:
        self.cursor.close()
        self.con.execute(f"DROP TABLE IF EXISTS {_FINDINGS}").fetchall()

    def judge(self, engine_request_ids: set[str], alerted: set[str], everything: bool = False) -> pd.DataFrame:
        """Run the rules on the new requests (and on those *engine_request_ids* name; on every request with
        *everything*); the requests of the analysed period that are affected now (tier confirmed or probable) and
        not among *alerted*, with the fields an alert gives."""
        top = one(self.con, "SELECT max(rowid) FROM requests")[0]
        if top is None:
            return _NONE.copy()
        total = one(self.con, "SELECT count(*) FROM requests")[0]
        selected = {s.mechanism.id for s in select_mechanisms(self.con, self.incident.mechanisms) if s.selected}
        rules = [r for r in self.rules if r.mechanism in selected]
        new_rules = {r.id for r in rules} - self.judged
        if (
            top <= self.watermark
            and not engine_request_ids
            and not everything
            and not new_rules
            and not self._refit_due(total)
            and all(per_request(r) for r in rules)
        ):
            return _NONE.copy()  # nothing new to judge
        self._shadow(-1 if everything else self.watermark, engine_request_ids)
        judged_whole: set[str] = set()
        for rule in [r for r in rules if not r.needs_latency_model]:
            judged_whole |= self._run(rule, whole=rule.id in new_rules or not per_request(rule))
        latency_rules = [r for r in rules if r.needs_latency_model]
        if self._refit_due(total):
            self._fit()
            self.fitted_at = total
            new_rules |= {r.id for r in latency_rules}
        if new_rules & {r.id for r in latency_rules}:
            # a new latency model: its rules judge again the requests another rule flagged (the only ones a weak
            # finding of theirs can make affected); every request, if one of them can find strong evidence
            flagged = {
                r
                for (r,) in self.con.execute(
                    f"SELECT DISTINCT request_id FROM {_FINDINGS} WHERE rule_id NOT IN (SELECT unnest($ids))",
                    {"ids": [r.id for r in latency_rules]},
                ).fetchall()
            }
            self._shadow(-1 if everything else self.watermark, engine_request_ids | flagged)
        for rule in latency_rules:
            whole = not per_request(rule) or (rule.id in new_rules and _can_be_strong(rule))
            judged_whole |= self._run(rule, whole=whole)
        self.judged |= {r.id for r in rules}
        self.watermark = top
        return self._affected(judged_whole, alerted)

    # --- the rows judged ---------------------------------------------------------------------------------
    def _shadow(self, watermark: int, engine_request_ids: set[str]) -> None:
        """The cursor's temporary ``requests``: a view of the rows after *watermark* (the table's last row groups,
        read in place), and a copy of the older ones *engine_request_ids* name."""
        main = f'"{self.catalog}".main.requests'
        older = "SELECT * FROM {main} LIMIT 0"
        if engine_request_ids and watermark >= 0:
            self.cursor.register("watch_engine_ids", pa.table({"request_id": sorted(engine_request_ids)}))
            older = (
                f"SELECT * FROM {main} WHERE rowid <= $w AND request_id IN (SELECT request_id FROM watch_engine_ids)"
            )
        try:
            self.cursor.execute(
                f"CREATE OR REPLACE TEMP TABLE watch_older AS {older.format(main=main)}",
                {"w": watermark} if "$w" in older else None,
            ).fetchall()
        finally:
            if engine_request_ids and watermark >= 0:
                self.cursor.unregister("watch_engine_ids")
        # a view takes no parameters: the watermark is an integer, written in
        self.cursor.execute(
            f"CREATE OR REPLACE TEMP VIEW requests AS SELECT * FROM {main} "
            f"WHERE rowid > {int(watermark)} UNION ALL SELECT * FROM watch_older"
        ).fetchall()

    def _run(self, rule: Rule, whole: bool) -> set[str]:
        """Run *rule* on the new rows (or, *whole*, on every request) and keep its findings; the ids it flagged
        when it ran whole (they need not be among the new rows)."""
        cursor = self.con if whole else self.cursor
        used = rule.used_parameters()
        args = {k: v for k, v in self.params[rule.id].items() if k in used}
        if whole:
            cursor.execute(f"DELETE FROM {_FINDINGS} WHERE rule_id = $watch_rule", {"watch_rule": rule.id}).fetchall()
        else:
            cursor.execute(
                f"DELETE FROM {_FINDINGS} WHERE rule_id = $watch_rule AND request_id IN "
                "(SELECT request_id FROM requests)",
                {"watch_rule": rule.id},
            ).fetchall()
        cursor.execute(
            f"INSERT INTO {_FINDINGS} SELECT CAST(request_id AS VARCHAR), $watch_rule, "
            f"CAST(strength AS VARCHAR) FROM (\n{rule.sql}\n) AS found",
            {**args, "watch_rule": rule.id},
        ).fetchall()
        if not whole:
            return set()
        return {
            r
            for (r,) in cursor.execute(
                f"SELECT request_id FROM {_FINDINGS} WHERE rule_id = $watch_rule", {"watch_rule": rule.id}
            ).fetchall()
        }

    def _refit_due(self, total: int) -> bool:
        if not any(r.needs_latency_model for r in self.rules):
            return False
        return self.fitted_at == 0 or total >= REFIT_GROWTH * self.fitted_at

    def _fit(self) -> None:
        """The latency model, fitted as detect fits it: without the requests the other rules flagged."""
        latency_rules = {r.id for r in self.rules if r.needs_latency_model}
        self.con.register("watch_latency_rules", pa.table({"rule_id": sorted(latency_rules) or [""]}))
        try:
            self.con.execute(f"""CREATE OR REPLACE TEMP TABLE flagged_before_latency AS
                                 SELECT DISTINCT request_id FROM {_FINDINGS}
                                 WHERE rule_id NOT IN (SELECT rule_id FROM watch_latency_rules)""").fetchall()
        finally:
            self.con.unregister("watch_latency_rules")
        latency.fit_models(self.con, exclude_table="flagged_before_latency")

    def _affected(self, judged_whole: set[str], alerted: set[str]) -> pd.DataFrame:
        """The requests judged now (the cursor's ``requests`` and *judged_whole*), not among *alerted*, whose tier
        is affected (confirmed or probable) and that lie in the analysed period."""
        whole = pa.table({"request_id": pa.array(sorted(judged_whole - alerted), pa.string())})
        done = pa.table({"request_id": pa.array(sorted(alerted), pa.string())})
        self.cursor.register("watch_whole_ids", whole)
        self.cursor.register("watch_alerted_ids", done)
        try:
            self.cursor.execute(f"""
                CREATE OR REPLACE TEMP TABLE watch_affected AS
                WITH judged AS (
                    SELECT request_id FROM requests ANTI JOIN watch_alerted_ids USING (request_id)
                    UNION SELECT request_id FROM watch_whole_ids
                )
                SELECT request_id, {TIER} AS confidence, string_agg(rule_id, ' ' ORDER BY rule_id) AS rules
                FROM {_FINDINGS} SEMI JOIN judged USING (request_id)
                GROUP BY request_id HAVING {TIER} IN ('confirmed', 'probable')""").fetchall()
            rows = """SELECT r.request_id, r.account_id, r.model,
                             coalesce(r.prefill_instance, r.decode_instance) AS instance, r.ts, a.confidence, a.rules
                      FROM watch_affected a JOIN {requests} r USING (request_id)"""
            found = self.cursor.execute(rows.format(requests="requests")).df()
            # judged by a rule run on every request, not among the new rows: their rows read from the evidence
            if one(self.cursor, "SELECT count(*) FROM watch_affected ANTI JOIN requests USING (request_id)")[0]:
                found = pd.concat(
                    [
                        found,
                        self.cursor.execute(
                            rows.format(
                                requests=f"(SELECT * FROM \"{self.catalog}\".main.requests SEMI JOIN "
                                "(SELECT request_id FROM watch_affected ANTI JOIN requests USING (request_id)) "
                                "USING (request_id))"
                            )
                        ).df(),
                    ],
                    ignore_index=True,
                )
        finally:
            self.cursor.unregister("watch_whole_ids")
            self.cursor.unregister("watch_alerted_ids")
        return in_period(found, self.incident)


# detect's tiers (kvforensics/stages/detect.py): confirmed, probable, possible from the rules' strengths
TIER = (
    "CASE WHEN count(*) FILTER (WHERE strength = 'strong') >= 1 AND count(*) >= 2 THEN 'confirmed' "
    "WHEN count(*) FILTER (WHERE strength = 'strong') >= 1 OR count(*) >= 2 THEN 'probable' ELSE 'possible' END"
)


def in_period(found: pd.DataFrame, incident: Incident) -> pd.DataFrame:
    """The rows of *found* in the incident's analysed period ([scope] start, end), in time order."""
    start, end = incident.scope.start, incident.scope.end
    keep = pd.Series(True, index=found.index)
    if start is not None:
        keep &= found["ts"] >= pd.Timestamp(start)
    if end is not None:
        keep &= found["ts"] < pd.Timestamp(end)
    return found[keep].sort_values(["ts", "request_id"], ignore_index=True)


_NONE = pd.DataFrame(columns=["request_id", "account_id", "model", "instance", "ts", "confidence", "rules"])


def affected_after_detect(con: duckdb.DuckDBPyConnection, incident: Incident) -> pd.DataFrame:
    """The affected requests of ``detect``'s tiers (when watch stops), with the fields an alert gives."""
    return in_period(
        con.execute("""
        SELECT r.request_id, r.account_id, r.model, coalesce(r.prefill_instance, r.decode_instance) AS instance,
               r.ts, t.confidence, t.rules
        FROM request_tiers t JOIN requests r ON r.request_id = t.request_id
        WHERE t.confidence IN ('confirmed', 'probable')""").df(),
        incident,
    )


__all__: Sequence[str] = ("LiveDetection", "affected_after_detect", "per_request")
