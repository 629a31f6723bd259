"""SGLang's own per-request log (``--log-requests``) as a requests source: ``format = "sglang_requests"``.

SGLang logs one ``Receive`` line when a request arrives and one ``Finish`` line when it ends, as
text or JSON (``--log-requests-format json``); see §1.3 of the engine-log format reference. This
module turns each finished request into one staged record with the canonical ``*_raw`` text
fields; ``sources/requests/load.py`` then types, validates, deduplicates and quarantines it exactly as
it does gateway logs, so every rule about bad records lives in one place.

Accepted lines (each may carry the ``[YYYY-MM-DD HH:MM:SS(.mmm)( TPn ...)] `` envelope and the
outer ANSI / Docker / ``(Worker pid=N)`` prefixes shared with engine logs):

* ``Receive: obj=GenerateReqInput(...)[, headers={...}]`` (0.4.x inline and 0.5.x request_logger)
* ``Finish: obj=GenerateReqInput(...)[, headers={...}], out={... 'meta_info': {...}}``
* ``in=GenerateReqInput(...), out={...}`` (<= 0.3.x: a Finish without a separate Receive)
* ``{"timestamp": "<local ISO>", "event": "request.received" | "request.finished", "rid": ...,
  "obj": {...}, "headers": {...}, "out": {"meta_info": {...}}}`` (JSON format, bare or enveloped)
* ``server_args=...``: the served model name, used when nothing better names the model

``Receive OpenAI`` lines and ``request.received.openai`` events carry no request id and are
skipped (counted in a note), as are lines of the engine log that are not request-log lines.

How each canonical field is read (``columns`` may map any of them to a dotted path into the
record, whose roots are ``rid``, ``obj``, ``headers``, ``out``, ``meta_info``, ``timestamp``; a bare
name that is not a root is looked up as a header, then in ``meta_info``, then in ``obj``):

* ``request_id``: ``meta_info.id``, else the request's ``rid``.
* ``ts`` (received): ``meta_info.request_received_ts`` (epoch, with ``--enable-metrics``), else
  ``obj.received_time`` (epoch), else the time of the Receive line with that id, else the Finish
  time minus ``e2e_latency``, else (<= 0.3.x, which logs no latency) the Finish time itself, with a
  note. Line times are local without an offset: the source's ``timezone``.
* ``account_id``: the ``x-smg-routing-key`` header (SGLang logs only whitelisted headers), else
  ``obj.routing_key``. SGLang has no account field: a record without one is quarantined with
  "no account id in the request log (map one with columns.account_id)", and a note says how many.
* ``model``: the source's ``model`` setting (explicit configuration wins), else ``obj.model``
  (some builds carry it), else the ``served_model_name`` (or ``model_path``) of this file's latest
  ``server_args`` line. These are engine names: the loader renames them to gateway model ids
  through the incident's ``[models] aliases`` (as the capacity of the engine logs is), and says so.
* ``status``: the engine's view, not the HTTP status a gateway in front may have returned:
  ``finish_reason`` of type ``abort`` gives its ``status_code`` (500 when it has none), any other
  finish reason 200.
* ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``: from ``meta_info``.
* ``latency_ms`` = ``e2e_latency`` x 1000; ``ttft_ms`` = ``first_token_latency`` x 1000 (seconds).

Records: one per Finish line (its Receive line merged in), one per Receive line whose Finish never
came in this file (quarantined: the client disconnected, the request was still running when the
log ends, or it finished in a later rotated file), and one per request-log line that cannot be
read. Prompt and output text never leave this module: a record's ``raw`` is a JSON summary of the
identifiers and ``meta_info`` numbers, and an unreadable line's ``raw`` has long strings elided.

Size: one log format's reader; the lines it accepts and where each canonical field is read from (above) are
one contract, kept in one module with the reader that keeps it.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http import HTTPStatus
from pathlib import Path

from kvforensics.config import Source
from kvforensics.sources.common.textio import LineStream, printable_raw
from kvforensics.sources.engine_logs.contract import LongLine
from kvforensics.sources.engine_logs.lines import split_outer_prefixes
from kvforensics.sources.engine_logs.sglang.python_repr import (
    ReprDump,
    header_value,
    plain_summary,
    top_level_items,
    value_at,
)

FORMAT = "sglang_requests"
ROUTING_KEY_HEADER = "x-smg-routing-key"
RAW_LIMIT = 2000

# Reasons the typing step gives, rewritten to say what is missing in an SGLang request log and how
# to supply it.
NO_ACCOUNT = "no account id in the request log (map one with columns.account_id)"
NO_MODEL = "no model in the request log (set model = \"<gateway model id>\" on the source)"
NO_TS = (
    "no receive time in the request log (no request_received_ts, no Receive line and no "
    "stamped Finish line with e2e_latency)"
)
NO_STATUS = "no finish_reason in the Finish line, so no status"
NO_ID = "no request id in the request-log line (neither meta_info.id nor rid)"

_ENVELOPE = re.compile(
    r"^\[(?P<date>\d{4}-\d{2}-\d{2}) (?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,6}))?(?: +[^\]\s]+)* *\] ?"
)
_LONG_STRING = re.compile(r"'[^'\\]{40,}(?:\\.[^'\\]*)*'|\"[^\"\\]{40,}(?:\\.[^\"\\]*)*\"")
_HTTP_CODE = re.compile(r"\b([1-5]\d\d)\b")
_JSON_EVENT = re.compile(r'"event"\s*:\s*"request\.')
_TEXT_KINDS = (
    ("Receive OpenAI: obj=", "openai"),
    ("Receive: obj=", "receive"),
    ("Finish: obj=", "finish"),
    ("in=", "legacy"),
)
_SNIFF_LINES = 200


# --------------------------------------------------------------------------------------------
# Lines
# --------------------------------------------------------------------------------------------


@dataclass
class StagedRequest:
    """One record for the staging table: canonical field -> source text."""

    line: int
    raw: str
    problem: str | None
    values: dict[str, str | None]


@dataclass
class _Event:
    kind: str  # receive | finish | openai | server_args | bad
    line: int
    ts: str | None  # the line's own time: naive local ISO text, or ISO with offset (Docker prefix)
    rid: object = None
    obj: object = None
    headers: object = None
    out: object = None
    problem: str | None = None
    raw: str = ""
    fmt: str = "text"  # text | JSON


@dataclass
class _Pending:
    line: int
    ts: str | None
    headers: object


def _redacted(text: str) -> str:
    """A request-log line as the quarantine may show it: long string literals (prompts) elided."""
    text = _LONG_STRING.sub(lambda m: f"<{len(m.group()) - 2} chars>", text)
    return text if len(text) <= 500 else text[:500] + f"... [{len(text) - 500} more chars]"


def _envelope(text: str) -> tuple[str | None, str]:
    """(line time as ISO text or None, message) with every known prefix removed."""
    outer = split_outer_prefixes(text)
    rest = outer.rest
    m = _ENVELOPE.match(rest)
    if m:
        frac = m["frac"]
        stamp = f"{m['date']}T{m['time']}" + (f".{frac.ljust(6, '0')}" if frac else "")
        return stamp, rest[m.end() :]
    if outer.docker_ts is not None:
        return outer.docker_ts.isoformat(), rest
    return None, rest


def _text_event(kind: str, line: int, ts: str | None, body: str) -> _Event:
    """A Receive / Finish / in= line; *body* is ``<obj>[, headers={...}][, out={...}]`` after the prefix."""
    spans, _ = top_level_items(body, 0)
    parts: dict[str, str] = {}
    for i, (a, b) in enumerate(spans):
        item = body[a:b]
        if i == 0:
            parts["obj"] = item
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if sep and name in ("headers", "out") and name not in parts:
            parts[name] = value.strip()
    obj = ReprDump.parse(parts.get("obj", ""))
    headers = ReprDump.parse(parts["headers"]) if "headers" in parts else None
    out = ReprDump.parse(parts["out"]) if "out" in parts else None
    return _Event(
        kind="finish" if kind == "legacy" else kind,
        line=line,
        ts=ts,
        fmt="text",
        rid=value_at(obj, "rid"),
        obj=obj,
        headers=headers,
        out=out,
    )


def _json_event(line: int, env_ts: str | None, body: str) -> _Event | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        if _JSON_EVENT.search(body):
            return _Event(
                kind="bad",
                line=line,
                ts=env_ts,
                problem="malformed JSON request-log line",
                raw=_redacted(body),
                fmt="JSON",
            )
        return None
    if not isinstance(data, dict):
        return None
    event = data.get("event")
    if not isinstance(event, str) or not event.startswith("request."):
        return None
    stamp = data.get("timestamp")
    ts = stamp if isinstance(stamp, str) and stamp.strip() else env_ts
    if event == "request.received.openai":
        return _Event(kind="openai", line=line, ts=ts, fmt="JSON")
    kind = {"request.received": "receive", "request.finished": "finish"}.get(event)
    if kind is None:
        return _Event(kind="other", line=line, ts=ts)
    obj = data.get("obj")
    rid = data.get("rid")
    if rid is None:
        rid = value_at(obj, "rid")
    return _Event(
        kind=kind, line=line, ts=ts, rid=rid, obj=obj, headers=data.get("headers"), out=data.get("out"), fmt="JSON"
    )


def read_line(line: int, text: str) -> _Event | None:
    """The request-log event on one line, or None when the line is not a request-log line."""
    ts, msg = _envelope(text)
    body = msg.lstrip()
    if body.startswith("{"):
        return _json_event(line, ts, body)
    for prefix, kind in _TEXT_KINDS:
        if body.startswith(prefix):
            if kind == "openai":
                return _Event(kind="openai", line=line, ts=ts)
            if kind == "legacy" and ", out=" not in body:
                return None
            return _text_event(kind, line, ts, body[len(prefix) :])
    if "server_args=" in body:
        return _server_args_event(line, body)
    return None


def _server_args_event(line: int, body: str) -> _Event | None:
    at = body.find("server_args=")
    dump = ReprDump.parse(body[at + len("server_args=") :])
    if dump is None:
        return None
    return _Event(kind="server_args", line=line, ts=None, obj=dump)


def recognises(path: Path) -> bool:
    """True if the first lines of the file hold SGLang request-log lines (text or JSON)."""
    stream = LineStream(path)
    seen = 0
    for _, raw in stream:
        if not raw.strip():
            continue
        seen += 1
        if seen > _SNIFF_LINES:
            break
        text = raw.decode("utf-8", "replace")
        if not (_JSON_EVENT.search(text) or "Receive: obj=" in text or "Finish: obj=" in text or "in=" in text):
            continue
        event = read_line(0, text)
        # SGLang's records always carry the request object; a gateway's own "event" field does not make one
        if event is not None and event.kind in ("receive", "finish") and isinstance(event.obj, (dict, ReprDump)):
            return True
    return False


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _text(value: object) -> str | None:
    """A value as the staging table holds it; None when absent. Containers are not values."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (int, str)):
        return str(value)
    return None


def _seconds_to_ms(value: object) -> str | None:
    n = _number(value)
    if n is None:
        return _text(value)
    if not math.isfinite(n):
        return repr(n)
    try:
        return repr(round(n * 1000.0, 3))
    except OverflowError:
        return repr(n)


def _status_code(value: object) -> str | None:
    """``status_code`` of an abort as it appears in either format: 400, '400', HTTPStatus.X, <HTTPStatus.X: 400>."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _text(value)
    text = str(value).strip()
    if text.isdigit():
        return text
    name = text.rsplit(".", 1)[-1].strip("<>").split(":")[0].strip()
    if name in HTTPStatus.__members__:
        return str(HTTPStatus[name].value)
    m = _HTTP_CODE.search(text)
    return m.group(1) if m else text[:40]


def _status(finish_reason: object) -> tuple[str | None, bool]:
    """(status text, whether it is an abort without a status code)."""
    if finish_reason is None:
        return None, False
    if isinstance(finish_reason, (Mapping, ReprDump)):
        if str(value_at(finish_reason, "type")).lower() == "abort":
            code = _status_code(value_at(finish_reason, "status_code"))
            return (code, False) if code is not None else ("500", True)
        return "200", False
    if isinstance(finish_reason, str):
        return ("500", True) if "abort" in finish_reason.lower() else ("200", False)
    return _text(finish_reason), False


def _minus_seconds(stamp: str | None, seconds: object) -> str | None:
    n = _number(seconds)
    if stamp is None or n is None or not math.isfinite(n) or abs(n) > 1e7:
        return None
    try:
        return (datetime.fromisoformat(stamp) - timedelta(seconds=n)).isoformat()
    except (ValueError, OverflowError):
        return None


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass
class RequestLogReader:
    """Streams the staged records of one SGLang request-log file; ``notes`` once it is exhausted."""

    source: Source
    path: Path
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    served_model: str | None = None
    _pending: dict[str, deque[_Pending]] = field(default_factory=dict)
    _formats: set[str] = field(default_factory=set)

    def _count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def __iter__(self) -> Iterator[StagedRequest]:
        stream = LineStream(self.path)
        for n, raw in stream:
            if isinstance(raw, LongLine):  # too long to read whole: quarantined with its size and hash
                self._count("unreadable")
                yield StagedRequest(line=n, raw=printable_raw(raw), problem=raw.reason, values={})
                continue
            if not raw.strip():
                self._count("blank")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", "replace")
                self._count("not_utf8")
            event = read_line(n, text)
            if event is None or event.kind == "other":
                self._count("other")
                continue
            if event.kind == "server_args":
                name = value_at(event.obj, "served_model_name") or value_at(event.obj, "model_path")
                if isinstance(name, list) and name:
                    name = name[0]
                if isinstance(name, str) and name.strip():
                    self.served_model = name.strip()
                self._count("other")
                continue
            self._formats.add(event.fmt)
            if event.kind == "openai":
                self._count("openai")
            elif event.kind == "bad":
                self._count("unreadable")
                yield StagedRequest(line=n, raw=event.raw, problem=event.problem, values={})
            elif event.kind == "receive":
                self._receive(event)
            else:
                yield self._finish(event)
        for rid, queue in self._pending.items():
            for p in queue:
                self._count("orphan")
                yield StagedRequest(
                    line=p.line,
                    raw=json.dumps({"line": "Receive", "rid": rid}, ensure_ascii=False)[:RAW_LIMIT],
                    problem="Receive line without a Finish line in this file (the client disconnected, the "
                    "request was still running when the log ends, or it finished in a later file)",
                    values={},
                )
        self._pending.clear()
        if stream.stopped:
            self.notes.append(stream.stopped)
        self.notes[:0] = self._summary()

    def _receive(self, event: _Event) -> None:
        rids = event.rid if isinstance(event.rid, list) else [event.rid]  # a batch logs every rid
        for rid in rids:
            key = _text(rid)
            if key is None or not key.strip() or isinstance(rid, bool):
                self._count("receive_no_rid")
                continue
            self._pending.setdefault(key, deque()).append(_Pending(event.line, event.ts, event.headers))
            self._count("receive")

    def _lookup(self, root: dict[str, object], path: str) -> object:
        parts = path.split(".")
        if parts[0] not in root:
            if len(parts) == 1:
                for node in (root.get("headers"),):
                    hit = header_value(node, path)
                    if hit is not None:
                        return hit
                for node in (root.get("meta_info"), root.get("obj")):
                    hit = value_at(node, path)
                    if hit is not None:
                        return hit
            return None
        node = root[parts[0]]
        for i, part in enumerate(parts[1:], start=1):
            node = header_value(node, part) if parts[0] == "headers" and i == 1 else value_at(node, part)
            if node is None:
                return None
        return node

    def _finish(self, event: _Event) -> StagedRequest:
        self._count("finish")
        meta = value_at(event.out, "meta_info")
        rid = value_at(meta, "id")
        if _text(rid) is None or isinstance(rid, bool):
            rid = event.rid
        rid_text = _text(rid) if not isinstance(rid, bool) else None
        pending = None
        if rid_text is not None and rid_text in self._pending:
            queue = self._pending[rid_text]
            pending = queue.popleft()
            if not queue:
                del self._pending[rid_text]
            self._count("matched")
        headers = event.headers if event.headers is not None else (pending.headers if pending else None)
        root: dict[str, object] = {
            "rid": rid,
            "obj": event.obj,
            "headers": headers,
            "out": event.out,
            "meta_info": meta,
            "timestamp": event.ts,
        }
        columns = self.source.columns
        values: dict[str, str | None] = {}
        problem = None

        values["request_id"] = rid_text
        if "ts" in columns:
            values["ts"] = _text(self._lookup(root, columns["ts"]))
        else:
            values["ts"] = self._received_ts(meta, event, pending)

        if "account_id" in columns:
            account = self._lookup(root, columns["account_id"])
        else:
            account = header_value(headers, ROUTING_KEY_HEADER)
            if account is None:
                account = value_at(event.obj, "routing_key")
        values["account_id"] = _text(account)
        if account is not None and values["account_id"] is None:
            problem = "account_id is not a single value in the request log"
        if values["account_id"] is None:
            self._count("no_account")

        if "model" in columns:
            values["model"] = _text(self._lookup(root, columns["model"]))
        elif self.source.model:
            values["model"] = self.source.model
            self._count("model_setting")
        else:
            model = _text(value_at(event.obj, "model"))
            if model:
                self._count("model_obj")
            elif self.served_model:
                model = self.served_model
                self._count("model_served")
            values["model"] = model

        if "status" in columns:
            values["status"] = _text(self._lookup(root, columns["status"]))
        else:
            status, abort_default = _status(value_at(meta, "finish_reason"))
            values["status"] = status
            if status is not None and status != "200":
                self._count("abort")
            if abort_default:
                self._count("abort_default")

        for canonical, key in (
            ("prompt_tokens", "prompt_tokens"),
            ("completion_tokens", "completion_tokens"),
            ("cached_tokens", "cached_tokens"),
        ):
            values[canonical] = _text(
                self._lookup(root, columns[canonical]) if canonical in columns else value_at(meta, key)
            )
        values["latency_ms"] = (
            _text(self._lookup(root, columns["latency_ms"]))
            if "latency_ms" in columns
            else _seconds_to_ms(value_at(meta, "e2e_latency"))
        )
        values["ttft_ms"] = (
            _text(self._lookup(root, columns["ttft_ms"]))
            if "ttft_ms" in columns
            else _seconds_to_ms(value_at(meta, "first_token_latency"))
        )
        for canonical in ("prefill_instance", "decode_instance"):
            values[canonical] = _text(self._lookup(root, columns[canonical])) if canonical in columns else None

        summary = {
            "line": "Finish",
            "rid": plain_summary(rid),
            "receive_line": pending.line if pending else None,
            "headers": plain_summary(headers),
            "meta_info": plain_summary(meta),
        }
        raw = json.dumps(summary, ensure_ascii=False, default=str)
        if len(raw) > RAW_LIMIT:
            raw = raw[:RAW_LIMIT] + f"... [{len(raw) - RAW_LIMIT} more chars]"
        return StagedRequest(line=event.line, raw=raw, problem=problem, values=values)

    def _received_ts(self, meta: object, event: _Event, pending: _Pending | None) -> str | None:
        for value, key in (
            (value_at(meta, "request_received_ts"), "ts_metrics"),
            (value_at(event.obj, "received_time"), "ts_obj"),
        ):
            n = _number(value)
            if n is not None and n > 0:
                self._count(key)
                return repr(n)
        if pending is not None and pending.ts is not None:
            self._count("ts_receive")
            return pending.ts
        derived = _minus_seconds(event.ts, value_at(meta, "e2e_latency"))
        if derived is not None:
            self._count("ts_derived")
            return derived
        if event.ts is not None:  # <= 0.3.x logs no e2e_latency: the Finish time is the best there is
            self._count("ts_finish")
            return event.ts
        self._count("no_ts")
        return None

    def _summary(self) -> list[str]:
        c = self.counts.get
        notes = []
        kinds = " and ".join(sorted(self._formats)) or "no"
        notes.append(
            f"read as SGLang --log-requests output ({kinds} format): {c('finish', 0)} finished "
            f"request(s), {c('matched', 0)} matched to their Receive line"
        )
        if any(c(k) for k in ("ts_metrics", "ts_obj", "ts_receive", "ts_derived", "ts_finish")):
            parts = [
                f"{c(k)} from {what}"
                for k, what in (
                    ("ts_metrics", "meta_info.request_received_ts"),
                    ("ts_obj", "obj.received_time"),
                    ("ts_receive", "the Receive line"),
                    ("ts_derived", "the Finish line time minus e2e_latency"),
                    (
                        "ts_finish",
                        "the Finish line time (no e2e_latency logged: later than the receive time by the "
                        "request's duration)",
                    ),
                )
                if c(k)
            ]
            notes.append("receive times: " + ", ".join(parts))
        if c("no_account"):
            notes.append(
                f"{c('no_account')} request(s) without an account id quarantined: SGLang logs only whitelisted "
                f"headers ({ROUTING_KEY_HEADER} plus SGLANG_LOG_REQUEST_HEADERS); map the one that carries the "
                "account with columns = { account_id = \"headers.<name>\" }"
            )
        elif c("finish") and "account_id" not in self.source.columns:
            notes.append(
                f"account_id read from the router's routing key (the {ROUTING_KEY_HEADER} header, else "
                "obj.routing_key): check that your router sets it to the account"
            )
        if c("model_setting"):
            notes.append(f"model set from the source's model setting ({self.source.model})")
        if c("model_served"):
            notes.append(
                f"model for {c('model_served')} request(s) from this file's server_args "
                f"(served model '{self.served_model}'), an engine name: set the source's model to the "
                "gateway's model id if they differ"
            )
        if c("finish") and "status" not in self.source.columns:
            notes.append(
                "status is the engine's view (finish_reason abort -> its status_code, otherwise 200), not the "
                f"HTTP status a gateway in front may have returned; {c('abort', 0)} abort(s)"
                + (f", {c('abort_default')} without a status_code read as 500" if c("abort_default") else "")
            )
        if c("orphan"):
            notes.append(f"{c('orphan')} Receive line(s) without a Finish line quarantined")
        if c("openai"):
            notes.append(f"{c('openai')} 'Receive OpenAI' line(s) skipped: they carry no request id")
        if c("receive_no_rid"):
            notes.append(f"{c('receive_no_rid')} Receive line(s) without a request id skipped")
        if c("other"):
            notes.append(f"{c('other')} line(s) that are not request-log lines skipped")
        if c("blank"):
            notes.append(f"{c('blank')} blank line(s) skipped")
        if c("not_utf8"):
            notes.append(f"{c('not_utf8')} line(s) not valid UTF-8, read with replacement characters")
        return notes


def reason_rewrites(source: Source) -> dict[str, str]:
    """Typing-step reasons for a missing field, reworded for an SGLang request log."""
    defaults = {"request_id": NO_ID, "ts": NO_TS, "account_id": NO_ACCOUNT, "model": NO_MODEL, "status": NO_STATUS}
    rewrites = {}
    for canonical, reason in defaults.items():
        if canonical in source.columns:
            name = "account id" if canonical == "account_id" else canonical
            reason = f"no {name} in the request log (columns.{canonical} = '{source.columns[canonical]}' is absent)"
        rewrites[f"missing required field '{canonical}'"] = reason
    if "prompt_tokens" in source.columns:
        rewrites["missing required field 'prompt_tokens'"] = (
            f"no prompt_tokens in the request log (columns.prompt_tokens = '{source.columns['prompt_tokens']}' "
            "is absent)"
        )
    return rewrites
