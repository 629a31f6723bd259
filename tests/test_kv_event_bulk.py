"""The bulk reader of KV-event files gives the rows the Python reference gives: kv_events, kv_event_messages,
kv_event_gaps and the quarantine, line for line, on every fixture, on generated archives in the engines'
shapes (damaged the ways archives are, several files whose chains run on from one to the next), on
compressed and truncated files and on any batch hypothesis writes."""

from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kv_events import kv_source

from kvforensics.core.db import connect, run_script
from kvforensics.simulate.sources.kv_event_streams import COLUMNS, SHAPES, Stream, lines
from kvforensics.sources.kv_events.bulk import read_bulk
from kvforensics.sources.kv_events.chains import Chains
from kvforensics.sources.kv_events.load import load_kv_events
from kvforensics.sources.kv_events.reference import FIELDS, read_reference

FIXTURES = Path(__file__).parent / "fixtures"
KEY = bytes.fromhex("a7" * 32)
ARCHIVE = COLUMNS["sglang-archive"]
TABLES = ("kv_events", "kv_event_messages", "kv_event_gaps", "quarantine")


def source(tmp_path: Path, columns: dict[str, str] | None = None, extra: str = ""):
    mapped = "columns = { " + ", ".join(f'{k} = "{v}"' for k, v in columns.items()) + " }" if columns else ""
    return kv_source(tmp_path, extra=f"{mapped}\n{extra}")


def rows(con) -> dict[str, list[tuple]]:
    return {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}


def both(tmp_path: Path, files: list[Path], columns: dict[str, str] | None = None, extra: str = ""):
    """Each file loaded by the reference into one database and by the bulk reader into another, chains
    carried from file to file in each: (reference loads, bulk loads, reference rows, bulk rows)."""
    src = source(tmp_path, columns, extra)
    ref, bulk = connect(), connect()
    ref_chains, bulk_chains = Chains(), Chains()
    ref_loads = [read_reference(ref, src, p, KEY, ref_chains) for p in files]
    bulk_loads = [read_bulk(bulk, src, p, KEY, bulk_chains, 0) for p in files]
    for con in (ref, bulk):
        run_script(con, "kv_event_gaps")
    return ref_loads, bulk_loads, rows(ref), rows(bulk)


def assert_agree(tmp_path: Path, files: list[Path], columns: dict[str, str] | None = None, extra: str = ""):
    ref_loads, bulk_loads, ref_rows, bulk_rows = both(tmp_path, files, columns, extra)
    for table in TABLES:
        assert bulk_rows[table] == ref_rows[table], table
    for r, b in zip(ref_loads, bulk_loads, strict=True):
        assert not isinstance(b, str), b
        assert (b.records_read, b.loaded, b.quarantined) == (r.records_read, r.loaded, r.quarantined)
        assert b.notes[1:] == r.notes and b.notes[0].startswith("read in bulk by DuckDB")
    return bulk_loads, bulk_rows


def write(tmp_path: Path, name: str, text_lines: list[str]) -> Path:
    folder = tmp_path / "events"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join(line + "\n" for line in text_lines))
    return path


@pytest.mark.parametrize("fixture", sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("kv_events*/*.jsonl")))
def test_every_fixture_is_read_in_bulk_with_the_references_rows(tmp_path, fixture):
    path = tmp_path / "events" / Path(fixture).name
    path.parent.mkdir()
    shutil.copy(FIXTURES / fixture, path)
    loads, _ = assert_agree(tmp_path, [path], ARCHIVE if "archive" in fixture else None)
    assert loads[0].notes[0] == "read in bulk by DuckDB"  # the engines' own shapes: no line left to the reference


@pytest.mark.parametrize("shape", SHAPES)
def test_generated_archives_agree_and_chains_run_on_across_files(tmp_path, shape):
    files = [
        write(tmp_path, f"engine-0.{i}.jsonl", list(lines(Stream(shape, 400, seed=11 + i, capacity=300))))
        for i in range(2)
    ]
    loads, got = assert_agree(tmp_path, files, COLUMNS[shape] or None, 'instance = "engine-0"')
    assert all(load.notes[0] == "read in bulk by DuckDB" for load in loads)
    stored = [r for r in got["kv_events"] if r[5] == "stored"]  # kind; position is column 8
    assert stored and sum(r[8] is not None and r[8] > 0 for r in stored) > len(stored) / 2  # chains followed


@pytest.mark.parametrize("shape", SHAPES)
def test_damaged_archives_agree_line_for_line(tmp_path, shape):
    """Cut lines, not JSON, unknown events, unreadable timestamps and ranks, wrong arities and sizes, sequence
    numbers sent twice or skipped, hashes as hex, base64 and 0x text, escapes, trailing commas, keys twice."""
    files = [
        write(tmp_path, f"engine-0.{i}.jsonl", list(lines(Stream(shape, 500, seed=5 + i, damage=0.2))))
        for i in range(2)
    ]
    loads, got = assert_agree(tmp_path, files, COLUMNS[shape] or None, 'instance = "engine-0"')
    assert all("outside its shapes read by the Python reference" in load.notes[0] for load in loads)
    assert got["quarantine"]
    if shape == "sglang-archive":
        assert {r[-1] for r in got["kv_event_gaps"]} == {"gap", "restart"}


def test_keys_written_twice_and_lenient_json_go_to_the_reference(tmp_path):
    good = {"recv_ts": "x", "instance": "sglang-1", "seq": 1, "batch": [1.0, [["BlockRemoved", [7], "GPU"]], 0]}
    text = [
        json.dumps(good),
        json.dumps(good)[:-1] + ', "seq": 9}',  # Python reads the last seq, DuckDB the first
        '{"recv_ts": "x", "instance": "sglang-1", "seq": 2, "batch": [2.0, [{"type": "BlockRemoved", '
        '"block_hashes": [8], "block_hashes": [1]}], 0]}',  # Python reads the last block_hashes
        '{"recv_ts": "x", "instance": "sglang-1", "seq": 3, "batch": [3.0, [["BlockRemoved", [9], "GPU"],], 0]}',
        '{"recv_ts": "x", "instance": "sglang-1", "seq": 4, "batch": [nan, [["BlockRemoved", [9], "GPU"]], 0]}',
        '{"recv_ts": "x", "instance": "sglang-1", "seq": 5, "batch": [NaN, [["BlockRemoved", [9], "GPU"]], 0]}',
        '{"recv_ts": "x", "instance": "sglang-\\u0031", "seq": 6, "batch": [6.0, [["BlockRemoved", [9], "GPU"]], 0]}',
        '{"type": "BlockRemoved", "type": "AllBlocksCleared"}',
        "[" + "9" * 5000 + ", []]",
    ]
    loads, got = assert_agree(tmp_path, [write(tmp_path, "a.jsonl", text)], ARCHIVE)
    assert loads[0].notes[0] == "read in bulk by DuckDB; 8 line(s) outside its shapes read by the Python reference"


def test_a_map_with_a_key_twice(tmp_path):
    text = [
        '[1.0, [{"type": "BlockRemoved", "block_hashes": [8], "block_hashes": [9]}]]',
        '[2.0, [{"type": "BlockRemoved", "block_hashes": [8]}, ["BlockRemoved", [10]]]]',
    ]
    loads, got = assert_agree(tmp_path, [write(tmp_path, "a.jsonl", text)])
    assert sorted(r[6] for r in got["kv_events"]) == ["10", "8", "9"]  # block_hash: the map's last block_hashes
    assert loads[0].notes[0] == "read in bulk by DuckDB; 1 line(s) outside its shapes read by the Python reference"


@pytest.mark.parametrize("compress", ["gzip", "zstd", "truncated"])
def test_compressed_and_truncated_files(tmp_path, compress):
    text = "".join(line + "\n" for line in lines(Stream("sglang-archive", 300, seed=3))).encode()
    folder = tmp_path / "events"
    folder.mkdir()
    if compress == "zstd":
        path = folder / "a.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(text))
    else:
        path = folder / "a.jsonl.gz"
        data = gzip.compress(text)
        path.write_bytes(data[: len(data) * 2 // 3] if compress == "truncated" else data)
    src = source(tmp_path, ARCHIVE)
    if compress == "truncated":
        assert read_bulk(connect(), src, path, KEY, Chains(), 0).startswith("DuckDB cannot number its lines")
        load = load_kv_events(connect(), src, path, KEY, bulk_from=0)
        assert load.notes[0].startswith("read by the Python reference: DuckDB cannot number its lines")
        assert any("input ends early" in n for n in load.notes)
        return
    assert_agree(tmp_path, [path], ARCHIVE)


def test_crlf_and_blank_lines_and_whitespace(tmp_path):
    batch = json.dumps([1.5, [["BlockStored", [1], None, [5, 6], 4, None]]])
    path = write(tmp_path, "a.jsonl", [batch, "", "   ", batch.replace(",", ", "), "\t" + batch + "  "])
    loads, _ = assert_agree(tmp_path, [path])
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert isinstance(read_bulk(connect(), source(tmp_path), path, KEY, Chains(), 0), str)  # a CR: the reference


def test_reference_and_bulk_files_share_their_chains(tmp_path):
    """A file read in bulk, one by the reference (its keys not ones the bulk reader follows), one in bulk
    again: the chains run on through all three, whichever read each."""
    stream = list(lines(Stream("vllm-array", 600, seed=21, capacity=200)))
    files = [write(tmp_path, f"e.{i}.jsonl", stream[i * 200 : (i + 1) * 200]) for i in range(3)]
    src = source(tmp_path, extra='instance = "engine-0"')
    ref, bulk = connect(), connect()
    ref_chains, bulk_chains = Chains(), Chains()
    for i, path in enumerate(files):
        read_reference(ref, src, path, KEY, ref_chains)
        if i == 1:
            load = load_kv_events(bulk, src, path, KEY, bulk_chains, bulk_from=10_000)
            assert load.notes[0].startswith("read by the Python reference: 200 lines, fewer than the 10,000")
        else:
            load = load_kv_events(bulk, src, path, KEY, bulk_chains, bulk_from=0)
            assert load.notes[0] == "read in bulk by DuckDB"
    assert rows(bulk) == rows(ref)
    assert bulk_chains.messages == ref_chains.messages == 600


@pytest.mark.parametrize(
    ("columns", "followed"),
    [
        ({"ts": "b.t", "events": "b.evs", "dp_rank": "rank", "instance": "who", "seq": "n"}, True),
        ({"ts": "b.0", "events": "b.1", "dp_rank": "meta.2"}, True),
        ({"ts": "b.0.x", "events": "b.1"}, False),
        ({"ts": "b.0", "events": "b.t"}, True),
    ],
)  # "b" an object: its "0" a key the JSON path cannot read, left
def test_keys_the_source_maps(tmp_path, columns, followed):
    def nest(key: str, value, into: dict) -> None:
        *names, last = key.split(".")
        for name in names:
            into = into.setdefault(name, {})
        into[last] = value

    text = []
    for i in range(6):
        message: dict = {}
        if columns["events"] == "b.1":
            message["b"] = [1_790_000_000.5 + i, [["BlockStored", [100 + i], 99 + i if i else None, [1, 2], 2, None]]]
            if "dp_rank" in columns:
                message["meta"] = [0, 1, 3] if i % 2 else {"2": 5}
        else:
            for part, value in (
                ("ts", 1_790_000_000.5 + i),
                ("dp_rank", i % 3),
                ("instance", f"p{i % 2}"),
                ("seq", i),
                ("events", [["BlockStored", [100 + i], 99 + i if i else None, [1, 2], 2]]),
            ):
                if part in columns:
                    nest(columns[part], value, message)
        text.append(json.dumps(message))
    path = write(tmp_path, "a.jsonl", text)
    if followed:
        assert_agree(tmp_path, [path], columns)
    else:
        reason = read_bulk(connect(), source(tmp_path, columns), path, KEY, Chains(), 0)
        assert isinstance(reason, str) and "(columns.ts)" in reason


TIMES = st.one_of(
    st.floats(-1e20, 1e20, allow_nan=False),
    st.integers(-(10**19), 10**19),
    st.floats(1e9, 2e9),
    st.floats(1e12, 2e12),
    st.floats(1e15, 2e15),
    st.floats(1e18, 2e18),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(times=st.lists(TIMES, min_size=1, max_size=20), offset=st.sampled_from([0, 2.5, -3600.000001, 1e-7]))
def test_timestamps_of_every_magnitude(tmp_path, times, offset):
    text = [json.dumps([t, [["AllBlocksCleared"]]]) for t in times]
    assert_agree(tmp_path, [write(tmp_path, "a.jsonl", text)], extra=f"clock_offset_s = {offset}")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**70) | st.just(2**33) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
HASH = st.one_of(st.integers(-(2**64), 2**64), st.sampled_from(["0x1f", "ab12", "AB", "QUJD", "", "zz", "q=="]))
TOKENS = st.lists(st.integers(-1, 200_000), max_size=10)
FIELD = st.one_of(
    JSON,
    st.integers(-3, 20),
    TOKENS,
    st.sampled_from(["GPU", "CPU_PINNED", "0x1f"]),
    st.lists(HASH, max_size=3),
    st.just({"cache_salt": "t"}),
    st.just([["salt-a"], None]),
)
STORED = st.builds(
    lambda h, p, t, s, rest: ["BlockStored", h, p, t, s, *rest],
    st.lists(HASH, min_size=1, max_size=3),
    st.one_of(st.none(), HASH),
    TOKENS,
    st.integers(1, 6),
    st.lists(FIELD, max_size=7),
)
EVENT = st.one_of(
    STORED,
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
        lambda ts, events, rank: [ts, events, *rank],
        st.one_of(st.floats(1e9, 2e9), st.integers(), JSON),
        st.lists(EVENT, max_size=4),
        st.lists(st.one_of(st.integers(-1, 3), JSON), max_size=1),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(BATCH, min_size=1, max_size=6))
def test_any_batch_gives_the_references_rows(tmp_path, batches):
    text = [json.dumps(b, allow_nan=True) for b in batches]
    assert_agree(tmp_path, [write(tmp_path, "a.jsonl", text)])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {
                "instance": st.one_of(st.sampled_from(["a", "b", ""]), JSON),
                "seq": st.one_of(st.integers(-1, 5), st.sampled_from(["3", "x", "007"]), JSON),
                "batch": BATCH,
            }
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_archived_message_gives_the_references_rows(tmp_path, messages):
    text = [json.dumps(m, allow_nan=True) for m in messages]
    assert_agree(tmp_path, [write(tmp_path, "a.jsonl", text)], ARCHIVE)


def test_load_kv_events_reads_in_bulk_from_a_size_and_says_which_reader(tmp_path):
    path = write(tmp_path, "a.jsonl", list(lines(Stream("vllm-array", 50, seed=2))))
    src = source(tmp_path)
    small = load_kv_events(connect(), src, path, KEY)
    assert small.reader == "python" and small.notes[0] == (
        "read by the Python reference: 50 lines, fewer than the 2,000 from which the bulk reader is faster"
    )
    assert load_kv_events(connect(), src, path, KEY, bulk_from=50).reader == "duckdb-bulk"
    assert math.isclose(small.records_read, small.loaded)


def test_a_file_read_in_chunks_gives_the_same_rows(tmp_path, monkeypatch):
    """Chains, message numbers, sequence breaks, shapes and counts run on from one chunk of lines to the next."""
    import kvforensics.sources.common.bulk_lines as bulk_lines

    monkeypatch.setattr(bulk_lines, "CHUNK_LINES", 70)
    monkeypatch.setattr(bulk_lines, "SLICE_LINES", 16)
    path = write(
        tmp_path, "engine-0.jsonl", list(lines(Stream("sglang-archive", 400, seed=8, capacity=200, damage=0.05)))
    )
    assert_agree(tmp_path, [path], ARCHIVE)
    # a chain that runs from the first chunk into a later one: a block whose parent only the first chunk stored
    got = rows_of(path, ARCHIVE)  # columns 3 batch (the line), 5 kind, 6 block_hash, 7 parent, 8 position
    first = {r[6] for r in got if r[5] == "stored" and r[3] <= 70}
    later = {r[6] for r in got if r[5] == "stored" and r[3] > 70}
    assert any(r[5] == "stored" and r[3] > 70 and r[7] in first - later and r[8] is not None for r in got)


def rows_of(path: Path, columns: dict[str, str]) -> list[tuple]:
    con = connect()
    read_bulk(con, source(path.parent.parent, columns), path, KEY, Chains(), 0)
    return con.execute("SELECT * FROM kv_events").fetchall()


def test_ingest_begins_the_kv_event_files_line_checks_on_their_own_thread(tmp_path, monkeypatch):
    """A simulated prefix-cache incident ingested: its KV-event files' lines were checked on the checks' own thread
    (begun when the ingest starts, while the gateway files load), read in bulk, and the rows are the ones checks
    made at each file's read give."""
    import threading

    from kvforensics.investigation import Investigation
    from kvforensics.simulate.prefix import simulate_prefix
    from kvforensics.sources.common import bulk_lines
    from kvforensics.sources.kv_events import bulk, entry

    simulate_prefix("prefix-l3-unsalted", tmp_path / "incident", seed=3, requests=1000)
    incident = tmp_path / "incident" / "incident.toml"
    threads: list[str] = []  # where the KV-event files' lines were checked (the content file's are too)
    check = bulk_lines.check_lines
    kv_files = {str(p) for p in (tmp_path / "incident" / "kv-events").iterdir()}

    def recording_check(con, path, *args):
        if str(path) in kv_files:
            threads.append(threading.current_thread().name)
        return check(con, path, *args)

    monkeypatch.setattr(entry, "BULK_MIN_LINES", 0)
    monkeypatch.setattr(bulk, "BULK_MIN_LINES", 0)
    monkeypatch.setattr(bulk_lines, "check_lines", recording_check)
    inv = Investigation.open(incident, tmp_path / "out")
    inv.ingest()
    assert threads and all(name.startswith("kvf-line-checks") for name in threads), threads
    notes = inv.con.execute("SELECT notes FROM load_report WHERE kind = 'kv_events'").fetchall()
    assert notes and all(n[0].startswith("read in bulk by DuckDB") for n in notes), notes
    ahead = rows(inv.con)
    inv.con.close()
    monkeypatch.setattr(entry, "begin", None)  # no checks begun: each made at its file's read
    threads.clear()
    again = Investigation.open(incident, tmp_path / "again")
    again.ingest()
    assert threads and not any(name.startswith("kvf-line-checks") for name in threads)
    assert rows(again.con) == ahead and ahead["kv_events"]
