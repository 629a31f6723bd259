"""The detection rules as a Spark Structured Streaming query, for a provider whose request logs outgrow one
machine (``docs/architecture.md``, "Watch on Spark Structured Streaming").

A file source reads canonical request rows (Parquet files with the columns of ``requests`` in
``sql/schema.sql``, as the provider's own job lands them: typed, one row per request) from a folder as files
arrive. Every micro-batch is handed to ``foreachBatch``, where it is a static DataFrame: it becomes the view
``requests`` the rules read, beside the tables the evidence database holds (capacity, engine events, the latency
model ...; pushed once, and again with :func:`refresh` when the start-ups change), and every rule that judges a
request on its own row (:func:`kvforensics.watch.detection.per_request`) runs on it, in its portable SQL rendered
for Spark, as ``--engine spark`` runs it. A rule cannot run on the stream itself: Structured Streaming refuses
window functions other than over event time, and every rule ranks its candidates per request with
``row_number()``; and a rule that compares a request with earlier ones (the prefix_reuse rules) needs all of
them, so it stays with the batch run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import duckdb
import pandas as pd

from kvforensics.engines.portable import render
from kvforensics.stages.rulebook import Rule, load_rules, rule_parameters
from kvforensics.watch.detection import per_request

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming import StreamingQuery

    from kvforensics.engines.spark import SparkEngine

#: the evidence tables the per-request rules read beside ``requests``
STATIC_TABLES = ("capacity", "engine_events", "latency_model")

Findings = Callable[[pd.DataFrame, int], None]


def refresh(engine: SparkEngine, con: duckdb.DuckDBPyConnection, tables: Iterable[str] = STATIC_TABLES) -> None:
    """The evidence tables the rules read beside the requests, pushed to Spark (again)."""
    engine.push_tables(con, list(tables))


def start(
    engine: SparkEngine,
    con: duckdb.DuckDBPyConnection,
    folder: str,
    checkpoint: str,
    on_findings: Findings,
    *,
    overrides: dict[str, dict[str, Any]] | None = None,
    rules: Iterable[Rule] | None = None,
    available_now: bool = False,
    max_files_per_trigger: int | None = None,
) -> StreamingQuery:
    """Start the query: the Parquet request files of *folder* as they arrive (progress kept in *checkpoint*),
    each micro-batch judged by the per-request rules; *on_findings* gets each batch's findings
    (``request_id, strength, evidence, rule_id``) and the batch's id. With *available_now*, the files there now
    are read and the query ends (a test, or a catch-up run)."""
    chosen = [r for r in (rules if rules is not None else load_rules()) if per_request(r)]
    params = {r.id: rule_parameters(r, (overrides or {}).get(r.id)) for r in chosen}
    refresh(engine, con)
    con.execute("CREATE OR REPLACE TEMP VIEW requests_columns AS SELECT * FROM requests LIMIT 0").fetchall()
    engine.push_tables(con, ["requests_columns"])  # the canonical columns, with their Spark types
    spark = engine.spark
    schema = spark.table("requests_columns").schema
    reader = spark.readStream.schema(schema)
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)

    def judge(batch: DataFrame, batch_id: int) -> None:
        # the micro-batch lives in a session of its own, cloned from this one with its views when the query began
        session = batch.sparkSession
        batch.createOrReplaceTempView("requests")
        frames = []
        for rule in chosen:
            used = rule.used_parameters()
            args = {k: v for k, v in params[rule.id].items() if k in used}
            found = session.sql(render(rule.template, "spark"), args or None).toPandas()
            found["rule_id"] = rule.id
            frames.append(found)
        if frames:
            on_findings(pd.concat(frames, ignore_index=True), batch_id)

    writer = reader.parquet(folder).writeStream.foreachBatch(judge).option("checkpointLocation", checkpoint)
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="5 seconds")
    return writer.start()
