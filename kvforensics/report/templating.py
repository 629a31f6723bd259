"""The Jinja environment of the report and the notices: filters that print every value as the outputs write it."""

from __future__ import annotations

import functools
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
from jinja2 import (
    BytecodeCache,
    Environment,
    FileSystemBytecodeCache,
    FileSystemLoader,
    StrictUndefined,
    select_autoescape,
)
from jinja2.bccache import Bucket
from markupsafe import Markup

from kvforensics.core.escaping import markdown_text, visible_controls
from kvforensics.core.timestamps import iso

TEMPLATES = Path(__file__).parent / "templates"


def _missing(value: Any) -> bool:
    """None, pandas' NA and NaT, or a float NaN: a value the evidence does not have."""
    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and value != value)


def _fmt_ts(value: Any) -> str:
    if _missing(value):
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (datetime, pd.Timestamp)):
        return iso(pd.Timestamp(value).to_pydatetime()) or ""
    return str(value)


def _fmt_num(value: Any, digits: int = 0) -> str:
    if _missing(value):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int,)) or (isinstance(value, float) and digits == 0 and float(value).is_integer()):
        return f"{int(value):,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError):
        return str(value)


def _fmt_fixed(value: Any, digits: int = 1) -> str:
    """A number with exactly ``digits`` decimals; empty when missing."""
    if _missing(value):
        return ""
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return str(value)


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _utc(value: Any) -> datetime | None:
    if _missing(value):
        return None
    stamp = pd.Timestamp(value)
    return (stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")).to_pydatetime()


def prose_time(value: Any, *, day_only: bool = False) -> str:
    """A time for a sentence: ``8 Sep 2026 21:38 UTC`` (no milliseconds, no ISO ``T``); empty when missing."""
    t = _utc(value)
    if t is None:
        return ""
    day = f"{t.day} {_MONTHS[t.month - 1]} {t.year}"
    return day if day_only else f"{day} {t:%H:%M} UTC"


def prose_span(first: Any, last: Any) -> str:
    """When something happened, for a sentence: ``on 8 Sep 2026 at 21:38 UTC``, ``on 8 Sep 2026 between 21:38 and
    21:46 UTC``, ``between 27 Aug 2026 21:49 UTC and 2 Sep 2026 10:55 UTC`` (never "between X and X")."""
    a, b = _utc(first), _utc(last)
    if a is None or b is None:
        return f"on {prose_time(a or b)}" if (a or b) else ""
    if f"{a:%Y-%m-%d %H:%M}" == f"{b:%Y-%m-%d %H:%M}":
        return f"on {prose_time(a, day_only=True)} at {a:%H:%M} UTC"
    if a.date() == b.date():
        return f"on {prose_time(a, day_only=True)} between {a:%H:%M} and {b:%H:%M} UTC"
    return f"between {prose_time(a)} and {prose_time(b)}"


_PLURALS = {
    "response": "responses",
    "request": "requests",
    "account": "accounts",
    "time": "times",
    "model server": "model servers",
    "notice": "notices",
    "more account": "more accounts",
    "affected response": "affected responses",
    "start-up": "start-ups",
    "misconfigured model server": "misconfigured model servers",
}


def plural(count: Any, word: str) -> str:
    """``1 response``, ``3 responses``, ``1,204 requests`` (never "request(s)")."""
    n = 0 if _missing(count) else int(count)
    return f"{n:,} {word if n == 1 else _PLURALS.get(word, word + 's')}"


def file_labels(paths: Any) -> list[str]:
    """Each path as its shortest trailing part no other path of *paths* ends with: ``vllm-0/vllm.log.gz`` where
    every instance's log is ``vllm.log.gz``, the bare file name where it is unique."""
    parts = [str(p).replace("\\", "/").split("/") for p in paths]
    labels = []
    for mine in parts:
        n = 1
        while n < len(mine) and sum(1 for other in parts if other[-n:] == mine[-n:]) > 1:
            n += 1
        labels.append("/".join(mine[-n:]))
    return labels


def words(items: Any) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = [str(i) for i in items]
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def for_class(text: str, account_class: str) -> str:
    """A mechanism's notice wording for an account of *account_class*: the provider's own accounts are told "another
    account's", not "another customer's" (their traffic is not a customer's, and neither is every other account's)."""
    if account_class == "customer":
        return text
    return (
        text.replace("another customer's", "another account's")
        .replace("other customers'", "other accounts'")
        .replace("another customer", "another account")
        .replace("other customers", "other accounts")
    )


def _ts_seconds(value: Any) -> str:
    """An ISO 8601 UTC time to the second (``2026-09-08T21:38:10Z``): a table cell a person reads."""
    t = _utc(value)
    return "" if t is None else f"{t:%Y-%m-%dT%H:%M:%SZ}"


def _printable(value: Any) -> Any:
    """Every text a template prints, with control characters (NUL...) made visible; markup built by the renderer
    (the SVG charts, the audit table) passes unchanged."""
    return visible_controls(value) if isinstance(value, str) and not isinstance(value, Markup) else value


class _TemplateCache(FileSystemBytecodeCache):
    """Jinja's own cache of compiled templates (in the temporary folder, a directory that only this user may read and
    write, which Jinja checks), so that a run does not compile the report's templates again: compiling them took about
    0.6 s a run. A template whose source changed, or another Python's, is compiled again; a cache that cannot be
    read or written is only slower, never an error."""

    def load_bytecode(self, bucket: Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # unreadable, truncated, or not what Jinja wrote (pickle, marshal): compile it again
            bucket.reset()

    def dump_bytecode(self, bucket: Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def _bytecode_cache() -> BytecodeCache | None:
    """The cache of compiled templates, or None where it cannot be made or ``KVFORENSICS_TEMPLATE_CACHE=0``."""
    if os.environ.get("KVFORENSICS_TEMPLATE_CACHE", "1") == "0":
        return None
    try:
        return _TemplateCache(pattern="kvforensics-%s.cache")
    except (OSError, RuntimeError):
        return None


@functools.cache
def template_env(autoescape: bool) -> Environment:
    """The report's template environment (one per process for each escaping: its templates compiled once, not
    once per notice). Nothing changes it after it is made."""
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        undefined=StrictUndefined,
        autoescape=select_autoescape(["html", "j2"]) if autoescape else False,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_printable,
        bytecode_cache=_bytecode_cache(),
    )
    env.filters["ts"] = _fmt_ts
    env.filters["num"] = _fmt_num
    env.filters["fixed"] = _fmt_fixed
    env.filters["md"] = markdown_text
    env.filters["prose_time"] = prose_time
    env.filters["ts_s"] = _ts_seconds
    env.filters["for_class"] = for_class
    env.globals.update(prose_span=prose_span, plural=plural, words=words)
    return env
