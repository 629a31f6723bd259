"""Run the detection rules and the scope SQL on Apache Spark, results back in evidence.duckdb.

What runs where (``kvforensics run incident.toml --engine spark``):

* ingest stays on DuckDB (it is the loader) and writes the canonical tables to evidence.duckdb;
* the canonical tables the SQL reads are handed to Spark through Arrow (``requests`` may instead be
  an existing Spark/Hive table: ``[settings] spark_requests_table = "db.table"``, whose rows are
  then also copied into evidence.duckdb, because the latency fit, the report and ``verify`` read it);
* every rule runs on Spark; the latency fit (an aggregate over ``requests``) and the combination of
  the collected findings into tiers run on DuckDB, as in a DuckDB run;
* the scope scripts run on Spark statement by statement, each table a cached view; the persistent
  ones (affected_responses, possible_sources, notifications, ...) are written back to
  evidence.duckdb with exactly the column types a DuckDB run gives them, so the outputs, the report
  and ``verify`` read the same database either way.

The session runs in UTC with few shuffle partitions and Arrow transfers; ``local[2]`` unless a master
is given (``--spark-master spark://host:7077``, ``yarn``, ...).
"""

from __future__ import annotations

import shutil
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import duckdb
import pandas as pd

from kvforensics.engines.portable import (
    EngineError,
    TableStatement,
    create_duckdb_view,
    render,
    run_duckdb_script,
    script_statements,
    used_parameters,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from kvforensics.config import Incident
    from kvforensics.stages.rulebook import Rule

#: The Spark release the parity tests run against (the ``spark`` extra pins it).
PYSPARK_VERSION = "4.3.0"
DEFAULT_MASTER = "local[2]"
#: Canonical tables the rules and scripts read, as ingest leaves them.
CANONICAL_TABLES = (
    "requests",
    "capacity",
    "engine_events",
    "content_fingerprints",
    "content_stats",
    "account_patterns",
    "request_blocks",
    "kv_events",
    "prefix_windows",
    "prefix_shared_namespaces",
    "exposure_windows",
)
#: Tables detect writes that the scope scripts read.
DETECT_TABLES = ("latency_model", "findings", "request_tiers")

_SPARK_TYPES = {
    "VARCHAR": "STRING",
    "BIGINT": "BIGINT",
    "INTEGER": "INT",
    "DOUBLE": "DOUBLE",
    "BOOLEAN": "BOOLEAN",
    "TIMESTAMP WITH TIME ZONE": "TIMESTAMP",
    "JSON": "STRING",
}


def unavailable_reason() -> str | None:
    """Why Spark cannot run here (no pyspark, no Java), or None when it can."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed: pip install 'kvforensics[spark]'"
    import os

    java_home = os.environ.get("JAVA_HOME")
    if not shutil.which("java") and not (java_home and os.path.exists(os.path.join(java_home, "bin", "java"))):
        return "Spark needs Java 17 or later: install it or set JAVA_HOME"
    return None


def session(master: str | None = None) -> SparkSession:
    """The Spark session kvforensics runs on (created once per process, then reused)."""
    reason = unavailable_reason()
    if reason:
        raise EngineError(f"cannot run on Spark: {reason}")
    import warnings

    from pyspark.sql import SparkSession

    # kvforensics hands Spark Arrow tables, not pandas frames: pyspark's pandas-version warning is noise
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    master = master or DEFAULT_MASTER
    active = SparkSession.getActiveSession()
    if active is not None:
        if active.sparkContext.master != master:
            raise EngineError(
                f"a Spark session on {active.sparkContext.master} is already running in this "
                f"process; cannot switch to {master}"
            )
        return active
    builder = (
        SparkSession.builder.master(master)
        .appName("kvforensics")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", "-Duser.timezone=UTC")
        .config("spark.executor.extraJavaOptions", "-Duser.timezone=UTC")
        .config("spark.sql.ansi.enabled", "true")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.arrow.pyspark.fallback.enabled", "false")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    if master.startswith("local"):
        builder = builder.config("spark.sql.shuffle.partitions", "2").config("spark.default.parallelism", "2")
    try:
        spark = builder.getOrCreate()
    except Exception as e:  # py4j / JVM start-up errors carry no common base class
        raise EngineError(f"could not start Spark on {master}: {_first_line(e)} (Spark needs Java 17+)") from e
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def _spark_errors(what: str) -> Iterator[None]:
    """Spark's errors as an :class:`EngineError` naming what failed (the CLI prints it, exit 2)."""
    from pyspark.errors import PySparkException

    try:
        yield
    except PySparkException as e:
        raise EngineError(f"Spark could not run {what}: {_first_line(e)}") from e


def requests_table_setting(incident: Incident) -> str | None:
    """``[settings] spark_requests_table`` of the incident file, if any."""
    try:
        data = tomllib.loads(incident.path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return None
    value = (data.get("settings") or {}).get("spark_requests_table")
    if value is not None and not isinstance(value, str):
        raise EngineError("[settings] spark_requests_table must be a table name like \"db.table\"")
    return value


def _duckdb_columns(con: duckdb.DuckDBPyConnection, table: str) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in con.execute(f'DESCRIBE "{table}"').fetchall()]


def _to_arrow(con: duckdb.DuckDBPyConnection, query: str):
    relation = con.sql(query)
    fetch = getattr(relation, "to_arrow_table", None) or relation.arrow
    return fetch()


def _spark_type(duckdb_type: str) -> str:
    spark_type = _SPARK_TYPES.get(duckdb_type)
    if spark_type is None:
        raise EngineError(f"no Spark type for DuckDB column type {duckdb_type}")
    return spark_type


@dataclass
class SparkEngine:
    """Spark views of one investigation's tables, and the way back into its evidence database."""

    spark: SparkSession
    requests_table: str | None = None
    _canonical_loaded: bool = False
    _cached: dict[str, DataFrame] = field(default_factory=dict)

    @classmethod
    def start(cls, master: str | None = None, requests_table: str | None = None) -> SparkEngine:
        return cls(session(master), requests_table)

    # --- tables in --------------------------------------------------------------------------------
    def push_tables(self, con: duckdb.DuckDBPyConnection, tables: Iterable[str]) -> None:
        """Copy DuckDB tables to Spark temp views of the same name (via Arrow)."""
        for table in tables:
            cols = _duckdb_columns(con, table)
            select = ", ".join(f'CAST("{c}" AS VARCHAR) AS "{c}"' if t == "JSON" else f'"{c}"' for c, t in cols)
            arrow = _to_arrow(con, f'SELECT {select} FROM "{table}"')
            schema = ", ".join(f"`{c}` {_spark_type(t)}" for c, t in cols)
            df = (
                self.spark.createDataFrame(arrow, schema=schema)
                if arrow.num_rows
                else self.spark.createDataFrame([], schema=schema)
            )
            df.createOrReplaceTempView(table)

    def load_canonical(self, con: duckdb.DuckDBPyConnection) -> None:
        """The canonical tables as Spark views (once per investigation)."""
        if self._canonical_loaded:
            return
        tables = list(CANONICAL_TABLES)
        if self.requests_table:
            tables.remove("requests")
            self._read_requests_table(con)
        self.push_tables(con, tables)
        self._canonical_loaded = True

    def _read_requests_table(self, con: duckdb.DuckDBPyConnection) -> None:
        """``requests`` from an existing Spark/Hive table with the canonical columns; copied to DuckDB."""
        from pyspark.errors import AnalysisException

        assert self.requests_table
        try:
            source = self.spark.table(self.requests_table)
        except AnalysisException as e:
            raise EngineError(
                f"cannot read Spark table {self.requests_table!r} "
                f"([settings] spark_requests_table): {str(e).splitlines()[0]}"
            ) from None
        cols = _duckdb_columns(con, "requests")
        have = {c.lower(): c for c in source.columns}
        optional = {"cache_salt", "cached_tokens_source"}  # added after Spark tables were first read: NULL when absent
        missing = [c for c, _ in cols if c.lower() not in have and c not in optional]
        if missing:
            raise EngineError(
                f"Spark table {self.requests_table!r} lacks the canonical request column(s) "
                f"{missing}; it needs {[c for c, _ in cols]} (see kvforensics/sql/schema.sql)"
            )
        df = source.selectExpr(
            *[
                f"CAST(`{have[c.lower()]}` AS {_spark_type(t)}) AS `{c}`"
                if c.lower() in have
                else f"CAST(NULL AS {_spark_type(t)}) AS `{c}`"
                for c, t in cols
            ]
        )
        df = df.cache()
        df.createOrReplaceTempView("requests")
        self._cached["requests"] = df
        arrow = df.toArrow()
        replaced = con.execute("SELECT count(*) FROM requests").fetchall()[0][0]
        con.register("spark_requests", arrow)
        try:
            con.execute("DELETE FROM requests").fetchall()
            con.execute("INSERT INTO requests SELECT * FROM spark_requests").fetchall()
        finally:
            con.unregister("spark_requests")
        note = f"requests read from Spark table {self.requests_table} ({arrow.num_rows} rows)" + (
            f"; they replace the {replaced} rows loaded from the requests source(s)" if replaced else ""
        )
        con.execute("DELETE FROM ingest_notes WHERE note LIKE 'requests read from Spark table %'").fetchall()
        con.execute("INSERT INTO ingest_notes VALUES ('warning', $n)", {"n": note}).fetchall()

    # --- queries --------------------------------------------------------------------------------------
    def _sql(self, template: str, params: Mapping[str, Any]) -> DataFrame:
        used = used_parameters(template)
        missing = used - set(params)
        if missing:
            raise KeyError(f"the SQL needs parameter(s) {sorted(missing)}")
        args = {k: v for k, v in params.items() if k in used}
        return self.spark.sql(render(template, "spark"), args or None)

    def run_rule(self, con: duckdb.DuckDBPyConnection, rule: Rule, params: Mapping[str, Any]) -> pd.DataFrame:
        """The rule's flagged requests, computed on Spark: ``request_id, strength, evidence``.

        Evidence is re-serialised by DuckDB's ``json()``, so its text is what ``json_object`` writes
        on DuckDB (Spark prints doubles in Java's notation, e.g. ``1.5E7``)."""
        self.load_canonical(con)
        with _spark_errors(f"rule {rule.id}"):
            arrow = self._sql(rule.template, params).toArrow()
        con.register("spark_findings", arrow)
        try:
            return con.execute(
                "SELECT request_id, strength, CAST(json(evidence) AS VARCHAR) AS evidence FROM spark_findings"
            ).df()
        finally:
            con.unregister("spark_findings")

    def run_scripts(self, con: duckdb.DuckDBPyConnection, scripts: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        """Run portable scripts on Spark; write their persistent tables back to the evidence database."""
        self.load_canonical(con)
        self.push_tables(con, DETECT_TABLES)
        types = reference_types(con, scripts)
        persistent: list[TableStatement] = []
        try:
            for name, params in scripts:
                for stmt in script_statements(name):
                    # Materialised once, lineage cut: later statements read this result as a leaf,
                    # so neither the plans nor the work grow with the depth of the script.
                    with _spark_errors(f"sql/{name}.sql, table {stmt.name}"):
                        df = self._sql(stmt.query, params).localCheckpoint(eager=True)
                    self._replace_view(stmt.name, df)
                    if not stmt.temporary:
                        persistent.append(stmt)
            for stmt in persistent:  # in script order, so a view's inputs are written back before it
                if stmt.view:
                    create_duckdb_view(con, stmt)
                else:
                    self._write_back(con, stmt.name, types[stmt.name])
        finally:
            for name in [n for n in self._cached if n != "requests"]:  # free the script tables
                self._cached.pop(name).unpersist()
                self.spark.catalog.dropTempView(name)

    def _replace_view(self, name: str, df: DataFrame) -> None:
        old = self._cached.pop(name, None)
        df.createOrReplaceTempView(name)
        self._cached[name] = df
        if old is not None:
            old.unpersist()

    def _write_back(self, con: duckdb.DuckDBPyConnection, table: str, columns: list[tuple[str, str]]) -> None:
        with _spark_errors(f"the copy of {table} to the evidence database"):
            arrow = self.spark.table(table).toArrow()
        got = [f.name for f in arrow.schema]
        if got != [c for c, _ in columns]:
            raise EngineError(f"Spark's {table} has columns {got}; DuckDB's has {[c for c, _ in columns]}")
        select = ", ".join(f'CAST("{c}" AS {t}) AS "{c}"' for c, t in columns)
        con.register("spark_result", arrow)
        try:
            con.execute(f'CREATE OR REPLACE TABLE "{table}" AS SELECT {select} FROM spark_result').fetchall()
        finally:
            con.unregister("spark_result")


def reference_types(
    con: duckdb.DuckDBPyConnection, scripts: Sequence[tuple[str, Mapping[str, Any]]]
) -> dict[str, list[tuple[str, str]]]:
    """The column names and types each script table has when DuckDB creates it.

    The scripts run on DuckDB over empty copies of their input tables (milliseconds), so a table
    written back from Spark gets exactly the types a DuckDB run gives it (e.g. DuckDB's ``sum`` of
    BIGINT is HUGEINT, Spark's BIGINT)."""
    ref = duckdb.connect()
    try:
        ref.execute("SET TimeZone = 'UTC'")
        for table in CANONICAL_TABLES + DETECT_TABLES:
            cols = ", ".join(f'"{c}" {t}' for c, t in _duckdb_columns(con, table))
            ref.execute(f'CREATE TABLE "{table}" ({cols})')
        for name, params in scripts:
            run_duckdb_script(ref, name, dict(params))
        return {stmt.name: _duckdb_columns(ref, stmt.name) for name, _ in scripts for stmt in script_statements(name)}
    finally:
        ref.close()
