"""The per-request rules as a Spark Structured Streaming query over a folder of request files flag what detect
flags (kvforensics/watch/streaming.py). Skipped, with the reason, when pyspark or Java is missing."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest

from kvforensics.engines.spark import unavailable_reason

REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def test_a_file_source_stream_flags_what_detect_flags(mini_incident: Path, tmp_path: Path) -> None:
    from kvforensics.engines.spark import SparkEngine
    from kvforensics.investigation import Investigation
    from kvforensics.stages.rulebook import load_rules
    from kvforensics.watch import streaming
    from kvforensics.watch.detection import per_request

    inv = Investigation.open(mini_incident, tmp_path / "out", progress=False, pdf=False)
    try:
        inv.ingest()
        inv.detect()
        con = inv.con
        expected = con.execute("SELECT request_id, rule_id, strength FROM findings ORDER BY ALL").df()
        folder = tmp_path / "landing"
        folder.mkdir()
        # the provider's job lands typed request rows, two files here (DuckDB writes the Parquet)
        for n, where in enumerate(
            ("ts < TIMESTAMPTZ '2026-08-28 09:30:00+00'", "ts >= TIMESTAMPTZ '2026-08-28 09:30:00+00'")
        ):
            con.execute(
                f"COPY (SELECT * FROM requests WHERE {where}) TO '{folder / f'part-{n}.parquet'}' (FORMAT PARQUET)"
            ).fetchall()
        found: list[pd.DataFrame] = []
        engine = SparkEngine.start()
        began = time.monotonic()
        query = streaming.start(
            engine,
            con,
            str(folder),
            str(tmp_path / "checkpoint"),
            lambda f, _batch: found.append(f),
            available_now=True,
        )
        query.awaitTermination(120)
        took = time.monotonic() - began
    finally:
        inv.close()
    rules = {r.id for r in load_rules() if per_request(r)}
    got = pd.concat(found)[["request_id", "rule_id", "strength"]].sort_values(["request_id", "rule_id", "strength"])
    want = expected[expected["rule_id"].isin(rules)]
    assert not want.empty and "r-leak" in set(want["request_id"])
    assert got.reset_index(drop=True).equals(want.reset_index(drop=True))
    print(f"\nmicro-batch of {len(rules)} rules over the mini incident's 402 requests: {took:.1f} s")
