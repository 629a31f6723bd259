"""The output folder of an investigation: one evidence set, written whole, by one run at a time.

- ``check_out_dir``: ``--out`` must be a folder (or not exist yet) that no source's path can match, so
  that a later run never reads its own outputs as evidence.
- ``FolderLock``: a lock file holding the PID and host of the run writing the folder; a second run
  into the same folder stops with a one-line error, a lock left by a crashed run (its process gone)
  is taken over.
- ``publish``: outputs are written into a staging folder inside the output folder and then renamed
  into place, file by file (``os.replace`` is atomic), folders such as ``notices/`` swapped whole, so
  a reader never sees a half-written file and a smaller re-run leaves no stale notice.
"""

from __future__ import annotations

import glob as globmod
import os
import shutil
import socket
from fnmatch import fnmatchcase
from pathlib import Path

from kvforensics.config import Incident
from kvforensics.core.errors import ConfigError

LOCK_NAME = ".kvforensics.lock"
STAGING_NAME = ".kvforensics-staging"
# Everything a run writes into its folder; a rebuild removes these (and only these) before it starts.
OUTPUT_NAMES = (
    "scope.json",
    "affected_requests.csv",
    "notifications.csv",
    "quarantine.csv",
    "manifest.json",
    "manifest.json.sig",
    "report.html",
    "report.md",
    "report.pdf",
    "notices",
)
DATABASE_NAMES = ("evidence.duckdb", "evidence.duckdb.wal", "evidence.spill")
WRITTEN_LAST = "manifest.json"  # it describes the others, so it is put in place after them


def check_out_dir(out: Path, incident: Incident) -> None:
    """Refuse an ``--out`` that is a file, or a folder some source's path could match files in."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder: name a folder (it is created if missing)")
    target = out.resolve()
    for source in incident.sources:
        if _could_match_below(target, source.base_dir / source.path):
            raise ConfigError(
                f"--out {out} is inside the inputs of source '{source.name}' (path '{source.path}'), so the next "
                f"run would read its outputs as evidence: choose an output folder outside {source.base_dir}"
                if target != source.base_dir.resolve()
                else f"--out {out} is the incident folder, which source '{source.name}' (path '{source.path}') reads: "
                f"choose an output folder outside the inputs, e.g. {source.base_dir / 'out'}"
            )


def _could_match_below(target: Path, pattern: Path) -> bool:
    """Whether a file somewhere below folder *target* could be one of the files *pattern* names
    (a folder: every file below it; a glob, ``**`` crossing folders; else one file)."""
    parts = pattern.parts
    magic = next((i for i, p in enumerate(parts) if globmod.has_magic(p)), None)
    if magic is None:  # a folder (read recursively) or a single file
        path = pattern.resolve()
        return path.is_dir() and (target == path or path in target.parents)
    root = Path(*parts[:magic]).resolve()
    if target != root and root not in target.parents:
        return False
    below = target.relative_to(root).parts
    rest = parts[magic:]
    for i, name in enumerate(below):
        if i >= len(rest) - 1:  # the pattern's last part names files; the target's files lie deeper
            return "**" in rest[i:]
        if rest[i] == "**":
            return True
        if not fnmatchcase(name, rest[i]):
            return False
    return True  # the target is a folder the pattern reaches into (or its root)


class FolderLock:
    """``<out>/.kvforensics.lock``: which process (PID, host) is writing this output folder."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        if self.held:
            return
        me = f"{os.getpid()} {socket.gethostname()}\n"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._live_holder()
                if holder is None:  # left by a run that ended without removing it
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(
                    f"another kvforensics run ({holder}) is writing to {self.path.parent}: wait for it to finish, "
                    f"or use another --out folder (if no run is active, delete {self.path})"
                ) from None
            with os.fdopen(fd, "w") as fh:
                fh.write(me)
            self.held = True
            return
        raise ConfigError(f"could not take the lock {self.path}: delete it if no kvforensics run is active")

    def _live_holder(self) -> str | None:
        """'pid N on HOST' of a run still alive, or None for a stale (or our own) lock."""
        try:
            pid_text, _, host = self.path.read_text(encoding="utf-8").strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            return None  # unreadable or half-written: no run holds it
        if host and host != socket.gethostname():
            return f"pid {pid} on {host}"  # another machine: its process cannot be checked from here
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, owned by another user
        return f"pid {pid}"

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def new_staging(out: Path) -> Path:
    """An empty staging folder inside *out* (same file system, so renames out of it are atomic)."""
    staging = out / STAGING_NAME
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def publish(staging: Path, out: Path, *, remove: tuple[str, ...] = ()) -> None:
    """Move everything in *staging* into *out*: files renamed over the old ones, folders swapped
    whole; names in *remove* that the staging folder lacks are deleted from *out* (stale)."""
    names = sorted((p.name for p in staging.iterdir()), key=lambda n: (n == WRITTEN_LAST, n))
    for name in names:
        new, old = staging / name, out / name
        if new.is_dir():
            retired = staging / f".old-{name}"
            if old.exists():
                os.replace(old, retired)
            os.replace(new, old)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(new, old)
    for name in remove:
        if name not in names:
            remove_output(out / name)
    shutil.rmtree(staging, ignore_errors=True)


def remove_output(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def clear_evidence(out: Path) -> None:
    """Remove the evidence database and every output of an earlier run (nothing else in *out*)."""
    for name in (*DATABASE_NAMES, *OUTPUT_NAMES, STAGING_NAME):
        remove_output(out / name)
