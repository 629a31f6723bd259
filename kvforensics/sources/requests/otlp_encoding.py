"""The OTLP/JSON encoding read into plain Python values.

What ``sources/requests/otlp.py`` needs to read a trace export as the OTLP specification's "JSON Protobuf
Encoding" writes it (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding): fields by
their lowerCamelCase names (protobuf names accepted), repeated fields, attributes as lists of
``{"key", "value": AnyValue}`` pairs, 64-bit integers as decimal strings, enums as integers (their
names accepted); and a whole-file JSON document parsed with the offset at which each object opens,
for its line number. A part that breaks the structure raises :class:`SpanProblem`.
"""

from __future__ import annotations

import bisect
import json
import json.scanner
import math
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Callable


class SpanProblem(ValueError):
    """A span (or a part of an export) that breaks the OTLP structure."""


def json_text(value: object, strict: bool = False) -> str:
    """JSON text of a record; a number JSON cannot hold (inf, nan) is kept as its text, for the
    typing to refuse. A lone UTF-16 surrogate (``"\\ud800"`` in the input) is not text: ``strict``
    refuses it (SpanProblem), otherwise it is shown escaped."""
    try:
        text = _ENCODER.encode(value)
    except ValueError:
        text = json.dumps(_finite(value), ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if strict:
            raise SpanProblem("a value holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text") from None
        text = json.dumps(_finite(value), default=str)
    return text


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, default=str)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def json_object(value: object, what: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpanProblem(f"{what or 'value'} is not a JSON object")
    return value


def member(obj: Mapping[str, Any], key: str, default: Any, snake: str | None = None) -> Any:
    """A field by its lowerCamelCase JSON name, or by its protobuf name (receivers accept both)."""
    if key in obj:
        return obj[key]
    return obj.get(snake, default) if snake else default


def repeated(obj: object, keys: tuple[str, ...]) -> Iterator[tuple[int, Any]]:
    """The entries of a repeated field (absent or null: none)."""
    value: Any = next((v for k in keys if (v := json_object(obj).get(k)) is not None), [])
    if not isinstance(value, list):
        raise SpanProblem(f"{keys[0]} is not a list")
    yield from enumerate(value)


def attribute_map(obj: dict[str, Any]) -> dict[str, Any]:
    """``attributes`` (a list of key/value pairs) as a dict of plain values."""
    pairs = obj.get("attributes") or []
    if not isinstance(pairs, list):
        raise SpanProblem("attributes is not a list")
    return _key_values(pairs, "attribute")


def _key_values(pairs: Iterable[object], what: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for i, pair in enumerate(pairs):
        if type(pair) is not dict or type(key := pair.get("key")) is not str:
            raise SpanProblem(f"{what} #{i + 1} is not a {{key, value}} pair")
        value = pair.get("value")
        # the common case first: a string
        values[key] = value["stringValue"] if type(value) is dict and "stringValue" in value else _any_value(value)
    return values


def _any_value(value: object) -> Any:
    """An ``AnyValue`` as a plain value. ``intValue`` is a decimal string in OTLP/JSON (a number is
    accepted); a value that is not what its type says is kept as its text, so that a canonical field
    mapped to it is quarantined with that text rather than read as something else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SpanProblem("an attribute value is not an AnyValue object")
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        v = value["intValue"]
        if isinstance(v, str):
            try:
                return int(v)
            except ValueError:
                return v
        return v
    if "doubleValue" in value:
        v = value["doubleValue"]
        if isinstance(v, str):  # "NaN", "Infinity" and numbers as text (protobuf JSON)
            try:
                f = float(v)
            except ValueError:
                return v
            return f if math.isfinite(f) else v
        return v
    if "boolValue" in value:
        return value["boolValue"]
    if "bytesValue" in value:
        return value["bytesValue"]
    if "arrayValue" in value:
        inner = value["arrayValue"] or {}
        items = inner.get("values") or [] if isinstance(inner, dict) else None
        if not isinstance(items, list):
            raise SpanProblem("an arrayValue has no list of values")
        return [_any_value(v) for v in items]
    if "kvlistValue" in value:
        inner = value["kvlistValue"] or {}
        items = inner.get("values") or [] if isinstance(inner, dict) else None
        if not isinstance(items, list):
            raise SpanProblem("a kvlistValue has no list of values")
        return _key_values(items, "kvlistValue entry")
    return None  # an empty AnyValue: no value


def enum_name(value: object, names: tuple[str, ...], prefix: str) -> str | None:
    """An OTLP enum (an integer in OTLP/JSON; its protobuf name accepted) by its short name."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return names[value] if 0 <= value < len(names) else str(value)
    if isinstance(value, str):
        return value.removeprefix(prefix) if value.startswith(prefix) else value
    return None


def unix_nanos(value: object) -> Any:
    """A fixed64 time: a decimal string or a number; anything else is kept for the typing to refuse."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def iso_utc(nanos: object) -> object:
    """Unix nanoseconds as ISO-8601 UTC to the microsecond (exact, where a double of the nanoseconds
    is not); a value that is no such time is kept as it is, for the typing to judge."""
    if isinstance(nanos, int) and not isinstance(nanos, bool) and 0 <= nanos < _YEAR_2200_NS:
        return (_EPOCH + timedelta(microseconds=nanos // 1000)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return nanos


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_YEAR_2200_NS = 7_258_118_400 * 10**9


def line_numbers(text: str, first_line: int) -> Callable[[int], int]:
    """Offset in ``text`` -> its physical line number (``text`` begins on ``first_line``)."""
    newlines = [i for i, c in enumerate(text) if c == "\n"]
    return lambda offset: first_line + bisect.bisect_left(newlines, offset)


def decode_with_offsets(text: str) -> tuple[Any, dict[int, int]]:
    """Parse a JSON document, recording where each object opens (``id(obj) -> offset``), with the
    json module's pure-Python scanner (whole-file documents only: it is slower than the C one)."""
    decoder = json.JSONDecoder()
    opened_at: dict[int, int] = {}
    parse_object = decoder.parse_object  # type: ignore[attr-defined]

    def located(s_and_end: tuple[str, int], *args: Any) -> tuple[Any, int]:
        obj, end = parse_object(s_and_end, *args)
        opened_at[id(obj)] = s_and_end[1] - 1
        return obj, end

    decoder.parse_object = located  # type: ignore[attr-defined]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    return decoder.decode(text), opened_at
