"""Engine-log plumbing shared by the SGLang and vLLM parsers: reading files, clocks, repr dumps."""

from __future__ import annotations

import gzip
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock
from zoneinfo import ZoneInfo

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforensics.core.errors import InputError
from kvforensics.sources.engine_logs import lines as engine_lines
from kvforensics.sources.engine_logs.parse import (
    LocalClock,
    PoolReport,
    PoolReports,
    open_lines,
    parse_engine_log,
    parse_repr_fields,
    sniff_format,
    split_outer_prefixes,
)

FIXTURES = Path(__file__).parent / "fixtures" / "engine_logs"
UTC_ZONE = ZoneInfo("UTC")
LA = ZoneInfo("America/Los_Angeles")

SGLANG_LINES = (
    b"[2026-08-27 10:00:00] server_args=ServerArgs(model_path='m', tp_size=1, disaggregation_mode='prefill')\n"
    b"[2026-08-27 10:00:05] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 681280, KV size: 20.00 GB\n"
    b"[2026-08-27 10:00:06] max_total_num_tokens=681280, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    b"max_running_requests=64, context_len=1048576, available_gpu_mem=5.12 GB\n"
    b"[2026-08-27 10:00:07] The server is fired up and ready to roll!\n"
)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --- open_lines ------------------------------------------------------------------------------


def test_open_lines_plain_numbers_lines_from_one_and_keeps_raw_bytes(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.log", b"first\r\nsecond\nthird without newline")
    assert list(open_lines(path)) == [
        (1, "first", b"first"),
        (2, "second", b"second"),
        (3, "third without newline", b"third without newline"),
    ]


def test_open_lines_gives_none_text_for_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.log", b"ok\ncaf\xe9 latin-1\nok again\n")
    assert [(n, t) for n, t, _ in open_lines(path)] == [(1, "ok"), (2, None), (3, "ok again")]


def test_open_lines_reads_gzip_and_zstd_by_their_magic_bytes(tmp_path: Path) -> None:
    gz = _write(tmp_path / "rotated.log.1", gzip.compress(SGLANG_LINES))  # no .gz suffix
    zst = _write(tmp_path / "a.log.zst", zstandard.ZstdCompressor().compress(SGLANG_LINES))
    expected = SGLANG_LINES.decode().splitlines()
    for path, compression in ((gz, "gzip"), (zst, "zstd")):
        stream = open_lines(path)
        assert [t for _, t, _ in stream] == expected
        assert stream.compression == compression
        assert stream.truncated is None


def test_open_lines_reads_multi_member_gzip_and_multi_frame_zstd(tmp_path: Path) -> None:
    gz = _write(tmp_path / "a.gz", gzip.compress(b"a\nb\n") + gzip.compress(b"c\n"))
    zc = zstandard.ZstdCompressor()
    zst = _write(tmp_path / "a.zst", zc.compress(b"a\nb\n") + zc.compress(b"c\n"))
    assert [t for _, t, _ in open_lines(gz)] == ["a", "b", "c"]
    assert [t for _, t, _ in open_lines(zst)] == ["a", "b", "c"]


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_truncated_compressed_file_yields_complete_lines_and_says_where_it_stopped(
    tmp_path: Path, compression: str
) -> None:
    data = b"".join(b"line %05d of the engine log\n" % i for i in range(20000))
    packed = gzip.compress(data) if compression == "gzip" else zstandard.ZstdCompressor().compress(data)
    path = _write(tmp_path / "cut", packed[: len(packed) // 2])
    stream = open_lines(path)
    lines = list(stream)
    assert lines, "the first half of the file is readable"
    assert [t for _, t, _ in lines] == data.decode().splitlines()[: len(lines)]
    assert stream.truncated is not None
    assert stream.truncated.compression == compression
    assert stream.truncated.after_line == len(lines)
    assert stream.truncated.describe().startswith(f"{compression} stream truncated after line {len(lines)}: ")


_LINE_PIECES = st.sampled_from(
    [
        b"",
        b"x",
        b"[2026-08-27 10:00:00 TP0] ReqTimeStats(rid=a)",
        b"\r",
        b"\xef\xbb\xbf",
        b"\xff\xfe",
        "\u00e9\u2026".encode(),
        b"\x00",
        b"\t \x1f",
        b"\xe2\x80",
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(st.lists(_LINE_PIECES, max_size=3).map(b"".join), max_size=12),
    final_newline=st.booleans(),
    compression=st.sampled_from(["none", "gzip", "zstd"]),
    cut=st.sampled_from([None, 0.5, 0.9]),
    max_lines=st.sampled_from([1, 2, 5, 1000]),
    chunk=st.sampled_from([None, 3, 17]),
    max_bytes=st.sampled_from([None, 1, 12, 40]),
)
def test_line_batches_are_the_lines_iteration_gives(
    lines: list[bytes],
    final_newline: bool,
    compression: str,
    cut: float | None,
    max_lines: int,
    chunk: int | None,
    max_bytes: int | None,
) -> None:
    """Batches cut by offsets (valid UTF-8) and batches read line by line (anything else) both give
    iteration's numbers, texts, bytes and truncation; the Arrow column holds the texts. With small
    reads (*chunk* bytes), lines and batches span reads; a batch holds at most *max_bytes* (or one line)."""
    data = b"\n".join(lines) + (b"\n" if final_newline else b"")
    in_file = data.split(b"\n")
    if compression != "none":
        data = gzip.compress(data) if compression == "gzip" else zstandard.ZstdCompressor().compress(data)
        if cut is not None:
            data = data[: int(len(data) * cut)]
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(engine_lines, "_CHUNK", chunk or engine_lines._CHUNK):
        path = _write(Path(tmp) / "engine.log", data)
        stream = open_lines(path)
        expected = list(stream)
        batched = open_lines(path)
        got, sizes = [], []
        for batch in batched.batches(max_lines, max_bytes):
            assert 0 < len(batch.raws) <= max_lines and len(batch.texts) == len(batch.raws)
            assert batch.column.to_pylist() == list(batch.texts)
            got += [(batch.first + i, batch.texts[i], batch.raws[i]) for i in range(len(batch.raws))]
            sizes.append([len(in_file[batch.first + i - 1]) + 1 for i in range(len(batch.raws))])  # bytes in the file
    # every batch but the last is full: max_lines lines, or the next line would pass max_bytes
    for lengths, following in zip(sizes, sizes[1:], strict=False):
        if max_bytes is not None and len(lengths) > 1:
            assert sum(lengths) <= max_bytes
        assert len(lengths) == max_lines or (max_bytes is not None and sum(lengths) + following[0] > max_bytes)
    assert got == expected
    assert batched.lines_yielded == stream.lines_yielded == len(expected)
    assert batched.truncated == stream.truncated


def test_open_lines_refuses_a_missing_file_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"missing\.log: cannot open engine log"):
        open_lines(tmp_path / "missing.log")


# --- parse_engine_log ------------------------------------------------------------------------


def test_parse_engine_log_reads_a_gzip_file_with_auto_format(tmp_path: Path) -> None:
    path = _write(tmp_path / "prefill-0.log.gz", gzip.compress(SGLANG_LINES))
    parse = parse_engine_log(path, fmt="auto", instance="prefill-0", tz=UTC_ZONE)
    assert parse.lines_read == 4
    [startup] = parse.startups
    assert (startup.engine, startup.role, startup.kv_pool_tokens, startup.context_length) == (
        "sglang",
        "prefill",
        681280,
        1048576,
    )


def test_parse_engine_log_on_truncated_gzip_notes_the_cut_and_quarantines_the_partial_line(
    tmp_path: Path,
) -> None:
    data = SGLANG_LINES * 400
    packed = gzip.compress(data)
    path = _write(tmp_path / "p.log.gz", packed[: len(packed) * 2 // 3])
    parse = parse_engine_log(path, fmt="sglang", instance="p", tz=UTC_ZONE)
    [note] = [n for n in parse.notes if "truncated" in n]
    assert note.startswith("gzip stream truncated after line ")
    complete = int(note.split("after line ")[1].split(":")[0])
    if parse.quarantined:  # the cut fell inside a line (almost always)
        [partial] = parse.quarantined
        assert partial.line == complete + 1
        assert partial.reason == "incomplete last line: gzip stream truncated"
    assert parse.lines_read == complete + len(parse.quarantined)


def test_parse_engine_log_auto_refuses_a_file_it_cannot_recognise(tmp_path: Path) -> None:
    path = _write(tmp_path / "other.log", b"hello\nworld\n")
    with pytest.raises(InputError, match='set format = "sglang" or "vllm"'):
        parse_engine_log(path, fmt="auto", instance="x", tz=UTC_ZONE)


def test_parse_engine_log_rejects_an_unknown_format(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.log", SGLANG_LINES)
    with pytest.raises(InputError, match="unknown engine log format 'trtllm'; use one of: sglang, vllm or auto"):
        parse_engine_log(path, fmt="trtllm", instance="x", tz=UTC_ZONE)


def test_parse_engine_log_on_an_empty_file_returns_an_empty_parse(tmp_path: Path) -> None:
    parse = parse_engine_log(_write(tmp_path / "e.log", b""), fmt="auto", instance="x", tz=UTC_ZONE)
    assert (parse.startups, parse.events, parse.lines_read) == ([], [], 0)
    assert parse.notes == ["empty file: no lines to read"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sglang-0.2-gpu-prefix.log", "sglang"),
        ("sglang-0.2.15-time-only.log", "sglang"),
        ("sglang-0.5.23-ray-post-capture.log", "sglang"),
        ("vllm-0.6.3.log", "vllm"),
        ("vllm-0.33.0-banner-dp.log", "vllm"),
        ("vllm-0.10.1-pd-producer-docker.log", "vllm"),
    ],
)
def test_sniff_format_tells_sglang_from_vllm(name: str, expected: str) -> None:
    text = (FIXTURES / name).read_text()
    assert sniff_format(text.splitlines()) == expected


_VLLM_ENVELOPE = re.compile(r"^(?:INFO|WARNING|ERROR):? +(?:\d\d-\d\d [\d:]+ \[[^\]]*\] )?")
_SGLANG_ENVELOPE = re.compile(r"^\[[^\]]*\] ")


def _bare(name: str, envelope: re.Pattern[str], keep: str) -> list[str]:
    """The messages of fixture *name* whose line holds *keep*, with the engine's envelope stripped."""
    return [
        envelope.sub("", split_outer_prefixes(line).rest)
        for line in (FIXTURES / name).read_text().splitlines()
        if re.search(keep, line)
    ]


def test_sniff_format_recognises_bare_lines_by_their_messages(tmp_path: Path) -> None:
    # issue 29, observation 5: prefixes stripped by a collector; no version, args or summary line among them
    vllm_lines = _bare("vllm-0.11.0-hybrid-pd-prefill.log", _VLLM_ENVELOPE, "KV cache|concurrency|startup complete")
    assert vllm_lines[0] == "Available KV cache memory: 9.87 GiB"
    assert sniff_format(vllm_lines) == "vllm"
    sglang_lines = _bare("sglang-0.5.23-ray-post-capture.log", _SGLANG_ENVELOPE, "Load weight|KV Cache|fired up")
    assert sglang_lines and not any(line.startswith("[") for line in sglang_lines)
    # a model path naming the other engine does not outvote the lines themselves
    assert sniff_format([*sglang_lines, "model_path=/models/vllm-export/llama"]) == "sglang"
    path = tmp_path / "bare.log"
    path.write_text("\n".join(vllm_lines) + "\n")
    [s] = parse_engine_log(path, fmt="auto", instance="x", tz=UTC_ZONE, year=2026).startups
    assert (s.engine, s.kv_pool_tokens, s.context_length) == ("vllm", 190800, 180000)


def test_sniff_format_returns_none_for_unknown_text() -> None:
    assert sniff_format(["hello", None, "INFO:     127.0.0.1 - GET / 200"]) is None


# --- outer prefixes and clocks ---------------------------------------------------------------


def test_split_outer_prefixes_removes_ansi_docker_and_process_prefixes() -> None:
    outer = split_outer_prefixes(
        "2026-08-27T21:00:03.123456789Z \x1b[36m(VllmWorker rank=1 pid=3002)\x1b[0m INFO 08-27 14:00:03 [x.py:1] hi"
    )
    assert outer.docker_ts == datetime(2026, 8, 27, 21, 0, 3, 123456, tzinfo=UTC)
    assert outer.process == "VllmWorker rank=1"
    assert outer.rest == "INFO 08-27 14:00:03 [x.py:1] hi"


def test_local_clock_converts_los_angeles_summer_and_winter_time_to_utc() -> None:
    clock = LocalClock(LA)
    assert clock.to_utc(datetime(2026, 8, 27, 10, 0), 1) == datetime(2026, 8, 27, 17, 0, tzinfo=UTC)  # PDT
    assert clock.to_utc(datetime(2026, 12, 1, 10, 0), 2) == datetime(2026, 12, 1, 18, 0, tzinfo=UTC)  # PST
    assert clock.notes() == []


def test_local_clock_reads_dst_ambiguous_and_missing_times_with_fold_0_and_says_so() -> None:
    clock = LocalClock(LA)
    # 01:30 happens twice on 2026-11-01; fold=0 is the first (PDT, UTC-7)
    assert clock.to_utc(datetime(2026, 11, 1, 1, 30), 10) == datetime(2026, 11, 1, 8, 30, tzinfo=UTC)
    # 02:30 does not exist on 2026-03-08; fold=0 uses the offset before the gap (PST, UTC-8)
    assert clock.to_utc(datetime(2026, 3, 8, 2, 30), 20) == datetime(2026, 3, 8, 10, 30, tzinfo=UTC)
    assert clock.notes() == [
        (
            "1 line(s) fall in the repeated hour when daylight saving time ends in America/Los_Angeles "
            "(first at line 10: 2026-11-01 01:30:00); read with fold=0, i.e. with the UTC offset in force before the change"
        ),
        (
            "1 line(s) fall in the hour skipped when daylight saving time starts (they cannot exist) in "
            "America/Los_Angeles (first at line 20: 2026-03-08 02:30:00); read with fold=0, i.e. with the UTC offset "
            "in force before the change"
        ),
    ]


def test_local_clock_adds_the_clock_offset_in_real_seconds() -> None:
    clock = LocalClock(UTC_ZONE, clock_offset_s=-2.5)
    assert clock.to_utc(datetime(2026, 8, 27, 10, 0, 0), 1) == datetime(2026, 8, 27, 9, 59, 57, 500000, tzinfo=UTC)
    assert clock.notes() == ["clock offset of -2.5 s added to every engine timestamp"]


# --- repr dumps and pool reports -------------------------------------------------------------


def test_parse_repr_fields_reads_nested_values_and_quotes() -> None:
    fields, complete = parse_repr_fields(
        "ServerArgs(model_path='a,b', json_model_override_args='{\"rope\": {\"f\": 4.0}}', "
        "lora_paths=None, extra={'k': [1, (2, 3)], 'q': \"it's)\"}, path=PosixPath('/x'), tp_size=8)"
    )
    assert complete
    assert fields == {
        "model_path": "a,b",
        "json_model_override_args": '{"rope": {"f": 4.0}}',
        "lora_paths": None,
        "extra": {"k": [1, (2, 3)], "q": "it's)"},
        "path": "PosixPath('/x')",
        "tp_size": 8,
    }


def test_parse_repr_fields_keeps_what_it_read_from_a_cut_off_dump() -> None:
    fields, complete = parse_repr_fields("ServerArgs(model_path='m', tp_size=8, context_len")
    assert not complete
    assert fields == {"model_path": "m", "tp_size": 8}


def test_parse_repr_fields_reads_a_dict_dump_that_is_not_a_literal() -> None:
    fields, complete = parse_repr_fields(
        "{'model': 'x', 'kv_transfer_config': KVTransferConfig(kv_role='kv_consumer')}"
    )
    assert complete
    assert fields == {"model": "x", "kv_transfer_config": "KVTransferConfig(kv_role='kv_consumer')"}


def test_parse_repr_fields_reads_a_bare_config_string_with_a_missing_comma() -> None:
    fields, _ = parse_repr_fields("model='m', max_seq_len=32768, chunked_prefill_enabled=False multi_step=True, seed=0")
    assert fields["max_seq_len"] == 32768
    assert fields["seed"] == 0


def test_pool_reports_last_value_per_reporter_wins_and_the_minimum_is_effective() -> None:
    pool = PoolReports()
    pool.add(PoolReport(1, "TP0", 700000, "KV Cache is allocated"), group="alloc")
    pool.add(PoolReport(2, "TP1", 700000, "KV Cache is allocated"), group="alloc")
    pool.add(PoolReport(3, "TP0", 681280, "Post-capture KV sizing"), group="alloc")  # resize: TP0 now 681280
    pool.add(PoolReport(4, "TP0", 681280, "max_total_num_tokens"))
    best = pool.effective(prefer_source="max_total_num_tokens")
    assert best is not None
    assert (best.tokens, best.line) == (681280, 4)
    assert (
        pool.summary()
        == "681280 (TP0: Post-capture KV sizing; TP0: max_total_num_tokens), 700000 (TP1: KV Cache is allocated)"
    )
