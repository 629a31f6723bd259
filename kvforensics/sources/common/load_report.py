"""What reading one input file did, and its row of ``load_report``: the record every kind's reader returns and
ingest reports, so that every file's records are accounted for (read, loaded, quarantined, duplicates); and
one ingest as the kinds' entries see it (:class:`IngestRun`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import duckdb

from kvforensics.config import Incident, Source
from kvforensics.sources.common.textio import file_digest


@dataclass
class FileLoad:
    """What happened to one input file."""

    file: Path
    records_read: int = 0
    loaded: int = 0
    quarantined: int = 0
    duplicates: int = 0
    notes: list[str] = field(default_factory=list)
    reader: str = ""  # duckdb-json / duckdb-lines / duckdb-parquet (DuckDB's readers) or python
    # the format the file was read as: the source's, or the one its reader recognised (a jsonl source's
    # file that is SGLang's request log or an OTLP export)
    format: str = ""


@dataclass(frozen=True)
class InputFile:
    """One input file as ingest reports it (a row of ``load_report``)."""

    source: str
    kind: str
    file: str
    sha256: str
    bytes: int
    records_read: int
    loaded: int
    quarantined: int
    duplicates: int
    notes: tuple[str, ...]


@dataclass
class IngestResult:
    files: list[InputFile] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)

    @property
    def records_read(self) -> int:
        return sum(f.records_read for f in self.files)

    @property
    def quarantined(self) -> int:
        return sum(f.quarantined for f in self.files)


Tick = Callable[[int], None]


@dataclass
class IngestRun:
    """One ingest as the source kinds' entries see it (``load(run, source, files)``): the database, the incident,
    progress callbacks, the digests taken already, the result they add to, the start-ups the engine logs
    gave (ingest turns them into ``capacity``) and what an entry keeps from one call to the next (``state``,
    under its module's name)."""

    con: duckdb.DuckDBPyConnection
    incident: Incident
    tick: Tick
    on_file: Callable[[str], None]
    digests: Mapping[str, tuple[str, int]]
    result: IngestResult
    startups: list[tuple[Source, Path, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


def digest(path: Path, known: Mapping[str, tuple[str, int]] | None) -> tuple[str, int]:
    """The file's (SHA-256, bytes): taken already (*known*, by absolute path), else now."""
    return (known or {}).get(str(path.resolve())) or file_digest(path)


def forget_file(con: duckdb.DuckDBPyConnection, source: Source, path: Path) -> None:
    """The load report and quarantine of a file read before, removed before it is read again."""
    params = {"s": source.name, "f": str(path)}
    con.execute("DELETE FROM load_report WHERE source = $s AND file = $f", params).fetchall()
    con.execute("DELETE FROM quarantine WHERE source = $s AND file = $f", params).fetchall()


def record(
    con: duckdb.DuckDBPyConnection, source: Source, path: Path, digest: tuple[str, int], load: FileLoad
) -> InputFile:
    """The file's row of ``load_report``, written."""
    rec = InputFile(
        source=source.name,
        kind=source.kind,
        file=str(path),
        sha256=digest[0],
        bytes=digest[1],
        records_read=load.records_read,
        loaded=load.loaded,
        quarantined=load.quarantined,
        duplicates=load.duplicates,
        notes=tuple(load.notes),
    )
    con.execute(
        "INSERT INTO load_report VALUES ($source, $kind, $file, $sha, $bytes, $read, $loaded, $q, $d, $notes)",
        {
            "source": rec.source,
            "kind": rec.kind,
            "file": rec.file,
            "sha": rec.sha256,
            "bytes": rec.bytes,
            "read": rec.records_read,
            "loaded": rec.loaded,
            "q": rec.quarantined,
            "d": rec.duplicates,
            "notes": "; ".join(rec.notes) or None,
        },
    ).fetchall()
    return rec


def load_each(run: IngestRun, source: Source, files: list[Path], read: Callable[[Path], FileLoad]) -> list[InputFile]:
    """Each file of a source read whole again (its earlier report and quarantine removed first) by *read*, and
    reported: the entry of a kind whose files are read one by one."""
    out = []
    for path in files:
        run.on_file(f"{source.name}: {path.name}")
        forget_file(run.con, source, path)
        taken = digest(path, run.digests)
        out.append(record(run.con, source, path, taken, read(path)))
    return out
