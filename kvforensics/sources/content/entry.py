"""What ingest calls for a content source (``entry`` of ``kind.yml``): each file read whole, its prompts cut
into blocks of the size the KV events and start-ups loaded before it show."""

from __future__ import annotations

from pathlib import Path

from kvforensics.config import Source
from kvforensics.core.fingerprint import key_for
from kvforensics.sources.common.load_report import IngestRun, InputFile, load_each
from kvforensics.sources.content.load import load_content
from kvforensics.sources.content.prefix_blocks import block_size


def load(run: IngestRun, source: Source, files: list[Path]) -> list[InputFile]:
    incident = run.incident
    size = block_size(run.con, incident.prefix_block_size)
    return load_each(
        run,
        source,
        files,
        lambda path: load_content(
            run.con, source, path, key_for(incident.id), size, incident.prefix_word_blocks, incident.winnow_window
        ),
    )
