"""How untrusted text (account ids, models, request ids, instance and source names, raw log lines) is written into
each text output: CSV cells that a spreadsheet cannot run, Markdown that renders as the literal text, and no control
characters that make a file binary.

The evidence database keeps every value as it was read; these functions apply only when a value is written to a
CSV, Markdown or HTML file, so ``kvforensics verify`` re-derives a written cell from the database with them.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from kvforensics.timestamps import iso

# C0 control characters other than TAB, LF and CR, and DEL: NUL bytes make a text file binary to every tool.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# A leading character with which a spreadsheet starts a formula (OWASP CSV injection,
# https://owasp.org/www-community/attacks/CSV_Injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
CSV_MODES = ("neutralised", "raw")


def visible_controls(text: str) -> str:
    """``text`` with each C0 control (except TAB, LF, CR) and DEL written as a visible ``\\xNN`` escape."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def neutralise_formula(text: str) -> str:
    """``text`` with a leading ``'`` when a spreadsheet would read it as a formula (first character in
    ``FORMULA_STARTS``); any other text unchanged."""
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def csv_cell(value: Any, *, raw: bool = False) -> Any:
    """One CSV cell as the tool writes it. Text (always untrusted: it came from the inputs) has its control
    characters made visible and, unless ``raw``, a formula start neutralised; numbers the tool computed stay numbers
    (a negative count or latency is written as ``-5``, not ``'-5``); timestamps are ISO 8601 UTC; NULL is empty."""
    if value is None:
        return ""
    if isinstance(value, str):
        text = visible_controls(value)
        return text if raw else neutralise_formula(text)
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Characters CommonMark/GFM give a meaning inline: emphasis, code, links and images, headings, tables, strikethrough,
# escapes. Each is backslash-escaped, which CommonMark renders as the character itself. "(" and ")" stay as they are:
# they belong to a link only right after "]", and every "[" and "]" is escaped (so is "<", which opens autolinks).
# "_" between two letters or digits (snake_case) cannot open or close emphasis and stays as it is.
_MD_SPECIAL = re.compile(r"([\\`*\[\]!#|~{}]|(?<![^\W_])_|_(?![^\W_]))")
# GFM turns bare URLs ("https://...", "www...") and e-mail addresses into links; an escape breaks the pattern.
_MD_AUTOLINK = re.compile(r"(?i)(:(?=//)|(?<=www)\.|(?<=[\w.+-])@)")


def markdown_text(value: Any) -> str:
    """Untrusted text for a Markdown line or table cell: it renders as the literal text, never as a link, image,
    emphasis, code or HTML. Line breaks become spaces so a value stays in its table cell or heading."""
    text = visible_controls(str(value))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    text = _MD_AUTOLINK.sub(r"\\\1", text)
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
