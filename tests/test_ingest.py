"""Ingest of gateway request logs: bad input gets an exact reason and nothing is lost."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import duckdb
import pytest
from conftest import write_mini

from kvforensics.config import Source
from kvforensics.core.db import connect
from kvforensics.core.errors import InputError
from kvforensics.sources.requests.load import load_requests_file

COLUMNS = {"request_id": "rid", "ts": "received_at", "status": "http_status"}


def rec(rid, **kw):
    base = {
        "rid": rid,
        "received_at": "2026-08-28T10:00:00Z",
        "account_id": "a1",
        "model": "m",
        "http_status": 200,
        "prompt_tokens": 100,
    }
    base.update(kw)
    return json.dumps(base)


def source(tmp_path: Path, fmt="jsonl", tz="UTC", columns=COLUMNS, offset=0.0) -> Source:
    return Source(
        name="gw",
        kind="requests",
        path="*",
        format=fmt,
        timezone=tz,
        base_dir=tmp_path,
        columns=columns,
        clock_offset_s=offset,
    )


def load(tmp_path, name, text: str | bytes, **kw):
    p = tmp_path / name
    if name.endswith(".gz"):
        p.write_bytes(gzip.compress(text.encode() if isinstance(text, str) else text, mtime=0))
    else:
        p.write_bytes(text.encode() if isinstance(text, str) else text)
    con = connect()
    result = load_requests_file(con, source(tmp_path, **kw), p)
    reasons = [r[0] for r in con.execute("SELECT reason FROM quarantine ORDER BY line").fetchall()]
    return con, result, reasons


def test_corrupt_jsonl_fixture_set(tmp_path):
    lines = [
        rec("ok1"),
        "{not json",
        "[1, 2, 3]",
        rec("bad_ts", received_at="31/08/2026 10:00"),
        rec("bad_status", http_status="OK"),
        rec("bad_tokens", prompt_tokens="many"),
        rec("neg", prompt_tokens=-5),
        json.dumps(
            {
                "rid": "no_account",
                "received_at": "2026-08-28T10:00:00Z",
                "model": "m",
                "http_status": 200,
                "prompt_tokens": 1,
            }
        ),
        rec("ok1"),  # exact duplicate: at-least-once shipping
        rec("ok1", account_id="someone-else"),  # same id, conflicting values
        rec("cache", prompt_tokens=10, cached_tokens=11),
        rec("ttft", ttft_ms="fast"),
        "",
        rec("ok2", ttft_ms=12.5),
    ]
    raw = ("\n".join(lines) + "\n").encode() + b'{"rid": "latin1", "x": "caf\xe9"}\n'
    con, r, reasons = load(tmp_path, "gw.jsonl", raw)
    assert (r.records_read, r.loaded, r.quarantined, r.duplicates) == (14, 2, 11, 1)
    assert r.records_read == r.loaded + r.quarantined + r.duplicates
    assert reasons == [
        "malformed JSON",
        "not a JSON object",
        "bad timestamp '31/08/2026 10:00'",
        "status is not an HTTP status code: 'OK'",
        "prompt_tokens is not a non-negative integer: 'many'",
        "prompt_tokens is not a non-negative integer: '-5'",
        "missing required field 'account_id'",
        f"duplicate request_id with conflicting values (kept the record at {tmp_path / 'gw.jsonl'}:1)",
        "cached_tokens (11) exceeds prompt_tokens (10)",
        "ttft_ms is not a non-negative number: 'fast'",
        "not UTF-8",
    ]
    assert "1 blank line(s) skipped" in r.notes
    (conflict_raw,) = con.execute("SELECT raw FROM quarantine WHERE reason LIKE 'duplicate%'").fetchone()
    assert json.loads(conflict_raw)["account_id"] == "someone-else"  # read again from its line


@pytest.mark.parametrize("collide", [False, True], ids=["id-hash", "colliding-hash"])
@pytest.mark.parametrize("merge_rows", [1, 1000], ids=["batch-per-file", "one-batch"])
def test_duplicates_across_files_and_loads_keep_the_earliest_record(tmp_path, monkeypatch, merge_rows, collide):
    """One batch of several files, then a later load: the record kept is the earliest loaded (earlier
    load, then file order, then line); exact copies count as duplicates, others are conflicts whose
    raw text names what differed; every file's counts add up. The merge finds repeated ids by a hash
    of the id: with a hash that collides for most ids, nothing changes."""
    import kvforensics.core.db as db
    import kvforensics.sources.requests.load as requests_loader
    import kvforensics.sources.requests.typed as request_typing
    from kvforensics.sources.requests.load import load_requests_files

    monkeypatch.setattr(requests_loader, "MERGE_ROWS", merge_rows)
    if collide:

        def colliding(name: str, original=db.sql) -> str:
            text = original(name)
            if name in ("requests_typed", "requests_merge"):
                assert "hash(request_id)" in text or "hash(r.request_id)" in text
                text = text.replace("hash(request_id)", "(hash(request_id) % 2)").replace(
                    "hash(r.request_id)", "(hash(r.request_id) % 2)"
                )
            return text

        monkeypatch.setattr(db, "sql", colliding)
        monkeypatch.setattr(request_typing, "sql", colliding)
    (tmp_path / "a.jsonl").write_text("\n".join([rec("x"), rec("y"), rec("x")]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join([rec("x", account_id="other"), rec("z"), rec("y")]) + "\n")
    (tmp_path / "c.jsonl").write_text("\n".join([rec("z", prompt_tokens=7), rec("w"), rec("x")]) + "\n")
    con = connect()
    src = source(tmp_path)
    first = load_requests_files(con, src, [tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    later = load_requests_files(con, src, [tmp_path / "c.jsonl"])
    counts = [(r.file.name, r.records_read, r.loaded, r.quarantined, r.duplicates) for r in first + later]
    assert counts == [("a.jsonl", 3, 2, 0, 1), ("b.jsonl", 3, 1, 1, 1), ("c.jsonl", 3, 1, 1, 1)]
    kept = con.execute("SELECT request_id, source_file, source_line FROM requests ORDER BY 1").fetchall()
    assert [(rid, Path(f).name, line) for rid, f, line in kept] == [
        ("w", "c.jsonl", 2),
        ("x", "a.jsonl", 1),
        ("y", "a.jsonl", 2),
        ("z", "b.jsonl", 2),
    ]
    bad = con.execute("SELECT file, line, reason, raw FROM quarantine ORDER BY file").fetchall()
    assert [(Path(f).name, line) for f, line, _, _ in bad] == [("b.jsonl", 1), ("c.jsonl", 1)]
    assert bad[0][2].endswith(f"(kept the record at {tmp_path / 'a.jsonl'}:1)")
    assert bad[1][2].endswith(f"(kept the record at {tmp_path / 'b.jsonl'}:2)")
    assert json.loads(bad[0][3])["account_id"] == "other" and json.loads(bad[1][3])["prompt_tokens"] == 7


def test_missing_mapped_field_names_the_source_column(tmp_path):
    lines = [json.dumps({"received_at": "2026-08-28T10:00:00Z"}), rec("r2")]
    con, r, reasons = load(tmp_path, "gw.jsonl", "\n".join(lines) + "\n")
    assert reasons == ["missing required field 'request_id' (column rid)"]


def test_timestamps_normalised_to_utc(tmp_path):
    lines = [
        rec("iso_z"),
        rec("offset", received_at="2026-08-28T12:00:00+02:00"),
        rec("naive", received_at="2026-08-28 03:00:00"),
        rec("epoch_s", received_at=1787911200),
        rec("epoch_ms", received_at=1787911200000),
    ]
    con, r, reasons = load(tmp_path, "gw.jsonl", "\n".join(lines), tz="America/Los_Angeles")
    assert reasons == []
    got = {rid: ts.isoformat() for rid, ts in con.execute("SELECT request_id, ts FROM requests").fetchall()}
    assert set(got.values()) == {"2026-08-28T10:00:00+00:00"}
    assert "1 timestamp(s) without offset read as America/Los_Angeles" in r.notes


def test_clock_offset_is_applied(tmp_path):
    con, r, _ = load(tmp_path, "gw.jsonl", rec("a"), offset=-30.0)
    assert con.execute("SELECT ts FROM requests").fetchall()[0][0].isoformat() == "2026-08-28T09:59:30+00:00"


def test_truncated_gzip_loads_what_it_can(tmp_path):
    full = gzip.compress(("\n".join(rec(f"r{i}") for i in range(2000)) + "\n").encode(), mtime=0)
    p = tmp_path / "gw.jsonl.gz"
    p.write_bytes(full[: len(full) // 2])
    con = connect()
    r = load_requests_file(con, source(tmp_path), p)
    assert 0 < r.loaded < 2000
    assert r.records_read == r.loaded + r.quarantined + r.duplicates
    assert any(n.startswith("input ends early after line") for n in r.notes)


def test_csv_and_parquet_with_mapping(tmp_path):
    import pandas as pd

    df = pd.DataFrame(
        {
            "rid": ["c1", "c2"],
            "received_at": ["2026-08-28T10:00:00Z", "2026-08-28T11:00:00Z"],
            "account_id": ["a", "b"],
            "model": ["m", "m"],
            "http_status": [200, 400],
            "prompt_tokens": [10, 20],
            "extra": ["x", "y"],
        }
    )
    df.to_csv(tmp_path / "gw.csv", index=False)
    con = connect()
    r = load_requests_file(con, source(tmp_path, fmt="csv"), tmp_path / "gw.csv")
    assert (r.records_read, r.loaded) == (2, 2)
    df.to_parquet(tmp_path / "gw.parquet")
    con = connect()
    r = load_requests_file(con, source(tmp_path, fmt="parquet"), tmp_path / "gw.parquet")
    assert (r.records_read, r.loaded) == (2, 2)
    assert con.execute("SELECT sum(prompt_tokens) FROM requests").fetchall()[0][0] == 30


def test_csv_missing_required_column_is_a_clear_error(tmp_path):
    (tmp_path / "gw.csv").write_text(
        "rid,received_at,model,http_status,prompt_tokens\nr1,2026-08-28T10:00:00Z,m,200,5\n"
    )
    with pytest.raises(InputError) as e:
        load_requests_file(connect(), source(tmp_path, fmt="csv"), tmp_path / "gw.csv")
    assert str(e.value) == (
        f"source 'gw': {tmp_path / 'gw.csv'}: required field 'account_id' is missing (no column of that name); "
        "the file has columns ['http_status', 'model', 'prompt_tokens', 'received_at', 'rid']. "
        "Map it in the incident file: columns = { account_id = \"<column>\" }"
    )


@pytest.mark.parametrize("name", ["gw.jsonl", "gw.jsonl.gz"])
def test_jsonl_mapped_to_a_key_no_record_has_is_a_clear_error(tmp_path, name):
    """A misspelt mapping (ts = "recieved_at") is a mapping mistake, as a CSV column the header lacks
    is: exit 2 with the key and the keys the records have, not every record quarantined."""
    text = "\n".join(rec(f"r{i}") for i in range(3)) + "\n"
    with pytest.raises(InputError) as e:
        load(tmp_path, name, text, columns={**COLUMNS, "ts": "recieved_at"})
    assert str(e.value) == (
        f"source 'gw': {tmp_path / name}: required field 'ts' is missing (mapped to key 'recieved_at'): no record "
        "has it; the records have keys ['account_id', 'http_status', 'model', 'prompt_tokens', 'received_at', "
        "'rid']. Map it in the incident file: columns = { ts = \"<key>\" }"
    )


def test_jsonl_key_missing_from_the_first_records_only_is_read_where_it_is(tmp_path):
    """The keys are sampled from the first records; a key that appears later in the file is no
    mapping mistake: records without it are quarantined, the others load."""
    lines = [json.dumps({k: v for k, v in json.loads(rec(f"r{i}")).items() if k != "received_at"}) for i in range(2001)]
    con, r, reasons = load(tmp_path, "gw.jsonl", "\n".join([*lines, rec("late")]) + "\n")
    assert (r.loaded, r.quarantined) == (1, 2001)
    assert set(reasons) == {"missing required field 'ts' (column received_at)"}


@pytest.mark.parametrize("name", ["gw.jsonl", "gw.jsonl.gz"])
def test_an_optional_field_first_logged_after_the_sample_is_mapped(tmp_path, name):
    """A gateway upgraded mid-file starts logging cached_tokens (under a known alias) after the records whose
    keys are sampled: it is mapped all the same, for the records that have it."""
    lines = [rec(f"r{i}") for i in range(2500)]
    lines += [
        json.dumps({**json.loads(rec(f"c{i}")), "usage": {"prompt_tokens_details": {"cached_tokens": 64}}})
        for i in range(3)
    ]
    con, r, reasons = load(tmp_path, name, "\n".join(lines) + "\n")
    assert reasons == [] and r.loaded == 2503
    assert con.execute(
        "SELECT request_id, cached_tokens FROM requests WHERE cached_tokens IS NOT NULL ORDER BY 1"
    ).fetchall() == [("c0", 64), ("c1", 64), ("c2", 64)]
    assert (
        "cached_tokens <- usage.prompt_tokens_details.cached_tokens: first logged after the first 2,000 records "
        "(the keys of every record were read to map it)"
    ) in r.notes


def test_a_field_name_that_is_only_a_value_maps_nothing(tmp_path):
    lines = [rec(f"r{i}") for i in range(2100)] + [rec("v", model="cached_tokens")]
    con, r, reasons = load(tmp_path, "gw.jsonl", "\n".join(lines) + "\n")
    assert reasons == [] and r.loaded == 2101
    assert not any("first logged" in n for n in r.notes)
    assert con.execute("SELECT count(*) FROM requests WHERE cached_tokens IS NOT NULL").fetchall() == [(0,)]


def test_opentelemetry_names_are_recognised_without_a_mapping(tmp_path):
    line = json.dumps(
        {
            "gen_ai.response.id": "otel1",
            "timestamp": "2026-08-28T10:00:00Z",
            "account_id": "a",
            "gen_ai.request.model": "m",
            "http.response.status_code": 200,
            "gen_ai.usage.input_tokens": 900,
            "gen_ai.usage.output_tokens": 5,
            "gen_ai.usage.cache_read.input_tokens": 100,
        }
    )
    con, r, reasons = load(tmp_path, "gw.jsonl", line, columns={})
    assert reasons == []
    assert con.execute("SELECT request_id, prompt_tokens, cached_tokens FROM requests").fetchall() == [
        ("otel1", 900, 100)
    ]
    assert any("gen_ai.usage.input_tokens" in n for n in r.notes)


def test_empty_file_loads_nothing(tmp_path):
    con, r, reasons = load(tmp_path, "gw.jsonl", "")
    assert (r.records_read, r.loaded, r.quarantined) == (0, 0, 0)


def test_values_that_cannot_be_stored_are_quarantined_not_raised(tmp_path):
    lines = [
        rec("big_status", http_status=1e20),
        rec("big_prompt", prompt_tokens=10**30),
        rec("inf_prompt", prompt_tokens="Infinity"),
        rec("big_cached", cached_tokens=10**19, prompt_tokens=5),
        rec("epoch_overflow", received_at=1e300),
        rec("infinite_ts", received_at="infinity"),
        rec("far_future", received_at="294000-01-01"),
        rec("before_1970", received_at="1969-12-31T23:59:59Z"),
        json.dumps(
            {
                "rid": {"nested": [1]},
                "received_at": "2026-08-28T10:00:00Z",
                "account_id": "a",
                "model": "m",
                "http_status": 200,
                "prompt_tokens": 1,
            }
        ),
        rec("bool_account", account_id=True),
        rec("ok"),
    ]
    con, r, reasons = load(tmp_path, "gw.jsonl", "\n".join(lines) + "\n")
    assert (r.records_read, r.loaded, r.quarantined) == (11, 1, 10)
    assert reasons == [
        "status is not an HTTP status code: '100000000000000000000.0'",
        "prompt_tokens is out of range: '1000000000000000000000000000000'",
        "prompt_tokens is not a non-negative integer: 'Infinity'",
        "cached_tokens is out of range: '10000000000000000000'",
        "bad timestamp '1e300'",
        "bad timestamp 'infinity'",
        "bad timestamp '294000-01-01'",
        "bad timestamp '1969-12-31T23:59:59Z'",
        "request_id must be a string or a number, not a JSON object",
        "account_id must be a string or a number, not a JSON boolean",
    ]


DIRTY = [
    rec("ok1"),
    "{not json",
    "[1, 2, 3]",
    rec("bad_ts", received_at="31/08/2026 10:00"),
    rec("bad_status", http_status="OK"),
    rec("neg", prompt_tokens=-5),
    "",
    "   ",
    rec("obj", account_id={"nested": 1}),
    rec("ok1"),
    rec("ok1", account_id="x"),
    rec("ok2", ttft_ms=12.5, received_at="2026-08-28 03:00:00"),
    rec("big", prompt_tokens=1e20),
]
# every line a JSON object (so DuckDB's NDJSON reader can take it), with values that are easy to read
# differently: wrong JSON types, nulls, huge and fractional numbers, unicode, keys in other cases
CLEAN = [
    rec("ok1"),
    rec("bad_status", http_status="OK"),
    rec("neg", prompt_tokens=-5),
    rec("obj", account_id={"nested": 1}),
    rec("arr", model=[1]),
    rec("bool", prompt_tokens=True),
    rec("ok1"),
    rec("ok1", account_id="x"),
    rec("null_ttft", ttft_ms=None),
    rec("frac", prompt_tokens=2.5),
    rec("ok2", ttft_ms=12.50, received_at="2026-08-28 03:00:00"),
    rec("big", prompt_tokens=1e20),
    rec("exp", prompt_tokens=1e3),
    rec("uni", account_id="kunde-\u00e4\u00df-\U0001f600"),
    rec("epoch", received_at=1787911200.5),
    json.dumps(
        {
            "RID": "upper",
            "rid": "lower",
            "received_at": 1,
            "account_id": "a",
            "model": "m",
            "http_status": 200,
            "prompt_tokens": 1,
        }
    ),
    rec("esc", model='m\\"quoted"\n'),
    rec("huge_int", prompt_tokens=10**30),
    rec("u64", cached_tokens=10**19),
    rec("neg_zero", ttft_ms=-0.0),
    rec("tiny", latency_ms=1e-300),
    rec("false", account_id=False),
    rec(""),
    rec("missing_tokens", prompt_tokens=None),
]


# every record loads, with values whose text a reader could get wrong: numbers where text is expected
# (in exponent form too, which the text reader must give up), text where numbers are expected, floats,
# huge integers, unicode and escapes, epoch timestamps, ids that read as JSON literals
VALID = [
    rec("ok1"),
    rec(12345),
    rec(123456789012345678901234567890),
    rec("str_num", prompt_tokens="42"),
    rec("float_int", prompt_tokens=1e3, completion_tokens=7.0),
    rec("ttft", ttft_ms=0.1, latency_ms=1e-7),
    rec("epoch_s", received_at=1787911200.5),
    rec("epoch_ms", received_at=1787911200123),
    rec("uni", account_id="kunde-\u00e4\u00df-\U0001f600", model='m\\"q"\n'),
    rec("neg_zero", ttft_ms=-0.0),
    rec("ok1"),
    rec("naive", received_at="2026-08-28 03:00:00"),
    rec("instances", prefill_instance=7, decode_instance="d-1e-5"),
]
EXPONENT_ID = rec(1.5e20)  # DuckDB's text for it (1.5e+20) differs from the JSON reader's digits
LITERAL_ID = rec("true")  # a string the text reader cannot tell from the JSON literal
READERS = {"text": (True, ("text",)), "json": (True, ("json",)), "lines": (True, ()), "python": (False, ())}


@pytest.mark.parametrize(
    "lines",
    [DIRTY, CLEAN, VALID, VALID + [EXPONENT_ID], VALID + [LITERAL_ID]],
    ids=["dirty", "clean", "valid", "exponent-id", "literal-id"],
)
def test_duckdb_and_python_staging_agree(tmp_path, monkeypatch, lines):
    """DuckDB's NDJSON reader (values as text, values as JSON), DuckDB's line reader and the Python
    reader load and refuse the same records with the same reasons, values and notes. Each is forced
    first; a reader that cannot keep a file hands it on, and which one loaded it is checked."""
    import kvforensics.sources.requests.readers as request_readers

    (tmp_path / "gw.jsonl").write_text("\n".join(lines) + "\n")
    results = {}
    readers = {}
    for name, (fast, json_readers) in READERS.items():
        monkeypatch.setattr(request_readers, "FAST_STAGING", fast)
        monkeypatch.setattr(request_readers, "JSON_READERS", json_readers)
        con = connect()
        r = load_requests_file(con, source(tmp_path, tz="Europe/Berlin"), tmp_path / "gw.jsonl")
        readers[name] = r.reader
        results[name] = (
            (r.records_read, r.loaded, r.quarantined, r.duplicates),
            sorted(r.notes),
            con.execute("SELECT line, reason, raw FROM quarantine ORDER BY line").fetchall(),
            con.execute("SELECT * EXCLUDE (source_file) FROM requests ORDER BY request_id").fetchall(),
        )
    assert results["text"] == results["json"] == results["lines"] == results["python"]
    if lines is DIRTY:
        assert results["text"][0] == (11, 2, 8, 1)
        assert readers == {"text": "duckdb-lines", "json": "duckdb-lines", "lines": "duckdb-lines", "python": "python"}
    elif lines is CLEAN:  # refused records: the text reader gives the file to the next reader
        assert readers == {"text": "duckdb-lines", "json": "duckdb-json", "lines": "duckdb-lines", "python": "python"}
    else:
        kept = "duckdb-json-text" if lines is VALID else "duckdb-lines"
        assert readers == {"text": kept, "json": "duckdb-json", "lines": "duckdb-lines", "python": "python"}
        assert results["text"][0] == (len(lines), len(lines) - 1, 0, 1)
    if lines is VALID:
        values = {r[0]: r for r in results["text"][3]}
        assert values["123456789012345678901234567890"][5] == 100 and values["str_num"][5] == 42
        assert values["float_int"][5:7] == (1000, 7) and values["instances"][10:12] == ("7", "d-1e-5")


def test_control_bytes_anywhere_in_a_file_lose_no_line(tmp_path):
    """A 0x01 (the fast reader's delimiter) or a lone CR deep in a file must neither cut a record
    short nor shift line numbers: the record is quarantined whole, at its own line."""
    filler = [rec(f"f{i}", prompt_tokens=100 + i) for i in range(30_000)]  # > 1 MiB before the bad lines
    lines = [*filler, "\x01", rec("cut") + "\x01tail", '{"rid": "cr",\r "x": 1}', rec("last")]
    (tmp_path / "gw.jsonl").write_bytes(("\n".join(lines) + "\n").encode())
    con = connect()
    r = load_requests_file(con, source(tmp_path), tmp_path / "gw.jsonl")
    assert (r.records_read, r.loaded, r.quarantined) == (30_004, 30_001, 3)
    bad = con.execute("SELECT line, reason, raw FROM quarantine ORDER BY line").fetchall()
    assert [(line, reason) for line, reason, _ in bad] == [
        (30_001, "malformed JSON"),
        (30_002, "malformed JSON"),
        (30_003, "missing required field 'ts' (column received_at)"),
    ]  # a CR between tokens is JSON whitespace
    assert "tail" in bad[1][2]
    assert con.execute("SELECT source_line FROM requests WHERE request_id = 'last'").fetchall() == [(30_004,)]


def test_clean_files_take_duckdbs_reader_and_odd_ones_the_python_reader(tmp_path):
    """The fast path must really be taken for clean JSONL (plain and gzip) and Parquet, and given up
    (not failed) for bytes DuckDB refuses."""
    import gzip

    import pandas as pd

    lines = [rec("a"), rec("b", received_at="2026-08-28 03:00:00"), "", "{broken"]
    (tmp_path / "clean.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "clean.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    (tmp_path / "latin1.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + b'{"rid": "caf\xe9"}\n')
    pd.DataFrame(
        {
            "rid": ["p1", "p2"],
            "received_at": ["2026-08-28T10:00:00Z", "bad"],
            "account_id": ["a", "b"],
            "model": ["m", "m"],
            "http_status": [200, 200],
            "prompt_tokens": [1, 2],
        }
    ).to_parquet(tmp_path / "gw.parquet")
    readers = {}
    for name, fmt in [
        ("clean.jsonl", "jsonl"),
        ("clean.jsonl.gz", "jsonl"),
        ("latin1.jsonl", "jsonl"),
        ("gw.parquet", "parquet"),
    ]:
        con = connect()
        r = load_requests_file(con, source(tmp_path, fmt=fmt), tmp_path / name)
        readers[name] = (r.reader, r.records_read, r.loaded, r.quarantined)
        raw = con.execute("SELECT raw FROM quarantine").fetchall()
        assert len(raw) == r.quarantined and all(text for (text,) in raw)  # refused records keep their text
        if fmt == "parquet":
            assert json.loads(raw[0][0]) == {
                "request_id": "p2",
                "ts": "bad",
                "account_id": "b",
                "model": "m",
                "status": 200,
                "prompt_tokens": 2,
            }
    assert readers == {
        "clean.jsonl": ("duckdb-lines", 3, 2, 1),
        "clean.jsonl.gz": ("duckdb-lines", 3, 2, 1),
        "latin1.jsonl": ("python", 4, 2, 2),
        "gw.parquet": ("duckdb-parquet", 2, 1, 1),
    }
    # without the blank and the broken line, DuckDB's NDJSON reader takes the file: reading values as
    # JSON when a record is refused, as text when every record loads (plain and gzip)
    (tmp_path / "tidy.jsonl").write_text("\n".join([rec("a"), rec("b", http_status="x")]) + "\n")
    r = load_requests_file(connect(), source(tmp_path), tmp_path / "tidy.jsonl")
    assert (r.reader, r.records_read, r.loaded, r.quarantined) == ("duckdb-json", 2, 1, 1)
    for name, compress in (("valid.jsonl", bytes), ("valid.jsonl.gz", gzip.compress)):
        (tmp_path / name).write_bytes(compress(("\n".join([rec("a"), rec("b", http_status="404")]) + "\n").encode()))
        r = load_requests_file(connect(), source(tmp_path), tmp_path / name)
        assert (r.reader, r.records_read, r.loaded, r.quarantined) == ("duckdb-json-text", 2, 2, 0)


def test_parquet_staging_paths_agree(tmp_path, monkeypatch):
    import pandas as pd

    import kvforensics.sources.requests.readers as request_readers

    df = pd.DataFrame(
        {
            "rid": ["p1", "p2", "p3", "p1"],
            "received_at": pd.to_datetime(
                ["2026-08-28T10:00:00Z", "2026-08-28T11:00:00Z", "2026-08-28T12:00:00Z", "2026-08-28T10:00:00Z"]
            ),
            "local": pd.to_datetime(["2026-08-28 12:00:00"] * 4),
            "account_id": ["a", "b", None, "a"],
            "model": ["m"] * 4,
            "http_status": [200, 400, 200, 200],
            "prompt_tokens": [10, 20, 30, 10],
        }
    )
    df.to_parquet(tmp_path / "gw.parquet")
    results = {}
    for fast in (True, False):
        monkeypatch.setattr(request_readers, "FAST_STAGING", fast)
        for ts_col in ("received_at", "local"):
            con = connect()
            src = source(tmp_path, fmt="parquet", tz="Europe/Berlin", columns={**COLUMNS, "ts": ts_col})
            r = load_requests_file(con, src, tmp_path / "gw.parquet")
            results[fast, ts_col] = (
                (r.records_read, r.loaded, r.quarantined, r.duplicates),
                con.execute("SELECT line, reason FROM quarantine").fetchall(),
                con.execute("SELECT request_id, ts FROM requests ORDER BY 1").fetchall(),
            )
    expected = {
        "received_at": ["2026-08-28T10:00:00+00:00", "2026-08-28T11:00:00+00:00"],
        "local": ["2026-08-28T10:00:00+00:00", "2026-08-28T10:00:00+00:00"],
    }  # 12:00 in Berlin
    for ts_col in ("received_at", "local"):
        assert results[True, ts_col] == results[False, ts_col]
        assert results[True, ts_col][0] == (4, 2, 1, 1)
        assert [t.isoformat() for _, t in results[True, ts_col][2]] == expected[ts_col]


def test_parquet_number_columns_of_every_type_read_as_their_text_would(tmp_path, monkeypatch):
    """DuckDB's Parquet reader hands integer and float64 columns to the typing as numbers, others as
    text: loaded values and refusal messages match the Python reader's for each Arrow type."""
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    import kvforensics.sources.requests.readers as request_readers

    n = 7
    table = pa.table(
        {
            "rid": [f"r{i}" for i in range(n)],
            "received_at": ["2026-08-28T10:00:00Z"] * n,
            "account_id": ["a"] * n,
            "model": ["m"] * n,
            "http_status": pa.array([200, 404, 99, 200, 200, 200, 200], pa.int16()),
            "prompt_tokens": pa.array([10, 2**63 - 1, 5, 3, 9007199254740993, 4, 5], pa.uint64()),
            "completion_tokens": pa.array([1.0, 2.5, None, 1e20, 3.0, float("nan"), -0.0], pa.float64()),
            "cached_tokens": pa.array(
                [decimal.Decimal("1.000"), None, decimal.Decimal("0.500"), None, None, None, None], pa.decimal128(10, 3)
            ),
            "ttft_ms": pa.array([0.1, 12.25, None, 3.5, 1e-7, 2.0, float("inf")], pa.float32()),
            "latency_ms": pa.array([100, -1, None, 5, 6, 7, 8], pa.int64()),
        }
    )
    pq.write_table(table, tmp_path / "gw.parquet")
    results = {}
    for fast in (True, False):
        monkeypatch.setattr(request_readers, "FAST_STAGING", fast)
        con = connect()
        r = load_requests_file(con, source(tmp_path, fmt="parquet"), tmp_path / "gw.parquet")
        results[fast] = (
            (r.records_read, r.loaded, r.quarantined),
            con.execute("SELECT line, reason FROM quarantine ORDER BY line").fetchall(),
            con.execute("SELECT * EXCLUDE (source_file) FROM requests ORDER BY request_id").fetchall(),
        )
    assert results[True] == results[False]
    assert results[True][0] == (7, 1, 6)
    assert [reason for _, reason in results[True][1]] == [
        "prompt_tokens is out of range: '9223372036854775807'",
        "status is not an HTTP status code: '99'",
        "completion_tokens is out of range: '1e+20'",
        "prompt_tokens is out of range: '9007199254740993'",
        "completion_tokens is not a non-negative integer: 'nan'",
        "ttft_ms is not a non-negative number: 'inf'",
    ]
    (loaded,) = results[True][2]
    # the float32 0.1 keeps its exact value, as the Python reader reads it
    assert loaded[0] == "r0" and loaded[4:10] == (200, 10, 1, 1, 0.10000000149011612, 100.0)


def test_an_evidence_database_of_the_earlier_schema_is_migrated(tmp_path):
    """Databases written when requests carried a row_hash column load new files after connect()."""
    import duckdb

    path = tmp_path / "evidence.duckdb"
    old = duckdb.connect(str(path))
    old.execute(
        "CREATE TABLE requests (request_id VARCHAR NOT NULL, ts TIMESTAMPTZ NOT NULL, account_id VARCHAR NOT NULL, "
        "model VARCHAR NOT NULL, status INTEGER NOT NULL, prompt_tokens BIGINT NOT NULL, "
        "completion_tokens BIGINT, cached_tokens BIGINT, ttft_ms DOUBLE, latency_ms DOUBLE, "
        "prefill_instance VARCHAR, decode_instance VARCHAR, source VARCHAR NOT NULL, "
        "source_file VARCHAR NOT NULL, source_line BIGINT NOT NULL, row_hash VARCHAR NOT NULL)"
    )
    old.execute(
        "INSERT INTO requests VALUES ('x', '2026-08-28 10:00:00+00', 'a1', 'm', 200, 100, NULL, NULL, NULL, "
        "NULL, NULL, NULL, 'gw', 'old.jsonl', 1, 'h')"
    )
    old.close()
    (tmp_path / "gw.jsonl").write_text("\n".join([rec("x"), rec("y")]) + "\n")
    con = connect(path)
    r = load_requests_file(con, source(tmp_path), tmp_path / "gw.jsonl")
    assert (r.records_read, r.loaded, r.duplicates) == (2, 1, 1)
    assert "row_hash" not in [c[0] for c in con.execute("DESCRIBE requests").fetchall()]


def test_a_reader_error_whose_message_python_cannot_decode_falls_back(tmp_path):
    """DuckDB's NDJSON reader refuses a JSON array line with an error message that quotes the line
    cut inside a 4-byte character (found by hypothesis); the line reader then takes the file."""
    lines = [
        b'{"decode_instance": null, "request_id": "dup-1"}',
        json.dumps([{"": None, "\x1f\x1f\x1f\x1f": None, "\U00010000\U00010000": None}]).encode(),
    ]
    (tmp_path / "gw.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    src = Source(name="gw", kind="requests", path="*", format="jsonl", timezone="UTC", base_dir=tmp_path, columns={})
    con = connect()
    r = load_requests_file(con, src, tmp_path / "gw.jsonl")
    assert (r.reader, r.records_read, r.loaded, r.quarantined) == ("duckdb-lines", 2, 0, 2)
    assert [reason for (reason,) in con.execute("SELECT reason FROM quarantine ORDER BY line").fetchall()] == [
        "missing required field 'ts'",
        "not a JSON object",
    ]


def _setting(con) -> str:
    return con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]


def test_sizes_are_read_as_duckdb_reads_them() -> None:
    from kvforensics.core.db import size_bytes

    assert size_bytes("2GB") == 2 * 10**9 and size_bytes("512MiB") == 2**29 and size_bytes("1.5 GB") == 15 * 10**8
    con = duckdb.connect()
    for size in ("2GB", "512MiB", "1.5 GB", "300MB"):
        con.execute(f"SET memory_limit = '{size}'")
        shown = _setting(con)
        con.execute(f"SET memory_limit = '{size_bytes(size)}B'")
        assert _setting(con) == shown


_RSS_AFTER_A_DROP = """
import sys, time
from kvforensics.core.db import connect

def rss_mb():
    return next(int(line.split()[1]) // 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))

con = connect(sys.argv[1], memory_limit="2GB")
con.execute("CREATE TEMP TABLE t AS SELECT i, md5(CAST(i AS VARCHAR)) AS s FROM range(12000000) AS r(i)")
held = rss_mb()
con.execute("DROP TABLE t")
deadline = time.monotonic() + 20
while rss_mb() > held - 300 and time.monotonic() < deadline:
    time.sleep(0.2)
print(held, rss_mb())
"""


def test_memory_duckdb_frees_leaves_the_process(tmp_path) -> None:
    """Without its allocator's background threads, DuckDB keeps what it freed: the process stays at the
    most DuckDB ever held, and RSS exceeds memory_limit once Python holds memory too."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _RSS_AFTER_A_DROP, str(tmp_path / "evidence.duckdb")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    held, after = map(int, done.stdout.split()[-2:])  # after any progress bar DuckDB printed
    assert held > 450, held  # the table was in memory (~520 MB)
    assert after < held - 300, (held, after)


def test_the_memory_governor_takes_what_the_process_holds_outside_duckdb_off_its_limit(tmp_path) -> None:
    from kvforensics.core.db import MemoryGovernor, _rss_bytes

    def shown(nbytes: int) -> str:  # a limit as DuckDB shows it
        scratch = duckdb.connect()
        scratch.execute(f"SET memory_limit = '{nbytes}B'")
        return _setting(scratch)

    # the limit leaves room for whatever this worker already holds (imports, other tests' leftovers): the
    # 400 MB below stays under half of it, and 1.2 GB goes over half
    rss = _rss_bytes()
    if rss is None:
        pytest.skip("no /proc/self/statm here: the governor measures nothing")
    limit_mb = 2 * rss // 10**6 + 2000
    limit = limit_mb * 10**6
    con = connect(tmp_path / "evidence.duckdb", memory_limit=f"{limit_mb}MB")
    configured = _setting(con)
    with MemoryGovernor(con, every_s=0) as governor:
        governor.tick()
        before = governor.outside
        held = bytearray(b"\x01" * 400_000_000)  # 400 MB that DuckDB does not count
        governor.tick()
        assert 350_000_000 < governor.outside - before < 600_000_000, (before, governor.outside)
        assert _setting(con) == shown(limit - governor.outside)
        more = bytearray(b"\x01" * 800_000_000)  # outside more than half the limit: DuckDB keeps half
        governor.tick()
        assert _setting(con) == shown(limit // 2)
        del more
    assert _setting(con) == configured  # restored
    del held
    unlimited = duckdb.connect(str(tmp_path / "unlimited.duckdb"))  # a limit kvforensics.core.db.connect did not set
    before = _setting(unlimited)
    with MemoryGovernor(unlimited, every_s=0) as governor:
        governor.tick()
        assert _setting(unlimited) == before and governor.outside == 0


def test_a_statement_that_runs_out_of_memory_under_the_governors_lowered_limit_runs_again_under_the_configured_one(
    tmp_path,
) -> None:
    """What the allocators keep of memory DuckDB freed counts as held outside it, so a lowered limit can be too
    low for a statement that fits the configured one (at 1M requests a KV-event rule failed at half the limit,
    after the rule before it had left 1.5 GB in the RSS): it runs again under the configured limit. Under the
    configured limit itself, running out of memory is an error as before."""
    from kvforensics.core.db import MemoryGovernor, size_bytes

    con = connect(tmp_path / "evidence.duckdb", memory_limit="1GB")
    con.execute("SET temp_directory = ''").fetchall()  # nothing spills: the statement needs its memory
    configured = _setting(con)
    big = "SELECT count(*) FROM (SELECT DISTINCT range AS x FROM range(4000000))"
    with MemoryGovernor(con, every_s=3600) as governor:
        governor.tick()  # measured now: run() measures again only in an hour
        governor._lowered = False
        con.execute(f"SET memory_limit = '{size_bytes('16MB')}B'").fetchall()
        with pytest.raises(duckdb.OutOfMemoryException):  # not lowered by the governor: no second run
            governor.run(lambda: con.execute(big).fetchall())
        governor.outside = size_bytes("1GB")  # as a measurement that took most of the limit for Python
        governor._lowered, governor._changed = True, True
        assert governor.run(lambda: con.execute(big).fetchall()) == [(4_000_000,)]
        assert _setting(con) == configured and not governor._lowered
    assert _setting(con) == configured


def test_a_connection_opened_without_a_limit_has_the_bounded_default(tmp_path, monkeypatch) -> None:
    """Without --memory-limit or [settings] memory_limit, DuckDB's own default (80% of the machine) would let
    a run grow to 20 GB of RSS: the limit is the smaller of 4 GB and half the memory, and the governor holds it."""
    from kvforensics.core import db
    from kvforensics.core.db import MemoryGovernor, size_bytes

    default = db.default_memory_limit()
    assert size_bytes(default) <= size_bytes("4GB")
    con = connect(tmp_path / "evidence.duckdb")
    expected = duckdb.connect()
    expected.execute(f"SET memory_limit = '{default}'")
    shown = con.execute("SELECT value FROM duckdb_settings() WHERE name = 'memory_limit'").fetchall()[0][0]
    assert shown == _setting(expected)
    assert con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0].endswith("evidence.spill")
    with MemoryGovernor(con, every_s=0) as governor:  # active: what Python holds is taken off DuckDB's limit
        assert governor.limit == size_bytes(default)
        governor.tick()
        assert governor.outside > 0
        expected.execute(
            f"SET memory_limit = '{max(size_bytes(default) - governor.outside, size_bytes(default) // 2)}B'"
        )
        assert _setting(con) == _setting(expected)
    # half of a small machine (or container), 4 GB of a large one
    monkeypatch.setattr(db, "usable_memory_bytes", lambda: 6 * 2**30)
    assert db.default_memory_limit() == "3072MiB"
    monkeypatch.setattr(db, "usable_memory_bytes", lambda: 64 * 2**30)
    assert db.default_memory_limit() == f"{size_bytes('4GB') // 2**20}MiB"
    monkeypatch.setattr(db, "usable_memory_bytes", lambda: None)
    assert db.default_memory_limit() == f"{size_bytes('4GB') // 2**20}MiB"
    # an explicit limit wins, and may be larger
    assert _setting(connect(tmp_path / "big.duckdb", memory_limit="6GB")) == _setting(
        duckdb.connect(config={"memory_limit": "6GB"})
    )


def test_engine_logs_are_parsed_with_their_batches_memory_set_aside_from_duckdbs(tmp_path, monkeypatch) -> None:
    """DuckDB's memory_limit counts its own buffers only: while engine logs are parsed, what their
    batches hold outside it is taken off its limit, and the limit is the incident's again after."""
    import kvforensics.sources.engine_logs.entry as engine_entry
    from kvforensics.config import load_incident
    from kvforensics.core.db import memory_set_aside, size_bytes
    from kvforensics.sources.engine_logs.columnar import HELD_PER_FILE
    from kvforensics.stages.ingest import ingest

    incident = load_incident(write_mini(tmp_path / "mini"))
    con = connect(tmp_path / "evidence.duckdb", memory_limit="3GB")
    expected = duckdb.connect()
    expected.execute(f"SET memory_limit = '{size_bytes('3GB') - 2 * HELD_PER_FILE}B'")  # two logs, two cores
    seen = []
    parse = engine_entry.parse_engine_log

    def spying(cursor, *args):
        seen.append(_setting(cursor))
        return parse(cursor, *args)

    monkeypatch.setattr(engine_entry, "parse_engine_log", spying)
    monkeypatch.setattr(engine_entry.os, "cpu_count", lambda: 2)
    ingest(con, incident)
    assert seen == [_setting(expected)] * 2
    assert _setting(con) == _setting(connect(tmp_path / "other.duckdb", memory_limit="3GB"))
    # never below half the limit; without a limit of the incident's, nothing changes
    with memory_set_aside(con, 10**12):
        expected.execute(f"SET memory_limit = '{size_bytes('3GB') // 2}B'")
        assert _setting(con) == _setting(expected)
    unlimited = duckdb.connect(str(tmp_path / "unlimited.duckdb"))  # a limit kvforensics.core.db.connect did not set
    before = _setting(unlimited)
    with memory_set_aside(unlimited, 10**9):
        assert _setting(unlimited) == before
