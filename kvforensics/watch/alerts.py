"""Alerts: one JSON object per event, appended to ``<out>/alerts.jsonl`` and printed on stdout, each raised once.

Every alert has ``kind`` (``affected_response``, ``exposed_startup`` or ``evidence_gap``), ``alert_id`` (the kind
and what it is about: the request id, the start-up's instance and first line, the silent source and since when
...), the fields of its kind and ``detected_at`` (UTC, when watch raised it). ``alerts.jsonl`` is the record of
what was raised: a watch started again reads the ids in it and never raises one of them again. A batch of new
alerts is written (and flushed to disk) before ``--alert-command`` is run with the same lines on its standard
input, so a page always has its record. Strings from the evidence are JSON-escaped, non-ASCII as ``\\uXXXX``:
no terminal sequence reaches the screen, and no prompt text is ever in an alert.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

from kvforensics.core.errors import ConfigError
from kvforensics.core.escaping import visible_controls
from kvforensics.core.timestamps import iso

ALERTS_FILE = "alerts.jsonl"
KINDS = ("affected_response", "exposed_startup", "evidence_gap")
COMMAND_TIMEOUT_S = 60


def alert(kind: str, subject: str, detected_at: datetime | None = None, **fields: Any) -> dict[str, Any]:
    """One alert: its kind, its id (``kind:subject``), *fields* (times as UTC ISO 8601) and when it was raised."""
    if kind not in KINDS:
        raise ValueError(f"unknown alert kind {kind!r}")
    when = detected_at or datetime.now(timezone.utc)
    return {
        "kind": kind,
        "alert_id": f"{kind}:{subject}",
        **{k: iso(v) if isinstance(v, datetime) else v for k, v in fields.items()},
        "detected_at": iso(when),
    }


def line_of(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=True, default=str)


@dataclass
class AlertLog:
    """The alerts of one output folder: what was raised (from ``alerts.jsonl``), and where new ones go."""

    path: Path
    command: list[str] | None = None
    stdout: TextIO | None = field(default_factory=lambda: sys.stdout)
    warn: Callable[[str], None] = lambda message: print(message, file=sys.stderr)
    raised: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, out_dir: Path, command: str | None = None, **kwargs: Any) -> AlertLog:
        argv = None
        if command is not None:
            try:
                argv = shlex.split(command)
            except ValueError as e:
                raise ConfigError(
                    f"--alert-command {command!r} cannot be split into words ({e}): quote it as a shell would"
                ) from None
            if not argv:
                raise ConfigError("--alert-command is empty: name a command, e.g. --alert-command 'pager-send'")
        log = cls(path=out_dir / ALERTS_FILE, command=argv, **kwargs)
        log.raised = set(log.ids())
        return log

    def ids(self) -> Iterable[str]:
        """The ids of the alerts in the file (a line cut short by a crash is skipped)."""
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as fh:
            for text in fh:
                try:
                    record = json.loads(text)
                except ValueError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("alert_id"), str):
                    yield record["alert_id"]

    def records(self) -> list[dict[str, Any]]:
        """Every alert in the file, in the order raised."""
        if not self.path.exists():
            return []
        out = []
        for text in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(text))
            except ValueError:
                continue
        return out

    def raise_new(self, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Record, print and page the alerts of *alerts* not raised before; those are returned."""
        new, seen = [], set()
        for a in alerts:
            if a["alert_id"] not in self.raised and a["alert_id"] not in seen:
                new.append(a)
                seen.add(a["alert_id"])
        if not new:
            return []
        text = "".join(line_of(a) + "\n" for a in new)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        self.raised |= seen
        if self.stdout is not None:
            self.stdout.write(text)
            self.stdout.flush()
        if self.command:
            self._page(text)
        return new

    def _page(self, text: str) -> None:
        """Run the alert command with the batch on its standard input; a failure is said, never fatal."""
        shown = visible_controls(shlex.join(self.command or []))
        try:
            done = subprocess.run(
                self.command or [],
                input=text.encode("utf-8"),
                capture_output=True,
                timeout=COMMAND_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            self.warn(f"warning: --alert-command {shown} failed: {visible_controls(' '.join(str(e).split()))}")
            return
        if done.returncode != 0:
            said = visible_controls(" ".join(done.stderr.decode("utf-8", "replace").split())[:200])
            self.warn(f"warning: --alert-command {shown} exited {done.returncode}" + (f": {said}" if said else ""))
