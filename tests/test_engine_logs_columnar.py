"""The columnar engine-log reader agrees with the line-by-line parsers, event for event.

The Python parsers are the reference; :func:`parse_engine_file_columnar` must give the same
start-ups, events, quarantined lines, notes and line counts on every real fixture log and on
generated logs (near-misses of the lines it reads itself, DST hours, compression, truncation).
"""

from __future__ import annotations

import gzip
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import duckdb
import pyarrow as pa
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.core.db import run_script
from kvforensics.sources.engine_logs.clock import LocalClock
from kvforensics.sources.engine_logs.columnar import EvidenceSink, parse_engine_file_columnar
from kvforensics.sources.engine_logs.contract import BATCH_COLUMNS, EVENT_COLUMNS
from kvforensics.sources.engine_logs.parse import EngineFileParse, parse_engine_file

FIXTURES = Path(__file__).parent / "fixtures"
REAL_LOGS = sorted(
    p
    for d in ("engine_logs", "audit", "envelopes", "sglang_requests")
    for p in (FIXTURES / d).iterdir()
    if p.suffix in (".log", ".jsonl", ".json") and not p.name.endswith(".server_info.json")
)
NEW_YORK = ZoneInfo("America/New_York")


def _both(path: Path, **kw: object) -> tuple[EngineFileParse, EngineFileParse]:
    args = {"fmt": "auto", "instance": "i", "tz": ZoneInfo("UTC"), "year": 2026, "envelope": "auto", **kw}
    batch_lines = args.pop("batch_lines", 50_000)
    sink = args.pop("sink", True)
    reference = parse_engine_file(path, **args)  # type: ignore[arg-type]
    columnar = parse_engine_file_columnar(path, **args, batch_lines=batch_lines)  # type: ignore[arg-type]
    if sink:
        _assert_sink_stores_the_same(path, reference, args, batch_lines)
    return reference, columnar


def _assert_sink_stores_the_same(path: Path, reference: EngineFileParse, args: dict, batch_lines: int) -> None:
    """With a sink, the rows read column-wise go into the evidence tables as they are read: those rows
    plus what the parse still holds are the reference's events and batches (as ingest stores them)."""
    with duckdb.connect() as con:
        run_script(con, "schema")
        sunk = parse_engine_file_columnar(
            path,
            **args,
            batch_lines=batch_lines,
            con=con,  # type: ignore[arg-type]
            sink=EvidenceSink("s", str(path)),
        )
        assert not any(p.event_tables or p.batch_tables for p in sunk.instances.values())
        assert sunk.startups == reference.startups and sunk.lines_read == reference.lines_read
        assert sunk.all_quarantined() == reference.all_quarantined() and sunk.all_notes() == reference.all_notes()
        names = ", ".join(EVENT_COLUMNS.names).replace("line", "source_line")
        stored = (
            con.sql(
                f"SELECT {names} FROM engine_events WHERE source = 's' AND source_file = $f", params={"f": str(path)}
            )
            .to_arrow_table()
            .rename_columns(EVENT_COLUMNS.names)
        )
        events = pa.concat_tables([stored.cast(EVENT_COLUMNS), sunk.event_table()]).sort_by("line")
        assert events.to_pylist() == reference.event_table().sort_by("line").to_pylist()
        names = ", ".join(BATCH_COLUMNS.names).replace("line", "source_line")
        stored = con.sql(f"SELECT {names} FROM prefill_batches").to_arrow_table().rename_columns(BATCH_COLUMNS.names)
        batches = pa.concat_tables([stored.cast(BATCH_COLUMNS), sunk.batch_table()]).sort_by("line")
        assert batches.to_pylist() == reference.batch_table().sort_by("line").to_pylist()


def _assert_same(reference: EngineFileParse, columnar: EngineFileParse) -> None:
    assert columnar.envelope == reference.envelope
    assert columnar.lines_read == reference.lines_read
    assert columnar.startups == reference.startups
    assert columnar.events == reference.events
    assert columnar.all_quarantined() == reference.all_quarantined()
    assert columnar.all_notes() == reference.all_notes()
    assert columnar.warnings == reference.warnings
    assert columnar.event_table().to_pylist() == reference.event_table().to_pylist()
    assert columnar.batches == reference.batches
    assert columnar.batch_table().to_pylist() == reference.batch_table().to_pylist()


@pytest.mark.parametrize("path", REAL_LOGS, ids=lambda p: f"{p.parent.name}/{p.name}")
@pytest.mark.parametrize("batch_lines", [3, 50_000])
def test_real_fixture_logs_read_the_same(path: Path, batch_lines: int) -> None:
    _assert_same(*_both(path, batch_lines=batch_lines, sink=batch_lines == 3))


def _request_line(i: int, stamp: str = "2026-08-27 10:00:0{s}", ranks: str = " TP0", body: str | None = None) -> str:
    body = body or f"rid=r{i}, bootstrap_room={i}, input_len={100 + i}, cached_input_len=0, output_len=1, type=prefill"
    return f"[{stamp.format(s=i % 10)}{ranks}] ReqTimeStats({body}): bootstrap_duration=1.00ms, queue_duration=2.00ms"


START = [
    "[2026-08-27 09:59:00] server_args=ServerArgs(model_path='m', tp_size=2, disaggregation_mode='prefill')",
    "[2026-08-27 09:59:05 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 681280, KV size: 20.00 GB",
    "[2026-08-27 09:59:05 TP1] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 681280, KV size: 20.00 GB",
    "[2026-08-27 09:59:06 TP0] max_total_num_tokens=681280, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    "max_running_requests=64, context_len=1048576, available_gpu_mem=5.12 GB",
    "[2026-08-27 09:59:07] The server is fired up and ready to roll!",
]


def test_request_lines_are_read_column_wise_and_give_the_parsers_answer(tmp_path: Path) -> None:
    lines = START + [_request_line(i, ranks=f" TP{i % 2}") for i in range(200)]
    path = tmp_path / "prefill.log"
    path.write_text("\n".join(lines) + "\n")
    reference, columnar = _both(path, batch_lines=64)
    _assert_same(reference, columnar)
    (parse,) = columnar.instances.values()
    read_here = sum(t.num_rows for t in parse.event_tables)
    assert read_here >= 190  # all but the first line of each run (one run per batch)
    assert all(t.schema == EVENT_COLUMNS for t in parse.event_tables)
    assert len(parse.events) == 200 - read_here
    assert columnar.startups[0].tp_size == 2 and columnar.startups[0].last_line == len(lines)


# The prefill batch forms of SGLang's scheduler (see kvforensics/sources/engine_logs/sglang/batches.py): 0.5.x
# scheduler_components/metrics_reporter.py (PD prefill and hybrid variants), 0.4.x scheduler.py (a period,
# cache hit rate, mixed chunked prefill).
def _batch_line(
    i: int,
    stamp: str = "2026-08-27 10:00:0{s}",
    ranks: str = " TP0",
    body: str | None = None,
    head: str = "Prefill batch, ",
) -> str:
    body = body or (
        f"#new-seq: 1, #new-token: {200 + i}, #cached-token: {64 * (i % 3)}, token usage: 0.{i % 10}1, "
        f"#running-req: {i % 4}, #queue-req: 0, #pending-token: 0, cuda graph: False, "
        f"input throughput (token/s): 1234.50"
    )
    return f"[{stamp.format(s=i % 10)}{ranks}] {head}{body}"


PD_BATCH = (
    "#new-seq: 2, #new-token: 900, #cached-token: 128, token usage: 0.05, #running-req: 0, #queue-req: 1, "
    "#pending-token: 0, #bootstrap-req: 0, #inflight-req: 1, #optimistic-req: 0, cuda graph: False, "
    "input throughput (token/s): 5000.00"
)


def test_prefill_batch_lines_are_read_column_wise_with_the_role_they_hint(tmp_path: Path) -> None:
    bare = [s for s in START if "server_args" not in s]  # no server_args: the role comes from the batch lines
    lines = bare + [(_batch_line(i, body=PD_BATCH) if i % 3 else _request_line(i)) for i in range(120)]
    path = tmp_path / "prefill.log"
    path.write_text("\n".join(lines) + "\n")
    reference, columnar = _both(path, batch_lines=40)
    _assert_same(reference, columnar)
    (parse,) = columnar.instances.values()
    read_here = sum(t.num_rows for t in parse.batch_tables)
    assert read_here >= 70 and len(parse.prefill_batches) == 80 - read_here
    assert columnar.startups[0].role == "prefill"
    assert columnar.startups[0].flags["prefix_cache_hit_line"] == str(len(bare) + 2)  # i = 1
    assert {b.role for b in columnar.batches} == {"prefill"}


def test_a_private_or_the_callers_connection(tmp_path: Path) -> None:
    path = tmp_path / "p.log"
    path.write_text("\n".join(START + [_request_line(i) for i in range(20)]) + "\n")
    with duckdb.connect() as con:
        via_con = parse_engine_file_columnar(path, fmt="sglang", instance="i", tz=ZoneInfo("UTC"), con=con)
        assert con.execute("SELECT 42").fetchall() == [(42,)]
    own = parse_engine_file_columnar(path, fmt="sglang", instance="i", tz=ZoneInfo("UTC"))
    assert via_con.events == own.events and len(own.events) == 20


# Lines the columnar reader must leave to the parser, or read exactly as the parser does.
NEAR_MISSES = [
    _request_line(1, body="rid=a, input_len=5, input_len=6"),  # the later value wins in the parser
    _request_line(2, body="rid=a, rid=b, input_len=5"),
    _request_line(3, body="rid=, input_len=5"),
    _request_line(4, body="rid=a b, input_len=5"),
    _request_line(5, body="rid=a, input_len=5 "),
    _request_line(6, body="rid=a, input_len=-5"),
    _request_line(7, body="rid=a, input_len=1234567890123456789012"),
    _request_line(8, body="rid=a, cached_input_len=3"),
    _request_line(9, body="rid=a, type=x=y, input_len=2"),
    _request_line(10, body="rid=a, input_len=2, extra=ümlaut"),
    _request_line(10, body="rid=a\x1c, input_len=2"),
    _request_line(10, body="rid=a, input_len=\t2"),
    _request_line(10, ranks=" TP0\x0bX"),
    _request_line(11, stamp="2026-02-30 10:00:00"),
    _request_line(12, stamp="2026-08-27 24:00:00"),
    _request_line(13, stamp="2026-08-27 10:00:60"),
    _request_line(14, stamp="2026-08-27 10:00:00.1234567"),
    _request_line(15, stamp="2026-08-27 10:00:00,25"),
    _request_line(16, stamp="2026-08-27 10:00:00.000001"),
    _request_line(17, ranks=" DP1 TP3 PP0"),
    _request_line(18, ranks=""),
    _request_line(19, ranks="  TP1 "),
    _request_line(20, stamp="0000-01-01 00:00:00"),
    _request_line(21, stamp="9999-12-31 23:59:59"),
    _request_line(22, stamp="2026-03-08 02:30:00"),  # skipped in New York
    _request_line(23, stamp="2026-11-01 01:30:00"),  # repeated in New York
    _request_line(24, stamp="2026-11-01 00:59:59"),
    _request_line(25, body="rid=a, input_len=5, note=Input length (9 tokens) exceeds the maximum allowed length"),
    _request_line(26, body="rid=a, input_len=5, msg=KV checksum mismatch req=b"),
    _request_line(27, body="rid=a, input_len=5, why=SIGTERM received"),
    _request_line(28, body="rid=a, input_len=5, pkg=sglang"),
    _request_line(29) + " KV Cache is allocated. #tokens: 5",
    "[2026-08-27 10:00:00 TP0]  ReqTimeStats(rid=a, input_len=5)",
    "[2026-08-27 10:00:00 TP0] Receive: obj=ReqTimeStats(rid=a, input_len=5)",
    "[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5",
    "[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5) abort rid=b",
    "[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)" + "x" * 400,
    "[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)\x1b[0m",
    "[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)\x00",
    "[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)\r",
    "(SGLangWorker pid=5) [2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)",
    "2026-08-27T10:00:00.5Z [2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)",
    "[10:00:00 TP0] ReqTimeStats(rid=a, input_len=5)",
    "[2026-08-27 10:00:00 TP0] Req Time Stats(rid=a, input len=5, output len=1)",
    "[2026-08-27 10:00:00 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 5000, KV size: 1.00 GB",
    "[2026-08-27 10:00:00 TP0] max_total_num_tokens=5000, chunked_prefill_size=8192, context_len=4096",
    "[2026-08-27 10:00:00 TP0] The server is fired up and ready to roll!",
    "[2026-08-27 10:00:00] SIGTERM received. signum=15 frame=None. Draining requests and shutting down...",
    "[2026-08-27 10:00:00] server_args=ServerArgs(model_path='m', tp_size=4,",
    "  context_length=8192)",
    "sglang version: 0.5.20",
    "Traceback (most recent call last):",
    "",
    _batch_line(30),
    _batch_line(
        31,
        head="Prefill batch. ",
        body="#new-seq: 1, #new-token: 5, #cached-token: 0, cache hit rate: 0.00%, "
        "token usage: 0.01, #running-req: 0, #queue-req: 0",
    ),
    _batch_line(32, head="Prefill batch [17], "),
    _batch_line(
        33,
        head="Prefill batch(mixed #running-req: 3). ",
        body="#new-seq: 1, #new-token: 5, #cached-token: 2, cache hit rate: 1.00%, #queue-req: 0",
    ),
    _batch_line(34, body=PD_BATCH),
    _batch_line(
        35,
        body="#new-seq: 1, #new-token: 9, #cached-token: 0, full token usage: 0.10, "
        "swa token usage: 0.30, #running-req: 1, #queue-req: 0, ",
    ),
    _batch_line(
        36,
        body="#new-seq: 1, #new-token: 9, #cached-token: 0, full token usage: 0.10, mamba usage: 0.2, "
        "#unbootstrapped-req: 0, #queue-req: 0, #transferring-req: 2, ",
    ),
    _batch_line(37, body="#new-seq: 1, #new-token: 9, #cached-token: -1, token usage: 0.10"),
    _batch_line(38, body="#new-seq: 1, #new-token: 9, token usage: 0.10"),
    _batch_line(39, body="#new-seq: 1, #new-token: 12345678901234567890, #cached-token: 0"),
    _batch_line(40, body="#new-seq: 1, #new-token: 9, #cached-token: 4, #cached-token: 5, token usage: x"),
    _batch_line(41, body="#new-seq: 1, #new-token: 9, #cached-token: 4,token usage: 0.5"),
    _batch_line(42, body="#new-seq: 1, #new-token: 9,  #cached-token: 4"),
    _batch_line(43, body="#new-seq: 1, #new-token: 9, #cached-token: 4: 5"),
    _batch_line(44, body="#new-seq: 1, #new-token: 9, #cached-token: 4, token usage: 0.5, "),
    _batch_line(45, body="#new-seq: 1, #new-token: 9, #cached-token: 4, token usage: 1e3, #queue-req: 08"),
    _batch_line(46, body="#new-seq: 1, #new-token: 9, #cached-token: 4, note: ReqTimeStats(rid=a, input_len=5)"),
    _batch_line(47, body="#new-seq: 1, #new-token: 9, #cached-token: 4, note: Prefill transfer failed"),
    _batch_line(48, body="#new-seq: 1, #new-token: 9, #cached-token: 4, x: #prealloc-req: 1, #transfer-req: 2"),
    _batch_line(49, body="#new-seq: \u0661, #new-token: 9, #cached-token: 4"),
    _batch_line(50, head="Prefill batch,"),
    _batch_line(51, head=" Prefill batch, "),
    _batch_line(52, head="Prefill batches, "),
    _batch_line(53, ranks=" DP1 TP3 MOE_DP1 XTP2"),
]


@st.composite
def generated_log(draw: st.DrawFn) -> list[str | bytes]:
    out: list[str | bytes] = list(draw(st.sampled_from([[], START, START[:2]])))
    for _ in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(["run", "batches", "miss", "bytes"]))
        if kind == "batches":
            ranks = draw(st.sampled_from(["", " TP0", " DP1 TP2"]))
            body = draw(st.sampled_from([None, PD_BATCH]))
            start = draw(st.integers(0, 10_000))
            out += [_batch_line(start + i, ranks=ranks, body=body) for i in range(draw(st.integers(1, 6)))]
        elif kind == "run":
            ranks = draw(st.sampled_from(["", " TP0", " TP1", " DP1 TP0", " TP7"]))
            stamp = draw(
                st.sampled_from(
                    [
                        "2026-08-27 10:00:0{s}",
                        "2026-11-01 01:59:5{s}",
                        "2026-11-01 02:00:0{s}.5",
                        "2026-03-08 01:59:5{s}",
                        "2026-12-31 23:59:5{s}.123456",
                    ]
                )
            )
            start = draw(st.integers(0, 10_000))
            out += [_request_line(start + i, stamp=stamp, ranks=ranks) for i in range(draw(st.integers(1, 8)))]
        elif kind == "miss":
            out.append(draw(st.sampled_from(NEAR_MISSES)))
        else:
            out.append(
                draw(
                    st.sampled_from(
                        [b"\xff\xfe not utf-8", b"[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=\xff)", b"\x00\x00\x00"]
                    )
                )
            )
    return out


def _write(path: Path, lines: list[str | bytes], compression: str, newline: bytes) -> None:
    data = newline.join(x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in lines)
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=generated_log(),
    batch_lines=st.sampled_from([2, 5, 1000]),
    zone=st.sampled_from(["UTC", "America/New_York", "Australia/Lord_Howe"]),
    clock_offset_s=st.sampled_from([0.0, -3600.5]),
    compression=st.sampled_from(["none", "gzip", "zstd"]),
    newline=st.sampled_from([b"\n", b"\r\n"]),
    final_newline=st.booleans(),
)
def test_generated_logs_read_the_same(
    lines: list[str | bytes],
    batch_lines: int,
    zone: str,
    clock_offset_s: float,
    compression: str,
    newline: bytes,
    final_newline: bool,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.log"
        _write(path, lines + ([""] if final_newline else []), compression, newline)
        kw = {
            "fmt": "sglang",
            "tz": ZoneInfo(zone),
            "clock_offset_s": clock_offset_s,
            "batch_lines": batch_lines,
            "sink": batch_lines == 5,
        }  # stored through a sink too on a third of the examples
        _assert_same(*_both(path, **kw))


def test_a_truncated_gzip_stream_ends_the_same(tmp_path: Path) -> None:
    path = tmp_path / "engine.log.gz"
    data = gzip.compress(("\n".join(START + [_request_line(i) for i in range(300)]) + "\n").encode())
    path.write_bytes(data[: len(data) * 2 // 3])
    reference, columnar = _both(path, fmt="sglang", batch_lines=50)
    _assert_same(reference, columnar)
    assert any("truncated" in n for n in columnar.all_notes())


def test_dst_hours_are_left_to_the_parser_which_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("\n".join(START + [_request_line(i, stamp="2026-11-01 01:30:0{s}") for i in range(30)]) + "\n")
    reference, columnar = _both(path, fmt="sglang", tz=NEW_YORK)
    _assert_same(reference, columnar)
    assert any("repeated hour" in n for n in columnar.all_notes())
    assert not columnar.instances["i"].event_tables


def test_vllm_and_enveloped_files_take_the_reference_path() -> None:
    for path in (FIXTURES / "engine_logs" / "vllm-0.6.3.log", FIXTURES / "envelopes" / "kubectl-glm53-decode-0.log"):
        reference, columnar = _both(path)
        _assert_same(reference, columnar)
        assert not any(p.event_tables for p in columnar.instances.values())


def test_an_hour_with_a_daylight_saving_change_has_no_single_shift() -> None:
    clock = LocalClock(NEW_YORK, clock_offset_s=1.5)
    assert clock.hour_shift_us(2026, 8, 27, 10) == -4 * 3600 * 1_000_000 - 1_500_000  # EDT, minus the clock offset
    assert clock.hour_shift_us(2026, 3, 8, 2) is None  # skipped
    assert clock.hour_shift_us(2026, 11, 1, 1) is None  # repeated
    assert clock.hour_shift_us(2026, 2, 30, 10) is None  # not a date
    assert clock.hour_shift_us(9999, 12, 31, 23) is None  # its UTC instant is out of range
    local = datetime(2026, 8, 27, 10, 17, 3, 250)
    shift = clock.hour_shift_us(2026, 8, 27, 10)
    assert shift is not None
    assert clock.to_utc(local, 1) == local.replace(tzinfo=UTC) - timedelta(microseconds=shift)
