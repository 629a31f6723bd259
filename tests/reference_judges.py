"""The reference incidents' generators and scorers (tests/hicache_reference, tests/vllm_reference), loaded from their
folders, and a run of the toolkit on one of their incidents."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from kvforensics.cli import main

TESTS = Path(__file__).parent


def judge(folder: str) -> tuple[ModuleType, ModuleType]:
    """The ``generate`` and ``score`` modules of the reference incident in ``tests/<folder>``."""
    modules = []
    for name in ("generate", "score"):
        spec = importlib.util.spec_from_file_location(f"{folder}_{name}", TESTS / folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def run(incident: Path, out: Path) -> int:
    """``kvforensics run`` of *incident* into *out* (no PDF, quiet): its exit code."""
    return main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf"])


def assert_windows_within_a_minute(result: dict[str, Any], truth: dict[str, Any]) -> None:
    """Every instance of the truth has its salt-blind-store window, found within a minute of its start and end."""
    windows = result["windows"]
    assert windows["reported"] and windows["windows_on_other_instances"] == 0
    assert set(windows["per_instance"]) == set(truth["exposure_windows"])
    for instance, w in windows["per_instance"].items():
        assert w["found"] and w["path"] == "salt_blind_store", instance
        assert abs(w["start_error_s"]) <= 60 and abs(w["end_error_s"]) <= 60, (instance, w)


def assert_prober_found_alone(result: dict[str, Any]) -> None:
    """The prober is rated likely, and no look-alike (harness, retries, keep-alive, autocomplete) nor other account."""
    exploitation = result["exploitation"]
    assert exploitation["prober_found"] and exploitation["prober_tier"] == "likely"
    assert exploitation["lookalikes_flagged_count"] == 0 and exploitation["other_accounts_flagged"] == []


def judged(generate: ModuleType, score: ModuleType, root: Path, **kwargs: Any) -> tuple[int, dict, dict, Path]:
    """A reference incident generated under *root* (*kwargs*: the generator's seed, requests, ...), run, and scored:
    the exit code, the score, the truth and the output folder."""
    truth = generate.generate(root / "incident", **kwargs)
    code = run(root / "incident" / "incident.toml", root / "out")
    return code, score.score(root / "out", root / "incident" / "truth.json"), truth, root / "out"


def assert_conclusive_at_size(judgement: tuple[int, dict, dict, Path]) -> None:
    """The run exited 0, conclusive, with outputs, on an incident large enough for its scores to mean something."""
    code, result, truth, _ = judgement
    assert result["run"]["outputs"] and code == 0 and result["run"]["conclusive"], result["run"]
    assert truth["counts"]["affected"] > 50
