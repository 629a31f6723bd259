"""An incident's evidence written out again as it grew: to rehearse ``kvforensics watch`` (its tests, its
benchmark, a responder trying a deployment of it on a past incident).

:func:`timeline` reads the line-based files of an incident folder and puts every line at its time: a request at
the time its record gives (the source's ``ts`` column), an engine log line at its stamp (SGLang
``[YYYY-MM-DD HH:MM:SS ...]``, vLLM ``INFO MM-DD HH:MM:SS``; a line without one at the time of the line before
it), and a line of any other file (content, KV events, changes) spread evenly over the incident's time, in its
order. :meth:`Timeline.parts` cuts it, in time order, into parts of about as many requests each; :meth:`Part.write`
appends a part to the files of another folder: plain files as they are, a ``.gz`` file as a gzip member per part,
as ``gzip -c part >> file.gz`` appends one. The incident file is copied (with the request files joined into one
growing file, if asked), so the folder a replay leaves is the same evidence as the one it read.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvforensics.config import Incident, Source, load_incident
from kvforensics.sources.common.textio import open_binary

_SGLANG_STAMP = re.compile(rb"^\[(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})")
_VLLM_STAMP = re.compile(rb"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})")


@dataclass
class Part:
    """Lines to append, per file (relative to the folder), and the ids of the requests among them."""

    lines: dict[str, list[bytes]] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)
    until: float = 0.0  # the time (epoch seconds) of its last line

    def write(self, dest: Path) -> None:
        """Append the part's lines to the files under *dest* (a ``.gz`` file gains one gzip member)."""
        for rel, lines in self.lines.items():
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            data = b"".join(lines)
            if rel.endswith(".gz"):
                data = gzip.compress(data, compresslevel=1, mtime=0)
            with path.open("ab") as fh:
                fh.write(data)


@dataclass
class Timeline:
    """Every line of an incident's followed files at its time, and the incident file to write beside them."""

    items: list[tuple[float, int, int, str, bytes, str | None]]  # (time, file order, line, file, bytes, request id)
    incident_text: str
    copied: list[str]  # files copied whole before the first part (not line-based: Parquet)

    def parts(self, requests_per_part: int, breaks: frozenset[str] = frozenset()) -> Iterator[Part]:
        """The timeline in time order, cut after every *requests_per_part* requests and before each request
        whose id is in *breaks*."""
        part = Part()
        n = 0
        for t, _, _, rel, raw, rid in self.items:
            if rid in breaks and part.lines:
                yield part
                part, n = Part(), 0
            part.lines.setdefault(rel, []).append(raw)
            part.until = t
            if rid is not None:
                part.request_ids.append(rid)
                n += 1
                if n % requests_per_part == 0:
                    yield part
                    part = Part()
        if part.lines:
            yield part

    @property
    def requests(self) -> int:
        return sum(1 for item in self.items if item[5] is not None)

    def start(self, source_dir: Path, dest: Path) -> None:
        """The destination folder with the incident file and the files copied whole, before any part."""
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "incident.toml").write_text(self.incident_text, encoding="utf-8")
        for rel in self.copied:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source_dir / rel, dest / rel)


def timeline(incident_toml: Path, *, join_requests: str | None = None, plain: bool = False) -> Timeline:
    """The timeline of the incident *incident_toml* names. With *join_requests* (a path relative to the folder,
    e.g. ``gateway/requests.jsonl``), the records of its requests source go to that one file, in the order its
    files are read, and the incident file copied names it. With *plain*, a ``.gz`` file is written as plain
    text without its suffix (the paths of the incident file copied without it too)."""
    incident = load_incident(incident_toml)
    text = incident_toml.read_text(encoding="utf-8")
    base = incident.base_dir
    items: list[tuple[float, int, int, str, bytes, str | None]] = []
    spread: list[tuple[int, str, list[bytes]]] = []
    copied: list[str] = []
    order = 0
    for source, files in incident.source_files():
        if join_requests and source.kind == "requests":
            old = f'path = "{source.path}"'
            if old not in text:
                raise ValueError(f"{incident_toml} does not spell the path of source '{source.name}' as {old}")
            text = text.replace(old, f'path = "{join_requests}"', 1)
        if plain and source.path.endswith(".gz") and not (join_requests and source.kind == "requests"):
            old = f'path = "{source.path}"'
            if old not in text:
                raise ValueError(f"{incident_toml} does not spell the path of source '{source.name}' as {old}")
            text = text.replace(old, f'path = "{source.path[:-3]}"', 1)
        for path in files:
            rel = path.relative_to(base).as_posix()
            if plain and rel.endswith(".gz") and source.format != "parquet":
                rel = rel[:-3]
            order += 1
            if source.format == "parquet":
                copied.append(rel)
                continue
            lines = _lines(path)
            if source.kind == "requests":
                target = join_requests or rel
                items.extend(
                    (t, order, i, target, raw, rid)
                    for i, (t, raw, rid) in enumerate(_in_file_order(_requests(source, lines)))
                )
            elif source.kind == "engine_log":
                items.extend(
                    (t, order, i, rel, raw, None)
                    for i, (t, raw, _) in enumerate(
                        _in_file_order((t, raw, None) for t, raw in _stamped(incident, lines))
                    )
                )
            else:
                spread.append((order, rel, lines))
    times = [t for t, *_ in items if t > float("-inf")]
    lo, hi = (min(times), max(times)) if times else (0.0, 0.0)
    for file_order, rel, lines in spread:
        step = (hi - lo) / max(1, len(lines))
        items.extend((lo + i * step, file_order, i, rel, raw, None) for i, raw in enumerate(lines))
    items.sort(key=lambda item: item[:3])
    return Timeline(items, text, copied)


def _in_file_order(lines: Iterator[tuple[float, bytes, str | None]]) -> Iterator[tuple[float, bytes, str | None]]:
    """The lines of one file at the latest time seen so far in it: a record logged late (a re-delivery with its
    first time) stays where the file has it, so the replayed file is the file."""
    latest = float("-inf")
    for t, raw, rid in lines:
        latest = max(latest, t)
        yield latest, raw, rid


def _lines(path: Path) -> list[bytes]:
    with open_binary(path) as fh:
        data = fh.read()
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines[-1] += b"\n"
    return lines


def _requests(source: Source, lines: list[bytes]) -> Iterator[tuple[float, bytes, str | None]]:
    """Each record line with its time and request id (a line that is not a record: the time before it, no id)."""
    ts_key, id_key = source.column("ts"), source.column("request_id")
    last = float("-inf")
    header = source.format == "csv"
    columns: list[str] = []
    for raw in lines:
        if header:
            columns = next(csv.reader([raw.decode("utf-8", "replace")]))
            header = False
            yield float("-inf"), raw, None
            continue
        try:
            record = (
                dict(zip(columns, next(csv.reader([raw.decode("utf-8")])), strict=False))
                if columns
                else json.loads(raw)
            )
            t = _time(record.get(ts_key))
            rid = record.get(id_key)
        except (ValueError, AttributeError):
            yield last, raw, None
            continue
        last = t if t is not None else last
        yield last, raw, None if rid is None else str(rid)


def _time(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) / (1000.0 if value > 1e11 else 1.0)
    if isinstance(value, str):
        try:
            t = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    return None


def _stamped(incident: Incident, lines: list[bytes]) -> Iterator[tuple[float, bytes]]:
    """Each engine log line with the time of its stamp (read as UTC: the order is what matters here)."""
    year = incident.year or 2026
    last = float("-inf")
    for raw in lines:
        m = _SGLANG_STAMP.match(raw)
        if m:
            last = datetime(*map(int, m.groups()), tzinfo=timezone.utc).timestamp()
        elif (v := _VLLM_STAMP.match(raw)) is not None:
            mo, d, h, mi, s = map(int, v.groups())
            last = datetime(year, mo, d, h, mi, s, tzinfo=timezone.utc).timestamp()
        yield last, raw
