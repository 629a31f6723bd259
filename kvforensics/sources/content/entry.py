"""What ingest calls for a content source (``entry`` of ``kind.yml``): each file read whole, its prompts cut
into blocks of the size the KV events and start-ups loaded before it show."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from kvforensics.config import Source
from kvforensics.core.fingerprint import key_for
from kvforensics.sources.common.bulk_lines import begun_check, checks_begun
from kvforensics.sources.common.load_report import IngestRun, InputFile, load_each
from kvforensics.sources.content.bulk import BULK_MIN_LINES, bulk_refusal
from kvforensics.sources.content.load import load_content
from kvforensics.sources.content.prefix_blocks import block_size


def begin(run: IngestRun, source: Source, files: list[Path]) -> AbstractContextManager[None]:
    """Called when the ingest starts: the checks of the files' lines that the bulk reader makes before it reads them
    (two passes over each file) begun on a thread of their own while the sources before content load."""
    return checks_begun(run, source, files, BULK_MIN_LINES, bulk_refusal(source, run.incident.prefix_word_blocks))


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    incident = run.incident
    size = block_size(run.con, incident.prefix_block_size)
    return load_each(
        run,
        source,
        files,
        lambda path: load_content(
            run.con,
            source,
            path,
            key_for(incident.id),
            size,
            incident.prefix_word_blocks,
            incident.winnow_window,
            checked=begun_check(run, source, path),
        ),
    )
