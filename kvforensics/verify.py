"""Verify an output folder: inputs unchanged since the run, and scope.json matches the database."""

from __future__ import annotations

import json
from pathlib import Path

from kvforensics.db import connect
from kvforensics.errors import InputError
from kvforensics.loaders.textio import file_digest


def verify(out_dir: Path) -> list[str]:
    """Problems found (empty when the folder checks out)."""
    problems: list[str] = []
    manifest, scope = _read_json(out_dir, "manifest.json"), _read_json(out_dir, "scope.json")
    incident_dir = _incident_dir(out_dir, manifest)
    for item in manifest["inputs"]:
        path = Path(item["file"])
        path = path if path.is_absolute() else incident_dir / path
        if not path.exists():
            problems.append(f"input missing: {path}")
            continue
        digest, _ = file_digest(path)
        if digest != item["sha256"]:
            problems.append(f"input changed since the run: {path} (sha256 {digest} != {item['sha256']})")
    con = connect(out_dir / "evidence.duckdb", read_only=True)
    try:
        for key, query in manifest.get("headline_queries", {}).items():
            value = con.execute(query).fetchall()[0][0]
            expected = scope
            for part in key.split("."):
                expected = expected[part]
            if isinstance(expected, list):
                expected = len(expected)
            if value != expected:
                problems.append(f"scope.json {key} = {expected}, but the database gives {value} ({query})")
        if "conclusive" in scope and scope["conclusive"] != (not scope.get("inconclusive_reasons")):
            problems.append(f"scope.json conclusive = {scope['conclusive']} contradicts its "
                            f"{len(scope.get('inconclusive_reasons') or [])} inconclusive reason(s)")
    finally:
        con.close()
    return problems


def _read_json(out_dir: Path, name: str) -> dict:
    path = out_dir / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{name} is missing: name the output folder of a `kvforensics run`",
                         location=str(out_dir)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{name} is not the JSON `kvforensics run` writes ({e}); run the investigation again",
                         location=str(path)) from None
    if not isinstance(data, dict):
        raise InputError(f"{name} is not the JSON object `kvforensics run` writes", location=str(path))
    return data


def _incident_dir(out_dir: Path, manifest: dict) -> Path:
    recorded = manifest.get("incident", {}).get("dir")
    return Path(recorded) if recorded else out_dir
