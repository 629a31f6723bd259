"""Score a kvforensics output folder against the truth of a generated vLLM + LMCache incident.

``score(out_dir, truth_path)`` reads what the toolkit wrote (``scope.json``, ``affected_requests.csv``
or the ``affected_responses`` table of ``evidence.duckdb``, ``notifications.csv``, and where the
evidence database has them ``prefix_sources``, ``kv_event_gaps``) and returns a dict of scores:

* ``affected``: precision and recall of the affected responses, the false positives sorted into the
  truth's not-affected classes (same-tenant LMCache loads, shared-namespace loads, secondary hits, other) and the misses by traffic kind;
* ``recipients`` (role ``received_foreign_data``) and ``source_accounts`` (``data_exposed_confirmed``;
  ``data_exposed_possible`` is reported beside, not scored);
* ``sources``: per true positive, precision and recall of the source accounts named in
  ``prefix_sources`` (micro-averaged over request, account pairs), when the table is there;
* ``windows``: per instance, the start and end error in seconds of the toolkit's prefix windows
  (``scope.json`` ``prefix_windows``, paths other than ``isolated``) against the truth's exposure
  window (end against both the next start-up and the shutdown line); absent windows say so;
* ``exploitation``: whether the prober is among the probing accounts (likely / possible) and which
  look-alikes are;
* ``seq_gaps``: the truth's lost messages against ``kv_event_gaps``;
* ``run``: ``conclusive`` and the codes of ``inconclusive_reasons``.

The scores, their keys and the output are those of ``tests/hicache_reference/score.py`` (the truth keys
are the same: ``l3`` there is the LMCache store here), so one workflow serves both judges; a false
positive can also be of class ``rejected_too_long`` (a prompt the frontend refused with a 400).

Run ``python tests/vllm_reference/score.py OUT_DIR TRUTH.json``; it prints the dict as JSON.
"""

from __future__ import annotations

import csv
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

NEUTRALISED = ("'=", "'+", "'-", "'@", "'\t", "'\r")  # kvforensics' CSV cell neutralisation


def cell(text: str) -> str:
    return text[1:] if text.startswith(NEUTRALISED) else text


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return [{k: cell(v or "") for k, v in row.items()} for row in csv.DictReader(f)]


def pr(found: set[str], truth: set[str]) -> dict[str, Any]:
    tp = len(found & truth)
    return {
        "found": len(found),
        "truth": len(truth),
        "true_positives": tp,
        "precision": round(tp / len(found), 4) if found else None,
        "recall": round(tp / len(truth), 4) if truth else None,
    }


def seconds(ts: str | None) -> float | None:
    if not ts:
        return None
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def evidence_tables(out: Path) -> dict[str, list[dict[str, Any]]]:
    """The evidence tables the scores use, where the database and the tables exist."""
    db = out / "evidence.duckdb"
    if not db.exists():
        return {}
    try:
        import duckdb
    except ImportError:
        return {}
    tables: dict[str, list[dict[str, Any]]] = {}
    con = duckdb.connect(str(db), read_only=True)
    try:
        names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        for name in ("affected_responses", "prefix_sources", "kv_event_gaps", "findings"):
            if name in names:
                cur = con.execute(f'SELECT * FROM "{name}"')
                cols = [d[0] for d in cur.description]
                tables[name] = [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]
    finally:
        con.close()
    return tables


def affected_found(out: Path, tables: dict[str, list[dict[str, Any]]]) -> tuple[set[str], str]:
    csv_path = out / "affected_requests.csv"
    if csv_path.exists():
        return {r["request_id"] for r in read_csv(csv_path)}, "affected_requests.csv"
    if "affected_responses" in tables:
        return {str(r["request_id"]) for r in tables["affected_responses"]}, "evidence.duckdb affected_responses"
    return set(), "none"


def truth_class(rid: str, truth: dict[str, Any]) -> str:
    """Which of the truth's classes a request id is in (affected, or one of the not-affected ones)."""
    true = set(truth["affected_requests"])
    classes = {
        "affected": true,
        "same_tenant_l3_load": set(truth["same_tenant_l3_loads"]),
        "shared_namespace_l3_load": set(truth["shared_namespace_l3_loads"]),
        "secondary_own_namespace_copy": set(truth["secondary_requests"]),
        "prober_miss": set(truth["prober"]["probes"]) - true,
        "rejected_too_long": set(truth.get("rejected_too_long") or []),
    }
    return next((k for k, ids in classes.items() if rid in ids), "other")


def by_class(ids: set[str], truth: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rid in ids:
        kind = truth_class(rid, truth)
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


def score_affected(found: set[str], truth: dict[str, Any], findings: list[dict[str, Any]] | None) -> dict[str, Any]:
    true = set(truth["affected_requests"])
    fn: dict[str, int] = {}
    fn_known = 0
    for rid in true - found:
        kind = truth["sources"][rid]["kind"]
        fn[kind] = fn.get(kind, 0) + 1
        fn_known += bool(truth["sources"][rid].get("requester_stored_same_tokens_before"))
    uncounted = {str(f["request_id"]) for f in findings or []} - found
    return {
        **pr(found, true),
        "false_positives_by_class": by_class(found - true, truth),
        "misses_by_kind": dict(sorted(fn.items())),
        "misses_requester_stored_same_tokens_before": fn_known,
        "findings_not_counted_by_class": by_class(uncounted, truth) if findings is not None else None,
    }


def score_sources(found: set[str], truth: dict[str, Any], rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    if rows is None:
        return {"available": False}
    named: dict[str, set[str]] = {}
    for r in rows:
        named.setdefault(str(r["request_id"]), set()).add(str(r["source_account"]))
    pairs_found: set[tuple[str, str]] = set()
    pairs_true: set[tuple[str, str]] = set()
    for rid in found & set(truth["affected_requests"]):
        pairs_true |= {(rid, a) for a in truth["sources"][rid]["source_accounts"]}
        pairs_found |= {(rid, a) for a in named.get(rid, set())}
    tp = len(pairs_found & pairs_true)
    return {
        "available": True,
        "pairs_found": len(pairs_found),
        "pairs_true": len(pairs_true),
        "true_positives": tp,
        "precision": round(tp / len(pairs_found), 4) if pairs_found else None,
        "recall": round(tp / len(pairs_true), 4) if pairs_true else None,
    }


def score_windows(scope: dict[str, Any], truth: dict[str, Any]) -> dict[str, Any]:
    reported = [w for w in scope.get("prefix_windows") or [] if w.get("path") != "isolated"]
    if not reported:
        return {"reported": False}
    per_instance: dict[str, Any] = {}
    for inst, rows in truth["exposure_windows"].items():
        for tw in rows:
            t_start, t_end, t_proc = seconds(tw["start"]), seconds(tw["end"]), seconds(tw["process_end"])
            mine = [w for w in reported if w.get("instance") == inst]
            if not mine:
                per_instance[inst] = {"found": False}
                continue
            best = min(mine, key=lambda w: abs((seconds(w.get("start") or w.get("valid_from")) or 0) - (t_start or 0)))
            w_start = seconds(best.get("start") or best.get("valid_from"))
            w_end = seconds(best.get("end") or best.get("valid_to"))
            per_instance[inst] = {
                "found": True,
                "path": best.get("path"),
                "start_error_s": None if w_start is None or t_start is None else round(w_start - t_start, 1),
                "end_error_s": None if w_end is None or t_end is None else round(w_end - t_end, 1),
                "end_error_vs_shutdown_s": None if w_end is None or t_proc is None else round(w_end - t_proc, 1),
            }
    truth_instances = set(truth["exposure_windows"])
    extra = [w for w in reported if w.get("instance") not in truth_instances]
    return {
        "reported": True,
        "windows": len(reported),
        "per_instance": per_instance,
        "windows_on_other_instances": len(extra),
    }


def probing_accounts(scope: dict[str, Any]) -> dict[str, str]:
    """account -> tier from scope.json's exploitation.prefix_probing, plus accounts_looking_deliberate."""
    exp = scope.get("exploitation") or {}
    tiers: dict[str, str] = {}
    for row in (exp.get("prefix_probing") or {}).get("accounts") or []:
        tiers[str(row.get("account_id"))] = str(row.get("probing"))
    for name in exp.get("accounts_looking_deliberate") or []:
        tiers.setdefault(str(name), "deliberate")
    return tiers


def score_exploitation(scope: dict[str, Any], truth: dict[str, Any]) -> dict[str, Any]:
    tiers = probing_accounts(scope)
    prober = truth["prober"]["account"]
    flagged_lookalikes = {
        group: sorted(a for a in accounts if a in tiers) for group, accounts in truth["lookalikes"].items()
    }
    known = {prober} | {a for accounts in truth["lookalikes"].values() for a in accounts}
    return {
        "prober": prober,
        "prober_found": prober in tiers,
        "prober_tier": tiers.get(prober),
        "lookalikes_flagged": {g: a for g, a in flagged_lookalikes.items() if a},
        "lookalikes_flagged_count": sum(len(a) for a in flagged_lookalikes.values()),
        "other_accounts_flagged": sorted(a for a in tiers if a not in known),
    }


def score_gaps(truth: dict[str, Any], rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    if rows is None:
        return {"available": False}
    found = {(str(r["instance"]), int(r["missing"])) for r in rows if int(r.get("missing") or 0) > 0}
    true = {(g["instance"], g["lost_messages"]) for g in truth["seq_gaps"]}
    return {"available": True, **pr({f"{i}:{n}" for i, n in found}, {f"{i}:{n}" for i, n in true})}


def score(out_dir: str | Path, truth_path: str | Path) -> dict[str, Any]:
    out = Path(out_dir)
    truth = json.loads(Path(truth_path).read_text())
    scope_path = out / "scope.json"
    scope: dict[str, Any] = json.loads(scope_path.read_text()) if scope_path.exists() else {}
    tables = evidence_tables(out)
    found, read_from = affected_found(out, tables)
    notes = read_csv(out / "notifications.csv") if (out / "notifications.csv").exists() else []
    by_role: dict[str, set[str]] = {}
    for row in notes:
        by_role.setdefault(row["role"], set()).add(row["account_id"])
    return {
        "run": {
            "outputs": bool(scope),
            "conclusive": scope.get("conclusive"),
            "inconclusive_reasons": [r.get("code") for r in scope.get("inconclusive_reasons") or []],
            "affected_read_from": read_from,
        },
        "affected": score_affected(found, truth, tables.get("findings")),
        "recipients": pr(by_role.get("received_foreign_data", set()), set(truth["recipients"])),
        "source_accounts": pr(by_role.get("data_exposed_confirmed", set()), set(truth["source_accounts"])),
        "possible_source_accounts": len(by_role.get("data_exposed_possible", set())),
        "sources": score_sources(found, truth, tables.get("prefix_sources")),
        "windows": score_windows(scope, truth),
        "exploitation": score_exploitation(scope, truth),
        "seq_gaps": score_gaps(truth, tables.get("kv_event_gaps")),
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: score.py OUT_DIR TRUTH.json")
    print(json.dumps(score(sys.argv[1], sys.argv[2]), indent=1))
