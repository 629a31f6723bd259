"""Generated data sets, cached in the work directory by request count, gateway format (or prefix-cache
scenario: ``kvforensics simulate --mechanism prefix_reuse --prefix-scenario NAME``) and seed.

A data set is the simulator's output folder (``incident.toml``, ``gateway/``, ``engine/``, ...). It
is generated into a temporary folder and renamed into place only when the simulator succeeded, so
an interrupted generation is never mistaken for a cached one. ``dataset.json`` beside it records
how long generation took and what it produced.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from measure import run_measured

MARKER = "dataset.json"


@dataclass(frozen=True)
class Dataset:
    root: Path
    requests: int
    format: str
    seed: int
    info: dict
    scenario: str | None = None  # a prefix-cache incident (simulate/prefix), else the stale-pages one

    @property
    def label(self) -> str:
        """What the results file keys the runs of this data set by: its prefix scenario, else its format."""
        return self.scenario or self.format

    @property
    def incident_toml(self) -> Path:
        return self.root / "incident.toml"

    @property
    def gateway_files(self) -> list[Path]:
        suffix = ".jsonl.gz" if self.format == "jsonl" else ".parquet"
        return sorted(p for p in (self.root / "gateway").iterdir() if p.name.endswith(suffix))

    @property
    def has_content(self) -> bool:
        return (self.root / "content").is_dir() and any((self.root / "content").iterdir())

    @property
    def gateway_glob(self) -> str:
        suffix = "*.jsonl.gz" if self.format == "jsonl" else "*.parquet"
        return str(self.root / "gateway" / suffix)


def simulator_sha256() -> str:
    """A hash of the simulator's sources: a cached data set made by other code is reported."""
    root = Path(__file__).resolve().parent.parent / "kvforensics" / "simulate"
    digest = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".py", ".json"):
            digest.update(p.name.encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()[:16]


def dataset_dir(workdir: Path, requests: int, fmt: str, seed: int, scenario: str | None = None) -> Path:
    return workdir / "data" / f"{scenario or fmt}-n{requests}-seed{seed}"


def ensure_dataset(
    workdir: Path,
    requests: int,
    fmt: str,
    seed: int,
    *,
    log_path: Path,
    timeout_s: float | None = None,
    scenario: str | None = None,
) -> Dataset:
    """The cached data set, generating it with ``kvforensics simulate`` when absent. With *scenario*, the
    prefix-cache incident of that name (its gateway log is JSONL: *fmt* must be ``jsonl``)."""
    if scenario and fmt != "jsonl":
        raise ValueError(f"the prefix scenario {scenario} writes its gateway log as JSONL, not {fmt}")
    final = dataset_dir(workdir, requests, fmt, seed, scenario)
    marker = final / MARKER
    if marker.exists():
        info = json.loads(marker.read_text(encoding="utf-8"))
        info["simulator_changed_since"] = info.get("simulator_sha256") != simulator_sha256()
        return Dataset(final, requests, fmt, seed, info, scenario)
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    sim_hash = simulator_sha256()
    kind = ["--mechanism", "prefix_reuse", "--prefix-scenario", scenario] if scenario else ["--format", fmt]
    m = run_measured(
        [
            sys.executable,
            "-m",
            "kvforensics",
            "simulate",
            "--seed",
            str(seed),
            "--requests",
            str(requests),
            *kind,
            "--out",
            str(partial),
        ],
        log_path=log_path,
        timeout_s=timeout_s,
    )
    if not m.ok:
        raise RuntimeError(
            f"simulate --requests {requests} {' '.join(kind)} failed (exit {m.returncode}); "
            f"see {log_path}:\n{m.stderr_tail}"
        )
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    truth = json.loads((final / "ground_truth.json").read_text(encoding="utf-8"))
    gateway = [p for p in (final / "gateway").iterdir() if p.is_file()]

    def size(folder: str) -> int:
        return sum(p.stat().st_size for p in (final / folder).glob("*") if p.is_file())

    info = {
        "requests": requests,
        "format": fmt,
        "seed": seed,
        "generate_wall_s": round(m.wall_s, 2),
        "generate_peak_rss_mb": round(m.peak_rss_mb, 1),
        "gateway_files": len(gateway),
        "gateway_bytes": sum(p.stat().st_size for p in gateway),
        "engine_bytes": size("engine"),
        "content_bytes": size("content"),
        "simulator_sha256": sim_hash,
    }
    if scenario:  # simulate/prefix's ground truth: the responses computed on another tenant's blocks
        info.update(
            scenario=scenario,
            gateway_lines=truth["requests"],
            unique_requests=truth["requests"],
            affected_responses=len(truth["recipients"]),
            recipient_accounts=len(truth["recipient_accounts"]),
            source_accounts=len(truth["source_accounts"]),
            kv_events_bytes=size("kv-events"),
        )
    else:
        info.update(
            gateway_lines=truth["counts"]["gateway_lines"],
            unique_requests=truth["counts"]["requests"],
            affected_responses=truth["counts"]["affected_responses"],
            page_simulation=truth["page_simulation"],
        )
    # incident.toml paths are relative to the file, so the rename keeps the data set usable.
    (final / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return Dataset(final, requests, fmt, seed, info, scenario)
