"""SGLang's request-log dumps (Python reprs: ``GenerateReqInput(rid='a', ...)``, ``{'meta_info': ...}``)
read lazily, without ``eval``.

A level-3 request-log line can hold a million-token prompt, so a dump is split into its top-level
items only as far as a lookup needs (:class:`ReprDump`), and a value is parsed only when asked
for. Quoted strings are skipped whole, so commas and brackets inside a prompt cannot split an item
or forge one. ``sources/requests/sglang.py`` reads the request log with it.
"""

from __future__ import annotations

import ast
import math
import re
import threading
import warnings
from collections.abc import Mapping

# keys left out of a record's summary for the quarantine (large per-token arrays)
_META_SKIP = ("logprobs", "hidden_states", "routed_experts", "output_ids", "embedding")
# quoted strings (skipped whole), number-only lists (skipped whole: token ids), brackets and commas
_TOKENS = re.compile(r"'[^'\\]*(?:\\.[^'\\]*)*'|\"[^\"\\]*(?:\\.[^\"\\]*)*\"|\[[-+0-9eE., ]*\]|[()\[\]{},]")
_STRING = re.compile(r"'[^'\\]*(?:\\.[^'\\]*)*'|\"[^\"\\]*(?:\\.[^\"\\]*)*\"")
_CALL = re.compile(r"[A-Za-z_][\w.]*\(")
_NAME = re.compile(r"[A-Za-z_]\w*")


def _nested_item_pattern(depth: int) -> re.Pattern[str]:
    """One item of a repr list: strings, bracket groups nested up to *depth*, other characters but commas.

    Possessive repetition: the match never backtracks, so a line costs one pass in the regex engine.
    (A closing bracket of another kind than the opening one is accepted, as the slow scanner does.)
    """
    string = r"'[^'\\]*+(?:\\.[^'\\]*+)*+'|\"[^\"\\]*+(?:\\.[^\"\\]*+)*+\""
    plain = r"[^()\[\]{}'\"]"
    group = rf"[(\[{{](?:{string}|{plain})*+[)\]}}]"
    for _ in range(depth - 1):
        group = rf"[(\[{{](?:{string}|{plain}|{group})*+[)\]}}]"
    return re.compile(rf"(?:{string}|{group}|[^,()\[\]{{}}'\"])*+")


_ITEM = _nested_item_pattern(12)


def top_level_items(text: str, start: int) -> tuple[list[tuple[int, int]], int | None]:
    """Spans of the comma-separated items of ``text[start:]`` up to its unmatched closing bracket.

    Quoted strings are skipped whole, so commas and brackets inside a prompt cannot split an item
    (or forge one). Returns the spans and the index of the closing bracket (None if the text ended).
    Each item is one regex match; text the pattern cannot take (nesting deeper than it handles, an
    unterminated quote) goes to a token-by-token scan.
    """
    spans: list[tuple[int, int]] = []
    pos = start
    n = len(text)
    while True:
        end = _ITEM.match(text, pos).end()  # type: ignore[union-attr]  # matches the empty string at worst
        spans.append((pos, end))
        if end >= n:
            return spans, None
        c = text[end]
        if c == ",":
            pos = end + 1
        elif c in ")]}":
            return spans, end
        else:
            return top_level_items_by_token(text, start)


def top_level_items_by_token(text: str, start: int) -> tuple[list[tuple[int, int]], int | None]:
    depth = 0
    item_start = start
    spans: list[tuple[int, int]] = []
    for m in _TOKENS.finditer(text, start):
        c = text[m.start()]
        if c in "'\"" or (c == "[" and m.end() - m.start() > 1 and text[m.end() - 1] == "]"):
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                spans.append((item_start, m.start()))
                return spans, m.start()
            depth -= 1
        elif depth == 0:  # a top-level comma
            spans.append((item_start, m.start()))
            item_start = m.end()
    spans.append((item_start, len(text)))
    return spans, None


_INT = re.compile(r"-?\d{1,4000}")
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_WORDS: dict[str, object] = {
    "None": None,
    "True": True,
    "False": False,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
}


def _literal(text: str, *, fallback: bool = True) -> object:
    """A Python literal from its repr; the text itself when it is not one.

    Scalars (the fields read here) take a fast path; anything else goes to ``ast.literal_eval``
    unless *fallback* is off.
    """
    if not text:
        return text
    if text in _WORDS:
        return _WORDS[text]
    c = text[0]
    if c in "'\"":
        if len(text) >= 2 and text[-1] == c and "\\" not in text and c not in text[1:-1]:
            return text[1:-1]
    elif _INT.fullmatch(text):
        return int(text)
    elif _FLOAT.fullmatch(text):
        return float(text)
    if not fallback or len(text) > 10_000:
        return text
    return literal(text)


# Engine logs are parsed in threads side by side (kvforensics/stages/ingest.py). CPython 3.11 builds an AST's
# Python objects with a recursion count shared by threads: two threads doing it at once, with a
# garbage collection between, raise SystemError "AST constructor recursion depth mismatch" (a start-up's
# server_args line was quarantined that way). warnings.catch_warnings() is not thread-safe either.
_LITERAL_LOCK = threading.Lock()


def literal(text: str) -> object:
    """``ast.literal_eval(text)``, or *text* itself when it is not a Python literal; one thread at a time."""
    try:
        with _LITERAL_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for "1x"
            return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


class ReprDump:
    """The fields of ``Name(a=1, ...)`` or ``{'a': 1, ...}``, split only as far as a lookup needs.

    Values are parsed when asked for, so the prompt of a level-3 line is never parsed at all.
    """

    __slots__ = ("_text", "_items", "_pos", "_is_dict")

    def __init__(self, text: str) -> None:
        self._text = text
        self._items: dict[str, str] = {}
        self._is_dict = text.startswith("{")
        m = None if self._is_dict else _CALL.match(text)
        self._pos: int | None = 1 if self._is_dict else (m.end() if m else 0)  # None once fully split

    @classmethod
    def parse(cls, text: str) -> ReprDump | None:
        text = text.strip()
        if text.startswith("{") or _CALL.match(text):
            return cls(text)
        return None

    def _next_item(self) -> None:
        """Split off the next item (``self._pos`` is None when there are no more)."""
        text, pos = self._text, self._pos
        assert pos is not None
        end = _ITEM.match(text, pos).end()  # type: ignore[union-attr]  # matches the empty string at worst
        if end < len(text) and text[end] not in ",)]}":
            # nesting deeper than the pattern takes, or an unterminated quote: the token scanner
            spans, _ = top_level_items_by_token(text, pos)
            for a, b in spans:
                self._add(text[a:b])
            self._pos = None
            return
        self._add(text[pos:end])
        self._pos = end + 1 if end < len(text) and text[end] == "," else None

    def _add(self, item: str) -> None:
        item = item.strip()
        if self._is_dict:
            key_match = _STRING.match(item)
            if key_match:
                key: object = _literal(key_match.group())
                rest = item[key_match.end() :].lstrip()
                if not rest.startswith(":"):
                    return
                value = rest[1:]
            else:
                key, sep, value = item.partition(":")
                if not sep:
                    return
                key = key.strip()
            self._items.setdefault(str(key), value.strip())
        else:
            name, sep, value = item.partition("=")
            name = name.strip()
            if sep and _NAME.fullmatch(name):
                self._items.setdefault(name, value.strip())

    @property
    def items(self) -> dict[str, str]:
        """Field name -> the field's source text, for every field."""
        while self._pos is not None:
            self._next_item()
        return self._items

    def get(self, key: str) -> object:
        while key not in self._items and self._pos is not None:
            self._next_item()
        raw = self._items.get(key)
        return None if raw is None else _repr_value(raw)

    def keys(self) -> list[str]:
        return list(self.items)


def _repr_value(raw: str, *, fallback: bool = True) -> object:
    if raw.startswith("{") or _CALL.match(raw):
        return ReprDump(raw)
    return _literal(raw, fallback=fallback)


def value_at(node: object, key: str) -> object:
    if isinstance(node, Mapping):
        return node.get(key)
    if isinstance(node, ReprDump):
        return node.get(key)
    return None


def header_value(headers: object, name: str) -> object:
    name = name.lower()
    keys = headers.keys() if isinstance(headers, (Mapping, ReprDump)) else []
    for k in keys:
        if str(k).lower() == name:
            return value_at(headers, k)
    return None


def plain_summary(node: object, depth: int = 0) -> object:
    """A JSON-able copy of the small parts of a record (for the quarantine's raw column).

    Text dumps are not parsed for this: their values are shown as written, long ones elided.
    """
    if isinstance(node, ReprDump):
        return {
            k: (v if len(v) <= 200 else f"<{len(v)} chars>")
            for k, v in node.items.items()
            if not any(s in k for s in _META_SKIP)
        }
    if isinstance(node, Mapping):
        if depth > 2:
            return "{...}"
        return {
            str(k): plain_summary(v, depth + 1) for k, v in node.items() if not any(s in str(k) for s in _META_SKIP)
        }
    if isinstance(node, (list, tuple)):
        return f"[{len(node)} items]"
    if isinstance(node, str) and len(node) > 200:
        return f"<{len(node)} chars>"
    if isinstance(node, float) and not math.isfinite(node):
        return repr(node)
    if node is None or isinstance(node, (str, int, float, bool)):
        return node
    return str(node)[:200]
