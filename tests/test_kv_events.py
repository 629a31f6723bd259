"""KV-cache events as an input: both encodings of vLLM and SGLang batches, every refusal quarantined
with its reason, token ids kept only as keyed fingerprints."""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import json
import shutil
import struct
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import load_incident
from kvforensics.core.db import connect, run_script
from kvforensics.core.errors import ConfigError
from kvforensics.sources.common.chain import chain_fingerprint
from kvforensics.sources.content.prefix_blocks import prefix_blocks
from kvforensics.sources.kv_events.load import (
    FIELDS,
    Chains,
    block_fingerprint,
    canonical_hash,
    load_kv_events,
)

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"
KEY = bytes.fromhex("a7" * 32)


def kv_source(tmp_path: Path, path: str = "events/*.jsonl*", extra: str = ""):
    (tmp_path / "incident.toml").write_text(f"""[incident]
id = "kv-events-test"
title = "kv events"

[[sources]]
name = "kv"
kind = "kv_events"
path = "{path}"
{extra}

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"
format = "jsonl"
""")
    return load_incident(tmp_path / "incident.toml").sources[0]


def load_lines(tmp_path: Path, lines: list, name: str = "e0.jsonl", extra: str = "", key: bytes = KEY):
    folder = tmp_path / "events"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    source = kv_source(tmp_path, extra=extra)
    con = connect()
    return con, load_kv_events(con, source, path, key)


def rows(
    con,
    sql: str = "SELECT * EXCLUDE (source, source_file) FROM kv_events ORDER BY source_line, seq, "
    "position NULLS LAST, block_hash",
) -> list[dict]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def load_fixture(tmp_path: Path, name: str, key: bytes = KEY):
    folder = tmp_path / "events"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / name, folder / name)
    con = connect()
    return con, load_kv_events(con, kv_source(tmp_path), folder / name, key)


def test_vllm_first_array_form(tmp_path):
    con, load = load_fixture(tmp_path, "vllm-0.9-array.jsonl")
    assert (load.records_read, load.loaded, load.quarantined) == (4, 4, 0)
    got = rows(con)
    assert [(r["kind"], r["block_hash"], r["parent_block_hash"], r["position"], r["num_tokens"]) for r in got] == [
        ("stored", "-4611686018427387904", None, 0, 4),
        ("stored", "1311768467294899695", "-4611686018427387904", 1, 4),
        ("stored", "7", "1311768467294899695", 2, 3),  # the next batch continues the chain; a partial block
        ("removed", "-4611686018427387904", None, None, None),
        ("cleared", None, None, None, None),
    ]
    assert {r["instance"] for r in got} == {"vllm-0.9-array"}
    assert {r["dp_rank"] for r in got} == {None}
    assert str(got[0]["ts"]) == "2025-09-09 06:40:00.250000+00:00"
    assert [r["batch"] for r in got] == [1, 1, 2, 2, 3] and [r["seq"] for r in got] == [0, 0, 0, 1, 0]
    assert got[0]["block_fp"] == block_fingerprint([101, 102, 103, 104], KEY)
    assert got[2]["block_fp"] == block_fingerprint([109, 110, 111], KEY)


def test_vllm_array_with_lora_salt_and_group(tmp_path):
    con, _ = load_fixture(tmp_path, "vllm-0.11-array.jsonl")
    stored = rows(con, "SELECT * FROM kv_events WHERE kind = 'stored' ORDER BY position")
    assert [(r["lora"], r["salt"], r["medium"], r["kv_group"], r["dp_rank"]) for r in stored] == [
        ("adapter-a", "salt-tenant-a", "GPU", 0, 0),
        ("adapter-a", "salt-tenant-a", "GPU", 0, 0),
    ]
    assert stored[0]["block_hash"] == "89a1a98e709fa672374b463bbd8d5946ff4f530c5e65be07bf17ef8473ec96e9"
    assert stored[1]["parent_block_hash"] == stored[0]["block_hash"]


def test_vllm_object_form_base64_hashes_and_inherited_salt(tmp_path):
    con, load = load_fixture(tmp_path, "vllm-object.jsonl")
    assert (load.records_read, load.loaded) == (4, 4)
    got = rows(con)
    assert [(r["kind"], r["position"], r["salt"], r["dp_rank"]) for r in got] == [
        ("stored", 0, "salt-tenant-b", 1),
        ("stored", 1, "salt-tenant-b", 1),  # the salt is on the first block only; its child inherits it
        ("removed", None, None, 1),
        ("cleared", None, None, 1),
    ]
    first = base64.b64decode(
        json.loads((FIXTURES / "vllm-object.jsonl").read_text().splitlines()[0])["events"][0]["block_hashes"][0]
    ).hex()
    assert got[0]["block_hash"] == first and got[1]["parent_block_hash"] == first


def test_sglang_metadata_salt_and_equal_tokens_equal_fingerprints(tmp_path):
    con, _ = load_fixture(tmp_path, "sglang-0.5.18-array.jsonl")
    got = rows(con, "SELECT * FROM kv_events WHERE kind = 'stored' ORDER BY block_hash")
    by_hash = {r["block_hash"]: r for r in got}
    assert by_hash["900001"]["salt"] is None and by_hash["900101"]["salt"] == "salt-tenant-c"
    assert by_hash["900102"]["medium"] == "CPU_PINNED" and by_hash["900102"]["num_tokens"] == 2
    # the same tokens stored unsalted and salted: two hashes, one fingerprint (a shared prefix)
    assert by_hash["900001"]["block_fp"] == by_hash["900101"]["block_fp"]
    assert by_hash["900002"]["block_fp"] != by_hash["900001"]["block_fp"]


def test_fingerprints_are_keyed():
    tokens = [11, 22, 33, 44]
    assert block_fingerprint(tokens, KEY) == block_fingerprint(list(tokens), KEY)
    assert block_fingerprint(tokens, KEY) != block_fingerprint(tokens, bytes.fromhex("b8" * 32))
    assert block_fingerprint(tokens, KEY) != block_fingerprint([11, 22, 33, 45], KEY)
    assert 0 <= block_fingerprint(tokens, KEY) < 2**63


def test_fingerprints_in_the_database_follow_the_key(tmp_path):
    a, _ = load_fixture(tmp_path / "a", "vllm-0.9-array.jsonl")
    b, _ = load_fixture(tmp_path / "b", "vllm-0.9-array.jsonl", key=bytes.fromhex("b8" * 32))
    query = "SELECT block_fp FROM kv_events WHERE kind = 'stored' ORDER BY source_line, position"
    fa, fb = a.execute(query).fetchall(), b.execute(query).fetchall()
    assert len(fa) == 3 and all(x != y for x, y in zip(fa, fb, strict=True))


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (42, "42"),
        (-7, "-7"),
        ("0x2a", "42"),
        ("0X2A", "42"),
        ("ABCDEF01", "abcdef01"),
        (base64.b64encode(bytes(range(32))).decode(), bytes(range(32)).hex()),
        (2**200, str(2**200)),
    ],
)
def test_hash_forms(value, text):
    assert canonical_hash(value) == text


TOKENS = [5, 6, 7, 8]
STORED = ["BlockStored", [1], None, TOKENS, 4, None]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "malformed JSON"),
        ([1.0], "a batch array has 1 items"),
        ("42", "a batch must be a JSON array"),
        ([1.0, {"a": 1}], "the batch's events are an object, not a list"),
        (["yesterday", [STORED]], "event 0: the batch's timestamp \"yesterday\" is not epoch seconds"),
        ([float("nan"), [STORED]], "is not epoch seconds"),
        ([1.0, [STORED], -1], "dp rank -1 is not a non-negative 32-bit integer"),
        ([1.0, [STORED], 2**40], "dp rank 1099511627776 is not a non-negative 32-bit integer"),
        ([1.0, [["BlockRemoved", [1], "GPU", 2**40]]], "group_idx 1099511627776 is out of range"),
        ([1.0, [["BlockEvicted", [1]]]], "event 0: unknown event tag \"BlockEvicted\""),
        ([1.0, [[7, [1]]]], "must start with its tag"),
        ([1.0, ["BlockStored"]], "an event must be an array or object, not a string"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 4]]], "BlockStored with 4 fields; expected 5 to 11 (wrong arity)"),
        ([1.0, [["BlockRemoved"]]], "BlockRemoved with 0 fields; expected 1 to 3 (wrong arity)"),
        ([1.0, [["AllBlocksCleared", 1]]], "AllBlocksCleared with 1 fields; expected 0 (wrong arity)"),
        ([1.0, [{"block_hashes": [1]}]], "needs its tag in \"type\""),
        ([1.0, [{"type": "BlockStored", "block_hashes": [1]}]], "BlockStored lacks field(s) token_ids, block_size"),
        (
            [
                1.0,
                [{"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS, "block_size": 4, "cache_salt": 7}],
            ],
            "cache_salt 7 is not a string",
        ),
        ([1.0, [["BlockStored", [1], None, TOKENS, -4, None]]], "block_size -4 is not positive (negative size)"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 0, None]]], "block_size is 0"),
        ([1.0, [["BlockStored", [1], None, TOKENS, "4", None]]], "block_size \"4\" is not an integer"),
        ([1.0, [["BlockStored", [], None, [], 4, None]]], "block_hashes must be a non-empty list"),
        ([1.0, [["BlockStored", [1.5], None, TOKENS, 4, None]]], "block hash 1.5 is not an integer, hex or base64"),
        ([1.0, [["BlockStored", ["zz!"], None, TOKENS, 4, None]]], "block hash \"zz!\" is not"),
        ([1.0, [["BlockStored", [1], True, TOKENS, 4, None]]], "block hash true is not"),
        ([1.0, [["BlockStored", [1], None, [5, "6", 7, 8], 4, None]]], "token_ids must be a list of integers"),
        ([1.0, [["BlockStored", [1], None, [5, -6, 7, 8], 4, None]]], "token_ids holds a negative token id"),
        ([1.0, [["BlockStored", [1], None, TOKENS + TOKENS, 4, None]]], "token_ids holds 8 ids for 1 block(s)"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 4, -1]]], "negative lora_id -1"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 4, None, 3]]], "medium 3 is not a string"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 4, None, "GPU", None, [None, None]]]], "extra_keys must be a list"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 4, None, "GPU", None, None, -2]]], "negative group_idx -2"),
        ([1.0, [["BlockStored", [1], None, TOKENS, 4, None, "GPU", {"cache_salt": 5}]]], "metadata.cache_salt 5"),
    ],
)
def test_every_refusal_is_quarantined_with_its_reason(tmp_path, line, reason):
    good = [2.0, [["BlockRemoved", [9]]]]
    con, load = load_lines(tmp_path, [good, line, good])
    assert load.loaded == 2 and load.quarantined == 1 and load.records_read == 3
    ((qline, qreason, raw),) = con.execute("SELECT line, reason, raw FROM quarantine").fetchall()
    assert qline == 2 and reason in qreason, qreason
    assert raw is None or "5, 6" not in raw and "5,6" not in raw  # token ids never shown


def test_a_bad_batch_quarantines_each_of_its_events(tmp_path):
    con, load = load_lines(tmp_path, [["noon", [STORED, ["BlockRemoved", [1]], ["AllBlocksCleared"]]]])
    assert (load.records_read, load.loaded, load.quarantined) == (3, 0, 3)
    assert [r[0] for r in con.execute("SELECT reason FROM quarantine ORDER BY reason").fetchall()] == [
        f"event {i}: the batch's timestamp \"noon\" is not epoch seconds or ISO 8601" for i in range(3)
    ]


def test_one_bad_event_does_not_cost_its_batch(tmp_path):
    con, load = load_lines(tmp_path, [[1.0, [STORED, ["Nope"], ["BlockRemoved", [1]]]]])
    assert (load.loaded, load.quarantined) == (2, 1)
    assert rows(con, "SELECT kind FROM kv_events ORDER BY seq") == [{"kind": "stored"}, {"kind": "removed"}]


def test_token_ids_never_reach_the_database_file(tmp_path):
    secret = [914_207, 733_151, 802_919, 655_003]
    lines = [
        [1757400000.0, [["BlockStored", [77], None, secret, 4, None]]],
        [1757400001.0, [["BlockStored", [78], 77, secret, 4, "x"]]],  # quarantined: lora_id "x"
        "[1757400002.0, [[\"BlockStored\", [79], null, " + json.dumps(secret) + ", 4, nul",  # malformed
        [1757400003.0, [["BlockStored", [80], None, secret + secret, 4, None]]],
    ]  # quarantined: arity
    folder = tmp_path / "events"
    folder.mkdir()
    (folder / "e0.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    db = tmp_path / "evidence.duckdb"
    con = connect(db)
    load = load_kv_events(con, kv_source(tmp_path), folder / "e0.jsonl", KEY)
    assert (load.loaded, load.quarantined) == (1, 3)
    con.execute("CHECKPOINT")
    con.close()
    data = db.read_bytes()
    for needle in (
        ", ".join(map(str, secret)).encode(),
        ",".join(map(str, secret)).encode(),
        struct.pack("<4i", *secret),
        struct.pack("<4q", *secret),
        str(secret[0]).encode(),
    ):
        assert needle not in data


def test_compressed_files_and_a_truncated_stream(tmp_path):
    text = (FIXTURES / "sglang-0.5.18-array.jsonl").read_bytes()
    folder = tmp_path / "events"
    folder.mkdir()
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(text))
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(text)[:-30])
    source = kv_source(tmp_path)
    con = connect()
    loads = [load_kv_events(con, source, p, KEY) for p in source.files()]
    assert [(x.loaded, x.quarantined) for x in loads[:2]] == [(5, 0), (5, 0)]
    assert loads[2].quarantined >= 1 and any("input ends early" in n for n in loads[2].notes)
    assert {r[0] for r in con.execute("SELECT DISTINCT instance FROM kv_events").fetchall()} == {"a", "b", "c"}


def test_instance_from_a_field_and_from_the_template(tmp_path):
    lines = [{"pod": "prefill-3", "ts": 1.0, "events": [STORED]}, {"ts": 2.0, "events": [STORED]}, [3.0, [STORED]]]
    con, load = load_lines(tmp_path, lines, extra='columns = { instance = "pod" }')
    assert (load.loaded, load.quarantined) == (1, 2)
    assert con.execute("SELECT instance FROM kv_events").fetchall() == [("prefill-3",)]
    assert sorted(r[0] for r in con.execute("SELECT reason FROM quarantine").fetchall()) == [
        "no instance: key 'pod' (columns.instance) is missing or not a string",
        "the batch is an array, so it has no key 'pod' naming the instance (columns.instance)",
    ]
    con, _ = load_lines(tmp_path / "t", [[1.0, [STORED]]], name="node-7.jsonl", extra='instance = "engine-{stem}"')
    assert con.execute("SELECT instance FROM kv_events").fetchall() == [("engine-node-7",)]


def test_nested_keys_clock_offset_and_chains_across_files(tmp_path):
    first = {"batch": {"t": 100.0, "evs": [["BlockStored", [1], None, TOKENS, 4, None]]}, "rank": 2}
    second = {"batch": {"t": 101.0, "evs": [["BlockStored", [2], 1, TOKENS, 4, None]]}, "rank": 2}
    folder = tmp_path / "events"
    folder.mkdir()
    (folder / "p0.1.jsonl").write_text(json.dumps(first) + "\n")
    (folder / "p0.2.jsonl").write_text(json.dumps(second) + "\n")
    source = kv_source(
        tmp_path,
        extra='instance = "p0"\nclock_offset_s = 2.5\n'
        'columns = { ts = "batch.t", events = "batch.evs", dp_rank = "rank" }',
    )
    con = connect()
    chains = Chains()
    for p in source.files():
        load_kv_events(con, source, p, KEY, chains)
    got = rows(con, "SELECT instance, dp_rank, epoch(ts) AS t, position FROM kv_events ORDER BY ts")
    assert got == [
        {"instance": "p0", "dp_rank": 2, "t": 102.5, "position": 0},
        {"instance": "p0", "dp_rank": 2, "t": 103.5, "position": 1},
    ]


def test_config_refuses_other_formats_and_envelope_labels(tmp_path):
    with pytest.raises(ConfigError, match=r"format 'csv' is not one of \['jsonl'\] for kind 'kv_events'"):
        kv_source(tmp_path, extra='format = "csv"')
    with pytest.raises(ConfigError, match="names an envelope label"):
        kv_source(tmp_path, extra='instance = "{label:pod}"')
    with pytest.raises(ConfigError, match="did you mean 'instance'"):
        kv_source(tmp_path, extra='columns = { instanc = "pod" }')


def test_sample_ingest_is_unchanged_by_a_kv_events_source(tmp_path, sample_incident):
    """Ingest-only: the sample with a KV-event source added loads the same requests, start-ups and
    events, and the KV events beside them (load report, no quarantine)."""
    from kvforensics.stages.ingest import ingest

    sample = sample_incident.parent
    folder = tmp_path / "sample"
    shutil.copytree(sample, folder, ignore=shutil.ignore_patterns("ground_truth.json"))
    shutil.copytree(FIXTURES, folder / "kv", ignore=shutil.ignore_patterns("sglang-archive.jsonl", "sglang-37482-*"))
    text = (folder / "incident.toml").read_text()
    plain = load_incident(folder / "incident.toml")
    (folder / "incident.toml").write_text(
        text.replace("[scope]", '[[sources]]\nname = "kv"\nkind = "kv_events"\npath = "kv/*.jsonl"\n\n[scope]', 1)
    )
    with_kv = load_incident(folder / "incident.toml")
    counts = (
        "SELECT (SELECT count(*) FROM requests), (SELECT count(*) FROM capacity), "
        "(SELECT count(*) FROM engine_events), (SELECT count(*) FROM quarantine)"
    )
    a, b = connect(), connect()
    ingest(a, plain)
    ingest(b, with_kv)
    assert a.execute(counts).fetchall() == b.execute(counts).fetchall()
    assert b.execute("SELECT count(*), count(DISTINCT instance) FROM kv_events").fetchall() == [(17, 4)]
    assert b.execute("SELECT sum(loaded), sum(quarantined) FROM load_report WHERE kind = 'kv_events'").fetchall() == [
        (15, 0)
    ]


# --- archives as subscribers write them (issue 26) ---------------------------------------------------------

ARCHIVE_COLUMNS = (
    'columns = { ts = "batch.0", events = "batch.1", dp_rank = "batch.2", instance = "instance", seq = "seq" }'
)
A1, A2, A3, U1 = "7340032118290011001", "-2305843009213693951", "4611686018427387905", "1311768467294899695"
B1, B2, C1 = "-6917529027641081855", "3458764513820540929", "-1152921504606846975"


def load_archive(tmp_path: Path, name: str = "sglang-archive.jsonl", extra: str = ARCHIVE_COLUMNS):
    folder = tmp_path / "events"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / name, folder / name)
    con = connect()
    load = load_kv_events(con, kv_source(tmp_path, extra=extra), folder / name, KEY)
    run_script(con, "kv_event_gaps")
    return con, load


def test_an_archive_line_as_a_subscriber_writes_it_loads(tmp_path):
    """{"recv_ts", "instance", "endpoint", "topic", "seq", "batch": [ts, events, dp_rank]}: every event
    loaded, read through dotted keys that index the batch array; before, each line was quarantined as
    "the batch's events are null, not a list"."""
    con, load = load_archive(tmp_path)
    assert (load.records_read, load.loaded, load.quarantined) == (11, 11, 0)
    got = rows(
        con,
        "SELECT instance, dp_rank, msg_seq, kind, block_hash, medium, salt, epoch(ts) AS t FROM kv_events "
        "WHERE source_line = 1 ORDER BY seq, position",
    )
    assert got == [
        {
            "instance": "sglang-1",
            "dp_rank": 0,
            "msg_seq": 3898,
            "kind": "stored",
            "block_hash": A1,
            "medium": "GPU",
            "salt": "tenant-a",
            "t": 1789380033.0,
        },
        {
            "instance": "sglang-1",
            "dp_rank": 0,
            "msg_seq": 3898,
            "kind": "stored",
            "block_hash": A2,
            "medium": "GPU",
            "salt": "tenant-a",
            "t": 1789380033.0,
        },
        {
            "instance": "sglang-1",
            "dp_rank": 0,
            "msg_seq": 3898,
            "kind": "stored",
            "block_hash": A3,
            "medium": "GPU",
            "salt": "tenant-a",
            "t": 1789380033.0,
        },
    ]
    assert rows(con, "SELECT DISTINCT medium FROM kv_events WHERE medium IS NOT NULL ORDER BY 1") == [
        {"medium": "CPU_PINNED"},
        {"medium": "GPU"},
    ]  # as published
    assert (
        "event shapes seen: BlockStored array of 7 (4), BlockStored array of 8 (4), BlockRemoved array of 3 (2), "
        "AllBlocksCleared array of 1 (1)"
    ) in load.notes
    assert con.execute("SELECT count(*), count(msg_seq) FROM kv_event_messages").fetchall() == [(8, 8)]
    # the same file without the mapping: one record per line, quarantined with the key to map
    con, load = load_archive(tmp_path / "unmapped", extra="")
    assert (load.records_read, load.quarantined) == (8, 8)
    assert con.execute("SELECT DISTINCT reason FROM quarantine").fetchall() == [
        (
            "the batch's events are null, not a list (key 'events'; columns.events says where a message keeps them, "
            "e.g. \"batch.1\")",
        )
    ]


def test_sequence_gaps_and_restarts_land_in_kv_event_gaps(tmp_path):
    """Per (instance, dp rank) in read order: 3900 -> 3904 lost 3 messages; 3904 -> 0 is a restart (the new
    sequence starts at 0: nothing lost); rank 1's 17 -> 18 interleaved with rank 0 is no break."""
    con, _ = load_archive(tmp_path)
    got = rows(
        con,
        "SELECT instance, dp_rank, seq_before, seq_after, missing, epoch(from_ts) AS a, epoch(to_ts) AS b, "
        "kind, regexp_extract(source_file, '[^/]+$') AS file FROM kv_event_gaps ORDER BY to_ts",
    )
    assert got == [
        {
            "instance": "sglang-1",
            "dp_rank": 0,
            "seq_before": 3900,
            "seq_after": 3904,
            "missing": 3,
            "a": 1789380034.0,
            "b": 1789380094.0,
            "kind": "gap",
            "file": "sglang-archive.jsonl",
        },
        {
            "instance": "sglang-1",
            "dp_rank": 0,
            "seq_before": 3904,
            "seq_after": 0,
            "missing": 0,
            "a": 1789380094.0,
            "b": 1789380333.0,
            "kind": "restart",
            "file": "sglang-archive.jsonl",
        },
    ]


def test_a_quarantined_message_is_no_lost_one_and_a_late_restart_is(tmp_path):
    batch = [["BlockRemoved", [1]]]
    lines = [
        {"seq": 5, "b": [1.0, batch]},
        {"seq": 6, "b": ["noon", batch]},  # events quarantined: received
        {"seq": 7, "b": [3.0, batch]},
        {"seq": 7, "b": [3.0, batch]},  # delivered twice: no break
        {"seq": 2, "b": [9.0, batch]},  # restarted, its messages 0 and 1 not in the archive
        {"seq": "x", "b": [10.0, batch]},
    ]  # quarantined: no sequence number to follow
    con, load = load_lines(tmp_path, lines, extra='columns = { ts = "b.0", events = "b.1", seq = "seq" }')
    assert (load.loaded, load.quarantined) == (4, 2)
    assert sorted(r[0] for r in con.execute("SELECT reason FROM quarantine").fetchall()) == [
        "event 0: the batch's timestamp \"noon\" is not epoch seconds or ISO 8601",
        "event 0: the publisher's sequence number \"x\" is not a non-negative integer",
    ]
    run_script(con, "kv_event_gaps")
    assert con.execute("SELECT seq_before, seq_after, missing, kind FROM kv_event_gaps").fetchall() == [
        (7, 2, 2, "restart")
    ]
    # a mapped sequence number missing from a message, or a mapping an array batch cannot have
    con, load = load_lines(
        tmp_path / "m",
        [{"b": [1.0, batch]}, [2.0, batch]],
        extra='columns = { ts = "b.0", events = "b.1", seq = "seq" }',
    )
    assert sorted(r[0] for r in con.execute("SELECT reason FROM quarantine").fetchall()) == [
        "event 0: no sequence number: key 'seq' (columns.seq) is missing",
        "the batch is an array, so it has no key 'seq' holding the publisher's sequence number (columns.seq)",
    ]


def test_chain_fingerprints_match_equal_tokens_across_salts_and_prompt_blocks(tmp_path):
    """tenant-a, tenant-b and an unsalted request stored the same tokens under three chains of hashes
    (SGLang #30827 seeds salted chains from the salt): one chain_fp per prefix, the one request_blocks
    gives the same token ids; a merged store (#31479) is one row per page with its share of the ids."""
    con, _ = load_archive(tmp_path)
    by_hash = {r["block_hash"]: r for r in rows(con, "SELECT * FROM kv_events WHERE kind = 'stored'")}
    expected = prefix_blocks([101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112], 4, KEY)
    assert len({A1, B1, U1}) == 3 and {by_hash[h]["chain_fp"] for h in (A1, B1, U1)} == {expected[0][3]}
    assert by_hash[A2]["chain_fp"] == by_hash[B2]["chain_fp"] == expected[1][3]
    assert by_hash[A3]["chain_fp"] == expected[2][3] == chain_fingerprint(expected[1][3], expected[2][2], KEY)
    assert [(by_hash[h]["position"], by_hash[h]["num_tokens"], by_hash[h]["parent_block_hash"]) for h in (A2, A3)] == [
        (1, 4, A1),
        (2, 4, A2),
    ]
    assert by_hash[A3]["block_fp"] == block_fingerprint([109, 110, 111, 112], KEY)
    assert by_hash[C1]["chain_fp"] is None and by_hash[C1]["position"] is None  # its root is in no file read
    assert by_hash[C1]["block_fp"] == block_fingerprint([201, 202, 203, 204], KEY)
    # the fingerprint of ids as the loader writes them is the reference formula's
    ids = [0, 7, 151_935, 2**40]
    reference = hmac.new(KEY, b"kv-block:" + ",".join(map(str, ids)).encode(), hashlib.sha256).digest()
    assert (
        block_fingerprint(ids, KEY) == int.from_bytes(reference[:8], "big") >> 1 == block_fingerprint(tuple(ids), KEY)
    )
    reference = hmac.new(KEY, b"kv-chain:5:7", hashlib.sha256).digest()
    assert chain_fingerprint(5, 7, KEY) == int.from_bytes(reference[:8], "big") >> 1
    reference = hmac.new(KEY, b"kv-chain::7", hashlib.sha256).digest()
    assert chain_fingerprint(None, 7, KEY) == int.from_bytes(reference[:8], "big") >> 1


def test_sglang_37482_map_events_with_the_salt_as_a_field(tmp_path):
    """From sgl-project/sglang#37482 events are tagged maps, cache_salt and session_id fields of the event,
    fields at their default (null) left out by msgspec's omit_defaults."""
    con, load = load_lines(tmp_path, (FIXTURES / "sglang-37482-map.jsonl").read_text().splitlines())
    assert (load.loaded, load.quarantined) == (5, 0)
    assert "event shapes seen: BlockStored map (3), BlockRemoved map (1), AllBlocksCleared map (1)" in load.notes
    got = rows(con, "SELECT kind, position, salt, medium, lora, chain_fp FROM kv_events ORDER BY source_line, seq")
    chain = prefix_blocks([101, 102, 103, 104, 105, 106, 107, 108], 4, KEY)
    assert got == [
        {"kind": "stored", "position": 0, "salt": "tenant-c", "medium": "GPU", "lora": None, "chain_fp": chain[0][3]},
        {
            "kind": "stored",
            "position": 1,
            "salt": "tenant-c",
            "medium": "CPU_PINNED",
            "lora": None,
            "chain_fp": chain[1][3],
        },
        {"kind": "stored", "position": 0, "salt": None, "medium": "GPU", "lora": None, "chain_fp": chain[0][3]},
        {"kind": "removed", "position": None, "salt": None, "medium": "CPU_PINNED", "lora": None, "chain_fp": None},
        {"kind": "cleared", "position": None, "salt": None, "medium": None, "lora": None, "chain_fp": None},
    ]


UPSTREAM = Path(__file__).parent / "fixtures" / "kv_events_upstream"


@pytest.mark.parametrize("name", sorted(p.name for p in UPSTREAM.glob("*.jsonl")))
def test_every_upstream_stream_loads_whole(tmp_path, name):
    """The engines' published shapes (tests/fixtures/kv_events_upstream/README.md, each cited): nothing
    quarantined, the shapes said, the archives' sequence breaks found, equal ids one chain_fp per prefix."""
    extra = ARCHIVE_COLUMNS if "archive" in name else ""
    folder = tmp_path / "events"
    folder.mkdir()
    shutil.copy(UPSTREAM / name, folder / name)
    con = connect()
    load = load_kv_events(con, kv_source(tmp_path, extra=extra), folder / name, KEY)
    run_script(con, "kv_event_gaps")
    assert load.quarantined == 0 and load.loaded == load.records_read > 0
    assert any(n.startswith("event shapes seen: ") for n in load.notes)
    gaps = con.execute("SELECT kind, seq_before, seq_after, missing FROM kv_event_gaps").fetchall()
    assert gaps == {
        "sglang-archive-seq-gap.jsonl": [("gap", 42, 46, 3)],
        "sglang-archive-restart.jsonl": [("restart", 2, 0, 0)],
    }.get(name, [])
    # every block whose chain starts in the file has the fingerprint of its prefix
    assert con.execute(
        "SELECT count(*) FROM kv_events WHERE position IS NOT NULL AND block_fp IS NOT NULL AND chain_fp IS NULL"
    ).fetchall() == [(0,)]
    if name == "sglang-hicache-salted-mixed.jsonl":  # equal ids under tenant-a, no salt and tenant-b
        assert con.execute(
            "SELECT position, count(DISTINCT block_hash), count(DISTINCT chain_fp) FROM kv_events "
            "GROUP BY position ORDER BY position"
        ).fetchall() == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**70) | st.just(2**33) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELD = st.one_of(JSON, st.integers(-3, 20), st.lists(st.integers(-1, 9), max_size=9), st.sampled_from(["GPU", "0x1f"]))
EVENT = st.one_of(
    JSON,
    st.builds(lambda tag, fields: [tag, *fields], st.sampled_from([*FIELDS, "Other"]), st.lists(FIELD, max_size=12)),
    st.builds(
        lambda tag, fields: {"type": tag, **dict(zip(FIELDS["BlockStored"], fields, strict=False))},
        st.sampled_from([*FIELDS, None]),
        st.lists(FIELD, max_size=11),
    ),
)
BATCH = st.one_of(
    JSON,
    st.builds(
        lambda ts, events: [ts, events], st.one_of(st.floats(), st.integers(), JSON), st.lists(EVENT, max_size=4)
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(BATCH, min_size=1, max_size=4))
def test_any_batch_is_loaded_or_quarantined_never_a_crash(tmp_path, batches):
    lines = [json.dumps(b, allow_nan=True) for b in batches]
    con, load = load_lines(tmp_path, lines)
    assert load.records_read == load.loaded + load.quarantined
    assert con.execute("SELECT count(*) FROM quarantine").fetchall()[0][0] == load.quarantined
    events = con.execute("SELECT count(DISTINCT (source_line, seq)) FROM kv_events").fetchall()[0][0]
    assert events == load.loaded
