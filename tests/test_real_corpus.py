"""Real engine logs (tests/fixtures/real, each copied from a public repository or issue, README.md there names
the source) read as a responder holding them would: each runs through ``kvforensics ingest`` and
``kvforensics audit --incident`` in a small incident folder of its own (tests/incidents.py), with the log's
format left to ``auto``. The figures expected below were read off each file by hand; the comment on each row
says on which line of the file each one stands (line numbers are the fixture file's).

A case that fails for a known reason being fixed may be marked ``xfail(strict=True)`` naming it (``known``), so
that it turns into a failure the moment the fix lands and the mark has to go.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pytest
from incidents import traffic, write_incident

from kvforensics.cli import main

REAL = Path(__file__).parent / "fixtures" / "real"


@dataclass(frozen=True)
class Expected:
    """What the log says, by hand. ``pool``: the KV pool tokens, or the figures either reading of the log gives;
    ``version``: as logged, or None when the log does not name it (``inferred_below``: the bound the format
    gives); ``check1`` / ``check6``: (status, evidence line, or None when any line of the start-up will do)."""

    year: int
    pool: int | tuple[int, ...] | None
    context: int | None
    role: str
    model: str | None
    startup: str
    version: str | None
    check1: tuple[str, int | None]
    check6: tuple[str, int | None]
    inferred_below: str | None = None
    known: dict[str, str] = field(default_factory=dict)  # test -> the known item that still fails it


CORPUS = {
    # l.2 version 0.11.0+582e4e37.nv25.11 and the start (15:48:29), l.3 'model' /models/mistral-7b and no
    # kv_transfer_config (unified), l.7 / l.12 max len 32,768, l.12 enable_prefix_caching=True,
    # l.36 GPU KV cache size 840,160 (25.64x at l.37); the page dates the run January 2026
    "vllm-0.11.0-nv-docker-unified": Expected(
        2026,
        840_160,
        32_768,
        "unified",
        "/models/mistral-7b",
        "2026-01-23 15:48:29",
        "0.11.0+582e4e37.nv25.11",
        check1=("pass", 36),
        check6=("unknown", 12),
    ),
    # l.6 version 0.9.0.1 and the start (17:49:48), l.7 kv_role='kv_producer' (prefill) with LMCacheConnectorV1,
    # l.16 model meta-llama/Llama-3.1-8B-Instruct, max_seq_len=131072, enable_prefix_caching=True,
    # l.39 GPU KV cache size 406,768; LMCache's own lines date it 2025
    "vllm-0.9.0.1-lmcache-nixl-prefill": Expected(
        2025,
        406_768,
        131_072,
        "prefill",
        "meta-llama/Llama-3.1-8B-Instruct",
        "2025-06-02 17:49:48",
        "0.9.0.1",
        check1=("pass", 39),
        check6=("unknown", 16),
    ),
    # l.3 version and start, l.4 kv_role='kv_consumer' (decode), l.8 model, max_seq_len, prefix caching on,
    # l.25 GPU KV cache size 406,768
    "vllm-0.9.0.1-lmcache-nixl-decode": Expected(
        2025,
        406_768,
        131_072,
        "decode",
        "meta-llama/Llama-3.1-8B-Instruct",
        "2025-06-02 17:49:48",
        "0.9.0.1",
        check1=("pass", 25),
        check6=("unknown", 8),
    ),
    # l.3 version 0.9.2.dev356+g02cabff20 and start (00:03:53), l.4 kv_producer, tensor_parallel_size 2 and
    # 'enable_prefix_caching': False (check 6 cites it: off, yet LMCacheConnectorV1 is consulted, so unknown), l.6 max model len 131,072, l.11 engine config (enable_prefix_caching=False),
    # l.27 / l.29 GPU KV cache size 939,456 (once per worker, the same)
    "vllm-0.9.2-lmcache-nixl-tp2-prefill": Expected(
        2025,
        939_456,
        131_072,
        "prefill",
        "meta-llama/Llama-3.1-8B-Instruct",
        "2025-07-09 00:03:53",
        "0.9.2.dev356+g02cabff20",
        check1=("pass", 27),
        check6=("unknown", 4),
    ),
    # l.3 version 0.9.2.dev325+g2965c99c8 and start (18:17:48), l.4 kv_consumer, prefix caching off (check 6: as the prefill's),
    # l.6 max model len 131,072, l.10 engine config, l.23 / l.25 GPU KV cache size 939,456
    "vllm-0.9.2-lmcache-nixl-tp2-decode": Expected(
        2025,
        939_456,
        131_072,
        "decode",
        "meta-llama/Llama-3.1-8B-Instruct",
        "2025-07-14 18:17:48",
        "0.9.2.dev325+g2965c99c8",
        check1=("pass", 23),
        check6=("unknown", 4),
    ),
    # l.2 version 0.11.0 and start (14:16:17), l.3 served_model_name Qwen3-30B-A3B-Instruct-2507,
    # max_model_len 131,072, no kv_transfer_config, l.7 max model len again; no KV cache line: the pool is not
    # in the log. Check 6 stays unknown: prefix caching is 0.11's default, tenancy is not stated
    "vllm-0.11.0-tp4-no-pool": Expected(
        2025,
        None,
        131_072,
        "unified",
        "Qwen3-30B-A3B-Instruct-2507",
        "2025-11-18 14:16:17",
        "0.11.0",
        check1=("unknown", 2),
        check6=("unknown", 2),
    ),
    # l.3 the first start-up line (Available KV cache memory, 10:51:48), l.5 GPU KV cache size 75,840 (the
    # derived figure), l.6 / l.7 Maximum concurrency for 120,000 tokens per request: 2.48x, i.e. room for
    # 297,600 tokens of requests: one max-length request fits, as V1 checked before it started (check 1 passes);
    # the pool is either figure, depending on which the reader keeps. No args in the excerpt: unified, no model
    "vllm-0.11-kimi-linear-hybrid-tp2": Expected(
        2025,
        (75_840, 297_600),
        120_000,
        "unified",
        None,
        "2025-11-06 10:51:48",
        None,
        check1=("pass", None),
        check6=("unknown", 3),
    ),
    # l.1 the first line (09:32:19), l.5 max_total_num_tokens=105600 ... context_len=40960 (l.3 KV Cache is
    # allocated #tokens 105600); no server_args line: no model, no disaggregation mode, no batch line: no line says its role,
    # no version (l.3 has no dtype: before 0.5.15). l.7 / l.8 HiCache with the Mooncake store
    "sglang-hicache-mooncake-store": Expected(
        2026,
        105_600,
        40_960,
        "unknown",
        None,
        "2026-03-25 09:32:19",
        None,
        check1=("pass", 5),
        check6=("unknown", 1),
        inferred_below="<0.5.15",
    ),
    # l.1 the first line (17:10:27), l.13 max_total_num_tokens=580364 ... context_len=8192 (l.6 / l.8 the same
    # pool per TP rank), TP0 / TP1 prefixes; no server_args line
    "sglang-hybrid-gdn-tp2": Expected(
        2026,
        580_364,
        8_192,
        "unknown",
        None,
        "2026-02-27 17:10:27",
        None,
        check1=("pass", 13),
        check6=("unknown", 1),
        inferred_below="<0.5.15",
    ),
    # l.1 a progress bar glued to DP1's Load weight end (13:39:14), l.9 / l.11 / l.13 KV Cache is allocated
    # #tokens 1029388 per DP replica (DP0..DP3); the excerpt stops before max_total_num_tokens: no context
    "sglang-dp-attention-ep4": Expected(
        2026,
        1_029_388,
        None,
        "unknown",
        None,
        "2026-05-07 13:39:14",
        None,
        check1=("unknown", None),
        check6=("unknown", 1),
        inferred_below="<0.5.15",
    ),
}


# the Dynamo worker's log has no start-up to expect figures of; Dynamo's own RFC 3339 lines date it October 2025
DYNAMO, DYNAMO_YEAR = "dynamo-vllm-nixl-worker", 2025


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@dataclass
class Run:
    ingest_code: int
    audit_code: int
    audit: dict
    capacity: list[dict]
    engine_load: tuple[int, int, int]  # records read, loaded, quarantined


def run_artifact(root: Path, name: str, year: int) -> Run:
    """``name``'s log as engine/<name>.log of an incident folder (format auto, the year its source dates it), a
    few gateway requests beside it; ingest, then the audit of the incident."""
    folder = root / name.replace(".", "-")
    incident = write_incident(
        folder,
        {name: (REAL / f"{name}.log").read_text()},
        traffic("m", n=5),
        engine_format="auto",
        year=year,
        title=f"Real log {name}",
    )
    code = main(["ingest", str(incident), "--out", str(folder / "out"), "--quiet", "--no-pdf"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        audit_code = main(["audit", "--incident", str(incident), "--json"])
    con = duckdb.connect(str(folder / "out" / "evidence.duckdb"), read_only=True)
    try:
        cur = con.execute("SELECT * FROM capacity ORDER BY valid_from")
        columns = [d[0] for d in cur.description]
        capacity = [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]
        (load,) = con.execute(
            "SELECT records_read, loaded, quarantined FROM load_report WHERE source = 'engines'"
        ).fetchall()
    finally:
        con.close()
    return Run(code, audit_code, json.loads(out.getvalue()), capacity, load)


class CorpusRuns:
    """Each artifact's incident ingested and audited once, when a test first asks for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[str, Run] = {}

    def __getitem__(self, name: str) -> Run:
        if name not in self._done:
            year = CORPUS[name].year if name in CORPUS else DYNAMO_YEAR
            self._done[name] = run_artifact(self.root, name, year)
        return self._done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> CorpusRuns:
    return CorpusRuns(tmp_path_factory.mktemp("real-corpus"))


def cases(test: str) -> list:
    return [
        pytest.param(name, marks=pytest.mark.xfail(reason=e.known[test], strict=True)) if test in e.known else name
        for name, e in CORPUS.items()
    ]


def verdict(run: Run, check: int) -> dict:
    (v,) = [v for v in run.audit["verdicts"] if v["check"] == check]
    return v


def test_every_fixture_is_in_the_table_and_named_in_the_readme() -> None:
    readme = (REAL / "README.md").read_text()
    files = {p.stem for p in REAL.glob("*.log")}
    assert files == set(CORPUS) | {DYNAMO}
    assert all(f"`{name}.log`" in readme for name in files)


@pytest.mark.parametrize("name", cases("ingest"))
def test_ingest_reads_the_start_up_as_the_log_states_it(runs: CorpusRuns, name: str) -> None:
    e, run = CORPUS[name], runs[name]
    assert run.ingest_code == 0
    (row,) = run.capacity
    pools = e.pool if isinstance(e.pool, tuple) else (e.pool,)
    assert row["kv_pool_tokens"] in pools
    assert (row["context_length"], row["role"], row["engine_model"], row["model"]) == (
        e.context,
        e.role,
        e.model,
        e.model,
    )
    assert (row["engine"], row["valid_from"]) == (name.split("-")[0], utc(e.startup))  # files are named by engine
    if e.version is not None:
        assert (row["engine_version"], row["version_source"]) == (e.version, "log")
    else:  # not logged: never a version the log does not give, at most a range its format suggests
        assert row["version_source"] != "log"
        assert row["engine_version"] is None or e.inferred_below in row["engine_version"]
    # every line of the file loaded, none quarantined (the fixture has one line per record)
    lines = len((REAL / f"{name}.log").read_text().splitlines())
    assert run.engine_load == (lines, lines, 0)


@pytest.mark.parametrize("name", cases("audit"))
def test_audit_checks_1_and_6_read_as_the_log_states_them(runs: CorpusRuns, name: str) -> None:
    e, run = CORPUS[name], runs[name]
    assert run.audit_code == 0  # nothing in the corpus was exposed
    assert {(v["startup_from"], v["engine_version"]) for v in run.audit["verdicts"]} == {
        (f"{utc(e.startup):%Y-%m-%dT%H:%M:%SZ}", run.capacity[0]["engine_version"])
    }
    for check, (status, line) in ((1, e.check1), (6, e.check6)):
        v = verdict(run, check)
        assert (v["status"], v["exposed"], Path(v["evidence_file"] or "").name) == (status, False, f"{name}.log")
        if line is not None:
            assert v["evidence_line"] == line
        assert v["model"] == e.model


@pytest.mark.parametrize("name", cases("role"))
def test_the_audit_and_the_capacity_table_give_the_start_up_one_role(runs: CorpusRuns, name: str) -> None:
    run = runs[name]
    assert {v["role"] for v in run.audit["verdicts"]} == {run.capacity[0]["role"]} == {CORPUS[name].role}


def test_a_hybrid_models_concurrency_line_is_what_the_check_cites(runs: CorpusRuns) -> None:
    """The Kimi Linear start-up: however the pool is stored, check 1 must not read it as too small to hold
    max_model_len, and its sentence names the 120,000-token requests the log says fit 2.48 times."""
    v = verdict(runs["vllm-0.11-kimi-linear-hybrid-tp2"], 1)
    assert "120,000" in v["detail"]
    assert "set --max-model-len" not in v["detail"]


def test_a_dynamo_worker_log_without_a_start_up_is_not_audited_and_loses_no_line(runs: CorpusRuns) -> None:
    """Dynamo's worker stopped before vLLM printed its version, engine config or KV cache: nothing to audit
    (exit 2), no start-up invented in capacity, every line (Dynamo's own and vLLM's) kept."""
    run = runs[DYNAMO]
    assert (run.ingest_code, run.audit_code, run.capacity) == (0, 2, [])
    assert run.audit["summary"]["startups"] == 0
    assert run.engine_load == (10, 10, 0)


def test_the_lmcache_1p1d_pair_in_one_incident_is_one_prefill_and_one_decode(tmp_path: Path) -> None:
    """Both servers of LMCache's 1P1D example in one incident: two instances of the same model, one per role,
    started in the same second (l.6 of the prefill log, l.3 of the decode log)."""
    logs = {f"{role}-0": (REAL / f"vllm-0.9.0.1-lmcache-nixl-{role}.log").read_text() for role in ("prefill", "decode")}
    incident = write_incident(tmp_path, logs, traffic("m", n=5), engine_format="auto", year=2025)
    assert main(["ingest", str(incident), "--out", str(tmp_path / "out"), "--quiet", "--no-pdf"]) == 0
    con = duckdb.connect(str(tmp_path / "out" / "evidence.duckdb"), read_only=True)
    rows = con.execute(
        "SELECT instance, role, engine_model, kv_pool_tokens, context_length, valid_from FROM capacity "
        "ORDER BY instance"
    ).fetchall()
    con.close()
    start = utc("2025-06-02 17:49:48")
    assert rows == [
        ("decode-0", "decode", "meta-llama/Llama-3.1-8B-Instruct", 406_768, 131_072, start),
        ("prefill-0", "prefill", "meta-llama/Llama-3.1-8B-Instruct", 406_768, 131_072, start),
    ]
