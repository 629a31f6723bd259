"""Inputs at the edges: huge lines, truncated streams, CR-only line ends, out-of-range UTC offsets,
local times a daylight-saving change makes ambiguous or nonexistent, chat-message prompts."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from datetime import date
from pathlib import Path

import pytest

from kvforensics.config import Source, load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.core.fingerprint import fingerprints, rendered_text
from kvforensics.sources.common.textio import INCOMPLETE_RECORD
from kvforensics.sources.requests.load import dst_days, load_requests_file
from kvforensics.stages.ingest import ingest


def rec(rid: str, **kw) -> str:
    base = {
        "request_id": rid,
        "ts": "2026-08-28T10:00:00Z",
        "account_id": "a1",
        "model": "m",
        "status": 200,
        "prompt_tokens": 100,
    }
    base.update(kw)
    return json.dumps(base)


def source(tmp_path: Path, tz: str = "UTC", ambiguous: str = "reject") -> Source:
    return Source(
        name="gw", kind="requests", path="*", format="jsonl", timezone=tz, base_dir=tmp_path, ambiguous=ambiguous
    )


def load(tmp_path: Path, name: str, data: bytes, **kw):
    path = tmp_path / name
    path.write_bytes(data)
    con = connect()
    result = load_requests_file(con, source(tmp_path, **kw), path)
    quarantined = con.execute("SELECT line, reason, raw FROM quarantine ORDER BY line").fetchall()
    return con, result, quarantined


def test_a_line_longer_than_duckdbs_readers_take_is_loaded(tmp_path):
    # DuckDB's NDJSON reader refuses objects past 16 MB and its line reader raises NotImplementedException
    huge = rec("huge", note="x" * 20_000_000)
    data = "\n".join([rec("r1"), huge, rec("r3"), "{broken"]) + "\n"
    con, r, quarantined = load(tmp_path, "big.jsonl", data.encode())
    assert (r.records_read, r.loaded, r.quarantined) == (4, 3, 1)
    assert r.reader == "python"
    assert [row[:2] for row in quarantined] == [(4, "malformed JSON")]
    assert con.execute("SELECT source_line FROM requests WHERE request_id = 'huge'").fetchone() == (2,)


def test_truncated_gzip_quarantines_its_partial_last_record(tmp_path):
    lines = [rec(f"r{i}", note="abc" * i) for i in range(60)]
    whole = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
    con, r, quarantined = load(tmp_path, "cut.jsonl.gz", whole[:-60])
    assert r.records_read == r.loaded + r.quarantined + r.duplicates
    assert r.quarantined == 1
    ((line, reason, raw),) = quarantined
    assert reason == INCOMPLETE_RECORD
    assert line == r.loaded + 1
    assert lines[line - 1].startswith(raw[:40]) and raw
    assert any("input ends early" in n and "quarantined" in n for n in r.notes)


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("rows", [30, 3000])  # DuckDB's readers, and the Python reader for a small file
def test_a_file_cut_inside_its_last_record_and_written_whole_ends_early(tmp_path, compress, rows):
    """A gateway file copied up to the middle of a record, then compressed whole: no stream ends early, but its
    last line stops inside its JSON. The load says the file ends early there (truncated_file: inconclusive);
    the same line with a mistake inside it, or a cut line before the last, is only quarantined."""
    lines = [rec(f"r{i}") for i in range(rows)]
    for last, cut in ((lines[-1][:50], True), (lines[-1].replace(",", "", 1), False)):
        text = "\n".join([*lines[:-1], last])
        data = gzip.compress(text.encode(), mtime=0) if compress else text.encode()
        _, r, quarantined = load(tmp_path, "cut.jsonl.gz" if compress else "cut.jsonl", data)
        assert [row[:2] for row in quarantined] == [(rows, "malformed JSON")]
        ends = [n for n in r.notes if "ends early" in n]
        assert ends == (
            [
                f"input ends early after line {rows - 1} (its last line, {rows}, is a record cut short: "
                "its JSON stops before the record does, so the file was cut there); later records, if any, "
                "are lost"
            ]
            if cut
            else []
        )
    text = "\n".join([*lines[:5], lines[5][:50], *lines[6:]])
    _, r, quarantined = load(tmp_path, "mid.jsonl", text.encode())
    assert [row[:2] for row in quarantined] == [(6, "malformed JSON")]
    assert not any("ends early" in n for n in r.notes)


def test_cr_only_line_ends_are_lines(tmp_path):
    lines = [rec(f"r{i}") for i in range(200)]
    lines[99] = "{not json"
    con, r, quarantined = load(tmp_path, "mac.jsonl", "\r".join(lines).encode() + b"\r")
    assert (r.records_read, r.loaded, r.quarantined) == (200, 199, 1)
    assert [row[:2] for row in quarantined] == [(100, "malformed JSON")]
    assert con.execute("SELECT max(source_line) FROM requests").fetchone() == (200,)
    assert any("CR only" in n for n in r.notes)


def test_cr_only_gzip_and_crlf_files(tmp_path):
    lines = [rec(f"r{i}") for i in range(30)]
    _, r, _ = load(tmp_path, "mac.jsonl.gz", gzip.compress("\r".join(lines).encode(), mtime=0))
    assert (r.records_read, r.loaded) == (30, 30)
    _, r, _ = load(tmp_path, "dos.jsonl", ("\r\n".join(lines) + "\r\n").encode())
    assert (r.records_read, r.loaded) == (30, 30)
    assert not any("CR only" in n for n in r.notes)


@pytest.mark.parametrize(
    "stamp, ok",
    [
        ("2026-08-28T10:00:00+25:00", False),
        ("2026-08-28T10:00:00-14:30", False),
        ("2026-08-28T10:00:00+05:60", False),
        ("2026-08-28T10:00:00+9900", False),
        ("2026-08-28T10:00:00+14:00", True),
        ("2026-08-28T10:00:00-14:00", True),
        ("2026-08-28T10:00:00+0530", True),
        ("2026-08-28T10:00:00Z", True),
    ],
)
def test_utc_offsets_are_range_checked(tmp_path, stamp, ok):
    _, r, quarantined = load(tmp_path, "off.jsonl", (rec("r", ts=stamp) + "\n").encode())
    assert r.loaded == int(ok)
    if not ok:
        assert quarantined[0][1] == f"timestamp offset is outside -14:00..+14:00: '{stamp}'"


DST_LINES = [
    rec("fall", ts="2026-11-01 01:30:00"),  # New York: 01:00-02:00 happens twice (EDT, then EST)
    rec("spring", ts="2026-03-08 02:30:00"),  # New York: 02:00-03:00 does not exist
    rec("summer", ts="2026-06-01 12:00:00"),
    rec("edge", ts="2026-11-01 00:59:59"),  # just before the repeated hour: one meaning
]


def test_dst_ambiguous_and_nonexistent_local_times_are_rejected_by_default(tmp_path):
    con, r, quarantined = load(tmp_path, "dst.jsonl", ("\n".join(DST_LINES) + "\n").encode(), tz="America/New_York")
    assert (r.loaded, r.quarantined) == (2, 2)
    assert [q[0] for q in quarantined] == [1, 2]
    assert "'2026-11-01 01:30:00' is ambiguous in America/New_York" in quarantined[0][1]
    assert "'2026-03-08 02:30:00' does not exist in America/New_York" in quarantined[1][1]
    assert 'set ambiguous = "earlier" or "later"' in quarantined[0][1]
    assert any(
        n.startswith("1 local time(s) ambiguous in America/New_York (first at line 1): quarantined") for n in r.notes
    )
    got = dict(con.execute("SELECT request_id, strftime(ts AT TIME ZONE 'UTC', '%H:%M:%S') FROM requests").fetchall())
    assert got == {"summer": "16:00:00", "edge": "04:59:59"}


@pytest.mark.parametrize("choice, fall, spring", [("earlier", "05:30", "06:30"), ("later", "06:30", "07:30")])
def test_dst_resolution_is_configurable(tmp_path, choice, fall, spring):
    con, r, _ = load(
        tmp_path, "dst.jsonl", ("\n".join(DST_LINES) + "\n").encode(), tz="America/New_York", ambiguous=choice
    )
    assert (r.loaded, r.quarantined) == (4, 0)
    got = dict(con.execute("SELECT request_id, strftime(ts AT TIME ZONE 'UTC', '%H:%M') FROM requests").fetchall())
    assert (got["fall"], got["spring"], got["summer"]) == (fall, spring, "16:00")
    assert any(f"read as the {choice} of the two UTC instants" in n for n in r.notes)


def test_dst_half_hour_shift_and_the_python_reader(tmp_path):
    # Lord Howe Island moves its clocks by 30 minutes (+11:00 <-> +10:30; back on 2026-04-05 at 02:00);
    # CR line ends send the file to the Python reader, which types it with the same SQL
    lines = [rec("howe", ts="2026-04-05 01:45:00"), rec("after", ts="2026-04-05 02:15:00")]
    con, r, _ = load(tmp_path, "howe.jsonl", "\r".join(lines).encode(), tz="Australia/Lord_Howe", ambiguous="later")
    assert r.reader == "python" and r.loaded == 2
    got = dict(con.execute("SELECT request_id, strftime(ts AT TIME ZONE 'UTC', '%d %H:%M') FROM requests").fetchall())
    assert got == {"howe": "04 15:15", "after": "04 15:45"}


def incident_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "incident.toml"
    path.write_text(f"""[incident]
id = "edge-test"
title = "inputs at the edges"

[[sources]]
name = "content"
kind = "content"
path = "content.jsonl"
format = "jsonl"

[[sources]]
name = "gw"
kind = "requests"
path = "gw.jsonl"
format = "jsonl"
timezone = "Europe/Berlin"
{extra}
""")
    return path


def test_ambiguous_is_a_checked_source_key(tmp_path):
    assert next(s for s in load_incident(incident_file(tmp_path)).sources if s.name == "gw").ambiguous == "reject"
    loaded = load_incident(incident_file(tmp_path, 'ambiguous = "later"'))
    assert next(s for s in loaded.sources if s.name == "gw").ambiguous == "later"
    with pytest.raises(ConfigError, match="ambiguous 'first' is not one of"):
        load_incident(incident_file(tmp_path, 'ambiguous = "first"'))
    content_too = incident_file(tmp_path)
    content_too.write_text(
        content_too.read_text().replace('format = "jsonl"\n', 'format = "jsonl"\nambiguous = "later"\n', 1)
    )
    with pytest.raises(ConfigError, match="applies to kind \"requests\" only"):
        load_incident(content_too)


def test_rendered_text_of_chat_messages():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the launch code?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                {"type": "text", "text": "Answer in French."},
            ],
        },
    ]
    assert rendered_text(messages) == "Be brief.\n\nWhat is the launch code?\n\nAnswer in French."
    assert rendered_text(json.dumps(messages)) == rendered_text(messages)
    assert rendered_text([{"type": "text", "text": "parts only"}]) == "parts only"
    assert rendered_text("[not json") == "[not json"
    assert rendered_text("plain") == "plain"
    assert rendered_text([{"role": "user", "content": ""}]) is None
    assert rendered_text({"role": "user"}) is None
    assert rendered_text(17) is None


def test_chat_message_prompts_are_fingerprinted(tmp_path, monkeypatch):
    key = "ab" * 32
    monkeypatch.setenv("KVFORENSICS_HMAC_KEY", key)
    secret = "the quarterly merger with Globex closes on the ninth of March at noon sharp"
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": secret}]},
    ]
    lines = [
        json.dumps({"request_id": "c1", "prompt": messages, "output": "ok"}),
        json.dumps({"request_id": "c2", "prompt": "x", "output": f"Sure: {secret}."}),
        json.dumps({"request_id": "c3", "prompt": json.dumps(messages), "output": "ok"}),
    ]
    (tmp_path / "content.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "gw.jsonl").write_text(rec("c1") + "\n")
    con = connect()
    ingest(con, load_incident(incident_file(tmp_path)))

    def fps(rid: str, part: str) -> set[int]:
        return {
            r[0]
            for r in con.execute(
                "SELECT fp FROM content_fingerprints WHERE request_id = $r AND part = $p", {"r": rid, "p": part}
            ).fetchall()
        }

    prompt = fps("c1", "prompt")
    assert prompt == fingerprints(rendered_text(messages) or "", bytes.fromhex(key))
    # an output quoting the secret (15 words: longer than winnowing's guarantee) shares a fingerprint with it
    assert prompt & fps("c2", "output")
    assert fps("c3", "prompt") == prompt


def test_truncated_content_stream_quarantines_its_partial_record(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORENSICS_HMAC_KEY", "cd" * 32)
    lines = [json.dumps({"request_id": f"c{i}", "prompt": "some words " * 20, "output": "ok"}) for i in range(40)]
    whole = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
    (tmp_path / "content.jsonl.gz").write_bytes(whole[:-50])
    (tmp_path / "gw.jsonl").write_text(rec("c1") + "\n")
    path = incident_file(tmp_path)
    path.write_text(path.read_text().replace('path = "content.jsonl"', 'path = "content.jsonl.gz"'))
    con = connect()
    result = ingest(con, load_incident(path))
    content = next(f for f in result.files if f.source == "content")
    assert content.quarantined == 1 and content.records_read == content.loaded + 1
    assert con.execute("SELECT reason FROM quarantine WHERE source = 'content'").fetchall() == [(INCOMPLETE_RECORD,)]


CSV_HEADER = "request_id,ts,account_id,model,status,prompt_tokens,note"


def csv_rows(n: int) -> list[str]:
    return [f"r{i},2026-08-28T10:00:00Z,a1,m,200,{i},row {i}" for i in range(n)]


def load_csv(tmp_path: Path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    con = connect()
    result = load_requests_file(con, replace(source(tmp_path), format="csv"), path)
    return con, result, con.execute("SELECT line, reason FROM quarantine ORDER BY line").fetchall()


def test_csv_truncated_gzip_cr_only_and_huge_cells(tmp_path):
    rows = csv_rows(120)
    whole = gzip.compress(("\n".join([CSV_HEADER, *rows]) + "\n").encode(), mtime=0)
    _, r, quarantined = load_csv(tmp_path, "cut.csv.gz", whole[:-40])
    assert quarantined[-1] == (r.loaded + 2, INCOMPLETE_RECORD)  # the header is line 1
    assert r.records_read == r.loaded + r.quarantined and r.quarantined == 1

    rows[9] = "bad,row"
    con, r, quarantined = load_csv(tmp_path, "mac.csv", "\r".join([CSV_HEADER, *rows]).encode())
    assert (r.records_read, r.loaded, quarantined) == (120, 119, [(11, "expected 7 fields, found 2")])

    rows = csv_rows(3)
    rows[1] = rows[1].replace("row 1", '"' + "y" * 300_000 + '"')  # past the csv module's default cell limit
    _, r, quarantined = load_csv(tmp_path, "wide.csv", ("\n".join([CSV_HEADER, *rows]) + "\n").encode())
    assert (r.records_read, r.loaded, quarantined) == (3, 3, [])


def test_only_records_near_an_offset_change_are_checked(tmp_path):
    assert dst_days("UTC") == [date(1, 1, 1)]
    berlin = set(dst_days("Europe/Berlin"))
    assert {date(2026, 3, 29), date(2026, 10, 25)} <= berlin and date(2026, 7, 1) not in berlin
    # Samoa skipped 2011-12-30 when it moved across the date line: a whole day that does not exist
    con, r, quarantined = load(
        tmp_path, "apia.jsonl", (rec("gone", ts="2011-12-30 12:00:00") + "\n").encode(), tz="Pacific/Apia"
    )
    assert r.loaded == 0 and "does not exist in Pacific/Apia" in quarantined[0][1]
