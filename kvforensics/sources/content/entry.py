"""What ingest calls for a content source (``entry`` of ``kind.yml``): each file read whole, its prompts cut
into blocks of the size the KV events and start-ups loaded before it show."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvforensics.config import Source
from kvforensics.core.fingerprint import key_for
from kvforensics.sources.common.bulk_lines import LineChecks
from kvforensics.sources.common.load_report import IngestRun, InputFile, load_each
from kvforensics.sources.content.bulk import BULK_MIN_LINES, bulk_refusal
from kvforensics.sources.content.load import load_content
from kvforensics.sources.content.prefix_blocks import block_size


@contextmanager
def begin(run: IngestRun, source: Source, files: list[Path]) -> Iterator[None]:
    """Called when the ingest starts: the checks of the files' lines that the bulk reader makes before it reads them
    (two passes over each file) begun on a thread of their own while the sources before content load."""
    if bulk_refusal(source, run.incident.prefix_word_blocks) is not None:
        yield
        return
    with LineChecks(run.con, files, BULK_MIN_LINES) as checks:
        run.state[f"{__name__}:{source.name}"] = checks
        yield


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    incident = run.incident
    size = block_size(run.con, incident.prefix_block_size)
    checks: LineChecks | None = run.state.get(f"{__name__}:{source.name}")
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
            checked=checks.get(path) if checks is not None else None,
        ),
    )
