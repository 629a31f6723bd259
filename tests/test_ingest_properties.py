"""Invariants of the requests loader: it never crashes, and every record is loaded, quarantined or a duplicate.

For arbitrary lines (bytes that are not UTF-8, huge numbers, nested JSON, wrong types, NaN and
Infinity literals, empty objects, repeated ids) ``load_requests_file`` returns normally, counts
``records_read == loaded + quarantined + duplicates``, gives every quarantined record a reason, and
loads every valid record with its values unchanged. The same holds for CSV rows and for SGLang's
--log-requests lines.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import Source
from kvforensics.core.canonical import CANONICAL_REQUEST_FIELDS
from kvforensics.core.db import connect
from kvforensics.sources.requests.load import FileLoad, load_requests_file

FAST = settings(
    max_examples=int(__import__("os").environ.get("KVF_EXAMPLES", 60)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# the three readers side by side cost a second or so an example: half as many
READERS_SIDE_BY_SIDE = settings(FAST, max_examples=max(1, FAST.max_examples // 2))
COMPRESSION_MAGIC = (b"\x1f\x8b", b"\x28\xb5\x2f\xfd")  # gzip, zstd: recognised whatever the file name
SGLANG_FIXTURES = Path(__file__).parent / "fixtures" / "sglang_requests"
SGLANG_LINES = sorted({line for f in SGLANG_FIXTURES.glob("*.log") for line in f.read_text().splitlines()})

# values: no surrounding spaces (the loader trims), never empty
name_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(
    lambda s: s.strip() == s and s.strip(" ") != ""
)
# from 2000: an epoch in milliseconds before 1973-03 is indistinguishable from one in seconds
instants = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2199, 12, 31), timezones=st.just(timezone.utc)
)
finite = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=30),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", " ", "NaN", "Infinity", "-1", "1e400", "2026-13-45", "0x10", "200 OK", "\x00", "nan"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
duplicate_ids = st.sampled_from(["dup-1", "dup-2", "dup-3"])


@st.composite
def valid_records(draw: st.DrawFn, index: int) -> dict:
    prompt = draw(st.integers(min_value=0, max_value=2**53 - 1))
    rec: dict = {
        "request_id": f"valid-{index}-" + draw(name_text),
        "ts": draw(instants),
        "account_id": draw(name_text),
        "model": draw(name_text),
        "status": draw(st.integers(min_value=100, max_value=599)),
        "prompt_tokens": prompt,
        "completion_tokens": draw(st.none() | st.integers(min_value=0, max_value=2**53 - 1)),
        "cached_tokens": draw(st.none() | st.integers(min_value=0, max_value=prompt)),
        "ttft_ms": draw(st.none() | finite),
        "latency_ms": draw(st.none() | finite),
        "prefill_instance": draw(st.none() | name_text),
        "decode_instance": draw(st.none() | name_text),
        "cache_salt": draw(st.none() | name_text),
    }
    return rec


@st.composite
def garbage_records(draw: st.DrawFn) -> dict:
    """A JSON object near the schema: canonical keys with arbitrary values, some missing, repeated ids."""
    rec = {}
    for f in CANONICAL_REQUEST_FIELDS:
        if draw(st.booleans()):
            rec[f] = draw(json_values)
    if draw(st.booleans()):
        rec["request_id"] = draw(duplicate_ids)
    elif isinstance(rec.get("request_id"), str) and rec["request_id"].strip().startswith("valid-"):
        rec["request_id"] = "x" + rec["request_id"]
    if draw(st.booleans()):
        rec.update(
            {
                "ts": "2026-08-28T10:00:00Z",
                "account_id": "a",
                "model": "m",
                "status": 200,
                "prompt_tokens": draw(st.integers(0, 5)),
            }
            if draw(st.booleans())
            else {}
        )
    return rec


def _ts_text(ts: datetime, style: str) -> object:
    if style == "epoch_ms":
        return int(ts.timestamp() * 1000)
    if style == "offset":
        return ts.astimezone(timezone(timedelta(hours=5, minutes=30))).isoformat()
    return ts.isoformat().replace("+00:00", "Z")


def _source(fmt: str, base: Path) -> Source:
    return Source(name="gw", kind="requests", path="*", format=fmt, timezone="UTC", base_dir=base, columns={})


_CONNECTION: list = []


def _empty_database():
    """One evidence database for the whole module, emptied per example (opening one costs ~50 ms)."""
    if not _CONNECTION:
        _CONNECTION.append(connect())
    con = _CONNECTION[0]
    con.execute("DELETE FROM requests").fetchall()
    con.execute("DELETE FROM quarantine").fetchall()
    return con


def _load(fmt: str, name: str, data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(data)
        con = _empty_database()
        load = load_requests_file(con, _source(fmt, Path(d)), path)
        return con, load


def _check_accounting(con, load: FileLoad) -> None:
    assert load.records_read == load.loaded + load.quarantined + load.duplicates
    reasons = [r[0] for r in con.execute("SELECT reason FROM quarantine").fetchall()]
    assert len(reasons) == load.quarantined
    assert all(isinstance(r, str) and r.strip() for r in reasons)
    assert con.execute("SELECT count(*) FROM requests").fetchall()[0][0] == load.loaded


def _check_round_trip(con, valid: list[dict], ts_exact: bool = True) -> None:
    cols = ", ".join(CANONICAL_REQUEST_FIELDS)
    got = {r[0]: r for r in con.execute(f"SELECT {cols} FROM requests").fetchall()}
    for rec in valid:
        row = got.get(rec["request_id"])
        assert row is not None, f"valid record {rec['request_id']!r} was not loaded"
        expected = tuple(rec[f] for f in CANONICAL_REQUEST_FIELDS)
        assert row[0] == expected[0] and row[2:] == expected[2:]
        delta = abs((row[1] - rec["ts"]).total_seconds())
        assert delta == 0 if ts_exact else delta < 0.001


line_kinds = st.one_of(
    st.binary(max_size=80).map(lambda b: b.replace(b"\n", b" ").replace(b"\r", b" ")),
    st.text(max_size=80).map(lambda t: t.replace("\n", " ").replace("\r", " ").encode("utf-8", "surrogatepass")),
    garbage_records().map(lambda r: json.dumps(r).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from(
        [
            b"{}",
            b"[]",
            b"null",
            b"{\"request_id\": {\"nested\": [1, {\"a\": NaN}]}}",
            b"   ",
            b"{\"request_id\": \"dup-1\", \"prompt_tokens\": 1e999}",
            b"\xff\xfe{\"a\": 1}",
        ]
    ),
)


@FAST
@given(
    garbage=st.lists(line_kinds, max_size=25),
    n_valid=st.integers(0, 4),
    data=st.data(),
    ts_style=st.sampled_from(["iso", "epoch_ms", "offset"]),
)
def test_jsonl_never_crashes_and_accounts_for_every_line(garbage, n_valid, data, ts_style):
    valid = [data.draw(valid_records(i)) for i in range(n_valid)]
    lines = list(garbage)
    for rec in valid:
        at = data.draw(st.integers(0, len(lines)))
        lines.insert(at, json.dumps({**rec, "ts": _ts_text(rec["ts"], ts_style)}).encode())
    data_bytes = b"\n".join(lines) + b"\n"
    con, load = _load("jsonl", "gw.jsonl", data_bytes)
    _check_accounting(con, load)
    if data_bytes.startswith(COMPRESSION_MAGIC):  # read as a (broken) compressed stream, and said so
        assert any("ends early" in note for note in load.notes)
        return
    assert load.records_read == sum(1 for line in lines if line.strip())
    # an epoch in milliseconds keeps only milliseconds of the instant
    _check_round_trip(con, valid, ts_exact=ts_style != "epoch_ms")


def test_a_line_of_ascii_whitespace_is_blank_to_every_reader():
    """Tab, VT and FF lines are blank (bytes.strip()), on the DuckDB reader as on the Python one;
    a line holding another control character is a record, quarantined as malformed."""
    for data in (b"\t\n", b" \x0b\x0c\r\n", b"\t\n\x1c\n"):
        con, load = _load("jsonl", "gw.jsonl", data)
        _check_accounting(con, load)
        assert load.records_read == sum(1 for line in data.split(b"\n") if line.strip())


csv_fields = st.one_of(
    st.text(max_size=15),
    json_scalars.map(lambda v: "" if v is None else str(v)),
    st.binary(max_size=10).map(lambda b: b.decode("utf-8", "surrogateescape")),
)


@FAST
@given(garbage=st.lists(st.lists(csv_fields, max_size=14), max_size=20), n_valid=st.integers(0, 4), data=st.data())
def test_csv_never_crashes_and_loads_every_valid_row(garbage, n_valid, data):
    valid = [data.draw(valid_records(i)) for i in range(n_valid)]
    rows = [list(r) for r in garbage]
    for rec in valid:
        at = data.draw(st.integers(0, len(rows)))
        rows.insert(
            at,
            [
                ""
                if rec[f] is None
                else _ts_text(rec[f], "iso")
                if f == "ts"
                else repr(rec[f])
                if isinstance(rec[f], float)
                else str(rec[f])
                for f in CANONICAL_REQUEST_FIELDS
            ],
        )
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(CANONICAL_REQUEST_FIELDS)
    writer.writerows(rows)
    con, load = _load("csv", "gw.csv", out.getvalue().encode("utf-8", "surrogateescape"))
    _check_accounting(con, load)
    _check_round_trip(con, valid)


@FAST
@given(body=st.binary(max_size=400))
def test_csv_of_arbitrary_bytes_after_a_good_header_never_crashes(body):
    con, load = _load("csv", "gw.csv", ",".join(CANONICAL_REQUEST_FIELDS).encode() + b"\n" + body)
    _check_accounting(con, load)


@st.composite
def mutated_sglang_line(draw: st.DrawFn) -> bytes:
    line = draw(st.sampled_from(SGLANG_LINES))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(line)))
        piece = draw(st.text(alphabet="'\"()[]{},:= 0123456789.-eNaI\\x", max_size=4))
        line = line[:at] + piece + line[at + draw(st.integers(0, 4)) :] if draw(st.booleans()) else line[:at]
    return line.encode()


@st.composite
def sglang_json_event(draw: st.DrawFn) -> bytes:
    meta = {
        k: draw(json_values)
        for k in (
            "id",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "e2e_latency",
            "request_received_ts",
            "first_token_latency",
        )
        if draw(st.booleans())
    }
    record = {
        "timestamp": draw(st.sampled_from(["2026-08-28T10:00:00.5", "", "garbage", "2026-08-28T10:00:00Z"])),
        "event": draw(
            st.sampled_from(["request.received", "request.finished", "request.received.openai", "request.other"])
        ),
        "rid": draw(duplicate_ids | json_values),
        "obj": draw(
            st.dictionaries(st.sampled_from(["rid", "model", "received_time", "routing_key"]), json_values, max_size=3)
            | json_values
        ),
        "headers": draw(
            st.dictionaries(st.sampled_from(["x-smg-routing-key", "x-account"]), json_values, max_size=2) | json_values
        ),
        "out": draw(st.just({"meta_info": meta}) | json_values),
    }
    return json.dumps(record).encode()


@FAST
@given(
    lines=st.lists(
        st.one_of(
            st.sampled_from(SGLANG_LINES).map(str.encode), mutated_sglang_line(), sglang_json_event(), line_kinds
        ),
        max_size=25,
    ),
    account=st.sampled_from([None, "headers.x-account", "obj.rid", "meta_info"]),
)
def test_sglang_request_log_never_crashes_and_accounts_for_every_request(lines, account):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "requests.log"
        path.write_bytes(b"\n".join(lines) + b"\n")
        con = _empty_database()
        src = Source(
            name="eng",
            kind="requests",
            path="*",
            format="sglang_requests",
            timezone="Europe/Berlin",
            base_dir=Path(d),
            columns={"account_id": account} if account else {},
            model="m",
        )
        load = load_requests_file(con, src, path)
    _check_accounting(con, load)
    rows = con.execute("SELECT ts, latency_ms, ttft_ms FROM requests").fetchall()
    assert all(
        ts is not None and (lat is None or math.isfinite(lat)) and (tt is None or math.isfinite(tt))
        for ts, lat, tt in rows
    )


@READERS_SIDE_BY_SIDE
@given(
    garbage=st.lists(garbage_records(), max_size=12),
    n_valid=st.integers(0, 4),
    data=st.data(),
    ts_style=st.sampled_from(["iso", "epoch_ms", "offset"]),
    blank=st.booleans(),
)
def test_the_three_jsonl_readers_agree_on_arbitrary_records(garbage, n_valid, data, ts_style, blank):
    """DuckDB's NDJSON reader, DuckDB's line reader and the Python reader load, refuse and count the
    same records with the same reasons, values and notes, whatever the values' JSON types."""
    lines = [json.dumps(g) for g in garbage]
    for i in range(n_valid):
        rec = data.draw(valid_records(i))
        lines.insert(data.draw(st.integers(0, len(lines))), json.dumps({**rec, "ts": _ts_text(rec["ts"], ts_style)}))
    if blank:
        lines.insert(data.draw(st.integers(0, len(lines))), "")
    payload = ("\n".join(lines) + "\n").encode()
    _assert_jsonl_readers_agree(payload)


def _assert_jsonl_readers_agree(payload: bytes) -> dict[str, str]:
    """Load the payload with each JSONL reader forced first; all must give the same counts, notes,
    quarantine and rows. Returns which reader loaded the file in each case."""
    import kvforensics.sources.requests.readers as request_readers

    results = {}
    readers = {}
    previous = (request_readers.FAST_STAGING, request_readers.JSON_READERS)
    try:
        for name, fast, json_readers in (
            ("text", True, ("text",)),
            ("json", True, ("json",)),
            ("lines", True, ()),
            ("python", False, ()),
        ):
            request_readers.FAST_STAGING, request_readers.JSON_READERS = fast, json_readers
            con, load = _load("jsonl", "gw.jsonl", payload)
            readers[name] = load.reader
            results[name] = (
                (load.records_read, load.loaded, load.quarantined, load.duplicates),
                sorted(load.notes),
                # a conflict names the file (in each load's own temporary folder) holding the kept record
                con.execute(
                    "SELECT line, replace(reason, $dir, '<dir>'), raw FROM quarantine ORDER BY line, reason",
                    {"dir": str(load.file.parent)},
                ).fetchall(),
                con.execute("SELECT * EXCLUDE (source_file) FROM requests ORDER BY request_id").fetchall(),
            )
    finally:
        request_readers.FAST_STAGING, request_readers.JSON_READERS = previous
    assert results["text"] == results["json"] == results["lines"] == results["python"]
    return readers


# values that load, in JSON types and spellings a reader could misread: numbers where text is
# expected (exponent forms included), numeric text and integral floats where numbers are expected
loose_text = st.one_of(
    name_text,
    st.integers(-(10**25), 10**25),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x == x),
    st.sampled_from(["true", "false", "null", "{x}", "[1]", "1e5", "-2.5E-3", "0x1"]),
)


@st.composite
def loose_valid_records(draw: st.DrawFn, index: int) -> dict:
    rec = draw(valid_records(index))
    for f in ("account_id", "model", "prefill_instance", "decode_instance"):
        if rec[f] is not None and draw(st.integers(0, 3)) == 0:
            rec[f] = draw(loose_text)
    for f in ("status", "prompt_tokens", "completion_tokens"):
        if rec[f] is not None:
            rec[f] = draw(st.sampled_from([rec[f], str(rec[f]), float(rec[f])]))
    if draw(st.integers(0, 3)) == 0:
        rec["request_id"] = draw(st.integers(0, 10**25) | st.floats(1, 1e300) | st.sampled_from(["true", "[x]"]))
    return rec


@READERS_SIDE_BY_SIDE
@given(data=st.data(), n=st.integers(1, 6), ts_style=st.sampled_from(["iso", "epoch_ms", "offset"]))
def test_the_jsonl_readers_agree_on_loose_valid_records(data, n, ts_style):
    """Records that all load (or collide as duplicate ids) but spell their values loosely: the text
    reader keeps the file only when it reads every value exactly as the JSON reader does."""
    lines = []
    for i in range(n):
        rec = data.draw(loose_valid_records(i))
        lines.append(json.dumps({**rec, "ts": _ts_text(rec["ts"], ts_style)}))
    readers = _assert_jsonl_readers_agree(("\n".join(lines) + "\n").encode())
    assert readers["json"] == "duckdb-json" and readers["text"] in ("duckdb-json-text", "duckdb-lines")
