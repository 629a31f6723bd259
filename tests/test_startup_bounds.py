"""Issue 28, observations 4 and 5: impossible start-up values are refused, not trusted. A KV pool or context length of
0 made every response of the start-up's lifetime affected (a false notice to every account it served); a number
beyond 64 bits stopped the investigation with an OverflowError. Each refusal is quarantined at its line, and the run
is inconclusive (startup_value_refused) while an exposure window depends on it."""

from __future__ import annotations

import json
from pathlib import Path
from zoneinfo import ZoneInfo

import duckdb
import pytest
from conftest import PREFILL_LOG, write_mini

from kvforensics.cli import main
from kvforensics.sources.engine_logs.parse import parse_engine_file
from kvforensics.sources.engine_logs.startup_bounds import MAX_TOKENS

POOL_LINE = "max_total_num_tokens=681280, chunked_prefill_size=8192"
CONTEXT = "context_len=1048576, available_gpu_mem"


def _run(tmp_path: Path, log: str) -> tuple[int, dict, list]:
    path = write_mini(tmp_path / "mini")
    (tmp_path / "mini" / "engine" / "p0.log").write_text(log)
    out = tmp_path / "out"
    code = main(["run", str(path), "--out", str(out), "--quiet", "--no-pdf"])
    with duckdb.connect(str(out / "evidence.duckdb"), read_only=True) as con:
        quarantined = con.execute(
            "SELECT regexp_extract(file, '[^/]+$'), line, reason FROM quarantine ORDER BY line"
        ).fetchall()
    return code, json.loads((out / "scope.json").read_text()), quarantined


def test_a_kv_pool_of_zero_tokens_is_refused_not_trusted(tmp_path):
    code, scope, quarantined = _run(tmp_path, PREFILL_LOG.replace(POOL_LINE, POOL_LINE.replace("681280", "0"), 1))
    # trusted, pool 0 made all 401 successful responses of the start-up affected, and 18 accounts "received" them
    assert code == 3 and scope["affected_responses"] <= 1
    reasons = {r["code"]: r["message"] for r in scope["inconclusive_reasons"]}
    assert "startup_incomplete" not in reasons
    assert reasons["startup_value_refused"].startswith(
        "engine instance 'p0': 1 start-up(s) with a value no engine can have, refused (KV pool 0 (line 5); "
        "start-up at p0.log line 1)"
    )
    assert quarantined == [
        (
            "p0.log",
            5,
            "impossible start-up value: KV pool 0 is outside 1..1,099,511,627,776; the start-up's KV pool is unknown",
        )
    ]


def test_a_context_length_beyond_64_bits_is_refused_with_its_line(tmp_path):
    code, scope, quarantined = _run(
        tmp_path, PREFILL_LOG.replace(CONTEXT, CONTEXT.replace("1048576", "1" + "0" * 30), 1)
    )
    assert code == 3  # not 2 with "unexpected OverflowError in stages/ingest.py"
    assert "startup_value_refused" in {r["code"] for r in scope["inconclusive_reasons"]}
    assert quarantined == [
        (
            "p0.log",
            5,
            "impossible start-up value: context length 100000000000... (31 digits) is "
            "outside 1..1,099,511,627,776; the start-up's context length is unknown",
        )
    ]


@pytest.mark.parametrize(
    "change, field, line",
    [
        (("context_length=1048576", "context_length=0"), "context_length", 5),  # the engine's context_len line
        (("tp_size=2", "tp_size=" + "9" * 20), "tp_size", 1),
        (("page_size=64", "page_size=-1"), "page_size", 1),
        (
            (
                "#tokens: 681280, KV size: 40.10 GB\n[2026-08-27 14:01:05 TP1]",
                "#tokens: 0, KV size: 40.10 GB\n[2026-08-27 14:01:05 TP1]",
            ),
            "kv_pool_tokens",
            3,
        ),  # the smallest pool reported, TP0's
    ],
)
def test_each_bounded_field_is_refused_at_the_line_it_came_from(tmp_path, change, field, line):
    old, new = change
    head = PREFILL_LOG.split("[2026-09-09")[0]  # the first start-up only
    assert old in head
    (tmp_path / "p0.log").write_text(
        head.replace(old, new, 1).replace(CONTEXT, CONTEXT.replace("1048576", "0"), 1)
        if field == "context_length"
        else head.replace(old, new, 1)
    )
    parse = parse_engine_file(tmp_path / "p0.log", fmt="sglang", instance="p0", tz=ZoneInfo("UTC"))
    (startup,) = parse.startups
    refused = [q for q in parse.all_quarantined() if q.reason.startswith("impossible start-up value")]
    assert getattr(startup, field) is None
    assert field in startup.flags["refused_fields"].split(",")
    assert line in [q.line for q in refused]


def test_the_bounds_let_real_pools_through():
    assert MAX_TOKENS >= 10**12 > 20_000_000 * 1000
