"""Which inputs an output folder's evidence was built from, and what changed since.

The evidence database records the incident file (path, SHA-256) and every input file (source, path,
SHA-256) in ``evidence_set`` / ``evidence_inputs`` before the ingest reads anything. The next run into
the same folder compares them with the inputs it finds: the same set resumes (files already loaded
are not read again); a different one is built afresh, refused (``--no-rebuild``) or, asked for with
``--append``, loaded incrementally when it only adds files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import duckdb

from kvforensics import __version__
from kvforensics.config import Incident
from kvforensics.core.db import run_script
from kvforensics.sources.common.textio import file_digest


@dataclass(frozen=True)
class InputSet:
    incident_file: str
    incident_sha256: str
    files: frozenset[tuple[str, str, str]]  # (source, absolute path, sha256)
    # absolute path -> (sha256, bytes), so that the ingest need not hash a file again
    digests: Mapping[str, tuple[str, int]] = field(default_factory=dict, compare=False)


def current_inputs(incident: Incident) -> InputSet:
    """The incident file and every file its sources name now (a file two sources claim refused), hashed."""
    digests: dict[str, tuple[str, int]] = {}
    files = set()
    for source, paths in incident.source_files():
        for path in paths:
            key = str(path.resolve())
            if key not in digests:  # an SGLang log may be both an engine log and a requests source
                digests[key] = file_digest(path)
            files.add((source.name, key, digests[key][0]))
    return InputSet(str(incident.path.resolve()), file_digest(incident.path)[0], frozenset(files), digests)


def recorded_inputs(db_path: Path) -> tuple[InputSet | None, bool]:
    """The set recorded in an evidence database (None if it records none), and whether it holds
    any loaded input at all."""
    if not db_path.exists():
        return None, False
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        loaded = "load_report" in tables and con.execute("SELECT count(*) FROM load_report").fetchall()[0][0] > 0
        if "evidence_set" not in tables:
            return None, loaded
        head = con.execute("SELECT incident_file, incident_sha256 FROM evidence_set").fetchall()
        if not head:
            return None, loaded
        files = frozenset(con.execute("SELECT source, file, sha256 FROM evidence_inputs").fetchall())
        return InputSet(head[0][0], head[0][1], files), loaded
    finally:
        con.close()


@dataclass(frozen=True)
class Changes:
    incident: str | None  # what changed about the incident file, if anything
    added: tuple[str, ...]
    removed: tuple[str, ...]
    modified: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.incident or self.added or self.removed or self.modified)

    @property
    def only_adds(self) -> bool:
        return not (self.incident or self.removed or self.modified)

    def describe(self) -> str:
        parts = [self.incident] if self.incident else []
        for what, names in (("added", self.added), ("removed", self.removed), ("modified", self.modified)):
            if names:
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                parts.append(f"{len(names)} file(s) {what}: {shown}")
        return "; ".join(parts)


def changes(old: InputSet, new: InputSet) -> Changes:
    if old.incident_file != new.incident_file:
        incident = f"a different incident file ({new.incident_file}; the evidence is from {old.incident_file})"
    elif old.incident_sha256 != new.incident_sha256:
        incident = f"the incident file {Path(new.incident_file).name} changed"
    else:
        incident = None
    before = {(s, f): h for s, f, h in old.files}
    after = {(s, f): h for s, f, h in new.files}
    base = Path(new.incident_file).parent

    def shown(keys: Iterable[tuple[str, str]]) -> tuple[str, ...]:
        """File names relative to the incident folder where they lie in it, sorted."""
        paths = (Path(f) for _s, f in keys)
        return tuple(sorted(p.relative_to(base).as_posix() if p.is_relative_to(base) else str(p) for p in paths))

    return Changes(
        incident=incident,
        added=shown(after.keys() - before.keys()),
        removed=shown(before.keys() - after.keys()),
        modified=shown(k for k, h in after.items() if k in before and before[k] != h),
    )


def record(con: duckdb.DuckDBPyConnection, inputs: InputSet) -> None:
    """Record *inputs* as the folder's evidence set (before the ingest reads them). How the run came
    to it (rebuilt, appended) is the run's, said in the manifest: the evidence is the same either way."""
    run_script(con, "evidence_set")
    con.execute("DELETE FROM evidence_set").fetchall()
    con.execute("DELETE FROM evidence_inputs").fetchall()
    con.execute(
        "INSERT INTO evidence_set VALUES ($f, $h)", {"f": inputs.incident_file, "h": inputs.incident_sha256}
    ).fetchall()
    con.executemany("INSERT INTO evidence_inputs VALUES (?, ?, ?)", sorted(inputs.files))


def scope_key(con: duckdb.DuckDBPyConnection, incident: Incident) -> str | None:
    """What a scope's outputs follow from besides the evidence tables: the incident file as it is now (its
    parameters), the evidence set the database records and the kvforensics version, as one SHA-256. A scope
    whose manifest records the same key need not run again (``kvforensics report`` after ``scope``). None
    when the database records no evidence set (built by an older kvforensics, or not ingested)."""
    tables = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    if not {"evidence_set", "evidence_inputs"} <= tables:
        return None
    head = con.execute("SELECT incident_file, incident_sha256 FROM evidence_set").fetchall()
    if not head:
        return None
    files = con.execute("SELECT source, file, sha256 FROM evidence_inputs ORDER BY ALL").fetchall()
    key = {
        "kvforensics": __version__,
        "incident_file": str(incident.path.resolve()),
        "incident_sha256": file_digest(incident.path)[0],
        "evidence_set": list(head[0]),
        "evidence_inputs": [list(f) for f in files],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
