"""vLLM engine logs (V0, V1 and 0.33) -> start-ups (KV pool, max_model_len, role, version) and events.

Envelopes (reference §2.1): ``INFO 08-27 14:00:03 file.py:123] msg`` (0.6.3),
``INFO 08-27 14:00:03 [file.py:123] msg`` (0.8 - 0.10), worker and process prefixes
(``(VllmWorker rank=1 pid=N) ``, ``(EngineCore_0 pid=N) ``, 0.33's ``(APIServer pid=1) ``), ANSI
colours and Docker's ``--timestamps`` RFC3339 prefix. The stamps have **no year**: the caller's
``year`` is used, rolled over at a December -> January change, and the assumption is noted.

A start-up begins at the first start-up line (version line or banner, ``args:``, ``non-default
args:``, engine config, KV cache lines) after the previous start-up became ready (``Application
startup complete``) or at the start of the file; a second version / args line also starts one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from kvforensics.sources.engine_logs.clock import DockerSkewCheck, LocalClock
from kvforensics.sources.engine_logs.contract import (
    EngineEvent,
    EngineLine,
    EngineLogParse,
    QuarantinedLine,
    add_note,
    add_reading_notes,
    raw_for_quarantine,
    truncate_detail,
    unreadable_reason,
)
from kvforensics.sources.engine_logs.fields import parse_repr_fields
from kvforensics.sources.engine_logs.lines import contains_any, split_outer_prefixes
from kvforensics.sources.engine_logs.shutdown import shutdown_reason
from kvforensics.sources.engine_logs.vllm.lines import (
    ABORTED,
    ARGS,
    AVAILABLE_KV,
    BANNER,
    BANNER_MODEL,
    BANNER_VERSION,
    BLOCKS,
    CONCURRENCY,
    CONNECTOR_CREATED,
    CONTINUATION_LINES,
    DUMPS,
    ENGINE_INIT,
    ENV,
    EVENT_NEEDLES,
    EVENT_RULES,
    FRONTEND_REQUESTED,
    KEY_VALUE,
    KV_CONNECTOR,
    KV_ROLE,
    KV_SIZE,
    LOOSE_ENV,
    NON_DEFAULT,
    NOT_A_CONTINUATION,
    OTHER_STARTUP,
    READY,
    REFUSE_V0,
    REFUSE_V1,
    STARTUP_NEEDLES,
    VERSION_API,
    VERSION_SERVER,
    left_open,
)
from kvforensics.sources.engine_logs.vllm.startup import ENGINE, VllmStartup, startup_record

__all__ = ["ENGINE", "parse_lines"]


@dataclass
class _Line:
    number: int
    ts: datetime | None
    process: str  # outer (Name pid=N) prefix without the pid; "" for the driver / API server
    msg: str
    envelope: str  # "vllm" | "none"


class _YearTracker:
    """vLLM stamps have no year: start from the given year and roll over at December -> January."""

    def __init__(self, year: int | None) -> None:
        self.year = year
        self.initial = year
        self.source = "given" if year is not None else None
        self.prev_month: int | None = None
        self.rollovers: list[tuple[int, int]] = []
        self.late_lines = 0

    def adopt(self, year: int, source: str) -> None:
        if self.year is None:
            self.year = self.initial = year
            self.source = source

    def year_for(self, month: int, line: int) -> int | None:
        if self.year is None:
            return None
        if self.prev_month is not None:
            if month < self.prev_month - 6:  # December -> January: a new year
                self.year += 1
                self.rollovers.append((line, self.year))
            elif month > self.prev_month + 6:  # a late line from just before the new year
                self.late_lines += 1
                return self.year - 1
        self.prev_month = month
        return self.year

    def notes(self) -> list[str]:
        if self.initial is None:
            return []
        out = [f"vLLM timestamps carry no year: {self.initial} assumed ({self.source})"]
        for line, year in self.rollovers:
            out.append(f"vLLM timestamps roll over from December to January at line {line}: {year} from there on")
        return out


class _VllmParser:
    def __init__(self, instance: str, tz: ZoneInfo, year: int | None, clock_offset_s: float) -> None:
        self.instance = instance
        self.tz = tz
        self.clock = LocalClock(tz, clock_offset_s)
        self.years = _YearTracker(year)
        self.skew = DockerSkewCheck()
        self.out = EngineLogParse()
        self.current: VllmStartup | None = None
        self.unyeared_lines = 0
        self.nul_lines = 0
        self.last_ts: datetime | None = None
        self.inherited_ts = 0
        self._last_stamp: tuple[str, int | None, datetime | None] = ("", None, None)
        # a dump that may go on over terminal-wrapped lines: (start-up, which dump, its text so far, its line)
        self.continuation: tuple[VllmStartup, str, list[str], int] | None = None

    def feed(self, number: int, text: str | None, raw: bytes) -> None:
        self.out.lines_read += 1
        if text is None:
            self._quarantine(number, unreadable_reason(raw), raw)
            return
        if "\x00" in text:
            stripped = text.replace("\x00", "")
            if not stripped.strip():
                self._quarantine(number, "only NUL bytes (a file hole left by a crash?)", raw)
                return
            self.nul_lines += 1
            text = stripped
        try:
            if self.continuation is not None and self._continue_dump(number, text):
                return
            line = self._envelope(number, text, raw)
            if line is not None and line.ts is not None:
                self.last_ts = line.ts
            if line is not None:
                msg = line.msg
                if contains_any(msg, STARTUP_NEEDLES) or not msg.isascii():
                    self._startup_line(line)
                if contains_any(msg, EVENT_NEEDLES):
                    self._event(line)
                self._lifetime(line)
        except Exception as e:  # noqa: BLE001 - never crash on one bad line: record it and go on
            self._quarantine(number, f"internal parser error ({type(e).__name__}: {e})", raw)

    def _quarantine(self, number: int, reason: str, raw: bytes | str) -> None:
        self.out.quarantined.append(QuarantinedLine(number, reason, raw_for_quarantine(raw)))

    def _envelope(self, number: int, text: str, raw: bytes) -> _Line | None:
        outer = split_outer_prefixes(text)
        rest = outer.rest
        process = outer.process or ""
        docker_ts = self.clock.shift(outer.docker_ts)
        if docker_ts is not None and self.years.year is None:
            try:
                self.years.adopt(docker_ts.astimezone(self.tz).year, "from the Docker --timestamps prefix")
            except OverflowError:
                pass
        m = ENV.match(rest)
        if m is None:
            loose = LOOSE_ENV.match(rest)
            if loose:
                self._quarantine(number, f"bad timestamp '{loose['stamp']}'", raw)
                return None
            return _Line(number, docker_ts, process, rest, "none")
        month, day = int(m["month"]), int(m["day"])
        stamp = f"{m['month']}-{m['day']} {m['time']}"
        full_stamp = m.group(0)
        if full_stamp == self._last_stamp[0] and self.years.year == self._last_stamp[1]:
            # the same second (or millisecond) as the previous line: the same instant
            self.years.year_for(month, number)
            ts = self._last_stamp[2]
            if ts is None:
                self.unyeared_lines += 1
                ts = docker_ts
            return _Line(number, ts, process, rest[m.end() :], "vllm")
        time = m["time"]
        hh, mm, ss = int(time[0:2]), int(time[3:5]), int(time[6:8])
        frac = int((m["frac"] or "0").ljust(6, "0"))
        ts = None
        try:
            datetime(2000, month, day, hh, mm, ss)  # valid in a leap year
        except ValueError:
            self._quarantine(number, f"bad timestamp '{stamp}'", raw)
            return None
        year = self.years.year_for(month, number)
        if year is None:
            self.unyeared_lines += 1
        else:
            try:
                local = datetime(year, month, day, hh, mm, ss, frac)
            except ValueError:
                self._quarantine(number, f"bad timestamp '{stamp}' (not a date in {year})", raw)
                return None
            try:
                ts = self.clock.to_utc(local, number)
            except ValueError as e:
                self._quarantine(number, f"bad timestamp '{stamp}' ({e})", raw)
                return None
            self.skew.observe(number, ts, outer.docker_ts)
        self._last_stamp = (full_stamp, year, ts)
        if ts is None:
            ts = docker_ts
        return _Line(number, ts, process, rest[m.end() :], "vllm")

    # -- start-ups ----------------------------------------------------------------------------

    def _begin(self, line: _Line, marker: str | None) -> VllmStartup:
        st = self.current
        if (
            st is None
            or st.ready_line is not None
            or st.shutdown is not None
            or (marker is not None and marker in st.markers)
        ):
            if st is not None and st.ready_line is None and st.shutdown is None:
                add_note(st.notes, f"did not become ready (next start-up begins at line {line.number})")
            self._finish_current()
            st = VllmStartup(line=line.number, ts=line.ts)
            self.current = st
        if marker is not None:
            st.markers.add(marker)
        if st.ts is None and line.ts is not None:
            st.ts = line.ts
        return st

    def _startup_line(self, line: _Line) -> None:
        msg = line.msg
        if READY.search(msg):
            if self.current is not None and self.current.ready_line is None:
                self.current.ready_line = line.number
            return
        if (m := VERSION_API.search(msg)) or (m := BANNER_VERSION.search(msg)):
            st = self._begin(line, "version")
            st.version = st.version or (m["v"], line.number)
            return
        if m := VERSION_SERVER.search(msg):
            st = self._begin(line, "version")
            st.version = st.version or (m["v"], line.number)
            st.serving_model = st.serving_model or (m["model"], line.number)
            return
        if m := BANNER_MODEL.search(msg):
            st = self._begin(line, None)
            st.serving_model = st.serving_model or (m["model"], line.number)
            return
        if m := ARGS.search(msg):
            st = self._begin(line, "args")
            st.args, complete = parse_repr_fields(msg[m.end() :])
            st.args_line = line.number
            self._kv_transfer(st, msg, line.number)
            if not complete:
                self.continuation = (st, "args", [msg[m.end() :]], line.number)
            return
        if m := NON_DEFAULT.search(msg):
            st = self._begin(line, "non_default")
            st.non_default, complete = parse_repr_fields(msg[m.end() :])
            st.non_default_line = line.number
            self._kv_transfer(st, msg, line.number)
            if not complete:
                self.continuation = (st, "non_default", [msg[m.end() :]], line.number)
            return
        if m := ENGINE_INIT.search(msg):
            st = self._begin(line, None)
            st.version = st.version or (m["v"], line.number)
            if m["gen"] and st.generation is None:
                st.generation = (m["gen"], line.number)
            if st.config_line is None:
                st.config, _ = parse_repr_fields(msg[m.end() :])
                st.config_line = line.number
                # the config string has no closing bracket: any line that reads as its rest goes on it
                self.continuation = (st, "config", [msg[m.end() :]], line.number)
            self._kv_transfer(st, msg, line.number)
            return
        if m := CONNECTOR_CREATED.search(msg):
            st = self.current if self.current is not None else self._begin(line, None)
            st.connectors_created.setdefault(m["c"], line.number)
            return
        refusal = REFUSE_V0.search(msg)
        if refusal:
            st = self._begin(line, None)
            st.refusal = st.refusal or (int(refusal["len"]), int(refusal["pool"]), line.number, "v0")
            return
        refusal = REFUSE_V1.search(msg)
        if refusal:
            st = self._begin(line, None)
            est = int(refusal["est"]) if refusal["est"] else None
            st.refusal = st.refusal or (int(refusal["len"]), est, line.number, "v1")
            return
        found = False
        if m := BLOCKS.search(msg):
            st = self._begin(line, None)
            st.blocks.append((line.number, line.process, int(m["n"]), m["dev"]))
            found = True
        if m := KV_SIZE.search(msg):
            st = self._begin(line, None)
            st.kv_tokens.append((line.number, line.process, int(m["n"].replace(",", "")), m["dev"]))
            found = True
        if m := CONCURRENCY.search(msg):
            st = self._begin(line, None)
            ratio = float(m["x"])
            if st.concurrency is None or ratio < st.concurrency[1]:  # the limiting worker's line
                st.concurrency = (int(m["len"].replace(",", "")), ratio, line.number)
            found = True
        if found:
            return
        if m := AVAILABLE_KV.search(msg):
            st = self._begin(line, None)
            st.available_kv_gib = m["gib"]
            return
        if OTHER_STARTUP.search(msg) or BANNER.search(msg):
            self._begin(line, None)

    def _continue_dump(self, number: int, text: str) -> bool:
        """Join a terminal-wrapped line to the dump before it (args, non-default args, engine config); True if
        *text* was one. A wrapped line has no envelope of its own and starts nothing else; of the engine
        config, which has no closing bracket, it must also read as its ``key=value`` list going on (or close a
        bracket or quote left open)."""
        assert self.continuation is not None
        st, which, parts, first = self.continuation
        rest = split_outer_prefixes(text).rest
        goes_on = (
            rest.strip()
            and not ENV.match(rest)
            and not LOOSE_ENV.match(rest)
            and not NOT_A_CONTINUATION.match(rest)
            and number - first <= CONTINUATION_LINES
            and (which != "config" or KEY_VALUE.search(rest) or left_open("".join(parts)))
        )
        if not goes_on:
            self._end_continuation()
            return False
        before = {"args": st.args, "non_default": st.non_default, "config": st.config}[which]
        parts.append(rest)
        fields, complete = parse_repr_fields("".join(parts))
        for key in fields.keys() - before.keys():
            st.field_lines.setdefault(key, number)
        setattr(st, which, fields)
        self._kv_transfer_wrapped(st, parts, first, number)
        if which != "config" and complete:
            add_note(st.notes, f"{DUMPS[which]} at line {first} is wrapped over {len(parts)} lines; joined")
            self.continuation = None
        return True

    def _end_continuation(self) -> None:
        """The dump being continued ends here; a bracketed one that never closed is noted as cut off."""
        if self.continuation is not None:
            st, which, parts, first = self.continuation
            if which != "config":
                add_note(st.notes, f"{DUMPS[which]} at line {first} is cut off; fields after the cut were not read")
            self.continuation = None

    def _lifetime(self, line: _Line) -> None:
        """The start-up's last line, and the first line saying the server stops."""
        st = self.current
        if st is None:
            return
        st.last_line = line.number
        st.last_ts = line.ts or st.last_ts
        if st.shutdown is None and (why := shutdown_reason(line.msg)) is not None:
            st.shutdown = (line.number, line.ts or self.last_ts, why)

    @staticmethod
    def _kv_transfer(st: VllmStartup, msg: str, number: int) -> None:
        if (m := KV_ROLE.search(msg)) and st.kv_role is None:
            st.kv_role = (m["role"], number)
        if (m := KV_CONNECTOR.search(msg)) and st.kv_connector is None:
            st.kv_connector = m["c"]

    @staticmethod
    def _kv_transfer_wrapped(st: VllmStartup, parts: list[str], first: int, number: int) -> None:
        """The KV-transfer role and connector of a dump read on over wrapped lines: a value the cut split
        ("Nix" + "lConnector") is read again whole, at the line it starts on."""
        joined = "".join(parts)
        if (m := KV_ROLE.search(joined)) and (st.kv_role is None or st.kv_role[1] == first):
            st.kv_role = (m["role"], first if m.end() <= len(parts[0]) else number)
        if (m := KV_CONNECTOR.search(joined)) and (st.kv_connector is None or m["c"].startswith(st.kv_connector)):
            st.kv_connector = m["c"]

    def _finish_current(self) -> None:
        if self.current is not None:
            self.out.startups.append(startup_record(self.current, instance=self.instance, notes=self.out.notes))
            self.current = None

    # -- events -------------------------------------------------------------------------------

    def _emit(self, line: _Line, kind: str, rid: str | None, prompt: int | None, limit: int | None) -> None:
        ts = line.ts
        if ts is None and line.envelope == "none" and self.last_ts is not None:
            ts = self.last_ts  # a traceback / continuation line: the time of the line it follows
            self.inherited_ts += 1
        self.out.events.append(
            EngineEvent(self.instance, ts, line.number, kind, rid, prompt, limit, truncate_detail(line.msg))
        )

    def _event(self, line: _Line) -> None:
        msg = line.msg
        for rule in EVENT_RULES:
            m = rule.pattern.search(msg)
            if m:
                self._emit(
                    line,
                    rule.kind,
                    m[rule.rid] if rule.rid else None,
                    int(m[rule.prompt]) if rule.prompt else None,
                    int(m[rule.limit]) if rule.limit else None,
                )
                return
        m = FRONTEND_REQUESTED.search(msg)
        if m:
            limit = int(m["m"])
            if m["n"] is not None:  # messages + completion: too long only if the messages alone are
                prompt = int(m["n"])
                self._emit(line, "abort_input_too_long" if prompt > limit else "abort_other", None, prompt, limit)
            else:
                self._emit(line, "abort_input_too_long", None, int(m["t"]), limit)
            return
        m = ABORTED.search(msg)
        if m:
            ids = re.findall(r"[^\s,\[\]'\"()]+", m["ids"])
            for rid in ids or [None]:
                self._emit(line, "abort_other", rid, None, None)

    def finish(self) -> EngineLogParse:
        self._end_continuation()
        self._finish_current()
        notes = self.out.notes
        for n in self.years.notes():
            add_note(notes, n)
        if self.years.late_lines:
            add_note(
                notes,
                f"{self.years.late_lines} December line(s) after the new year were dated to the old year",
            )
        if self.unyeared_lines:
            add_note(
                notes,
                f"{self.unyeared_lines} vLLM line(s) carry no year and no year was given: their timestamps are "
                "left empty (give the incident year)",
            )
        add_reading_notes(
            notes, inherited_ts=self.inherited_ts, nul_lines=self.nul_lines, clock=self.clock, skew=self.skew
        )
        return self.out


def parse_lines(
    lines: Iterable[EngineLine],
    *,
    instance: str,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
) -> EngineLogParse:
    """Parse vLLM log lines (as yielded by :func:`~kvforensics.sources.engine_logs.parse.open_lines`)."""
    parser = _VllmParser(instance, tz, year, clock_offset_s)
    for number, text, raw in lines:
        parser.feed(number, text, raw)
    return parser.finish()
