"""The simulator reproduces the incident faithfully, deterministically and in the real log formats."""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import math
import re
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvforensics.simulate import Scenario, simulate
from kvforensics.simulate.cli import add_arguments, run
from kvforensics.simulate.fleet.kv_pages import FREE, PageAllocator
from kvforensics.simulate.run import planned_incident, served_chunks
from kvforensics.simulate.sources.content import has_run
from kvforensics.simulate.sources.engine_log import EngineLog, request_lines
from kvforensics.simulate.sources.engine_stream import request_line_columns
from kvforensics.simulate.sources.gateway import column_names

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
MAX_SAMPLE_BYTES = 6 * 1024 * 1024

# --- Reference regexes (from /work/shared/reference/engine-log-formats.md) --------------------
ENVELOPE = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?: TP(\d+))?\] (.*)$")
KV_LINE = re.compile(r"^KV Cache is allocated\. dtype: (\S+), #tokens: (\d+), KV size: ([\d.]+) GB$")
SUMMARY = re.compile(
    r"^max_total_num_tokens=(\d+), chunked_prefill_size=(\d+), max_prefill_tokens=(\d+), "
    r"max_running_requests=(\d+), context_len=(\d+), available_gpu_mem=([\d.]+) GB$"
)
ABORT = re.compile(
    r"^Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)\. "
    r"Use a shorter input or enable --allow-auto-truncate\., self\.rid='([^']+)'$"
)
TIME_STATS = re.compile(
    r"^ReqTimeStats\(rid=(\S+), bootstrap_room=(\d+), input_len=(\d+), cached_input_len=(\d+), "
    r"output_len=(\d+), attempts=(\d+), type=(\w+)\): bootstrap_duration=[\d.]+ms, "
    r"queue_duration=[\d.]+ms, forward_duration=[\d.]+ms, entry_time=[\d.]+, "
    r"transfer_speed=[\d.]+ GB/s, transfer_total=[\d.]+ MB$"
)
SERVER_ARGS_OLD = re.compile(r"^server_args=ServerArgs\((.*)\)$")
SERVER_ARGS_NEW = re.compile(r"^server_args=(\{.*\})$")
OTHER_MESSAGES = [
    re.compile(r"^Load weight begin\. avail mem=[\d.]+ GB$"),
    re.compile(r"^Load weight end\. elapsed=[\d.]+ s, type=\w+, avail mem=[\d.]+ GB, mem usage=[\d.]+ GB\.$"),
    re.compile(r"^Memory pool end\. avail mem=-?[\d.]+ GB$"),
    re.compile(r"^Capture cuda graph begin\. This can take up to several minutes\. avail mem=-?[\d.]+ GB$"),
    re.compile(r"^Capture cuda graph end\. Time elapsed: [\d.]+ s\. mem usage=[\d.]+ GB\. avail mem=-?[\d.]+ GB\.$"),
    re.compile(r"^Capture \w+ CUDA graph begin\. backend=\w+, num_tokens=\d+, avail mem=-?[\d.]+ GB$"),
    re.compile(r"^Capture \w+ CUDA graph end\. elapsed=[\d.]+ s, mem usage=[\d.]+ GB, avail mem=-?[\d.]+ GB\.$"),
    re.compile(r"^CommonKVBootstrapServer started successfully on [\d.]+:\d+$"),
    re.compile(r"^The server is fired up and ready to roll!$"),
    re.compile(
        r"^Prefill batch, #new-seq: \d+, #new-token: \d+, #cached-token: \d+, token usage: [\d.]+, "
        r"#running-req: \d+, #queue-req: \d+, #pending-token: \d+, "
        r"(?:#bootstrap-req: \d+, #inflight-req: \d+, #optimistic-req: \d+, )?"
        r"cuda graph: (?:True|False), input throughput \(token/s\): [\d.]+$"
    ),
    re.compile(
        r"^Decode batch, #running-req: \d+, #token: \d+, token usage: [\d.]+, pre-allocated usage: [\d.]+, "
        r"#prealloc-req: \d+, #transfer-req: \d+, #retracted-req: \d+, cuda graph: (?:True|False), "
        r"gen throughput \(token/s\): [\d.]+, #queue-req: \d+$"
    ),
]
KNOWN = [KV_LINE, SUMMARY, ABORT, TIME_STATS, SERVER_ARGS_OLD, SERVER_ARGS_NEW, *OTHER_MESSAGES]

SMALL = {"requests": 3_000}
SCENARIOS = {
    "small-default": Scenario(**SMALL),
    "kite-la-otel": Scenario(
        seed=11,
        requests=6_000,
        affected=37,
        exploiters=2,
        engine_timezone="America/Los_Angeles",
        gateway_timestamps="iso_offset",
        gateway_timezone="Europe/Berlin",
        gateway_columns="otel",
        sglang_version="0.5.20",
        gateway_has_instances=False,
        model="@cf/acme/kite-9",
        engine_model="acme/Kite-9-Instruct",
        instance_prefix="kite9",
        context_length=524_288,
        exposed_pool_tokens=401_216,
        fixed_pool_tokens=1_048_576,
        decode_pool_tokens=655_360,
        fixed_decode_pool_tokens=1_048_576,
        prefill_instances=3,
        decode_instances=3,
        tp_size=4,
        start=datetime(2026, 3, 1, tzinfo=UTC),
        end=datetime(2026, 3, 15, tzinfo=UTC),
        exposure_start=datetime(2026, 3, 4, 8, tzinfo=UTC),
        fix_time=datetime(2026, 3, 12, 18, 30, tzinfo=UTC),
        report_time=datetime(2026, 3, 11, 4, tzinfo=UTC),
    ),
    "one-affected-tp1-epoch": Scenario(
        seed=3,
        requests=4_000,
        affected=1,
        tp_size=1,
        prefill_instances=1,
        decode_instances=1,
        gateway_timestamps="epoch_ms",
        gateway_columns="custom",
        custom_columns={"account_id": "customer"},
    ),
    # Above page_simulation_max_requests: every source written chunk by chunk (22 daily chunks).
    "streamed-adelaide-tp4": Scenario(
        seed=13,
        requests=12_000,
        page_simulation_max_requests=4_000,
        affected=30,
        exploiters=1,
        tp_size=4,
        engine_timezone="Australia/Adelaide",
        sglang_version="0.5.20",
    ),
    "none-affected-naive-tokyo": Scenario(
        seed=5,
        requests=4_000,
        affected=0,
        gateway_timestamps="naive_local",
        gateway_timezone="Asia/Tokyo",
        gateway_columns="canonical",
        engine_timezone="Asia/Kolkata",
    ),
}


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, scenario in SCENARIOS.items():
        out[name] = tmp_path_factory.mktemp(name)
        simulate(scenario, out[name])
    return out


@pytest.fixture(scope="session")
def sample_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample, generated exactly as documented: ``python -m kvforensics.simulate --seed 7 --out ...``."""
    out = tmp_path_factory.mktemp("sample")
    subprocess.run(
        [sys.executable, "-m", "kvforensics.simulate", "--seed", "7", "--out", str(out)],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return out


def truth(folder: Path) -> dict:
    return json.loads((folder / "ground_truth.json").read_text())


def scenario_of(folder: Path) -> dict:
    return truth(folder)["scenario"]


def gateway_rows(folder: Path) -> list[dict]:
    rows: list[dict] = []
    for path in sorted((folder / "gateway").iterdir()):
        if path.suffix == ".parquet":
            rows += pq.read_table(path).to_pylist()
        else:
            with gzip.open(path, "rt") as fh:
                rows += [json.loads(line) for line in fh]
    return rows


def canonical_rows(folder: Path, scenario: Scenario) -> dict[str, dict]:
    """Gateway rows keyed by request id, with canonical names and UTC epoch-ms timestamps."""
    names = column_names(scenario)
    out = {}
    for raw in gateway_rows(folder):
        row = {key: raw.get(written) for key, written in names.items()}
        row["ts_ms"] = parse_ts(row["ts"], scenario)
        out[row["request_id"]] = row
    return out


def parse_ts(value: object, scenario: Scenario) -> int:
    if isinstance(value, int):
        return value
    text = str(value).replace("Z", "+00:00")
    ts = datetime.fromisoformat(text)
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=ZoneInfo(scenario.gateway_timezone))
    return round(ts.timestamp() * 1000)


def iso_ms(text: str) -> int:
    return round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def engine_lines(folder: Path) -> dict[str, list[str]]:
    return {p.stem: p.read_text().splitlines() for p in sorted((folder / "engine").glob("*.log"))}


# --- Determinism -------------------------------------------------------------------------------


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    scenario = Scenario(seed=21, requests=2_000, affected=9)
    simulate(scenario, tmp_path / "a")
    simulate(scenario, tmp_path / "b")
    simulate(Scenario(seed=22, requests=2_000, affected=9), tmp_path / "c")
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert digest(tmp_path / "a")["ground_truth.json"] != digest(tmp_path / "c")["ground_truth.json"]


def test_streamed_path_is_reproducible_from_the_seed(tmp_path: Path) -> None:
    scenario = Scenario(seed=21, requests=4_000, affected=9, page_simulation_max_requests=2_000)
    simulate(scenario, tmp_path / "a")
    simulate(scenario, tmp_path / "b")
    files = digest(tmp_path / "a")
    assert files == digest(tmp_path / "b")
    assert "content/content.jsonl.gz" in files and sum(f.startswith("engine/") for f in files) == 9


# --- The incident, exactly ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_exactly_n_affected_and_all_above_the_exposed_pool(generated: dict[str, Path], name: str) -> None:
    scenario = SCENARIOS[name]
    gt = truth(generated[name])
    affected = gt["affected"]
    assert len(affected) == scenario.affected == gt["counts"]["affected_responses"]
    rows = canonical_rows(generated[name], scenario)
    for a in affected:
        assert scenario.exposed_pool_tokens < a["prompt_tokens"] < scenario.context_length
        row = rows[a["request_id"]]
        assert row["status"] == 200 and row["prompt_tokens"] == a["prompt_tokens"]
        assert row["model"] == scenario.model and row["account_id"] == a["account_id"]
        assert row["ts_ms"] == iso_ms(a["ts"])
        assert a["ttft_ms"] < 1_000  # a 1-token prefill, not a real one
    # The data itself shows exactly N: target-model 200s at or above the scheduler limit before the fix.
    long = [
        r
        for r in rows.values()
        if r["model"] == scenario.model and r["status"] == 200 and r["prompt_tokens"] >= scenario.scheduler_limit
    ]
    fix = scenario.fix_time.timestamp() * 1000
    assert sum(r["ts_ms"] < fix for r in long) == scenario.affected
    last_window_end = max((iso_ms(w["end"]) for w in gt["exposure_windows"]), default=0)
    post_fix = [r for r in long if r["ts_ms"] > last_window_end]
    assert len(post_fix) >= 10
    assert all(r["ttft_ms"] is None or r["ttft_ms"] > 60_000 for r in post_fix)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_no_affected_response_outside_its_instance_window(generated: dict[str, Path], name: str) -> None:
    gt = truth(generated[name])
    windows = {w["instance"]: w for w in gt["exposure_windows"]}
    for a in gt["affected"]:
        w = windows[a["prefill_instance"]]
        assert iso_ms(w["start"]) <= iso_ms(a["ts"]) < iso_ms(w["end"])
        assert a["pool_tokens"] == w["pool_tokens"] == SCENARIOS[name].exposed_pool_tokens


def test_sample_accounts_and_classes(sample_copy: Path) -> None:
    gt = truth(sample_copy)
    assert gt["counts"]["affected_responses"] == 155
    assert gt["counts"]["affected_accounts"] == 41
    assert gt["affected_by_class"] == {"customer": 111, "internal": 40, "reporter": 4}
    assert "loadtest-glm-01" in gt["affected_accounts"] and "bounty-4471" in gt["affected_accounts"]
    assert gt["exploiter_accounts"] == []
    assert gt["counts"]["accounts"] >= 300
    report = iso_ms("2026-09-08T23:11:00Z")
    reporter = [iso_ms(a["ts"]) for a in gt["affected"] if a["account_id"] == "bounty-4471"]
    assert all(report - 2 * 3_600_000 < t < report for t in reporter)


def test_exploiters_probe_just_above_the_pool(generated: dict[str, Path]) -> None:
    scenario = SCENARIOS["kite-la-otel"]
    gt = truth(generated["kite-la-otel"])
    assert len(gt["exploiter_accounts"]) == 2
    probes = [a for a in gt["affected"] if a["account_id"] in gt["exploiter_accounts"]]
    assert probes and all(a["prompt_tokens"] < scenario.exposed_pool_tokens + 2_500 for a in probes)
    sizes = Counter(a["prompt_tokens"] for a in probes)
    assert max(sizes.values()) >= 2  # repeated identical prompts


# --- Traps that must not look affected --------------------------------------------------------


def test_sample_traps(sample_copy: Path) -> None:
    scenario = Scenario()
    raw = gateway_rows(sample_copy)
    rows = canonical_rows(sample_copy, scenario)
    gt = truth(sample_copy)
    affected = {a["request_id"] for a in gt["affected"]}
    duplicates = len(raw) - len(rows)
    assert 0.002 < duplicates / len(rows) < 0.01
    lines = Counter(json.dumps(r, sort_keys=True) for r in raw)
    assert sum(n - 1 for n in lines.values()) == duplicates  # repeated verbatim
    null_ttft = sum(r["ttft_ms"] is None for r in rows.values()) / len(rows)
    assert 0.25 < null_ttft < 0.36
    target = [r for r in rows.values() if r["model"] == scenario.model]
    oversize = [r for r in target if r["prompt_tokens"] >= scenario.context_length]
    assert oversize and all(r["status"] == 400 and r["error"] for r in oversize)
    assert any(r["ts_ms"] > iso_ms("2026-09-09T15:00:00Z") for r in oversize)
    cache_hits = [r for r in target if r["cached_tokens"] > 0.9 * r["prompt_tokens"] > 200_000]
    assert len(cache_hits) >= 20
    assert all(r["prompt_tokens"] < scenario.scheduler_limit for r in cache_hits)
    assert not affected & {r["request_id"] for r in cache_hits}
    queued = [r for r in rows.values() if r["ttft_ms"] and r["ttft_ms"] > 5_000 and r["prompt_tokens"] < 20_000]
    assert queued
    statuses = Counter(r["status"] for r in rows.values())
    assert statuses[429] and statuses[500] + statuses[503]
    others = [r for r in rows.values() if r["model"] != scenario.model]
    assert not affected & {r["request_id"] for r in others}


# --- Engine logs --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sample", "kite-la-otel", "one-affected-tp1-epoch", "streamed-adelaide-tp4"])
def test_engine_lines_match_reference_formats(generated: dict[str, Path], sample_copy: Path, name: str) -> None:
    folder = sample_copy if name == "sample" else generated[name]
    scenario = Scenario() if name == "sample" else SCENARIOS[name]
    gt = truth(folder)
    affected = {a["request_id"]: a for a in gt["affected"]}
    aborts: dict[str, tuple[int, int]] = {}
    stubs: set[str] = set()
    for instance, lines in engine_lines(folder).items():
        kv_lines = summaries = startups = 0
        for line in lines:
            m = ENVELOPE.match(line)
            assert m, line
            message = m.group(3)
            assert any(p.match(message) for p in KNOWN), message
            rank = m.group(2)
            assert rank is None or scenario.tp_size > 1 or not instance.startswith(scenario.instance_prefix)
            if (a := ABORT.match(message)) is not None:
                assert rank in (None, "0")
                aborts[a.group(3)] = (int(a.group(1)), int(a.group(2)))
            elif (t := TIME_STATS.match(message)) is not None and t.group(3) == "1":
                stubs.add(t.group(1))
            elif KV_LINE.match(message):
                kv_lines += 1
            elif SUMMARY.match(message):
                assert rank in (None, "0")
                summaries += 1
            elif SERVER_ARGS_NEW.match(message):
                assert scenario.sglang_version == "0.5.20"
                args = ast.literal_eval(SERVER_ARGS_NEW.match(message).group(1))
                assert args["served_model_name"] and args["disaggregation_mode"] in (
                    "null",
                    "prefill",
                    "decode",
                )
                startups += 1
            elif SERVER_ARGS_OLD.match(message):
                assert scenario.sglang_version == "0.5.15"
                assert "served_model_name=" in message and "disaggregation_mode=" in message
                startups += 1
        tp = scenario.tp_size if instance.startswith(scenario.instance_prefix) else 8
        assert startups >= 1 and summaries == startups and kv_lines == startups * tp
    assert set(aborts) == set(affected)
    for rid, (prompt, limit) in aborts.items():
        assert prompt == affected[rid]["prompt_tokens"] and limit == scenario.scheduler_limit
    assert stubs == set(affected)


def test_engine_timestamps_are_local_time(generated: dict[str, Path]) -> None:
    scenario = SCENARIOS["kite-la-otel"]
    first = engine_lines(generated["kite-la-otel"])["kite9-prefill-0"][0]
    local = scenario.exposure_start.astimezone(ZoneInfo("America/Los_Angeles"))
    assert first.startswith(f"[{local:%Y-%m-%d %H:%M:%S}] server_args={{")
    toml = (generated["kite-la-otel"] / "incident.toml").read_text()
    assert 'timezone = "America/Los_Angeles"' in toml
    assert '"acme/Kite-9-Instruct" = "@cf/acme/kite-9"' in toml
    assert 'request_id = "gen_ai.response.id"' in toml


def test_start_ups_show_the_exposed_then_fixed_pool(sample_copy: Path) -> None:
    lines = engine_lines(sample_copy)["glm53-prefill-0"]
    pools = [int(m.group(1)) for line in lines if (m := SUMMARY.match(ENVELOPE.match(line).group(3)))]
    assert pools == [681_280, 2_042_880]
    decode = engine_lines(sample_copy)["glm53-decode-0"]
    decode_pools = [int(m.group(1)) for line in decode if (m := SUMMARY.match(ENVELOPE.match(line).group(3)))]
    assert all(p > 1_048_576 for p in decode_pools)


# --- KV pages ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=80), st.integers(8, 120))
def test_page_allocator_invariants(ops: list[tuple[bool, int]], n_pages: int) -> None:
    alloc = PageAllocator(n_pages)
    held: list[np.ndarray] = []
    freed_order: list[int] = []
    for request, (is_alloc, n) in enumerate(ops):
        if is_alloc and n <= alloc.free_pages:
            pages = alloc.alloc(n, request)
            if freed_order:  # FIFO: the oldest freed pages come back first
                reused = [p for p in pages.tolist() if p in freed_order]
                assert reused == freed_order[: len(reused)]
                freed_order = freed_order[len(reused) :]
            alloc.write(pages, request)
            held.append(pages)
        elif held:
            pages = held.pop(0)
            alloc.free(pages)
            freed_order += pages.tolist()
        in_use = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
        assert len(set(in_use.tolist())) == len(in_use)  # one owner at a time
        assert alloc.free_pages + alloc.used_pages == n_pages
        assert alloc.used_pages == len(in_use)
        assert (alloc.holder[in_use] != FREE).all()


def test_page_reads_account_for_every_reserved_page(sample_copy: Path) -> None:
    gt = truth(sample_copy)
    for a in gt["affected"]:
        k = math.ceil(a["prompt_tokens"] / 64)
        assert sum(a["pages_read_counts"]) + a["never_written_pages_read"] == k - 1
        assert a["request_id"] not in a["pages_read_from"]
        assert set(a["content_leaked_from"]) <= set(a["pages_read_from"])
        assert set(a["content_leaked_from_accounts"]) <= set(a["pages_read_from_accounts"])
    sources = {s for a in gt["affected"] for s in a["pages_read_from"]}
    assert len(sources) > 500


# --- Content --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sample", "streamed-adelaide-tp4"])
def test_affected_outputs_quote_their_sources(generated: dict[str, Path], sample_copy: Path, name: str) -> None:
    folder = sample_copy if name == "sample" else generated[name]
    scenario = Scenario() if name == "sample" else SCENARIOS[name]
    with gzip.open(folder / "content" / "content.jsonl.gz", "rt") as fh:
        records = [json.loads(line) for line in fh]
    content = {r["request_id"]: r for r in records}
    gt = truth(folder)
    rows = canonical_rows(folder, scenario)
    assert all(rows[rid]["model"] == scenario.model for rid in content)
    served = [rid for rid, r in rows.items() if r["model"] == scenario.model and r["status"] == 200]
    assert len(records) == len(content) == len(served) and set(content) == set(served)
    assert [rows[r["request_id"]]["ts_ms"] for r in records] == sorted(rows[rid]["ts_ms"] for rid in content)
    leaking = [a for a in gt["affected"] if a["content_leaked_from"]]
    assert len(leaking) > 0.9 * scenario.affected
    for a in leaking:
        output = content[a["request_id"]]["output"]
        for src in a["content_leaked_from"]:
            assert has_run(output, content[src]["prompt"]) or has_run(output, content[src]["output"])
        assert 2 <= len(a["content_leaked_from"]) <= 6


# --- Large-N path, CLI, sample ----------------------------------------------------------------------


def test_streaming_path_writes_parquet_without_page_simulation(tmp_path: Path) -> None:
    scenario = Scenario(seed=4, requests=30_000, page_simulation_max_requests=10_000, gateway_format="parquet")
    result = simulate(scenario, tmp_path)
    assert not result.page_simulation and result.notes
    assert result.content is not None and 'path = "content/content.jsonl.gz"' in result.incident_toml.read_text()
    assert all(p.suffix == ".parquet" for p in result.gateway_files)
    gt = truth(tmp_path)
    assert gt["page_simulation"] is False and len(gt["affected"]) == 155
    assert "pages_read_from" not in gt["affected"][0]
    assert len(canonical_rows(tmp_path, scenario)) == 30_000
    assert 'format = "parquet"' in (tmp_path / "incident.toml").read_text()


def test_streamed_engine_logs_have_one_stats_line_per_served_request_in_time_order(
    generated: dict[str, Path],
) -> None:
    scenario = SCENARIOS["streamed-adelaide-tp4"]
    folder = generated["streamed-adelaide-tp4"]
    rows = canonical_rows(folder, scenario)
    served = {rid: r for rid, r in rows.items() if r["model"] == scenario.model and r["status"] == 200}
    seen: Counter[str] = Counter()
    for instance, lines in engine_lines(folder).items():
        stamps = [ENVELOPE.match(line).group(1) for line in lines]
        assert stamps == sorted(stamps), instance  # no DST change in the period
        for line in lines:
            if (t := TIME_STATS.match(ENVELOPE.match(line).group(3))) is not None:
                assert served[t.group(1)]["prefill_instance"] == instance
                seen[t.group(1)] += 1
    assert seen == Counter(list(served))


def test_streamed_request_lines_are_the_reference_lines() -> None:
    """The column-wise lines say what ``engine_log.request_lines`` says, but for the random draws."""
    scenario = SCENARIOS["streamed-adelaide-tp4"]
    dep, incident, _, background = planned_incident(scenario)
    served = next(c for c in served_chunks(scenario, dep, incident, background) if c["affected"].sum() > 1)
    logs = {name: EngineLog(name) for name in dep.instances("target", "prefill")}
    request_lines(logs, served, dep, ZoneInfo(scenario.engine_timezone), True, np.random.default_rng(1))
    names, times, text = request_line_columns(served, dep, np.random.default_rng(1))
    drawn = re.compile(r"bootstrap_room=\d+|transfer_speed=[\d.]+")
    reference = [(i, line.ts_ms, drawn.sub("", line.text)) for i, log in logs.items() for line in log.lines]
    ours = [
        (str(i), int(t), drawn.sub("", x.removesuffix("\n")))
        for i, t, x in zip(names, times, text.to_pylist(), strict=True)
    ]
    assert len(ours) > 100 and sorted(ours) == sorted(reference)


def cli_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_scenario_file_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario_file = tmp_path / "s.toml"
    scenario_file.write_text('[scenario]\nrequests = 3000\naffected = 5\nsglang_version = "0.5.20"\n')
    assert run(cli_args(["--out", str(tmp_path / "o"), "--scenario-file", str(scenario_file), "--seed", "2"])) == 0
    assert truth(tmp_path / "o")["scenario"]["seed"] == 2
    assert len(truth(tmp_path / "o")["affected"]) == 5
    assert run(cli_args(["--out", str(tmp_path / "bad"), "--affected", "-1"])) == 2
    assert "Error: scenario: affected and exploiters must be >= 0" in capsys.readouterr().err
    scenario_file.write_text("[scenario]\nbogus = 1\n")
    assert run(cli_args(["--out", str(tmp_path / "bad"), "--scenario-file", str(scenario_file)])) == 2
    assert "unknown scenario field 'bogus'" in capsys.readouterr().err


def test_sample_is_small_complete_and_up_to_date(sample_copy: Path) -> None:
    files = digest(sample_copy)
    assert sum(p.stat().st_size for p in sample_copy.rglob("*") if p.is_file()) < MAX_SAMPLE_BYTES
    assert {"incident.toml", "ground_truth.json", "changes/changes.csv", "content/content.jsonl.gz"} <= set(files)
    assert sum(f.startswith("gateway/requests-") for f in files) == 22
    assert "ground_truth" not in (sample_copy / "incident.toml").read_text().split("\n", 1)[1]
    if SAMPLE.joinpath("incident.toml").exists():
        assert digest(SAMPLE) == files, (
            "data/sample is stale: python -m kvforensics.simulate --seed 7 --out data/sample"
        )


@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(
    seed=st.integers(0, 10_000),
    affected=st.integers(0, 60),
    exploiters=st.integers(0, 3),
    context=st.sampled_from([131_072, 262_144, 1_048_576]),
    pool_share=st.floats(0.4, 0.9),
    zone=st.sampled_from(["UTC", "America/Los_Angeles", "Australia/Adelaide"]),
)
def test_unseen_scenarios_have_exactly_n_affected(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    affected: int,
    exploiters: int,
    context: int,
    pool_share: float,
    zone: str,
) -> None:
    pool = int(context * pool_share) // 64 * 64
    scenario = Scenario(
        seed=seed, requests=3_000, affected=affected, exploiters=exploiters, context_length=context,
        exposed_pool_tokens=pool, fixed_pool_tokens=2 * context, decode_pool_tokens=context + 131_072,
        fixed_decode_pool_tokens=2 * context, engine_timezone=zone, tp_size=4,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("unseen")
    simulate(scenario, out)
    gt = truth(out)
    assert len(gt["affected"]) == affected
    assert all(pool < a["prompt_tokens"] < context for a in gt["affected"])
    messages = [ENVELOPE.match(line).group(3) for lines in engine_lines(out).values() for line in lines]
    aborts = [m for message in messages if (m := ABORT.match(message))]
    assert sorted(m.group(3) for m in aborts) == sorted(a["request_id"] for a in gt["affected"])
    assert all(int(m.group(2)) == pool - 6 for m in aborts)
