"""Issue 28, observation 2: a long last line was lost and called blank (DuckDB's line reader drops a last line of
some 30 MB without a word). Every line is loaded or quarantined; one too long to hold whole is quarantined with its
line, size and the SHA-256 of the whole line, and the memory a line takes stays bounded."""

from __future__ import annotations

import gzip
import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest

from kvforensics.config import Source
from kvforensics.core.db import connect
from kvforensics.sources.common.textio import scan_file
from kvforensics.sources.engine_logs import lines as engine_lines
from kvforensics.sources.engine_logs.contract import LongLine
from kvforensics.sources.engine_logs.parse import parse_engine_file
from kvforensics.sources.requests.load import load_requests_file


def rec(rid: str, **kw) -> str:
    return json.dumps(
        {
            "request_id": rid,
            "ts": "2026-08-28T10:00:00Z",
            "account_id": "a1",
            "model": "m",
            "status": 200,
            "prompt_tokens": 100,
            **kw,
        }
    )


def load(tmp_path: Path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    con = connect()
    source = Source(name="gw", kind="requests", path="*", format="jsonl", timezone="UTC", base_dir=tmp_path)
    result = load_requests_file(con, source, path)
    return con, result, con.execute("SELECT line, reason, raw FROM quarantine ORDER BY line").fetchall()


@pytest.mark.parametrize("end", [b"\n", b""])
def test_a_34_mb_last_record_is_loaded_not_called_blank(tmp_path, end):
    big = rec("big", note="x" * 34_000_000)
    con, r, quarantined = load(tmp_path, "last.jsonl", f"{rec('r1')}\n{rec('r2')}\n{big}".encode() + end)
    assert (r.records_read, r.loaded, r.quarantined) == (3, 3, 0)
    assert not any("blank" in n for n in r.notes), r.notes
    assert con.execute("SELECT source_line FROM requests WHERE request_id = 'big'").fetchone() == (3,)


def test_duckdbs_line_reader_is_not_given_a_line_it_cannot_hold(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"{}\n" + b"x" * (3 << 20))
    assert scan_file(path, {}) == (None, [])
    path.write_bytes(b"{}\n" + b"x" * (1 << 20) + b"\n{}")
    assert scan_file(path, {}) == (3, [])


def test_a_line_too_long_to_hold_is_quarantined_with_its_size_and_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_lines, "MAX_LINE_BYTES", 1 << 20)
    middle, last = rec("long-1", note="y" * 3_000_000), rec("long-2", note="z" * 2_000_000)
    data = "\n".join([rec("r1"), middle, rec("r3"), last]).encode()
    con, r, quarantined = load(tmp_path, "long.jsonl.gz", gzip.compress(data, mtime=0))
    assert (r.records_read, r.loaded, r.quarantined) == (4, 2, 2)
    assert [(line, reason) for line, reason, _ in quarantined] == [
        (2, "line too long to read whole (over 1,048,576 bytes): its size and SHA-256 lead the raw text"),
        (4, "line too long to read whole (over 1,048,576 bytes): its size and SHA-256 lead the raw text"),
    ]
    for (_, _, raw), text in zip(quarantined, (middle, last), strict=True):
        whole = text.encode()
        assert raw.startswith(
            f"[line of {len(whole):,} bytes, SHA-256 {hashlib.sha256(whole).hexdigest()}] {{\"request_id\": \"long-"
        )
        assert len(raw) < 5000
    assert sorted(r for (r,) in con.execute("SELECT request_id FROM requests").fetchall()) == ["r1", "r3"]


def test_a_long_engine_log_line_is_quarantined_on_both_readers(tmp_path, monkeypatch):
    from zoneinfo import ZoneInfo

    from kvforensics.sources.engine_logs.columnar import parse_engine_file_columnar

    monkeypatch.setattr(engine_lines, "MAX_LINE_BYTES", 1 << 20)
    lines = [
        "[2026-08-27 14:00:00] server_args=ServerArgs(model_path='m', context_length=4096, tp_size=1)",
        "[2026-08-27 14:00:01 TP0] " + "q" * 1_500_000,
        "[2026-08-27 14:00:06 TP0] max_total_num_tokens=8192, chunked_prefill_size=8192, context_len=4096",
    ]
    path = tmp_path / "p0.log"
    path.write_text("\n".join(lines) + "\n")
    for parse in (
        parse_engine_file(path, fmt="sglang", instance="p0", tz=ZoneInfo("UTC")),
        parse_engine_file_columnar(path, fmt="sglang", instance="p0", tz=ZoneInfo("UTC")),
    ):
        quarantined = parse.all_quarantined()
        assert [(q.line, q.reason.split(" (")[0]) for q in quarantined] == [(2, "line too long to read whole")]
        assert parse.lines_read == 3
        assert parse.instances["p0"].startups and parse.instances["p0"].startups[0].context_length == 4096


def test_a_long_line_costs_no_more_than_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_lines, "MAX_LINE_BYTES", 1 << 20)
    line = b"w" * 24_000_000
    path = tmp_path / "huge.log"
    path.write_bytes(b"a\n" + line + b"\nb\n")
    tracemalloc.start()
    try:
        got = [(n, text, raw) for n, text, raw in engine_lines.open_lines(path)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, peak
    assert [(n, text) for n, text, _ in got] == [(1, "a"), (2, None), (3, "b")]
    assert isinstance(got[1][2], LongLine)
    assert got[1][2].startswith(f"[line of 24,000,000 bytes, SHA-256 {hashlib.sha256(line).hexdigest()}] www".encode())


def test_a_long_line_of_a_cr_only_file_is_quarantined_too(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_lines, "MAX_LINE_BYTES", 1 << 20)
    long = rec("long", note="v" * 2_000_000)
    con, r, quarantined = load(tmp_path, "mac.jsonl", "\r".join([rec("r1"), long, rec("r3")]).encode() + b"\r")
    assert (r.records_read, r.loaded, r.quarantined) == (3, 2, 1)
    ((line, reason, raw),) = quarantined
    assert line == 2 and reason.startswith("line too long to read whole")
    assert raw.startswith(f"[line of {len(long):,} bytes, SHA-256 {hashlib.sha256(long.encode()).hexdigest()}]")
