"""Where an incident's source files may be: inside the incident folder (the incident file's folder).

A file that resolves outside it, through a '..' in a relative source path or a symbolic link among the evidence
(which could lead to any file of the machine, whose lines would then land in quarantine.csv), is refused unless the
responder allows it (``[settings] allow_outside``, ``--allow-outside``); a file under the folder an absolute source
path names is the responder's own choice. Every input read from outside is listed in the manifest.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable
from pathlib import Path

from kvforensics.core.errors import ConfigError


def outside_files(base_dir: Path, files: Iterable[Path]) -> list[Path]:
    """The *files* that resolve (through symbolic links and '..') outside the folder *base_dir*."""
    base = base_dir.resolve()
    return [f for f in files if not Path(f).resolve().is_relative_to(base)]


def absolute_root(path: str) -> Path | None:
    """The folder an absolute source path names before its first wildcard, resolved; None for a relative path."""
    written = Path(path)
    if not written.is_absolute():
        return None
    parts = []
    for part in written.parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts).resolve()


def check_inside(source: str, path: str, base_dir: Path, files: list[Path], where: str) -> None:
    """Refuse the *files* of source *source* (its *path* as written) that resolve outside *base_dir*, except those
    under the folder an absolute *path* names: a ConfigError located at *where* saying how to allow them."""
    named = absolute_root(path)
    refused = [f for f in outside_files(base_dir, files) if named is None or not f.resolve().is_relative_to(named)]
    if refused:
        raise ConfigError(
            f"source '{source}': {len(refused)} file(s) resolve outside the incident folder {base_dir} "
            f"(first {refused[0]} -> {refused[0].resolve()}), through '..' or a symbolic link; move "
            "them into the folder, or allow it with --allow-outside or [settings] allow_outside = true "
            "(the manifest lists each such file)",
            location=where,
        )
