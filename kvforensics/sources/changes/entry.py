"""What ingest calls for a changes source (``entry`` of ``kind.yml``): each change log read whole."""

from __future__ import annotations

from pathlib import Path

from kvforensics.config import Source
from kvforensics.sources.changes.load import load_changes
from kvforensics.sources.common.load_report import IngestRun, InputFile, load_each


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    return load_each(run, source, files, lambda path: load_changes(run.con, source, path))
