"""What ingest calls for a requests source (``entry`` of ``kind.yml``): its files that are new, loaded."""

from __future__ import annotations

from pathlib import Path

from kvforensics.config import Source
from kvforensics.sources.common.load_report import FileLoad, IngestRun, InputFile, digest, record
from kvforensics.sources.requests.load import load_requests_files


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    """Load the source's files that are new (by SHA-256; a file loaded before is reported, not read
    again), each file's load report written in the same transaction as its records."""
    con = run.con
    records: dict[Path, InputFile] = {}
    digests: dict[Path, tuple[str, int]] = {}
    todo: list[Path] = []
    for path in files:
        taken = digest(path, run.digests)
        seen = con.execute(
            "SELECT records_read, loaded, quarantined, duplicates, notes FROM load_report "
            "WHERE source = $s AND sha256 = $h",
            {"s": source.name, "h": taken[0]},
        ).fetchall()
        if seen:
            r = seen[0]
            records[path] = InputFile(
                source=source.name,
                kind=source.kind,
                file=str(path),
                sha256=taken[0],
                bytes=taken[1],
                records_read=r[0],
                loaded=r[1],
                quarantined=r[2],
                duplicates=r[3],
                notes=tuple(filter(None, [r[4], "already loaded (same SHA-256): not read again"])),
            )
        elif taken[1] == 0:
            records[path] = record(con, source, path, taken, FileLoad(file=path, notes=["empty file"]))
        else:
            digests[path] = taken
            todo.append(path)

    def merged(load: FileLoad) -> None:
        if load.records_read == 0 and not load.notes:
            load.notes.append("empty file")
        records[load.file] = record(con, source, load.file, digests[load.file], load)

    load_requests_files(
        con,
        source,
        todo,
        tick=run.tick,
        on_file=lambda p: run.on_file(f"{source.name}: {p.name}"),
        on_merged=merged,
        model_aliases=run.incident.model_aliases,
    )
    return [records[path] for path in files]
