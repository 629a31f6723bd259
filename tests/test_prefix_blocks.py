"""Prefix-cache inputs: cache_salt on requests, prompts cut into prefix blocks (request_blocks) from
token ids or words, joining the KV-cache events' block fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.sources.content.prefix_blocks import (
    chain_fingerprint,
    prefix_blocks,
    token_ids,
    word_fingerprint,
)
from kvforensics.sources.kv_events.load import block_fingerprint
from kvforensics.stages.ingest import ingest

KEY = bytes.fromhex("5c" * 32)


def test_blocks_of_token_ids_are_the_kv_event_fingerprints_and_chain_the_prefix():
    a = prefix_blocks(list(range(40)), 16, KEY)
    assert [(p, n) for p, n, _, _ in a] == [(0, 16), (1, 16)]  # only full blocks: 8 tokens left over
    assert a[0][2] == block_fingerprint(list(range(16)), KEY)
    assert a[1][3] == chain_fingerprint(a[0][3], a[1][2], KEY)
    b = prefix_blocks([*range(16), *range(100, 116)], 16, KEY)
    assert b[0] == a[0] and b[1][3] != a[1][3]  # same first block, different second: chains part
    moved = prefix_blocks([*range(100, 116), *range(16, 32)], 16, KEY)
    assert moved[1][2] == a[1][2] and moved[1][3] != a[1][3]  # same block after another prefix: other chain
    assert prefix_blocks(list(range(15)), 16, KEY) == []
    assert prefix_blocks(list(range(40)), 16, bytes(32)) != a  # keyed


def test_word_blocks_use_the_block_message_with_words():
    blocks = prefix_blocks("the quick brown fox".split(), 2, KEY)
    assert blocks[0][2] == word_fingerprint(["the", "quick"], KEY) != block_fingerprint([1, 2], KEY)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, []),
        ("", []),
        ([1, 2, 3], [1, 2, 3]),
        ("[4, 5]", [4, 5]),
        ([1, -1], None),
        ([1, True], None),
        ([1.5], None),
        ("not json", None),
        ({"a": 1}, None),
    ],
)
def test_token_ids(value, expected):
    assert token_ids(value) == expected


def write_incident(
    root: Path, prefix_cache: str = "", content_rows: list[dict] | None = None, kv_lines: list | None = None
) -> Path:
    requests = [
        {
            "request_id": "r1",
            "ts": "2026-08-28T10:00:00Z",
            "account_id": "a",
            "model": "m",
            "status": 200,
            "prompt_tokens": 40,
            "cached_tokens": 0,
            "prefill_instance": "i0",
            "cache_salt": "salt-a",
        },
        {
            "request_id": "r2",
            "ts": "2026-08-28T10:01:00Z",
            "account_id": "b",
            "model": "m",
            "status": 200,
            "prompt_tokens": 40,
            "cached_tokens": 32,
            "prefill_instance": "i0",
            "cache_salt": " ",
        },
    ]
    root.mkdir(parents=True, exist_ok=True)
    (root / "gateway.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (root / "content.jsonl").write_text("".join(json.dumps(r) + "\n" for r in content_rows or []))
    kv = ""
    if kv_lines is not None:
        (root / "kv").mkdir()
        (root / "kv" / "i0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kv_lines))
        kv = '[[sources]]\nname = "kv"\nkind = "kv_events"\npath = "kv/*.jsonl"\ninstance = "{stem}"\n\n'
    (root / "incident.toml").write_text(f"""[incident]
id = "prefix-blocks-test"

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"

[[sources]]
name = "content"
kind = "content"
path = "content.jsonl"

{kv}{prefix_cache}
""")
    return root / "incident.toml"


def test_ingest_cuts_token_ids_at_the_kv_events_block_size_and_keeps_cache_salt(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORENSICS_HMAC_KEY", KEY.hex())
    ids = list(range(1000, 1040))
    content = [
        {"request_id": "r1", "prompt": "hello there", "output": "hi", "prompt_token_ids": ids},
        {"request_id": "r2", "prompt": "hello again", "output": "hi", "prompt_token_ids": ids[:36]},
        {"request_id": "bad", "prompt": "x", "prompt_token_ids": [1, "two"]},
    ]
    # vLLM KVEventBatch, array form: [ts, [BlockStored(block_hashes, parent, token_ids, block_size, lora_id)]]
    kv = [[1787911200.0, [["BlockStored", [11, 12, 13, 14], None, ids[:32], 8, None]]]]
    incident = load_incident(write_incident(tmp_path, content_rows=content, kv_lines=kv))
    con = connect()
    ingest(con, incident)
    assert con.execute("SELECT request_id, cache_salt FROM requests ORDER BY 1").fetchall() == [
        ("r1", "salt-a"),
        ("r2", None),
    ]
    blocks = con.execute(
        "SELECT request_id, count(*), min(num_tokens), max(num_tokens) FROM request_blocks GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert blocks == [("r1", 5, 8, 8), ("r2", 4, 8, 8)]  # block size from the events: 8
    joined = con.execute("""SELECT count(*) FROM request_blocks b JOIN kv_events k
                            ON k.block_fp = b.block_fp AND k.position = b.position
                            WHERE b.request_id = 'r2'""").fetchall()
    assert joined == [(4,)]
    assert con.execute("SELECT count(DISTINCT chain_fp) FROM request_blocks").fetchall() == [(5,)]
    assert con.execute("SELECT reason FROM quarantine WHERE source = 'content'").fetchall() == [
        ("prompt_token_ids is not a list of non-negative integer token ids",)
    ]
    notes = con.execute("SELECT notes FROM load_report WHERE kind = 'content'").fetchall()[0][0]
    assert "prompt token ids cut into prefix blocks of 8" in notes


def test_words_are_cut_only_when_the_incident_asks_for_prefix_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORENSICS_HMAC_KEY", KEY.hex())
    words = " ".join(f"w{i}" for i in range(10))
    content = [
        {"request_id": "r1", "prompt": words, "output": "o"},
        {"request_id": "r2", "prompt": words + " more", "output": "o"},
    ]
    con = connect()
    ingest(con, load_incident(write_incident(tmp_path / "off", content_rows=content)))
    assert con.execute("SELECT count(*) FROM request_blocks").fetchall() == [(0,)]
    con = connect()
    ingest(con, load_incident(write_incident(tmp_path / "on", "[prefix_cache]\nblock_size = 4\n", content)))
    assert con.execute("SELECT request_id, count(*) FROM request_blocks GROUP BY 1 ORDER BY 1").fetchall() == [
        ("r1", 2),
        ("r2", 2),
    ]
    assert con.execute("SELECT count(DISTINCT chain_fp) FROM request_blocks").fetchall() == [(2,)]
    con = connect()
    ingest(con, load_incident(write_incident(tmp_path / "no_words", "[prefix_cache]\nword_blocks = false\n", content)))
    assert con.execute("SELECT count(*) FROM request_blocks").fetchall() == [(0,)]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("block_size = 0", "block_size must be from 1 to 1000000 tokens, got 0"),
        ('block_size = "16"', "'block_size' must be an integer (tokens per block), got a string"),
        ("word_blocks = 1", "'word_blocks' must be true or false, got an integer"),
        ("block = 16", "unknown key 'block'"),
    ],
)
def test_prefix_cache_table_is_checked(tmp_path, table, message):
    path = write_incident(tmp_path, f"[prefix_cache]\n{table}\n")
    with pytest.raises(ConfigError) as e:
        load_incident(path)
    assert message in str(e.value) and "[prefix_cache]" in str(e.value)
