"""What ingest calls for a kv_events source (``entry`` of ``kind.yml``): each file read whole, the chains of
stored blocks followed on from the files read before it in this ingest."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from kvforensics.config import Source
from kvforensics.core.fingerprint import key_for
from kvforensics.sources.common.bulk_lines import begun_check, checks_begun
from kvforensics.sources.common.load_report import IngestRun, InputFile, load_each
from kvforensics.sources.kv_events.bulk import BULK_MIN_LINES, bulk_refusal
from kvforensics.sources.kv_events.load import Chains, load_kv_events


def begin(run: IngestRun, source: Source, files: list[Path]) -> AbstractContextManager[None]:
    """Called when the ingest starts: the checks of the files' lines that the bulk reader makes before it reads them
    (two passes over each file) begun on a thread of their own while the sources before the KV events load."""
    return checks_begun(run, source, files, BULK_MIN_LINES, bulk_refusal(source))


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    chains = run.state.setdefault(__name__, Chains())  # KV-event chains continue across files and sources
    key = key_for(run.incident.id)
    return load_each(
        run,
        source,
        files,
        lambda path: load_kv_events(run.con, source, path, key, chains, checked=begun_check(run, source, path)),
    )
