"""Engine logs: the entry point the ingest stage calls, and the public names of the engine loaders.

:func:`parse_engine_file` reads one file (plain, gzip or zstd), recognises its engine
(:func:`sniff_format`) and collection envelope, and hands its lines to the parser of that engine
(:data:`PARSERS`); :func:`parse_engine_log` gives one file as one parse. The loaders are floors, each
importing only the ones below it:

* :mod:`~kvforensics.sources.engine_logs.contract`  the parse contract (start-ups, events, quarantined lines),
* :mod:`~kvforensics.sources.engine_logs.lines`  lines streamed from plain, gzip and zstd files; outer prefixes,
* :mod:`~kvforensics.sources.engine_logs.clock`  local stamps -> UTC; the Docker skew check,
* :mod:`~kvforensics.sources.engine_logs.fields` repr dumps of server arguments; KV pool reports,
* :mod:`~kvforensics.sources.engine_logs.sglang.parser`, :mod:`~kvforensics.sources.engine_logs.vllm.parser` the engine parsers,
* :mod:`~kvforensics.sources.engine_logs.envelopes.parse` kubectl, CRI, Docker, Loki, CloudWatch and journald exports,
* this module, on top. The names below are re-exported so that callers import from one place.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo

from kvforensics.core.errors import InputError
from kvforensics.sources.engine_logs.clock import DockerSkewCheck, LocalClock
from kvforensics.sources.engine_logs.contract import (
    EVENT_KINDS,
    EngineEvent,
    EngineFileParse,
    EngineLine,
    EngineLogParse,
    InstanceNamer,
    LineParser,
    QuarantinedLine,
    StartupRecord,
    add_note,
    raw_for_quarantine,
)
from kvforensics.sources.engine_logs.envelopes.parse import ENVELOPES, parse_enveloped, sniff_envelope
from kvforensics.sources.engine_logs.fields import (
    PoolReport,
    PoolReports,
    as_int,
    flag_value,
    parse_repr_fields,
)
from kvforensics.sources.engine_logs.lines import (
    SNIFF_LINES,
    LineStream,
    OuterPrefix,
    TruncatedInput,
    contains_any,
    open_lines,
    split_outer_prefixes,
)
from kvforensics.sources.engine_logs.sglang import parser as sglang
from kvforensics.sources.engine_logs.startup_bounds import refuse_impossible_values
from kvforensics.sources.engine_logs.vllm import parser as vllm
from kvforensics.sources.engine_logs.vllm.lines import LINE_SIGNATURE as VLLM_LINE_SIGNATURE

__all__ = [
    "EVENT_KINDS",
    "PARSERS",
    "DockerSkewCheck",
    "EngineEvent",
    "EngineFileParse",
    "EngineLine",
    "EngineLogParse",
    "LineStream",
    "LocalClock",
    "OuterPrefix",
    "PoolReport",
    "PoolReports",
    "QuarantinedLine",
    "StartupRecord",
    "TruncatedInput",
    "as_int",
    "contains_any",
    "flag_value",
    "open_lines",
    "parse_engine_file",
    "parse_engine_log",
    "parse_repr_fields",
    "sniff_format",
    "split_outer_prefixes",
]

PARSERS: dict[str, LineParser] = {"sglang": sglang.parse_lines, "vllm": vllm.parse_lines}
"""The engine parsers by format name: each reads :data:`EngineLine` items into an :class:`EngineLogParse`."""

_SGLANG_SNIFF = re.compile(
    r"^\[(?:\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}|\d{2}:\d{2}:\d{2} TP\d+|gpu=\d+)"
    r"|server_args=(?:ServerArgs\(|\{)|max_total_num_tokens=|sglang"
)
_VLLM_SNIFF = re.compile(
    r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{2}-\d{2} \d{2}:\d{2}:\d{2}"
    r"|vLLM (?:API )?server version|LLM engine \(v|non-default args: \{|vllm"
)


def sniff_format(first_lines: Iterable[str | None]) -> str | None:
    """Tell an SGLang log from a vLLM log by its first lines; None when neither is recognised.

    Each line votes by its envelope, and by its message when that is one only one engine prints
    (``sglang.LINE_SIGNATURE``, ``vllm_lines.LINE_SIGNATURE``): so bare lines, their prefixes stripped by
    whatever collected them, are recognised too."""
    score = {"sglang": 0, "vllm": 0}
    for text in itertools.islice(first_lines, SNIFF_LINES):
        if not text:
            continue
        rest = split_outer_prefixes(text).rest
        if _SGLANG_SNIFF.search(rest):
            score["sglang"] += 2 if rest.startswith("[") else 1
        if _VLLM_SNIFF.search(rest):
            score["vllm"] += 2 if rest[:1].isupper() and not rest.startswith("[") else 1
        sglang_line, vllm_line = sglang.LINE_SIGNATURE.search(rest), VLLM_LINE_SIGNATURE.search(rest)
        if sglang_line and not vllm_line:
            score["sglang"] += 2
        elif vllm_line and not sglang_line:
            score["vllm"] += 2
    best = max(score, key=lambda k: score[k])
    if score[best] == 0 or score["sglang"] == score["vllm"]:
        return None
    return best


def parse_engine_log(
    path: Path,
    *,
    fmt: Literal["sglang", "vllm", "auto"] | str,
    instance: str | InstanceNamer,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
    envelope: str = "none",
) -> EngineLogParse:
    """Parse one engine log file (plain, .gz or .zst) into start-ups, events and quarantined lines.

    ``fmt`` is ``"sglang"``, ``"vllm"`` or ``"auto"`` (decided from the first 200 lines).
    ``tz`` is the zone the engine's naive timestamps are in; ``year`` is needed for vLLM stamps
    (``MM-DD HH:MM:SS``); ``clock_offset_s`` corrects a skewed host clock. ``envelope`` as in
    :func:`parse_engine_file`; the instances of a file in an envelope are merged into one parse
    (each record keeps its instance).
    """
    return parse_engine_file(
        path, fmt=fmt, instance=instance, tz=tz, year=year, clock_offset_s=clock_offset_s, envelope=envelope
    ).merged()


def parse_engine_file(
    path: Path,
    *,
    fmt: Literal["sglang", "vllm", "auto"] | str,
    instance: str | InstanceNamer,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
    envelope: str = "auto",
) -> EngineFileParse:
    """Parse one engine log file into one :class:`EngineLogParse` per engine instance it holds.

    ``envelope`` is ``"none"`` (the engine's own lines, streamed), ``"auto"`` (recognised from the
    first lines) or one of :data:`kvforensics.sources.engine_logs.envelopes.parse.ENVELOPES`. In an envelope, the
    envelope's clock is the time of each line (the engine's stamp is compared with it and a
    disagreement reported), records are sorted by it per instance (stably, whatever the export's
    order), and every line number in the result is the file's physical line. ``instance`` is the
    instance's name, or a function naming it from a record's labels (:data:`InstanceNamer`).
    """
    parsers = PARSERS
    if fmt not in (*parsers, "auto"):
        raise InputError(
            f"unknown engine log format {fmt!r}; use one of: {', '.join(parsers)} or auto",
            location=str(path),
        )
    if envelope not in ("auto", "none", *ENVELOPES):
        raise InputError(
            f"unknown engine log envelope {envelope!r}; use one of: auto, none, {', '.join(ENVELOPES)}",
            location=str(path),
        )
    namer: InstanceNamer = (lambda _labels: instance) if isinstance(instance, str) else instance
    stream = open_lines(path)
    try:
        head = list(itertools.islice(stream, SNIFF_LINES))
        if not head:
            result = EngineFileParse(envelope="none", notes=["empty file: no lines to read"])
        else:
            found = sniff_envelope(head) if envelope == "auto" else envelope
            lines = itertools.chain(head, stream)
            if found == "none":
                name = namer(None)
                parse = parsers[engine_format(fmt, [t for _, t, _ in head], path)](
                    lines, instance=name, tz=tz, year=year, clock_offset_s=clock_offset_s
                )
                result = EngineFileParse(envelope="none", instances={name: parse}, lines_read=parse.lines_read)
            else:
                result = parse_enveloped(
                    found,
                    lines,
                    fmt=lambda texts: engine_format(fmt, texts, path),
                    parsers=parsers,
                    namer=namer,
                    tz=tz,
                    year=year,
                    clock_offset_s=clock_offset_s,
                )
                result.lines_read = stream.lines_yielded
                if envelope != "auto" and not result.instances and result.quarantined:
                    looks = sniff_envelope(head)
                    raise InputError(
                        f"no record of this file could be read as a {envelope} export"
                        + (f" (its first lines look like {looks})" if looks != envelope else "")
                        + ": check the source's envelope setting, or set envelope = \"auto\"",
                        location=str(path),
                    )
                if envelope == "auto":
                    result.notes.insert(0, f"read as a {found} export (recognised from its first lines)")
    finally:
        stream.close()
    add_truncation(result, stream)
    refuse_impossible_values(result)
    return result


def engine_format(fmt: str, texts: Iterable[str | None], path: Path) -> str:
    """*fmt*, or the engine recognised from the first *texts* when it is ``auto`` (InputError if neither)."""
    if fmt != "auto":
        return fmt
    head = list(itertools.islice(texts, SNIFF_LINES))
    sniffed = sniff_format(head)
    if sniffed is None:
        raise InputError(
            "cannot tell whether this is an SGLang or a vLLM log from its first "
            f'{len(head)} lines; set format = "sglang" or "vllm" for this source',
            location=str(path),
        )
    return sniffed


def add_truncation(parse: EngineFileParse, stream: LineStream) -> None:
    """Note where a truncated stream stopped, and quarantine its incomplete last line."""
    t = stream.truncated
    if t is None:
        return
    add_note(parse.notes, t.describe())
    if t.partial_tail:
        parse.lines_read += 1
        parse.quarantined.append(
            QuarantinedLine(
                line=t.after_line + 1,
                reason=f"incomplete last line: {t.compression} stream truncated",
                raw=raw_for_quarantine(t.partial_tail),
            )
        )
