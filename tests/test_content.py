"""Content and change-log loaders: fingerprints computed in bulk equal the reference, refused records
are quarantined in batches, and no content text reaches the database."""

from __future__ import annotations

import hmac
import json
from itertools import islice
from pathlib import Path

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import InputError
from kvforensics.core.fingerprint import WINNOW_WINDOW, fingerprint_key, fingerprints
from kvforensics.sources.changes.load import load_changes
from kvforensics.sources.common import records
from kvforensics.sources.content import load as content_loader
from kvforensics.sources.content.load import load_content

KEY = bytes.fromhex("5e" * 32)


def incident(tmp_path: Path, kind: str, name: str, fmt: str = "jsonl") -> tuple:
    path = tmp_path / "incident.toml"
    path.write_text(f"""[incident]
id = "content-test"
title = "content loader"

[[sources]]
name = "{kind}"
kind = "{kind}"
path = "{name}"
format = "{fmt}"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"
format = "jsonl"
""")
    inc = load_incident(path)
    ((source, files),) = [(s, f) for s, f in inc.source_files() if s.kind == kind]
    return source, tmp_path / name


def load_texts(tmp_path: Path, rows: list[dict], key: bytes = KEY, window: int = WINNOW_WINDOW):
    source, path = incident(tmp_path, "content", "content.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    con = connect()
    return con, load_content(con, source, path, key, window=window)


def stored(con, rid: str, part: str) -> set[int]:
    return {
        r[0]
        for r in con.execute(
            "SELECT fp FROM content_fingerprints WHERE request_id = $r AND part = $p", {"r": rid, "p": part}
        ).fetchall()
    }


WORDS = st.sampled_from(
    [
        "the",
        "Merger",
        "closes",
        "NOON",
        "é",
        "İstanbul",
        "straße",
        "ΣΊΣΥΦΟΣ",
        "x_1",
        "42",
        "½",
        "٣",
        "東京",
        "नमस्ते",
        "e\u0301",
        "Kelvin\u212a",
        "😀",
        "—",
        "“quoted”",
        "a-b",
        "\ud800",
    ]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(
        st.one_of(st.lists(WORDS, max_size=30).map(" ".join), st.text(max_size=80)), min_size=1, max_size=12
    ),
    window=st.sampled_from([1, 2, WINNOW_WINDOW, 5, 11]),
)
def test_bulk_fingerprints_equal_the_reference(tmp_path, texts, window):
    """The shingles winnowing keeps (the few words repeat, so their selection hashes tie) and their HMACs."""
    rows = [{"request_id": f"r{i}", "prompt": t, "output": "ok"} for i, t in enumerate(texts)]
    con, load = load_texts(tmp_path, rows, window=window)
    assert load.loaded == len(texts) and load.quarantined == 0
    for i, text in enumerate(texts):
        assert stored(con, f"r{i}", "prompt") == fingerprints(text, KEY, window=window)
    counts = dict(con.execute("SELECT request_id, shingles FROM content_stats WHERE part = 'prompt'").fetchall())
    assert counts == {f"r{i}": len(fingerprints(t, KEY, window=window)) for i, t in enumerate(texts) if t}


@pytest.mark.parametrize("key", [b"k", bytes(range(64)), bytes(range(100))])
def test_keys_of_any_length_give_the_keyed_fingerprints(tmp_path, key):
    text = "one two three four five six seven eight nine ten eleven"
    con, _ = load_texts(tmp_path, [{"request_id": "a", "prompt": text, "output": "Short answer, sir."}], key)
    assert stored(con, "a", "prompt") == fingerprints(text, key)
    assert stored(con, "a", "output") == fingerprints("Short answer, sir.", key)
    keyed = fingerprint_key(key)
    assert len(keyed) == 64 and keyed == hmac.new(
        key, b"kvforensics shingle fingerprint v2", "sha256"
    ).digest() + bytes(32)


def test_batches_do_not_change_the_result(tmp_path, monkeypatch):
    rows = [
        {
            "request_id": f"r{i}",
            "prompt": f"the same eight words and then a number {i} again " * 3,
            "output": "naïve café text with ünïcode words in it, nine or more of them",
        }
        for i in range(30)
    ]
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    con, _ = load_texts(tmp_path / "one", rows)
    monkeypatch.setattr(content_loader, "BATCH_CHARS", 100)
    monkeypatch.setattr(content_loader, "ARROW_ROWS", 3)  # Arrow batches of 3 texts, taken by DuckDB's threads
    small, _ = load_texts(tmp_path / "many", rows)
    query = "SELECT request_id, part, fp FROM content_fingerprints ORDER BY ALL"
    assert con.execute(query).fetchall() == small.execute(query).fetchall()
    query = "SELECT request_id, part, shingles FROM content_stats ORDER BY ALL"
    assert con.execute(query).fetchall() == small.execute(query).fetchall()


def test_an_error_while_fingerprinting_in_the_background_is_raised(tmp_path, monkeypatch):
    rows = [{"request_id": f"r{i}", "prompt": f"words of text number {i}", "output": "ok"} for i in range(20)]
    monkeypatch.setattr(content_loader, "BATCH_CHARS", 50)
    monkeypatch.setattr(content_loader, "fingerprint_script", lambda width, window: "SELECT 'not a width'::INTEGER")
    with pytest.raises(duckdb.ConversionException, match="not a width"):
        load_texts(tmp_path, rows)


def test_a_reading_error_is_the_one_raised_over_a_batch_in_flight(tmp_path, monkeypatch):
    rows = [{"request_id": f"r{i}", "prompt": f"words of text number {i}", "output": "ok"} for i in range(20)]
    read = content_loader.read_records

    def failing(source, path, load):  # two records (a batch of 48 characters, submitted), then an error
        yield from islice(read(source, path, load), 2)
        raise InputError("the input stops here")

    monkeypatch.setattr(content_loader, "read_records", failing)
    monkeypatch.setattr(content_loader, "BATCH_CHARS", 40)
    monkeypatch.setattr(  # every batch fails as well
        content_loader, "fingerprint_script", lambda width, window: "SELECT 'not a width'::INTEGER"
    )
    with pytest.raises(InputError, match="the input stops here"):
        load_texts(tmp_path, rows)


def test_texts_without_words_duplicates_and_chat_messages(tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me the launch code"}]}]
    con, load = load_texts(
        tmp_path,
        [
            {"request_id": "punct", "prompt": "?! ... --", "output": ""},
            {"request_id": "dup", "prompt": "first copy of the record", "output": None},
            {"request_id": "dup", "prompt": "second copy of the record", "output": 17},
            {"request_id": "chat", "prompt": messages, "output": json.dumps(messages)},
        ],
    )
    assert (load.loaded, load.quarantined) == (4, 0)
    stats = sorted(con.execute("SELECT request_id, part, shingles FROM content_stats").fetchall())
    # a text without words counts 0 shingles; an empty or non-text field has no row; both copies of a
    # duplicated id are kept, as the scope counts shingles per text
    assert stats == [
        ("chat", "output", 1),
        ("chat", "prompt", 1),
        ("dup", "prompt", 1),
        ("dup", "prompt", 1),
        ("punct", "prompt", 0),
    ]
    assert stored(con, "dup", "prompt") == (
        fingerprints("first copy of the record", KEY) | fingerprints("second copy of the record", KEY)
    )
    assert (
        stored(con, "chat", "prompt") == stored(con, "chat", "output") == fingerprints("Tell me the launch code", KEY)
    )


def test_refused_records_are_quarantined_in_batches_without_text(tmp_path, monkeypatch):
    monkeypatch.setattr(records.QuarantineRows, "BATCH", 3)
    inserts: list[int] = []  # the rows of each insert into the quarantine
    flush = records.QuarantineRows.flush

    def counted_flush(self: records.QuarantineRows) -> None:
        inserts.append(len(self._lines))
        flush(self)

    monkeypatch.setattr(records.QuarantineRows, "flush", counted_flush)
    source, path = incident(tmp_path, "content", "content.jsonl")
    lines = [
        '{"request_id": "ok", "prompt": "secret words of the customer"}',
        "{not json secret",
        "[1, 2]",
        '{"prompt": "secret without an id"}',
        '{"request_id": "\\ud800", "prompt": "secret"}',
        '{"request_id": "", "output": "secret"}',
        '{"request_id": "ok2", "output": "fine"}',
    ]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'\xff{"request_id": "x"}\n')
    con = connect()
    load = load_content(con, source, path, KEY)
    assert (load.records_read, load.loaded, load.quarantined) == (8, 2, 6)
    got = con.execute("SELECT line, reason, raw FROM quarantine ORDER BY line").fetchall()
    assert got == [
        (2, "malformed JSON", None),
        (3, "not a JSON object", None),
        (4, "missing required field 'request_id'", None),
        (5, "request_id is not valid Unicode (a lone surrogate escape)", None),
        (6, "missing required field 'request_id'", None),
        (8, "not UTF-8", None),
    ]
    assert [n for n in inserts if n] == [3, 3]  # 6 refused records: two inserts of 3
    tables = con.execute("SELECT database_name, schema_name, table_name FROM duckdb_tables()").fetchall()
    assert {"quarantine", "content_fingerprints", "content_stats"} <= {t[2] for t in tables}
    assert not any(
        "secret" in str(v)
        for db, schema, table in tables
        for row in con.execute(f'SELECT * FROM "{db}"."{schema}"."{table}"').fetchall()
        for v in row
    )
    assert con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE 'content_batch%'").fetchall() == [
        (0,)
    ]


def test_changes_from_csv(tmp_path):
    source, path = incident(tmp_path, "changes", "changes.csv", fmt="csv")
    path.write_text(
        "ts,model,instance,description,details\n"
        "2026-09-09T14:05:00Z,m1,pod-1,prefill restarted,kv pool raised\n"
        "1757426700,,,epoch seconds,\n"
        "1e30,,,an epoch beyond any date,\n"
        "yesterday,,,not a time,\n"
        "2026-09-09T15:00:00Z,,,,\n"
        "2026-09-09T16:00:00Z,too,few\n"
    )
    con = connect()
    load = load_changes(con, source, path)
    assert (load.records_read, load.loaded, load.quarantined) == (6, 2, 4)
    assert con.execute(
        "SELECT strftime(ts, '%Y-%m-%d %H:%M'), model, instance, description, details, source_line "
        "FROM changes ORDER BY source_line"
    ).fetchall() == [
        ("2026-09-09 14:05", "m1", "pod-1", "prefill restarted", "kv pool raised", 2),
        ("2025-09-09 14:05", None, None, "epoch seconds", None, 3),
    ]
    assert [r[0] for r in con.execute("SELECT reason FROM quarantine ORDER BY line").fetchall()] == [
        "bad timestamp '1e30'",
        "bad timestamp 'yesterday'",
        "missing required field 'description'",
        "expected 5 fields, found 3",
    ]


def test_changes_from_jsonl_with_unstorable_text(tmp_path):
    source, path = incident(tmp_path, "changes", "changes.jsonl")
    path.write_text(
        '{"ts": "2026-09-09T14:05:00Z", "description": "restart", "model": 7}\n'
        '{"ts": "2026-09-09T14:06:00Z", "description": "bad \\ud800 text"}\n'
    )
    con = connect()
    load = load_changes(con, source, path)
    assert (load.loaded, load.quarantined) == (1, 1)
    assert con.execute("SELECT model, description FROM changes").fetchall() == [("7", "restart")]
    assert con.execute("SELECT line, reason FROM quarantine").fetchall() == [
        (2, "field 'description' is not valid Unicode (a lone surrogate escape)")
    ]
