"""Invariants of the engine-log parsers: they never crash, and every line is read and accounted for."""

from __future__ import annotations

import gzip
import tempfile
from collections.abc import Callable
from pathlib import Path
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvforensics.sources.engine_logs.parse import EngineLine, EngineLogParse, open_lines, parse_engine_log
from kvforensics.sources.engine_logs.sglang import parser as sglang
from kvforensics.sources.engine_logs.vllm import parser as vllm

FIXTURES = Path(__file__).parent / "fixtures" / "engine_logs"
REAL_LINES = sorted({line for f in FIXTURES.glob("*.log") for line in f.read_text().splitlines()})
PARSERS: dict[str, Callable[..., EngineLogParse]] = {"sglang": sglang.parse_lines, "vllm": vllm.parse_lines}
ZONES = [ZoneInfo("UTC"), ZoneInfo("America/Los_Angeles"), ZoneInfo("Australia/Lord_Howe")]


def _as_line(value: str | bytes) -> tuple[str | None, bytes]:
    if isinstance(value, str):
        return value, value.encode("utf-8", "surrogatepass")
    try:
        return value.decode("utf-8"), value
    except UnicodeDecodeError:
        return None, value


@st.composite
def mutated_real_line(draw: st.DrawFn) -> str:
    """A real engine line with a few characters replaced, inserted or cut: near-misses of every pattern."""
    line = draw(st.sampled_from(REAL_LINES))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(line)))
        edit = draw(st.sampled_from(["replace", "insert", "cut"]))
        piece = draw(st.text(alphabet="0123456789-:[]() ,.='x\x00\x1b", max_size=3))
        if edit == "replace":
            line = line[:at] + piece + line[at + len(piece) :]
        elif edit == "insert":
            line = line[:at] + piece + line[at:]
        else:
            line = line[:at]
    return line


any_line = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200),
    st.sampled_from(REAL_LINES),
    mutated_real_line(),
)


def _lines(values: list[str | bytes]) -> list[EngineLine]:
    return [(i, *_as_line(v)) for i, v in enumerate(values, start=1)]


def _check_accounting(parse: EngineLogParse, lines: list[EngineLine]) -> None:
    numbers = {n for n, _, _ in lines}
    assert parse.lines_read == len(lines)
    assert {q.line for q in parse.quarantined} <= numbers
    assert len({q.line for q in parse.quarantined}) == len(parse.quarantined)
    assert {e.line for e in parse.events} <= numbers
    assert {s.line for s in parse.startups} <= numbers
    assert not [q for q in parse.quarantined if q.reason.startswith("internal parser error")]
    for s in parse.startups:
        assert s.ts is None or s.ts.utcoffset() is not None
        assert s.role in ("prefill", "decode", "unified", "unknown")  # unknown: no line says the role (issue 29)
        assert set(s.evidence.values()) <= numbers
    for e in parse.events:
        assert len(e.detail) <= 300


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(any_line, max_size=40),
    engine=st.sampled_from(sorted(PARSERS)),
    tz=st.sampled_from(ZONES),
    year=st.one_of(st.none(), st.integers(1990, 2100)),
    offset=st.floats(-86400, 86400, allow_nan=False),
)
def test_parse_lines_never_raises_and_accounts_for_every_line(
    values: list[str | bytes], engine: str, tz: ZoneInfo, year: int | None, offset: float
) -> None:
    lines = _lines(values)
    parse = PARSERS[engine](iter(lines), instance="i", tz=tz, year=year, clock_offset_s=offset)
    _check_accounting(parse, lines)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.sampled_from(REAL_LINES), min_size=1, max_size=60),
    engine=st.sampled_from(sorted(PARSERS)),
)
def test_real_lines_in_any_order_are_never_quarantined_for_internal_errors(values: list[str], engine: str) -> None:
    lines = _lines(list(values))
    parse = PARSERS[engine](iter(lines), instance="i", tz=ZoneInfo("UTC"), year=2026)
    _check_accounting(parse, lines)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=2000), compress=st.booleans(), cut=st.integers(0, 100))
def test_files_of_any_bytes_are_read_line_by_line_even_when_truncated(data: bytes, compress: bool, cut: int) -> None:
    assume(compress or not data.startswith((b"\x1f\x8b", b"\x28\xb5\x2f\xfd")))  # compression magic
    payload = gzip.compress(data) if compress else data
    truncated = compress and cut < 100
    if truncated:
        payload = payload[: len(payload) * cut // 100]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.log"
        path.write_bytes(payload)
        stream = open_lines(path)
        got = list(stream)
        if not truncated:
            expected = data.split(b"\n")
            if expected and expected[-1] == b"":
                expected.pop()
            assert [raw for _, _, raw in got] == [x[:-1] if x.endswith(b"\r") else x for x in expected]
            assert stream.truncated is None
        assert [n for n, _, _ in got] == list(range(1, len(got) + 1))
        parse = parse_engine_log(path, fmt="sglang", instance="i", tz=ZoneInfo("UTC"))
        assert parse.lines_read == len(got) + (1 if stream.truncated and stream.truncated.partial_tail else 0)
