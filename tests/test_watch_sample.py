"""The bundled sample replayed as it grew (kvforensics/watch/replay.py: its gateway files gaining gzip members,
its engine logs lines, in time order) while ``watch`` follows it: every response of the batch answer is alerted
within 60 s of the append that brought it, and none other; the exposed start-ups are alerted before the first
affected response is appended; after watch stops, ``scope`` on its folder writes the batch run's scope.json."""

from __future__ import annotations

import io
import json
import statistics
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from kvforensics.config import load_incident
from kvforensics.investigation import Investigation
from kvforensics.watch import Watch, WatchOptions
from kvforensics.watch.replay import timeline

PAUSE_S = 0.3  # between two appends
LIMIT_S = 60.0  # the bound from the append of a record to its alert


@pytest.fixture(scope="module")
def batch_answer(sample_incident: Path, tmp_path_factory) -> tuple[Path, set[str], list[tuple[str, str]]]:
    """The batch run's scope.json, its affected responses and its exposed start-ups (instance, start)."""
    out = tmp_path_factory.mktemp("batch")
    inv = Investigation.open(sample_incident, out, progress=False, pdf=False)
    try:
        inv.ingest()
        inv.detect()
        inv.scope_outputs(with_report=False)
        affected = {r for (r,) in inv.con.execute("SELECT request_id FROM affected_responses").fetchall()}
        exposed = [
            (i, s.strftime("%Y-%m-%dT%H:%M:%SZ"))
            for i, s in inv.con.execute("SELECT instance, valid_from FROM exposure_windows ORDER BY ALL").fetchall()
        ]
    finally:
        inv.close()
    return out / "scope.json", affected, exposed


def _alerts(out: Path) -> list[dict]:
    path = out / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_the_sample_replayed_is_alerted_as_it_grows_and_settles_to_the_batch_answer(
    sample_incident: Path, batch_answer, tmp_path: Path
) -> None:
    scope_json, affected, exposed = batch_answer
    line = timeline(sample_incident)
    first = next(rid for *_, rid in line.items if rid in affected)  # the first affected response, in time order
    dest, out = tmp_path / "incident", tmp_path / "out"
    line.start(sample_incident.parent, dest)
    parts = list(line.parts(1000, breaks=frozenset({first})))
    w = Watch(
        load_incident(dest / "incident.toml"), out, WatchOptions(interval=0.2, status=False, stdout=io.StringIO())
    )
    stop = threading.Event()
    done: dict = {}
    runner = threading.Thread(target=lambda: done.setdefault("summary", w.run(stop)))
    runner.start()
    appended: dict[str, float] = {}
    exposed_before: list[dict] = []
    try:
        for part in parts:
            if first in part.request_ids:  # the exposed start-ups must be alerted before this part is appended
                deadline = time.monotonic() + LIMIT_S
                while time.monotonic() < deadline and not exposed_before:
                    exposed_before = [a for a in _alerts(out) if a["kind"] == "exposed_startup"]
                    time.sleep(0.1)
                assert not [a for a in _alerts(out) if a["kind"] == "affected_response"]
            part.write(dest)
            now = time.time()
            appended.update((rid, now) for rid in part.request_ids)
            time.sleep(PAUSE_S)
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline and len([a for a in _alerts(out) if a["kind"] == "affected_response"]) < len(
            affected
        ):
            time.sleep(0.2)
    finally:
        stopped = time.time()
        stop.set()
        runner.join(120)
    assert done["summary"].alerted_not_in_answer == []
    raised = _alerts(out)
    responses = [a for a in raised if a["kind"] == "affected_response"]
    assert {a["request_id"] for a in responses} == affected and len(responses) == len(affected)
    delays = [_epoch(a["detected_at"]) - appended[a["request_id"]] for a in responses]
    assert max(delays) <= LIMIT_S and all(_epoch(a["detected_at"]) <= stopped for a in responses)
    assert sorted((a["instance"], a["start"]) for a in exposed_before) == exposed
    assert sorted((a["instance"], a["start"]) for a in raised if a["kind"] == "exposed_startup") == exposed
    print(
        f"\n{len(responses)} affected responses alerted {statistics.median(delays):.1f} s (median), "
        f"{max(delays):.1f} s (max) after their append"
    )
    inv = Investigation.open(dest / "incident.toml", out, progress=False, pdf=False)
    try:
        inv.scope_outputs(with_report=False)
    finally:
        inv.close()
    assert (out / "scope.json").read_bytes() == scope_json.read_bytes()
