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

from kvforensics.core.timestamps import iso

# Characters no renderer may receive as they are: the C0 controls other than TAB, LF and CR, DEL and the C1
# controls (NUL makes a text file binary to every tool; ESC starts terminal sequences), the surrogates (not text:
# UTF-8 cannot encode a lone one) and the non-characters U+FDD0..U+FDEF and U+xxFFFE/U+xxFFFF. XML 1.0 (SVG, the
# charts vl-convert draws) forbids the controls, surrogates and U+FFFE/U+FFFF outright, and vl-convert aborts the
# process on them; HTML calls them parse errors; a PDF or a file name carries them invisibly. Also the Unicode
# bidirectional controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069): invisible, they reorder the text
# around them as it is displayed, so an account id holding U+202E shows another id than it is in a notice, a table
# or a spreadsheet ("Trojan Source", CVE-2021-42574; Unicode UAX #9).
UNSAFE = re.compile(
    "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef\ufffe\uffff"
    "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
    + "".join(f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(1, 17))
    + "]"
)
# A leading character with which a spreadsheet starts a formula (OWASP CSV injection,
# https://owasp.org/www-community/attacks/CSV_Injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
CSV_MODES = ("neutralised", "raw")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def visible_controls(text: str) -> str:
    """``text`` safe for every renderer (SVG and XML, HTML, Markdown, PDF, CSV, the console): each control
    character (except TAB, LF, CR), bidirectional control, surrogate and non-character written as a visible escape, ``\\xNN`` (``\\x00``,
    ``\\x1b``, ``\\x85``), ``\\uNNNN`` (``\\ud800``, ``\\uffff``) or ``\\UNNNNNNNN``. The one helper every
    output applies to untrusted text; :func:`visible_controls_in` applies it inside a chart's spec."""
    return text if UNSAFE.search(text) is None else UNSAFE.sub(_escape, text)


def visible_controls_in(value: Any) -> Any:
    """Every string inside ``value`` (dicts, lists and tuples, keys included, as a chart's Vega-Lite spec holds its
    data, titles and tooltips) passed through :func:`visible_controls`; other values unchanged."""
    if isinstance(value, str):
        return visible_controls(value) if UNSAFE.search(value) else value
    if isinstance(value, dict):
        return {visible_controls_in(k): visible_controls_in(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [visible_controls_in(v) for v in value]
    return value


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
# "<", ">" and "&" are written as themselves where no Markdown or HTML reading can take them for markup, so that a
# version range reads ">0.5.9,<0.5.20" in the .md file: "<" becomes "&lt;" only where it could open a tag, a comment,
# a declaration or an autolink (a letter, "/", "!" or "?" follows; Markdown.pl and Python-Markdown do not honour a
# backslash before "<"), "&" becomes "&amp;" only where it starts something an entity could be, and ">" is escaped
# where it would start a block quote.
_MD_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")
_MD_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")
# GFM turns bare URLs ("https://...", "www...") and e-mail addresses into links; an escape breaks the pattern.
_MD_AUTOLINK = re.compile(r"(?i)(:(?=//)|(?<=www)\.|(?<=[\w.+-])@)")


# A character one of the rules below could act on; a text without any is written as it is (most ids and numbers).
_MD_ANY = re.compile(_MD_AUTOLINK.pattern + r"|[\\`*\[\]!#|~{}_<>&\r\n]|" + UNSAFE.pattern)


def markdown_text(value: Any) -> str:
    """Untrusted text for a Markdown line or table cell: it renders as the literal text, never as a link, image,
    emphasis, code or HTML. Line breaks become spaces so a value stays in its table cell or heading."""
    text = str(value)
    if _MD_ANY.search(text) is None:
        return text
    text = visible_controls(text)
    text = _MD_ENTITY.sub("&amp;", text)
    text = _MD_TAG_START.sub("&lt;", text)
    text = _MD_SPECIAL.sub(r"\\\1", text)
    text = re.sub(r"^(\s*)>", r"\1\\>", text)  # a block quote where a value starts a line
    text = _MD_AUTOLINK.sub(r"\\\1", text)
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
