"""Spark runs the same rule and scope SQL as DuckDB and gets identical results.

One simulated incident (5,000 requests with content, two deliberate exploiters, log gaps added) is
ingested once; detect and scope then run on DuckDB and on Spark local mode from copies of the same
evidence database, and every result table, scope.json and the CSVs must be identical. Skipped, with
the reason, when pyspark or Java is missing (``pip install -e '.[spark]'``; Java 17+).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

from kvforensics.engines.spark import unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

RESULT_TABLES = [
    "findings",
    "request_tiers",
    "latency_model",
    "account_classes",
    "analysed_requests",
    "affected_responses",
    "suspect_responses",
    "possible_sources",
    "content_matches",
    "account_behaviour",
    "notifications",
    "log_gaps",
]
SCOPE_OVERRIDES = {"min_hourly": 3}  # the simulated gateway is quiet: make its emptied hours count as gaps


@pytest.fixture(scope="module")
def spark():
    from kvforensics.engines.spark import session

    return session()


def _investigate(incident: Path, out: Path, engine: str):
    from kvforensics.investigation import Investigation
    from kvforensics.stages.scope import scope

    inv = Investigation.open(incident, out, progress=False, pdf=False, engine=engine)
    try:
        inv.detect()
        inv.scope_result = scope(inv.con, inv.incident, SCOPE_OVERRIDES, spark=inv.spark)
        inv.write_outputs()
    finally:
        inv.close()


@pytest.fixture(scope="module")
def runs(spark, tmp_path_factory) -> tuple[Path, Path]:
    """(DuckDB output folder, Spark output folder) of the same ingested incident."""
    from kvforensics.investigation import Investigation
    from kvforensics.simulate import Scenario, simulate

    root = tmp_path_factory.mktemp("parity")
    sim = simulate(
        Scenario(
            seed=31,
            requests=5000,
            accounts=120,
            affected=30,
            affected_customer_accounts=8,
            internal_affected=4,
            reporter_affected=1,
            exploiters=2,
        ),
        root / "data",
    )
    ingested = Investigation.open(sim.incident_toml, root / "duckdb", progress=False, pdf=False)
    try:
        ingested.ingest()
        con = ingested.con
        # a gateway outage (three empty hours) and requests naming a prefill instance no log covers
        con.execute(
            "DELETE FROM requests WHERE ts >= TIMESTAMPTZ '2026-08-24 09:00:00+00' "
            "AND ts < TIMESTAMPTZ '2026-08-24 12:00:00+00'"
        ).fetchall()
        con.execute(
            "UPDATE requests SET prefill_instance = 'ghost-prefill-9' WHERE request_id IN "
            "(SELECT request_id FROM requests WHERE prefill_instance IS NOT NULL "
            " AND status = 200 ORDER BY request_id LIMIT 3)"
        ).fetchall()
        con.execute("CHECKPOINT").fetchall()
    finally:
        ingested.close()
    (root / "spark").mkdir()
    shutil.copy(root / "duckdb" / "evidence.duckdb", root / "spark" / "evidence.duckdb")
    _investigate(sim.incident_toml, root / "duckdb", "duckdb")
    _investigate(sim.incident_toml, root / "spark", "spark")
    return root / "duckdb", root / "spark"


def _rows(con: duckdb.DuckDBPyConnection, query: str) -> list[tuple]:
    return sorted(con.execute(query).fetchall(), key=repr)


def test_spark_gives_identical_results(runs):
    """Every rule and the whole scope, DuckDB vs Spark local mode: same tables, types, rows, outputs."""
    duck_dir, spark_dir = runs
    duck = duckdb.connect(str(duck_dir / "evidence.duckdb"), read_only=True)
    sp = duckdb.connect(str(spark_dir / "evidence.duckdb"), read_only=True)
    # the data exercise every part of the SQL
    for table, query in [
        ("strong and weak findings", "SELECT count(DISTINCT strength) FROM findings"),
        ("rules", "SELECT count(DISTINCT rule_id) FROM findings"),
        ("possible sources", "SELECT count(*) FROM possible_sources"),
        ("confirmed content matches", "SELECT count(*) FROM content_matches WHERE confirmed"),
        ("deliberate accounts", "SELECT count(*) FROM account_behaviour WHERE looks_deliberate"),
        ("gateway gap", "SELECT count(*) FROM log_gaps WHERE instance IS NULL"),
        ("engine-log gap", "SELECT count(*) FROM log_gaps WHERE instance IS NOT NULL"),
    ]:
        assert duck.execute(query).fetchall()[0][0] >= (2 if table == "strong and weak findings" else 1), table

    assert _rows(sp, "SELECT request_id, rule_id, strength FROM findings") == _rows(
        duck, "SELECT request_id, rule_id, strength FROM findings"
    )
    assert _rows(sp, "SELECT * FROM request_tiers") == _rows(duck, "SELECT * FROM request_tiers")
    assert _rows(sp, "SELECT request_id FROM affected_responses") == _rows(
        duck, "SELECT request_id FROM affected_responses"
    )
    assert _rows(sp, "SELECT account_id, role, request_ids FROM notifications") == _rows(
        duck, "SELECT account_id, role, request_ids FROM notifications"
    )
    assert _rows(sp, "SELECT affected_request_id, source_request_id FROM possible_sources") == _rows(
        duck, "SELECT affected_request_id, source_request_id FROM possible_sources"
    )
    for table in RESULT_TABLES:
        assert sp.execute(f"DESCRIBE {table}").fetchall() == duck.execute(f"DESCRIBE {table}").fetchall(), table
        assert _rows(sp, f"SELECT * FROM {table}") == _rows(duck, f"SELECT * FROM {table}"), table
    for name in ("scope.json", "affected_requests.csv", "notifications.csv"):
        assert (spark_dir / name).read_bytes() == (duck_dir / name).read_bytes(), name


def test_requests_from_a_spark_table(spark, tmp_path):
    """``[settings] spark_requests_table``: the rules read requests from Spark, and evidence.duckdb gets them."""
    from conftest import write_mini

    from kvforensics.engines.portable import EngineError
    from kvforensics.engines.spark import SparkEngine
    from kvforensics.investigation import Investigation
    from kvforensics.stages.detect import detect

    incident = write_mini(tmp_path / "mini")
    inv = Investigation.open(incident, tmp_path / "duck", progress=False, pdf=False)
    try:
        inv.ingest()
        expected = detect(inv.con)[["request_id", "rule_id", "strength"]]
        requests = inv.query("SELECT * FROM requests ORDER BY request_id")
        engine = SparkEngine(spark, requests_table="kvf_gateway_requests")
        spark.createDataFrame(engine_arrow(inv.con)).createOrReplaceTempView("kvf_gateway_requests")
        found = detect(inv.con, spark=engine)[["request_id", "rule_id", "strength"]]
        assert sorted(map(tuple, found.values)) == sorted(map(tuple, expected.values))
        assert inv.query("SELECT * FROM requests ORDER BY request_id").equals(requests)
        notes = [r[0] for r in inv.con.execute("SELECT note FROM ingest_notes WHERE kind = 'warning'").fetchall()]
        assert (
            "requests read from Spark table kvf_gateway_requests (402 rows); they replace the 402 rows "
            "loaded from the requests source(s)" in notes
        )

        spark.sql("SELECT 'r1' AS request_id").createOrReplaceTempView("kvf_bad_requests")
        with pytest.raises(EngineError, match=r"lacks the canonical request column\(s\) \['ts', 'account_id'"):
            SparkEngine(spark, requests_table="kvf_bad_requests").load_canonical(inv.con)
    finally:
        inv.close()


# the columns of the store-load rule's case tables that name something (an instance, a namespace, an account, a
# page), and the content fingerprints: one case's names kept apart from every other's when the cases share tables
_CASE_NAMES = {
    "requests": ("request_id", "account_id", "prefill_instance", "cache_salt"),
    "prefix_windows": ("instance",),
    "kv_events": ("instance", "salt", "block_hash", "parent_block_hash", "source_file"),
    "account_patterns": ("pattern",),
    "prefix_shared_namespaces": ("pattern",),
}


def _cases_side_by_side(cases: list[dict]) -> tuple[dict[str, list[dict]], list[str]]:
    """Every case's rows in one set of tables, each name prefixed with its case's number and each content
    fingerprint moved by it, so no case can see another's pages, namespaces or accounts; and the requests the
    cases expect flagged, named the same way."""
    tables: dict[str, list[dict]] = {}
    expected: list[str] = []
    for n, case in enumerate(cases):
        for table, rows in case["tables"].items():
            for row in rows or []:
                row = dict(row)
                for column in _CASE_NAMES.get(table, ()):
                    if row.get(column) is not None:
                        row[column] = f"c{n}-{row[column]}"
                if row.get("chain_fp") is not None:
                    row["chain_fp"] = row["chain_fp"] + n * 1_000_000
                tables.setdefault(table, []).append(row)
        expected += [f"c{n}-{rid}" for rid in case["expect"]]
    return tables, sorted(expected)


def test_the_store_load_rule_cases_hold_on_spark(spark):
    """The prefix_reuse rule with a recursive CTE runs on Spark too: its YAML cases with chains of loaded
    pages flag the same requests there (UNION ALL, which is all Spark's recursion accepts). The cases run side by
    side in one set of tables, each in names of its own (one Spark query, not one per case); DuckDB gives every
    case's expected requests on those tables too, so the cases did not meet."""
    import kvforensics
    from kvforensics.core.db import connect
    from kvforensics.engines.spark import CANONICAL_TABLES, SparkEngine
    from kvforensics.stages.detect import load_case_tables, rule_parameters, run_rule
    from kvforensics.stages.rulebook import load_rules

    engine = SparkEngine(spark)
    rules = load_rules(Path(kvforensics.__file__).parent / "mechanisms" / "prefix_reuse" / "rules")
    rule = next(r for r in rules if r.id == "cross_tenant_store_load")
    # the cases whose loads are chains of pages (the recursion has parents to follow)
    cases = [c for c in rule.tests if any("parent_block_hash" in e for e in c["tables"]["kv_events"])]
    assert len(cases) >= 2 and not any(c.get("parameters") for c in cases)
    tables, expected = _cases_side_by_side(cases)
    con = connect()
    load_case_tables(con, tables)
    assert sorted(run_rule(con, rule, rule_parameters(rule))["request_id"]) == expected
    present = {t for (t,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    engine.push_tables(con, [t for t in CANONICAL_TABLES if t in present])
    flagged = engine.run_rule(con, rule, rule_parameters(rule))
    assert sorted(flagged["request_id"]) == expected


def engine_arrow(con: duckdb.DuckDBPyConnection):
    return con.sql("SELECT * FROM requests").to_arrow_table()


# --- the helpers' expansions agree value for value ----------------------------------------------


def _both(spark, template: str, params: dict | None = None, tables: dict | None = None) -> tuple[list, list]:
    """The template's rows on DuckDB and on Spark (``tables``: name -> pyarrow table, on both)."""
    from kvforensics.engines.portable import render

    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    for name, arrow in (tables or {}).items():
        con.register(name, arrow)
        spark.createDataFrame(arrow).createOrReplaceTempView(name)
    duck = con.execute(render(template, "duckdb"), params).fetchall()
    sp = [tuple(r) for r in spark.sql(render(template, "spark"), params).collect()]
    return duck, sp


def test_helpers_mean_the_same_on_both_engines(spark):
    import pyarrow as pa

    # round_double: the exact binary value, ties away from zero (0.01875 is 0.018749999... in binary)
    pairs = [(k, n) for n in range(1, 170) for k in range(0, 2 * n + 1)]
    grid = pa.table(
        {"k": pa.array([k for k, _ in pairs], pa.int64()), "n": pa.array([n for _, n in pairs], pa.int64())}
    )
    duck, sp = _both(
        spark,
        "SELECT k, n, {{ round_double(k / n, 4) }}, {{ round_double(k * CAST(1.05 AS DOUBLE) / n, 1) }}, "
        "{{ round_double(-k / n, 2) }} FROM kvf_grid ORDER BY k, n",
        tables={"kvf_grid": grid},
    )
    assert duck == sp and len(duck) > 20000

    globs = pa.table(
        {
            "v": [
                "loadtest-7",
                "xloadtest-7",
                "a.b",
                "axb",
                "a*b",
                "axb",
                "ab",
                "ac",
                "ab",
                "a^",
                "ab",
                "a(b)",
                "a$",
                "A",
                "bounty-4471",
                "x+y",
                "xxy",
                "a\nb",
            ],
            "p": [
                "loadtest-*",
                "loadtest-*",
                "a.b",
                "a.b",
                "a\\*b",
                "a\\*b",
                "a[!c]",
                "a[!c]",
                "a[^c]",
                "a[^c]",
                "a[b-d]",
                "a(b)",
                "a$",
                "a",
                "bounty-?471",
                "x+y",
                "x+y",
                "a*b",
            ],
        }
    )
    duck, sp = _both(
        spark, "SELECT v, p, {{ glob_match(v, p) }} FROM kvf_globs ORDER BY v, p", tables={"kvf_globs": globs}
    )
    assert duck == sp and any(m for *_, m in duck) and not all(m for *_, m in duck)

    from datetime import datetime, timezone

    ms = pa.table({"ms": [0.0, 0.0005, 0.0015, 0.0025, 1.2345, 123.4567, -0.0005, 1e6, 2.5e-3]})
    duck, sp = _both(
        spark,
        "SELECT ms, {{ add_milliseconds(ts, ms) }}, {{ add_hours(ts, -3) }} "
        "FROM (SELECT {{ as_timestamp($t0) }} AS ts) a, kvf_ms ORDER BY ms",
        {"t0": datetime(2026, 8, 28, 10, tzinfo=timezone.utc)},
        tables={"kvf_ms": ms},
    )
    assert [(m, t.replace(tzinfo=None), h.replace(tzinfo=None)) for m, t, h in duck] == sp

    groups = pa.table(
        {
            "g": ["a", "a", "a", "b"],
            "k": pa.array([2, 1, 1, 5], pa.int64()),
            "v": ["y", "z", "x", "q"],
            "x": [150.25, 1.5e20, 1e-7, 0.1],
        }
    )
    duck, sp = _both(
        spark,
        "SELECT g, {{ string_agg_ordered(v, ' ', k, v) }}, {{ median(k) }}, "
        "{{ json_object('g', g, 'n', CAST(NULL AS STRING), 'x', max(x), 'k', max(k)) }} "
        "FROM kvf_groups GROUP BY g ORDER BY g",
        tables={"kvf_groups": groups},
    )
    assert [r[:3] for r in duck] == [r[:3] for r in sp] == [("a", "x z y", 1.0), ("b", "q", 5.0)]
    normalised = [duckdb.execute("SELECT CAST(json($j) AS VARCHAR)", {"j": r[3]}).fetchall()[0][0] for r in sp]
    assert (
        [r[3] for r in duck]
        == normalised
        == ['{"g":"a","n":null,"x":150000000000000000000.0,"k":2}', '{"g":"b","n":null,"x":0.1,"k":5}']
    )
