"""Write the investigation's output folder: scope.json, CSVs, manifest, per-account notices.

Every figure written here is read from the evidence database; ``HEADLINE_QUERIES`` names the query
behind each headline number so ``kvforensics verify`` (and a reader) can re-derive it.
"""

from __future__ import annotations

import csv
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from kvforensics import __version__
from kvforensics.config import Incident
from kvforensics.core.escaping import csv_cell
from kvforensics.core.source_paths import outside_files
from kvforensics.evidence.digests import (
    TABLE_DIGEST_CONSTRUCTIONS,
    output_digests,
    run_method,
    table_digests,
)
from kvforensics.sources.common.textio import file_digest
from kvforensics.stages.detect import load_rules
from kvforensics.stages.scope import ScopeResult, iso

HEADLINE_QUERIES: dict[str, str] = {
    "affected_responses": "SELECT count(*) FROM affected_responses",
    "affected_accounts": "SELECT count(DISTINCT account_id) FROM affected_responses",
    "source_accounts.confirmed": "SELECT count(DISTINCT account_id) FROM notifications WHERE role = 'data_exposed_confirmed'",
    "source_accounts.possible": "SELECT count(DISTINCT account_id) FROM notifications WHERE role = 'data_exposed_possible'",
    "exposure_windows": "SELECT count(*) FROM exposure_windows",
    "windows": "SELECT count(DISTINCT model) FROM affected_responses",
    "inconclusive_reasons": "SELECT count(*) FROM inconclusive_reasons",
}
AFFECTED_COLUMNS = [
    "request_id",
    "ts",
    "account_id",
    "account_class",
    "model",
    "prompt_tokens",
    "pool_tokens",
    "ttft_ms",
    "expected_ttft_ms",
    "confidence",
    "rules",
    "latency_ms",
    "completion_tokens",
    "cached_tokens",
    "prefill_instance",
    "decode_instance",
    "pool_instance",
]
NOTIFICATION_COLUMNS = ["account_id", "account_class", "role", "responses", "first_ts", "last_ts", "request_ids"]
# who gets which notice (kvforensics.report.notices): a suspected exploiter's goes to trust and safety
NOTICE_COLUMNS = ["suspected_exploiter", "notice_type", "notice"]
# the responses in the possible tier: one weak signal, listed for review, never counted as affected
POSSIBLE_COLUMNS = [
    "request_id",
    "ts",
    "account_id",
    "account_class",
    "model",
    "prompt_tokens",
    "ttft_ms",
    "latency_ms",
    "prefill_instance",
    "decode_instance",
    "rules",
    "why_only_possible",
]


def write_csv(con: duckdb.DuckDBPyConnection, query: str, columns: list[str], path: Path, *, raw: bool = False) -> int:
    """The query's rows as CSV, each cell written by ``csv_cell`` (formula starts neutralised unless ``raw``)."""
    return write_rows(con.execute(query).fetchall(), columns, path, raw=raw)


def write_rows(rows: list[tuple[Any, ...]], columns: list[str], path: Path, *, raw: bool = False) -> int:
    """Rows as CSV, each cell written by ``csv_cell``."""
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for row in rows:
            w.writerow([csv_cell(v, raw=raw) for v in row])
    return len(rows)


def notification_rows(con: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """``notifications`` with who gets which notice: whether the account is a suspected exploiter (its notice goes to
    the provider's trust-and-safety team, not to it), the notice type and the notice's path in the folder."""
    from kvforensics.report.notices import notice_path, notice_type, suspected_accounts

    suspects = suspected_accounts(con)
    rows = con.execute(
        f"SELECT {', '.join(NOTIFICATION_COLUMNS)} FROM notifications ORDER BY role DESC, account_class, account_id"
    ).fetchall()
    return [
        (
            *r,
            "true" if r[0] in suspects else "false",
            notice_type(r[1], r[0] in suspects),
            notice_path(r[0], r[1], r[0] in suspects),
        )
        for r in rows
    ]


def possible_rows(con: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """The responses in the possible tier (``suspect_responses``: a single weak signal), each with why it is only
    possible: the rule, what it saw, and what would have counted it."""
    from kvforensics.stages.detect import load_rules

    titles = {r.id: r.title for r in load_rules()}
    rows = con.execute("""
        SELECT s.request_id, s.ts, s.account_id, s.account_class, s.model, s.prompt_tokens, r.ttft_ms, r.latency_ms,
               r.prefill_instance, r.decode_instance, s.rules,
               list(f.rule_id ORDER BY f.rule_id), list(f.strength ORDER BY f.rule_id),
               list(CAST(f.evidence AS VARCHAR) ORDER BY f.rule_id)
        FROM suspect_responses s JOIN requests r USING (request_id) JOIN findings f USING (request_id)
        GROUP BY ALL ORDER BY s.ts, s.request_id""").fetchall()
    out = []
    for *head, rule_ids, strengths, evidence in rows:
        signals = "; ".join(
            f"{strength} signal from {rule} ({titles.get(rule, rule)}: {_evidence_words(ev)})"
            for rule, strength, ev in zip(rule_ids, strengths, evidence, strict=True)
        )
        out.append(
            (
                *head,
                f"only one {signals}; a response is counted as affected with a strong signal and a second "
                "rule, or one strong signal, or two weak ones",
            )
        )
    return out


def _evidence_words(evidence: str | None) -> str:
    """A finding's evidence (JSON) as ``key value`` pairs for a sentence."""
    try:
        values = json.loads(evidence or "{}")
    except ValueError:
        return str(evidence)
    if not isinstance(values, dict):
        return str(values)
    return ", ".join(f"{k} {v}" for k, v in values.items() if v is not None and v != "")


def write_scope_json(result: ScopeResult, out: Path) -> None:
    (out / "scope.json").write_text(json.dumps(result.summary, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_tables(con: duckdb.DuckDBPyConnection, out: Path, *, raw_csv: bool = False) -> None:
    """affected_requests.csv, notifications.csv, possible_responses.csv, quarantine.csv; ``raw_csv`` keeps formula
    starts (machine use)."""
    write_csv(
        con,
        f"SELECT {', '.join(AFFECTED_COLUMNS)} FROM affected_responses ORDER BY ts, request_id",
        AFFECTED_COLUMNS,
        out / "affected_requests.csv",
        raw=raw_csv,
    )
    write_rows(notification_rows(con), NOTIFICATION_COLUMNS + NOTICE_COLUMNS, out / "notifications.csv", raw=raw_csv)
    write_rows(possible_rows(con), POSSIBLE_COLUMNS, out / "possible_responses.csv", raw=raw_csv)
    write_csv(
        con,
        "SELECT source, file, line, reason, raw FROM quarantine ORDER BY source, file, line",
        ["source", "file", "line", "reason", "raw"],
        out / "quarantine.csv",
        raw=raw_csv,
    )


def write_manifest(
    con: duckdb.DuckDBPyConnection,
    incident: Incident,
    scope: ScopeResult,
    out: Path,
    started: datetime,
    *,
    raw_csv: bool = False,
) -> dict[str, Any]:
    import duckdb as _duckdb
    import pandas as _pandas

    base = incident.base_dir
    inputs = []
    for row in con.execute(
        "SELECT source, kind, file, sha256, bytes, records_read, loaded, quarantined, duplicates, "
        "notes FROM load_report ORDER BY source, file"
    ).fetchall():
        path = Path(row[2])
        try:
            rel = str(path.relative_to(base))
        except ValueError:
            rel = str(path)
        inputs.append(
            {
                "source": row[0],
                "kind": row[1],
                "file": rel,
                "sha256": row[3],
                "bytes": row[4],
                "records_read": row[5],
                "loaded": row[6],
                "quarantined": row[7],
                "duplicates": row[8],
                "notes": row[9].split("; ") if row[9] else [],
            }
        )
    digest, size = file_digest(incident.path)
    method = run_method(con)  # rows-v4, or rows-v2 when its sort could run out of disk
    manifest = {
        "tool": {
            "name": "kvforensics",
            "version": __version__,
            "python": platform.python_version(),
            "duckdb": _duckdb.__version__,
            "pandas": _pandas.__version__,
        },
        "incident": {"id": incident.id, "file": incident.path.name, "dir": str(base), "sha256": digest, "bytes": size},
        "run": {"started": iso(started), "finished": iso(datetime.now(timezone.utc))},
        "conclusive": scope.summary["conclusive"],
        "inconclusive_reasons": scope.summary["inconclusive_reasons"],
        "inputs": inputs,
        # inputs that resolve outside the incident folder (an absolute source path, '..', a symbolic link;
        # [settings] allow_outside or --allow-outside lets the other ones be read)
        "outside_incident_folder": [
            str(Path(p).resolve())
            for p in outside_files(
                base, [Path(r[0]) for r in con.execute("SELECT DISTINCT file FROM load_report ORDER BY 1").fetchall()]
            )
        ],
        "totals": {k: sum(i[k] for i in inputs) for k in ("records_read", "loaded", "quarantined", "duplicates")},
        "rules": [
            {"id": r.id, "version": r.version, "parameters": {**r.parameters, **incident.rule_parameters.get(r.id, {})}}
            for r in load_rules()
        ],
        "scope_parameters": scope.parameters,
        "assumptions": [
            r[0]
            for r in con.execute("SELECT note FROM ingest_notes WHERE kind = 'assumption' ORDER BY note").fetchall()
        ],
        "warnings": [
            r[0] for r in con.execute("SELECT note FROM ingest_notes WHERE kind = 'warning' ORDER BY note").fetchall()
        ],
        "headline_queries": HEADLINE_QUERIES,
        "csv_cells": "raw" if raw_csv else "neutralised",  # formula starts (escaping.csv_cell)
        # what `kvforensics verify` re-hashes: every output file, every table of the evidence database
        "outputs": output_digests(out),
        "tables": table_digests(con, method),
        "table_digest": method,  # how `tables` was taken (kvforensics/evidence/digests.py)
        "table_digest_construction": TABLE_DIGEST_CONSTRUCTIONS[method],  # and what it resists
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest
