"""``simulate()``: one seeded incident data set, written to a folder.

Pipeline: deployment + accounts -> incident requests + hourly background chunks -> serve (status,
routing, leak, timings) -> [page simulation -> content] -> gateway files, engine logs, changes,
incident.toml, ground_truth.json. Up to ``page_simulation_max_requests`` everything is kept in
memory; above it every source is written chunk by chunk as it is generated (gateway files, the
engine logs' per-request lines through :class:`EngineLogStream`, content through
:class:`ContentStream`) and only the page simulation is skipped (said in a log line and in
ground_truth.json), so memory stays bounded at any number of requests.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
from rich.progress import Progress

import kvforensics.simulate.sources.incident_files as files
from kvforensics.core.errors import ConfigError
from kvforensics.simulate.fleet.deployment import MODEL_KEYS, Deployment, build_deployment
from kvforensics.simulate.fleet.kv_pages import PageSimulation, simulate_pages
from kvforensics.simulate.fleet.serving import serve, timelines
from kvforensics.simulate.incident import AffectedPlan, incident_rows
from kvforensics.simulate.scenario import Scenario
from kvforensics.simulate.sources.content import ContentWriter, Text
from kvforensics.simulate.sources.content_stream import ContentStream
from kvforensics.simulate.sources.engine_log import build_engine_logs, request_lines, write_engine_logs
from kvforensics.simulate.sources.engine_stream import EngineLogStream, request_line_columns
from kvforensics.simulate.sources.gateway import GatewayWriter, with_duplicates
from kvforensics.simulate.traffic import (
    HOUR_MS,
    INTERNAL_BACKGROUND_ACCOUNTS,
    STREAM_IDS,
    STREAM_LOG_LINES,
    build_accounts,
    iter_background,
    to_ms,
)

log = logging.getLogger(__name__)
CHUNK_ROWS = 200_000  # target rows per generated chunk (bounded memory at any N)


def hours_per_chunk(s: Scenario) -> int:
    hours = max(1, int((s.end - s.start).total_seconds() // 3600))
    return int(min(24, max(1, CHUNK_ROWS * hours // s.requests)))


@dataclass(frozen=True)
class SimulationResult:
    out_dir: Path
    incident_toml: Path
    ground_truth: Path
    gateway_files: list[Path]
    engine_logs: list[Path]
    changes: Path
    content: Path | None
    requests: int  # unique request ids
    gateway_lines: int  # including duplicated lines
    affected: int
    affected_accounts: int
    accounts: int
    page_simulation: bool
    notes: list[str] = field(default_factory=list)


def request_ids(seed: int, first: int, n: int) -> np.ndarray:
    """Unique ``req-<16 hex>`` ids: a bijective 64-bit scramble of the running request number."""
    with np.errstate(over="ignore"):
        x = np.arange(first, first + n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= np.uint64((seed * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) % 2**64)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
    hexes = x.astype(">u8").tobytes().hex()
    return np.array(["req-" + hexes[16 * i : 16 * i + 16] for i in range(n)], dtype=object)


def served_chunks(s: Scenario, dep: Deployment, incident: pd.DataFrame, background: int) -> Iterator[pd.DataFrame]:
    """Hour-ordered chunks of received requests (background + incident), served, with request ids."""
    accounts = build_accounts(s)
    start = to_ms(s.start)
    inc_hour = (incident["ts_ms"].to_numpy() - start) // HOUR_MS
    first_id = 0
    step = hours_per_chunk(s)
    for k, chunk in enumerate(iter_background(s, dep, accounts, background, step)):
        lo, hi = k * step, (k + 1) * step
        frame = pd.concat([chunk, incident[(inc_hour >= lo) & (inc_hour < hi)]], ignore_index=True)
        frame = frame.sort_values("ts_ms", kind="stable").reset_index(drop=True)
        frame["rid"] = request_ids(s.seed, first_id, len(frame))
        first_id += len(frame)
        yield serve(frame, dep)


def apply_pages(served: pd.DataFrame, dep: Deployment) -> tuple[pd.DataFrame, PageSimulation, np.ndarray]:
    """Run the decode page allocator over the target model's served requests; fold waits into timings."""
    rows = np.flatnonzero((served["model_idx"].to_numpy() == 0) & (served["status"].to_numpy() == 200))
    sub = served.iloc[rows]
    sim = simulate_pages(sub, timelines(dep, "target", "decode"), dep.scenario.page_size)
    out = served.copy()
    out.loc[rows, "decode_instance"] = sim.decode_instance  # RangeIndex: labels are positions
    for name in ("ttft_true_ms", "latency_ms"):
        out.loc[rows, name] = out[name].to_numpy()[rows] + sim.wait_ms
    logged = ~np.isnan(out["ttft_ms"].to_numpy())
    out["ttft_ms"] = np.where(logged, out["ttft_true_ms"].round(1), np.nan)
    out["latency_ms"] = out["latency_ms"].round(1)
    return out, sim, rows


def leaked_sources(reads: dict[int, int], rng: np.random.Generator) -> list[int]:
    """The 2-6 writers with the most pages read (ties: earlier row first)."""
    ranked = sorted(reads.items(), key=lambda kv: (-kv[1], kv[0]))
    return [row for row, _ in ranked[: int(rng.integers(2, 7))]]


def write_content(
    served: pd.DataFrame,
    rows: np.ndarray,
    sim: PageSimulation,
    leaked: dict[int, list[int]],
    s: Scenario,
    path: Path,
) -> Path:
    """Prompts/outputs of served target requests; affected outputs quote their leak sources."""
    writer = ContentWriter(s.seed)
    texts: dict[int, Text] = {}
    repeated: dict[tuple[str, int], str] = {}
    account = served["account"].to_numpy()
    prompt = served["prompt_tokens"].to_numpy()
    kind = served["kind"].to_numpy()
    for local, row in enumerate(rows):
        key = (str(account[row]), int(prompt[row]))
        text = writer.ordinary()
        if kind[row] == "affected_exploiter":
            text = Text(repeated.setdefault(key, text.prompt), text.output)
        texts[local] = text
    start = served["ts_ms"].to_numpy()[rows] + served["ttft_true_ms"].to_numpy()[rows]
    for local in sorted(sim.reads, key=lambda r: (start[r], r)):
        sources = [texts[src] for src in leaked[local]]
        texts[local] = Text(texts[local].prompt, writer.leaked_output(sources))
    rids = served["rid"].to_numpy()[rows]
    order = np.argsort(served["ts_ms"].to_numpy()[rows], kind="stable")
    lines = (
        json.dumps({"request_id": rids[i], "prompt": texts[i].prompt, "output": texts[i].output}, sort_keys=True)
        for i in order
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(("\n".join(lines) + "\n").encode("utf-8"))
    return path


def affected_records(
    served: pd.DataFrame,
    rows: np.ndarray | None,
    sim: PageSimulation | None,
    leaked: dict[int, list[int]],
    model_ids: list[str],
) -> list[dict[str, Any]]:
    aff = np.flatnonzero(served["affected"].to_numpy())
    local_of = {int(r): i for i, r in enumerate(rows)} if rows is not None else {}
    rid = served["rid"].to_numpy()
    account = served["account"].to_numpy()
    out = []
    for row in aff:
        r = served.iloc[row]
        rec: dict[str, Any] = {
            "request_id": r["rid"],
            "account_id": r["account"],
            "ts": pd.Timestamp(int(r["ts_ms"]), unit="ms", tz="UTC").strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
            "model": model_ids[int(r["model_idx"])],
            "prompt_tokens": int(r["prompt_tokens"]),
            "pool_tokens": int(r["pool_tokens"]),
            "prefill_instance": r["prefill_instance"],
            "decode_instance": r["decode_instance"],
            "kind": r["kind"].removeprefix("affected_"),
            "ttft_ms": None if np.isnan(r["ttft_true_ms"]) else round(float(r["ttft_true_ms"]), 1),
            "ttft_logged": not np.isnan(r["ttft_ms"]),
        }
        if sim is not None and rows is not None:
            local = local_of[int(row)]
            reads = sim.reads[local].pages_read
            writers = sorted(reads, key=lambda w: (-reads[w], w))
            rec["pages_read_from"] = [rid[rows[w]] for w in writers]
            rec["pages_read_from_accounts"] = sorted({account[rows[w]] for w in writers})
            rec["pages_read_counts"] = [reads[w] for w in writers]
            rec["never_written_pages_read"] = sim.reads[local].never_written_pages
            rec["content_leaked_from"] = [rid[rows[w]] for w in leaked[local]]
            rec["content_leaked_from_accounts"] = sorted({account[rows[w]] for w in leaked[local]})
        out.append(rec)
    return out


def with_leaks(records: list[dict[str, Any]], leaked: dict[str, list[tuple[str, str]]]) -> list[dict[str, Any]]:
    """Affected records of the streamed path with the requests their content quotes."""
    for rec in records:
        if rec["request_id"] in leaked:
            sources = leaked[rec["request_id"]]
            rec["content_leaked_from"] = [rid for rid, _ in sources]
            rec["content_leaked_from_accounts"] = sorted({account for _, account in sources})
    return records


def trap_ids(served: pd.DataFrame) -> dict[str, list[str]]:
    """Request ids of the incident's deliberate non-affected look-alikes, by kind."""
    kind = served["kind"].to_numpy()
    rid = served["rid"].to_numpy()
    out: dict[str, list[str]] = {}
    for k in sorted(set(kind.tolist()) - {"background"}):
        if not k.startswith("affected_"):
            out[k] = sorted(rid[kind == k].tolist())
    return out


def ground_truth(
    s: Scenario,
    dep: Deployment,
    plan: AffectedPlan,
    affected: list[dict[str, Any]],
    served_counts: dict[str, Any],
    page_sim: bool,
    traps: dict[str, list[str]],
) -> dict[str, Any]:
    accounts = sorted({a["account_id"] for a in affected})
    return {
        "scenario": s.as_dict(),
        "counts": {**served_counts, "affected_responses": len(affected), "affected_accounts": len(accounts)},
        "affected_accounts": accounts,
        "affected_by_class": {
            "customer": sum(plan.customers.values()) + sum(plan.exploiters.values()),
            "internal": plan.internal,
            "reporter": plan.reporter,
        },
        "exploiter_accounts": sorted(plan.exploiters),
        "internal_accounts": sorted(INTERNAL_BACKGROUND_ACCOUNTS + (s.internal_account,)),
        "reporter_accounts": [s.reporter_account],
        "exposure_windows": [files.window_json(w) for w in dep.exposure_windows()],
        "page_simulation": page_sim,
        "scheduler_limit_tokens": s.scheduler_limit,
        "traps": traps,
        "affected": affected,
    }


def planned_incident(s: Scenario) -> tuple[Deployment, pd.DataFrame, AffectedPlan, int]:
    """The deployment, the incident's own requests and their plan, and how many background requests fit."""
    dep = build_deployment(s)
    incident, plan = incident_rows(s, dep, build_accounts(s))
    background = s.requests - len(incident)
    if background < 1_000:
        raise ConfigError(
            f"requests={s.requests} leaves no room for background traffic; use >= {len(incident) + 1_000}",
            location="scenario",
        )
    return dep, incident, plan, background


def simulate(scenario: Scenario, out_dir: Path) -> SimulationResult:
    s = scenario
    out_dir = Path(out_dir)
    dep, incident, plan, background = planned_incident(s)
    model_ids = [dep.models[k].gateway_model for k in MODEL_KEYS]
    gateway = GatewayWriter(s, out_dir / "gateway", model_ids, isal=not s.simulates_pages)
    logs = build_engine_logs(dep, np.random.default_rng([s.seed, STREAM_IDS, 1]))
    zone = ZoneInfo(s.engine_timezone)
    notes: list[str] = []
    stream: EngineLogStream | None = None
    content: ContentStream | None = None
    if not s.simulates_pages:
        notes.append(
            f"requests={s.requests} > page_simulation_max_requests={s.page_simulation_max_requests}: "
            "KV page simulation skipped (affected outputs quote the requests that last finished on "
            "their decode instance)"
        )
        log.warning(notes[-1])
        stream = EngineLogStream(logs, out_dir / "engine")
        if s.write_content:
            content = ContentStream(s.seed, out_dir / "content" / "content.jsonl.gz")
    step = hours_per_chunk(s)
    chunks = -(-int((s.end - s.start).total_seconds() // 3600) // step)
    kept: list[pd.DataFrame] = []
    affected: list[dict[str, Any]] = []
    unique = 0
    seen_accounts: set[str] = set()
    traps: dict[str, list[str]] = {}
    dup_rng = np.random.default_rng([s.seed, STREAM_IDS, 2])
    log_rng = np.random.default_rng([s.seed, STREAM_IDS, 3])
    with Progress(transient=True) as progress:
        task = progress.add_task("simulating gateway traffic", total=chunks)
        for k, served in enumerate(served_chunks(s, dep, incident, background)):
            unique += len(served)
            seen_accounts.update(served["account"].unique().tolist())
            for kind, ids in trap_ids(served).items():
                traps[kind] = sorted(traps.get(kind, []) + ids)
            if stream is None:
                kept.append(served)
            else:
                gateway.write(with_duplicates(served, s.duplicate_rate, dup_rng))
                lines_rng = np.random.default_rng([s.seed, STREAM_LOG_LINES, k])
                stream.add(*request_line_columns(served, dep, lines_rng))
                stream.flush_before(to_ms(s.start) + (k + 1) * step * HOUR_MS)
                leaked = content.write(served, k) if content is not None else {}
                affected += with_leaks(affected_records(served, None, None, {}, model_ids), leaked)
            progress.advance(task)
    content_path = content.close() if content is not None else None
    if s.simulates_pages:
        served = pd.concat(kept, ignore_index=True)
        served, sim, rows = apply_pages(served, dep)
        leak_rng = np.random.default_rng([s.seed, STREAM_IDS, 4])
        leaked = {local: leaked_sources(sim.reads[local].pages_read, leak_rng) for local in sorted(sim.reads)}
        if s.write_content:
            content_path = write_content(served, rows, sim, leaked, s, out_dir / "content" / "content.jsonl.gz")
        gateway.write(with_duplicates(served, s.duplicate_rate, dup_rng))
        request_lines(logs, served, dep, zone, True, log_rng)
        affected = affected_records(served, rows, sim, leaked, model_ids)
    gateway_files = gateway.close()
    engine_paths = stream.close() if stream is not None else write_engine_logs(logs, out_dir / "engine")
    changes = files.write_text(out_dir / "changes" / "changes.csv", files.changes_csv(dep))
    toml = files.write_text(out_dir / "incident.toml", files.incident_toml(dep, content_path is not None))
    counts = {
        "requests": unique,
        "accounts": len(seen_accounts),
        "gateway_lines": gateway.lines,
        "duplicate_lines": gateway.lines - unique,
    }
    truth = ground_truth(s, dep, plan, affected, counts, s.simulates_pages, traps)
    if len(affected) != s.affected:
        raise AssertionError(f"simulated {len(affected)} affected responses, scenario asked for {s.affected}")
    truth_path = files.write_json(out_dir / "ground_truth.json", truth, records_key="affected")
    return SimulationResult(
        out_dir=out_dir,
        incident_toml=toml,
        ground_truth=truth_path,
        gateway_files=gateway_files,
        engine_logs=engine_paths,
        changes=changes,
        content=content_path,
        requests=unique,
        gateway_lines=gateway.lines,
        affected=len(affected),
        affected_accounts=truth["counts"]["affected_accounts"],
        accounts=len(seen_accounts),
        page_simulation=s.simulates_pages,
        notes=notes,
    )
