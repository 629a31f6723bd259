"""What start-up blocks are read with: Python repr dumps of server arguments and KV pool sizes
reported by several ranks."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvforensics.sources.engine_logs.sglang.python_repr import literal

# --------------------------------------------------------------------------------------------
# Python repr dumps: ServerArgs(...), Namespace(...), {'k': v}, "k=v, k=v" config strings
# --------------------------------------------------------------------------------------------

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {")", "]", "}"}


def _split_top_level(text: str, start: int) -> tuple[list[str], int | None]:
    """Split ``text[start:]`` at top-level commas until an unmatched closing bracket.

    Returns the items and the index of the closing bracket (None if the text ended first).
    Quotes (with backslash escapes) and nested brackets are respected.
    """
    items: list[str] = []
    stack: list[str] = []
    quote: str | None = None
    item_start = start
    i = start
    n = len(text)
    while i < n:
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in ("'", '"'):
            quote = c
        elif c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if not stack:
                items.append(text[item_start:i])
                return [s for s in (x.strip() for x in items) if s], i
            if stack[-1] == c:
                stack.pop()
            # a mismatched closer inside an unquoted value: ignore it rather than fail
        elif c == "," and not stack:
            items.append(text[item_start:i])
            item_start = i + 1
        i += 1
    items.append(text[item_start:])
    return [s for s in (x.strip() for x in items) if s], None


def _literal(value: str) -> object:
    if not value or len(value) > 100_000:
        return value
    return literal(value)


def parse_repr_fields(text: str) -> tuple[dict[str, object], bool]:
    """Read the fields of a Python repr dump, robustly.

    *text* starts at the dump: ``ServerArgs(a=1, b='x')``, ``Namespace(...)``, ``{'a': 1}`` or a
    bare ``a=1, b=x`` list (vLLM's config string). Values are Python literals where they can be
    read as such, otherwise their source text. Returns ``(fields, complete)``; ``complete`` is
    False when the dump was cut off (a wrapped or truncated line): the fields read so far are kept.
    """
    text = text.strip()
    fields: dict[str, object] = {}
    if text.startswith("{"):
        whole = _literal(text) if text.endswith("}") else text
        if isinstance(whole, dict):
            return {str(k): v for k, v in whole.items()}, True
        items, close = _split_top_level(text, 1)
        for item in items:
            key, sep, value = item.partition(":")
            if not sep:
                continue
            k = _literal(key.strip())
            fields[str(k)] = _literal(value.strip())
        return fields, close is not None
    m = re.match(r"[A-Za-z_][\w.]*\(", text)
    if m:
        items, close = _split_top_level(text, m.end())
        complete = close is not None
    else:
        items, close = _split_top_level(text, 0)
        complete = True
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", key):
            continue
        fields[key] = _literal(value.strip())
    return fields, complete


def flag_value(value: object) -> str:
    """A server-arg value as a flag string: booleans as true/false, None as none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?[\d,_]+\s*", value):
        try:
            return int(value.replace(",", "").replace("_", ""))
        except ValueError:
            return None
    return None


# --------------------------------------------------------------------------------------------
# KV pool reports: last value per reporter wins, the effective pool is the minimum
# --------------------------------------------------------------------------------------------


@dataclass
class PoolReport:
    line: int
    reporter: str  # rank or process that printed it ("TP0", "DP1 TP1", "VllmWorker rank=1" ...)
    tokens: int
    source: str  # which log line kind ("max_total_num_tokens", "KV Cache is allocated" ...)


class PoolReports:
    """Collect KV-pool sizes printed by several ranks/processes during one start-up.

    Within one ``(reporter, source group)`` the last value wins (post-capture resizes, repeated
    profiling); the effective pool is the smallest value any reporter holds at the end. Several
    reporters printing the same count are one value.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], PoolReport] = {}

    def add(self, report: PoolReport, group: str | None = None) -> None:
        self._last[(report.reporter, group or report.source)] = report

    def __bool__(self) -> bool:
        return bool(self._last)

    def reports(self) -> list[PoolReport]:
        return sorted(self._last.values(), key=lambda r: r.line)

    def effective(self, prefer_source: str | None = None) -> PoolReport | None:
        reports = self.reports()
        if not reports:
            return None
        low = min(r.tokens for r in reports)
        at_low = [r for r in reports if r.tokens == low]
        preferred = [r for r in at_low if r.source == prefer_source]
        return (preferred or at_low)[0]

    def summary(self) -> str:
        """E.g. ``681280 (TP0..TP7: KV Cache is allocated; TP0: max_total_num_tokens)``."""
        by_value: dict[int, dict[str, list[str]]] = {}
        for r in self.reports():
            by_value.setdefault(r.tokens, {}).setdefault(r.source, []).append(r.reporter or "-")
        parts = []
        for tokens in sorted(by_value):
            srcs = "; ".join(f"{_ranks_label(who)}: {src}" for src, who in by_value[tokens].items())
            parts.append(f"{tokens} ({srcs})")
        return ", ".join(parts)


def _ranks_label(who: list[str]) -> str:
    uniq = list(dict.fromkeys(who))
    if len(uniq) > 3:
        return f"{uniq[0]}..{uniq[-1]} ({len(uniq)} reporters)"
    return ",".join(uniq)
