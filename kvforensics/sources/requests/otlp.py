"""OpenTelemetry traces exported as OTLP/JSON, as a requests source: ``format = "otlp_json"``.

The input is what the OpenTelemetry Collector's file exporter writes (one ``TracesData`` /
``ExportTraceServiceRequest`` JSON object per line), or one such object as a whole JSON document
(an OTLP/HTTP request body saved to a file; a JSON array of them is also read):
``{"resourceSpans": [{"resource": {"attributes": [...]}, "scopeSpans": [{"scope": {...},
"spans": [{"traceId", "spanId", "name", "startTimeUnixNano", "attributes": [...], "events": [...],
"status": {"code": ...}}]}]}]}``. Encoding rules followed (OTLP specification, "JSON Protobuf
Encoding"): ids are hex strings (base64, protobuf's default JSON mapping, is also accepted and
converted), 64-bit integers (``intValue``, times in nanoseconds) may be strings or numbers, enums
(span kind, status code) are integers (their protobuf names are also accepted), and
``attributes`` are lists of ``{"key", "value": {"stringValue" | "intValue" | "doubleValue" |
"boolValue" | "bytesValue" | "arrayValue" | "kvlistValue"}}``.
Sources: https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding,
https://github.com/open-telemetry/opentelemetry-proto/blob/main/opentelemetry/proto/trace/v1/trace.proto,
https://github.com/open-telemetry/opentelemetry-collector-contrib/tree/main/exporter/fileexporter.

**One record per GenAI span**: a span with at least one ``gen_ai.*`` attribute is one model call,
unless its ``gen_ai.operation.name`` names an agent or tool step (``invoke_agent``,
``create_agent``, ``execute_tool``), which is not; so is a span of the OpenInference conventions
(Arize Phoenix and the OpenInference instrumentations) whose ``openinference.span.kind`` is ``LLM`` or
``EMBEDDING`` (https://arize-ai.github.io/openinference/spec/semantic_conventions.html). Other spans
(HTTP, database, agent, tool and chain spans) are skipped and counted in the file's notes; exports
of metrics or logs (``resourceMetrics`` / ``resourceLogs``) likewise.

**One request, one span**: where several GenAI spans of one trace carry the same request id (the
gateway's span and, inside it, the engine's own span of that request, or an SDK's span under a
proxy's), the outermost (earliest start) is the request and the others are skipped and counted.

**The record** is the span flattened to one JSON object (what ``columns`` maps against, and what
the quarantine shows as ``raw``): the span's attributes under their own names (GenAI semantic
conventions: ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``, ...), the resource's attributes
(``service.instance.id``, ...) where the span has no attribute of that name, and the values below,
which the reader derives (``columns`` of the ``otlp`` preset name them; see ``sources/requests/presets/otlp.toml``):

* ``otlp.location``: ``resourceSpans[i].scopeSpans[j].spans[k]`` within the line's export;
  ``otlp.trace_id``, ``otlp.span_id``, ``otlp.parent_span_id`` (lower-case hex), ``otlp.span_name``,
  ``otlp.span_kind`` (``SERVER``, ``CLIENT``, ...), ``otlp.scope_name``, ``otlp.scope_version``;
* ``otlp.start_time`` (ISO-8601 UTC, to the microsecond), ``otlp.start_time_unix_nano``,
  ``otlp.end_time_unix_nano`` (as given), ``otlp.duration_ms`` (end - start);
* ``otlp.status_code`` (``UNSET`` / ``OK`` / ``ERROR``) and ``otlp.status_message``;
* ``otlp.request_id``: ``gen_ai.response.id``, else ``gen_ai.request.id`` (vLLM's own spans), else the
  span id (a span re-exported by an at-least-once pipeline keeps its id, so it is a duplicate);
* ``otlp.account_id``: ``tenant.id``, else ``enduser.id``, else ``user.id``; absent when the span has
  none of them (the record is then quarantined, saying to map the attribute that names the customer);
* ``otlp.model``: ``gen_ai.request.model`` (the id the client asked for), else ``gen_ai.response.model``,
  else OpenInference's ``llm.request.model_name`` / ``llm.model_name``;
* ``otlp.http_status``: ``http.response.status_code``, else the older ``http.status_code``, else the
  span status: ``ERROR`` -> 500, ``OK`` / ``UNSET`` -> 200;
* ``otlp.input_tokens`` / ``otlp.output_tokens``: ``gen_ai.usage.input_tokens`` /
  ``gen_ai.usage.output_tokens``, else the older ``gen_ai.usage.prompt_tokens`` /
  ``gen_ai.usage.completion_tokens``, else OpenInference's ``llm.token_count.prompt`` /
  ``llm.token_count.completion``; ``otlp.cache_read_input_tokens``:
  ``gen_ai.usage.cache_read.input_tokens``, else ``gen_ai.usage.cache_read_input_tokens``, else
  ``llm.token_count.prompt_details.cache_read``;
* ``otlp.time_to_first_token_ms``: the first of the attributes ``gen_ai.response.time_to_first_chunk``,
  ``gen_ai.latency.time_to_first_token`` (vLLM), ``gen_ai.response.time_to_first_token`` (seconds,
  times 1000), else the time of the span's first ``first_token`` / ``first_chunk`` event (with or
  without a ``gen_ai.`` prefix) after the span's start.

Prompt and output text never leave this module: attributes that carry message content
(``gen_ai.input.messages``, ``gen_ai.prompt.*``, ...) keep only their length, and span events (where
older conventions put content) are read for the first-token time only.

**Line numbers.** A record's ``line`` is the physical line on which its span is: in a file of one
export per line, the line of that export (all spans of one export share it; ``otlp.location`` and
``otlp.span_id`` in ``raw`` tell them apart); in a whole-file document, the line on which the span's
object opens. A line that is not JSON, an export that is not an object with ``resourceSpans``, and a
span that breaks the structure (not an object, no valid ``spanId``/``traceId``, attributes that are
not key/value pairs) are records of their own, quarantined with the reason and location. (A
conflicting duplicate's ``raw`` is read again from the file: the span on its line with its request id.)

Size: one trace format's reader; which spans are model calls and where each canonical field is read
from (above) are one contract, kept in one module with the reader that keeps it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvforensics.config import Source
from kvforensics.core.errors import InputError
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import opens_document
from kvforensics.sources.engine_logs.contract import unreadable_reason
from kvforensics.sources.engine_logs.lines import open_lines
from kvforensics.sources.requests.otlp_encoding import (
    SpanProblem,
    attribute_map,
    decode_with_offsets,
    enum_name,
    iso_utc,
    json_object,
    json_text,
    line_numbers,
    member,
    repeated,
    unix_nanos,
)
from kvforensics.sources.requests.presets import load_preset
from kvforensics.sources.requests.staging import (
    Staged,
    choose_columns,
    expression_refs,
    json_fields_relation,
    python_staged,
    unknown_column,
)

if TYPE_CHECKING:
    import duckdb

FORMAT = "otlp_json"
BATCH = 50_000
SAMPLE_SPANS = 2000  # GenAI spans read before the names the source's expressions read are checked
MALFORMED_RAW_CHARS = 300  # of a line that is not JSON (it may hold captured prompt text further on)

# gen_ai.operation.name values of spans that are not a model call (GenAI agent and tool spans)
NOT_MODEL_CALLS = frozenset({"invoke_agent", "create_agent", "execute_tool"})
# openinference.span.kind values of model calls (OpenInference conventions: spans of the other kinds,
# CHAIN, TOOL, AGENT, RETRIEVER, ..., are steps around them)
OPENINFERENCE_MODEL_CALLS = frozenset({"LLM", "EMBEDDING"})
# attributes that carry prompt or output text (GenAI, OpenLLMetry and OpenInference names)
CONTENT_ATTRIBUTES = frozenset(
    {
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
        "gen_ai.tool.definitions",
        "gen_ai.prompt",
        "gen_ai.completion",
        "input.value",
        "output.value",
        "llm.prompts",
    }
)
CONTENT_PREFIXES = (
    "gen_ai.prompt.",
    "gen_ai.completion.",
    "llm.input_messages.",
    "llm.output_messages.",
    "llm.prompt_template.",
)
# the derived values: each the first attribute of its list that the span has (GenAI names, their
# older spellings, then OpenInference's)
FALLBACKS: dict[str, tuple[str, ...]] = {
    "otlp.account_id": ("tenant.id", "enduser.id", "user.id"),
    "otlp.model": ("gen_ai.request.model", "gen_ai.response.model", "llm.request.model_name", "llm.model_name"),
    "otlp.input_tokens": ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt"),
    "otlp.output_tokens": (
        "gen_ai.usage.output_tokens",
        "gen_ai.usage.completion_tokens",
        "llm.token_count.completion",
    ),
    "otlp.cache_read_input_tokens": (
        "gen_ai.usage.cache_read.input_tokens",
        "gen_ai.usage.cache_read_input_tokens",
        "llm.token_count.prompt_details.cache_read",
    ),
}
REQUEST_ID_ATTRIBUTES = ("gen_ai.response.id", "gen_ai.request.id")
HTTP_STATUS_ATTRIBUTES = ("http.response.status_code", "http.status_code")
TTFT_SECONDS_ATTRIBUTES = (
    "gen_ai.response.time_to_first_chunk",
    "gen_ai.latency.time_to_first_token",
    "gen_ai.response.time_to_first_token",
)
FIRST_TOKEN_EVENTS = frozenset({"first_token", "first_chunk", "gen_ai.first_token", "gen_ai.first_chunk"})
SPAN_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")
STATUS_HTTP = {"UNSET": 200, "OK": 200, "ERROR": 500}

# The typing step's reasons for a missing field, in the words of a span (only where the field is
# mapped to the derived value that says where it was looked for).
MISSING_REASONS = {
    "account_id": (
        "otlp.account_id",
        "no account on the span (none of the attributes "
        + ", ".join(FALLBACKS["otlp.account_id"])
        + "); map the attribute that names the customer: columns.account_id = \"<attribute>\"",
    ),
    "model": ("otlp.model", "no model on the span (none of the attributes " + ", ".join(FALLBACKS["otlp.model"]) + ")"),
    "prompt_tokens": (
        "otlp.input_tokens",
        "no input token count on the span (none of the attributes " + ", ".join(FALLBACKS["otlp.input_tokens"]) + ")",
    ),
    "ts": ("otlp.start_time", "span has no startTimeUnixNano"),
}


@dataclass(frozen=True)
class SpanRecord:
    """One staged record: a GenAI span flattened to JSON, or a part of the file that cannot be read."""

    line: int
    raw: str
    problem: str | None = None
    # a span's request, for finding the spans of one request nested in one trace (see NESTED_SPANS):
    # (trace id, request id, span id, start in nanoseconds); None when the request id is the span's own
    nesting: tuple[str, str, str, int | None] | None = None


@dataclass
class TraceExportReader:
    """Iterates the records of one OTLP/JSON file; ``notes`` and ``skipped`` say what else it held."""

    path: Path
    notes: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    keys: set[str] = field(default_factory=set)  # every key of the flattened records
    base64_ids: bool = False
    spans: int = 0  # GenAI spans read as records

    def __iter__(self) -> Iterator[SpanRecord]:
        stream = open_lines(self.path)
        lines = iter(stream)
        blank = 0
        first: tuple[int, str | None, bytes] | None = None
        for first in lines:
            if first[1] is None or first[1].strip():
                break
            blank += 1
        else:
            first = None
        if first is not None:
            n, text, raw = first
            if text is not None and opens_document(text):
                # the first line opens a value it does not close: the file may be one JSON document
                yield from self._document_or_lines([first, *lines])
            else:
                for n, text, raw in (first, *lines):
                    if text is not None and not text.strip():
                        blank += 1
                        continue
                    yield from self._line_records(n, text, raw)
        if blank:
            self.notes.append(f"{blank} blank line(s) skipped")
        if stream.truncated is not None:
            t = stream.truncated
            self.notes.append(
                f"input ends early after line {t.after_line} ({t.describe()}); later records, if any, are lost"
            )
        self._closing_notes()

    def _document_or_lines(self, numbered: list[tuple[int, str | None, bytes]]) -> Iterator[SpanRecord]:
        first = numbered[0][0]
        if all(t is not None for _, t, _ in numbered):
            whole = "\n".join(t or "" for _, t, _ in numbered)
            try:
                document, opened_at = decode_with_offsets(whole)
            except ValueError as e:
                self.notes.append(
                    f"line {first} opens a JSON value that the line does not close, and the file is "
                    f"not one JSON document either ({e}); each line read as an export of its own"
                )
            else:
                self.notes.append("read as one JSON document; a record's line is where its span opens")
                line_at = line_numbers(whole, first)

                def line_of(obj: object, default: int) -> int:
                    offset = opened_at.get(id(obj))
                    return default if offset is None else line_at(offset)

                exports = document if isinstance(document, list) else [document]
                for i, export in enumerate(exports):
                    where = f"[{i}]." if isinstance(document, list) else ""
                    yield from self._export_records(export, line_of(export, first), where, line_of)
                return
        for n, text, raw in numbered:
            if text is None or text.strip():
                yield from self._line_records(n, text, raw)

    def _line_records(self, n: int, text: str | None, raw: bytes) -> Iterator[SpanRecord]:
        if text is None:
            yield SpanRecord(n, raw[:MALFORMED_RAW_CHARS].decode("utf-8", "backslashreplace"), unreadable_reason(raw))
            return
        try:
            export = json.loads(text)
        except ValueError:
            yield SpanRecord(n, text[:MALFORMED_RAW_CHARS], "malformed JSON")
            return
        yield from self._export_records(export, n, "", lambda obj, default: default)

    def _export_records(
        self, export: object, n: int, where: str, line_of: Callable[[object, int], int]
    ) -> Iterator[SpanRecord]:
        if not isinstance(export, dict):
            yield _problem(n, where.rstrip(".") or "line", "not a JSON object", export)
            return
        if "resourceSpans" not in export and "resource_spans" not in export:
            other = next((k for k in ("resourceMetrics", "resourceLogs", "resourceProfiles") if k in export), None)
            if other is not None:
                self.skipped[f"export(s) of {other[len('resource') :].lower()}, not traces,"] += 1
                return
            yield _problem(n, where.rstrip(".") or "line", "not an OTLP/JSON trace export (no resourceSpans)", export)
            return
        try:
            resources = list(repeated(export, ("resourceSpans", "resource_spans")))
        except SpanProblem as e:
            yield _problem(n, where.rstrip(".") or "line", str(e), export)
            return
        for i, resource_spans in resources:
            at = f"{where}resourceSpans[{i}]"
            try:
                resource = {
                    key: _without_content(key, value)
                    for key, value in attribute_map(
                        json_object(
                            member(json_object(resource_spans, "resourceSpans entry"), "resource", None) or {},
                            "resource",
                        )
                    ).items()
                }
                scopes = list(repeated(resource_spans, ("scopeSpans", "scope_spans")))
            except SpanProblem as e:
                yield _problem(line_of(resource_spans, n), at, str(e), resource_spans)
                continue
            for j, scope_spans in scopes:
                sat = f"{at}.scopeSpans[{j}]"
                try:
                    scope = json_object(
                        member(json_object(scope_spans, "scopeSpans entry"), "scope", None) or {}, "scope"
                    )
                    spans = list(repeated(scope_spans, ("spans",)))
                except SpanProblem as e:
                    yield _problem(line_of(scope_spans, n), sat, str(e), scope_spans)
                    continue
                for k, span in spans:
                    record = self._span_record(span, f"{sat}.spans[{k}]", resource, scope, line_of(span, n))
                    if record is not None:
                        yield record

    def _span_record(
        self, span: object, at: str, resource: Mapping[str, Any], scope: Mapping[str, Any], line: int
    ) -> SpanRecord | None:
        try:
            attributes = attribute_map(json_object(span, "span"))
            openinference = attributes.get("openinference.span.kind")
            if openinference is not None:
                if not (isinstance(openinference, str) and openinference in OPENINFERENCE_MODEL_CALLS):
                    kind = str(openinference)[:20].encode("utf-8", "backslashreplace").decode("utf-8")
                    self.skipped[f"OpenInference {kind} span(s) (not model calls)"] += 1
                    return None
            else:
                for key in attributes:
                    if key.startswith("gen_ai."):
                        break
                else:
                    self.skipped["span(s) without gen_ai.* attributes (not model calls)"] += 1
                    return None
            operation = attributes.get("gen_ai.operation.name")
            if isinstance(operation, str) and operation in NOT_MODEL_CALLS:
                self.skipped[f"GenAI {operation} span(s) (agent or tool steps, not model calls)"] += 1
                return None
            assert isinstance(span, dict)
            trace_id = self._hex_id(member(span, "traceId", None, "trace_id"), 16, "traceId")
            span_id = self._hex_id(member(span, "spanId", None, "span_id"), 8, "spanId")
        except SpanProblem as e:
            ids = {
                k: span.get(k)
                for k in ("traceId", "spanId", "name")
                if isinstance(span, dict) and isinstance(span.get(k), str)
            }
            return SpanRecord(line, json_text({"otlp.location": at, **ids}), str(e))
        record = self._derived(span, at, trace_id, span_id, attributes, scope)
        for key, value in attributes.items():
            if key not in record:
                record[key] = _without_content(key, value)
        for key, value in resource.items():  # content already left out (see _export_records)
            if key not in record:
                record[key] = value
        try:
            raw = json_text(record, strict=True)
        except SpanProblem as e:
            return SpanRecord(line, json_text({"otlp.location": at, "otlp.span_id": span_id}), str(e))
        self.keys.update(record)
        self.spans += 1
        request_id = record["otlp.request_id"]
        nesting = None
        if request_id != span_id and isinstance(request_id, (str, int)) and not isinstance(request_id, bool):
            start = unix_nanos(record["otlp.start_time_unix_nano"])
            nesting = (
                trace_id,
                str(request_id),
                span_id,
                start if isinstance(start, int) and 0 <= start < 2**63 else None,
            )
        return SpanRecord(line, raw, nesting=nesting)

    def _derived(
        self,
        span: Mapping[str, Any],
        at: str,
        trace_id: str,
        span_id: str,
        attributes: Mapping[str, Any],
        scope: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The ``otlp.*`` values of a span (None where the span has no such value)."""
        status = member(span, "status", None)
        if not isinstance(status, dict):
            status = {}
        status_code = enum_name(status.get("code"), STATUS_CODES, "STATUS_CODE_")
        start = unix_nanos(member(span, "startTimeUnixNano", None, "start_time_unix_nano"))
        end = unix_nanos(member(span, "endTimeUnixNano", None, "end_time_unix_nano"))
        parent = member(span, "parentSpanId", None, "parent_span_id")
        try:
            parent = self._hex_id(parent, 8, "parentSpanId") if parent else None
        except SpanProblem:  # not needed to read the request: kept as it is
            pass
        timed = isinstance(start, int) and isinstance(end, int) and end >= start
        return {
            "otlp.location": at,
            "otlp.request_id": _first(attributes, REQUEST_ID_ATTRIBUTES, span_id),
            "otlp.start_time": iso_utc(start),
            "otlp.start_time_unix_nano": str(start) if isinstance(start, int) else start,
            "otlp.account_id": _first(attributes, FALLBACKS["otlp.account_id"]),
            "otlp.model": _first(attributes, FALLBACKS["otlp.model"]),
            "otlp.http_status": _first(
                attributes, HTTP_STATUS_ATTRIBUTES, STATUS_HTTP.get(status_code or "UNSET", 200)
            ),
            "otlp.input_tokens": _first(attributes, FALLBACKS["otlp.input_tokens"]),
            "otlp.output_tokens": _first(attributes, FALLBACKS["otlp.output_tokens"]),
            "otlp.cache_read_input_tokens": _first(attributes, FALLBACKS["otlp.cache_read_input_tokens"]),
            "otlp.time_to_first_token_ms": _ttft_ms(span, attributes, start),
            "otlp.duration_ms": (end - start) / 1e6 if timed else None,  # type: ignore[operator]
            "otlp.end_time_unix_nano": str(end) if isinstance(end, int) else end,
            "otlp.status_code": status_code,
            "otlp.status_message": status.get("message"),
            "otlp.span_name": member(span, "name", None),
            "otlp.span_kind": enum_name(member(span, "kind", None), SPAN_KINDS, "SPAN_KIND_"),
            "otlp.span_id": span_id,
            "otlp.trace_id": trace_id,
            "otlp.parent_span_id": parent,
            "otlp.scope_name": scope.get("name"),
            "otlp.scope_version": scope.get("version"),
        }

    def _hex_id(self, value: object, size: int, name: str) -> str:
        """An OTLP id as lower-case hex: hex as the OTLP/JSON encoding prescribes, or the base64 of
        protobuf's default JSON mapping (some encoders write it), converted."""
        if not isinstance(value, str) or not value:
            raise SpanProblem(f"no {name}")
        if len(value) == 2 * size:
            try:
                bytes.fromhex(value)
                return value.lower()
            except ValueError:
                pass
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        if len(decoded) == size:
            self.base64_ids = True
            return decoded.hex()
        raise SpanProblem(f"{name} {value[:40]!r} is not {size} bytes in hex")

    def _closing_notes(self) -> None:
        for what, count in sorted(self.skipped.items()):
            self.notes.append(f"{count} {what} skipped")
        if self.base64_ids:
            self.notes.append("span ids in base64 (protobuf's default JSON mapping, not OTLP/JSON's hex) read as hex")
        if not self.spans and self.skipped:
            self.notes.append(
                "no span of this file is a model call (every span was skipped, as counted above): "
                "no request was read from it"
            )


def _problem(line: int, at: str, reason: str, part: object) -> SpanRecord:
    """A part of an export that cannot be read: its location and an outline of it as ``raw`` (its
    scalars, not what it nests, which may hold captured content)."""
    return SpanRecord(line, f"{at}: {json_text(_outline(part))[:MALFORMED_RAW_CHARS]}", reason)


def _outline(part: object) -> object:
    def brief(value: object) -> object:
        if isinstance(value, dict):
            return f"{{{len(value)} keys}}"
        if isinstance(value, list):
            return f"[{len(value)} items]"
        return value[:40] if isinstance(value, str) else value

    if isinstance(part, dict):
        return {k: brief(v) for k, v in part.items()}
    if isinstance(part, list):
        return [brief(v) for v in part]
    return part


def _without_content(key: str, value: Any) -> Any:
    if key in CONTENT_ATTRIBUTES or key.startswith(CONTENT_PREFIXES):
        return f"[{len(json.dumps(value, default=str))} characters of content not kept]"
    return value


def _first(attributes: Mapping[str, Any], keys: Iterable[str], default: Any = None) -> Any:
    for key in keys:
        value = attributes.get(key)
        if value is not None:
            return value
    return default


def _ttft_ms(span: Mapping[str, Any], attributes: Mapping[str, Any], start: object) -> Any:
    seconds = _first(attributes, TTFT_SECONDS_ATTRIBUTES)
    if seconds is not None:
        return seconds * 1000 if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else seconds
    events = span.get("events") or []
    if not isinstance(start, int) or not isinstance(events, list):
        return None
    times = [
        unix_nanos(member(e, "timeUnixNano", None, "time_unix_nano"))
        for e in events
        if isinstance(e, dict) and isinstance(e.get("name"), str) and e["name"] in FIRST_TOKEN_EVENTS
    ]
    times = [t for t in times if isinstance(t, int) and t >= start]
    return (min(times) - start) / 1e6 if times else None


_EXPORT_START = re.compile(r'\A\s*\[?\s*\{\s*"resource_?[sS]pans"\s*:')
SNIFF_BYTES = 4096


def recognises(path: Path) -> bool:
    """Whether the file starts like an OTLP/JSON trace export (``{"resourceSpans": ...``), so a file
    given as ``jsonl`` can be read as what it is."""
    head = bytearray()
    try:
        for _, _, raw in open_lines(path):
            head += raw + b"\n"
            if len(head) >= SNIFF_BYTES:
                break
    except (OSError, InputError):
        return False
    return bool(_EXPORT_START.match(head[:SNIFF_BYTES].decode("utf-8", "replace").lstrip("\ufeff")))


def preset_columns() -> dict[str, str]:
    """The canonical fields the ``otlp`` preset maps (``sources/requests/presets/otlp.toml``): the format's own mapping,
    also used when a source names the format without the preset."""
    return dict(load_preset("otlp").get("columns", {}))


# GenAI spans of one request within one trace (the same otlp.request_id taken from the request's own id,
# on different spans): all but the outermost (the earliest start) are removed from the staged records.
# A span exported twice keeps its span id and stays, for the merge to count as a duplicate.
NESTED_SPANS = """
DELETE FROM otlp_records WHERE rowid IN (
    SELECT r FROM (
        SELECT rowid AS r, span_id, first_value(span_id) OVER (PARTITION BY trace_id, request_id
                                                               ORDER BY start NULLS LAST, span_id) AS outermost
        FROM otlp_records WHERE request_id IS NOT NULL)
    WHERE span_id <> outermost)"""


def _check_expression_refs(source: Source, path: Path, refs: Iterable[str], keys: set[str]) -> None:
    """Each name a ``columns`` expression reads must be a key of the records read so far (the first
    SAMPLE_SPANS GenAI spans, or all of a smaller file), or a path into one; else a ConfigError
    before any record of the file is loaded, as for JSONL."""
    for ref in refs:
        if ref not in keys and not any(ref.startswith(key + ".") for key in keys):
            raise unknown_column(source, path, ref, keys)


def stage(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    load: FileLoad,
    tick: Callable[[int], None],
    fast: bool = True,
) -> Staged:
    """Stage one OTLP/JSON file: one record per GenAI span (and per unreadable part), each
    flattened to JSON, then every canonical field extracted by the JSON loader's SQL."""
    import pyarrow as pa

    mapped = replace(source, columns={**preset_columns(), **source.columns})
    reader = TraceExportReader(path)
    con.execute(
        "CREATE OR REPLACE TEMP TABLE otlp_records (line BIGINT, raw VARCHAR, problem VARCHAR, trace_id VARCHAR, "
        "request_id VARCHAR, span_id VARCHAR, start BIGINT)"
    ).fetchall()
    schema = pa.schema(
        [
            ("line", pa.int64()),
            ("raw", pa.string()),
            ("problem", pa.string()),
            ("trace_id", pa.string()),
            ("request_id", pa.string()),
            ("span_id", pa.string()),
            ("start", pa.int64()),
        ]
    )
    batch: list[SpanRecord] = []

    def flush() -> None:
        if batch:
            nesting = [r.nesting or (None, None, None, None) for r in batch]
            columns = [
                [r.line for r in batch],
                [r.raw for r in batch],
                [r.problem for r in batch],
                *(list(values) for values in zip(*nesting, strict=True)),
            ]
            table = pa.Table.from_arrays(
                [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)], schema=schema
            )
            con.register("otlp_batch", table)
            con.execute("INSERT INTO otlp_records SELECT * FROM otlp_batch").fetchall()
            con.unregister("otlp_batch")
            tick(len(batch))
            batch.clear()

    unchecked = expression_refs(mapped)  # the attributes the expressions read, checked early
    for record in reader:
        batch.append(record)
        if unchecked and reader.spans >= SAMPLE_SPANS:
            _check_expression_refs(mapped, path, unchecked, reader.keys)
            unchecked = []
        if len(batch) >= BATCH:
            flush()
    if unchecked and reader.spans:
        _check_expression_refs(mapped, path, unchecked, reader.keys)
    flush()
    nested = con.execute(NESTED_SPANS).fetchall()[0][0]
    if nested:
        reader.notes.append(
            f"{nested} GenAI span(s) inside another span of the same request and trace skipped "
            "(e.g. the engine's own span under the gateway's): the outermost span is the request"
        )
    chosen = choose_columns(mapped, reader.keys)
    relation, params = json_fields_relation(mapped, chosen, "SELECT line, raw, problem FROM otlp_records", None)
    con.execute(f"CREATE OR REPLACE TEMP TABLE staging_requests AS {relation}", params).fetchall()
    con.execute("DROP TABLE otlp_records").fetchall()
    load.notes.extend(reader.notes)
    rewrites = {
        f"missing required field '{canonical}'": reason
        for canonical, (derived, reason) in MISSING_REASONS.items()
        if mapped.columns.get(canonical) == derived
    }
    return python_staged(rewrites)
