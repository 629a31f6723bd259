"""The answer of a drill-down as a notebook shows it: a title, a sentence on what it shows (or why it is
empty), the table and, for some, a chart."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from html import escape
from typing import Any, Callable, TypeVar

import duckdb
import pandas as pd

from kvforensics.core.errors import InputError
from kvforensics.core.escaping import visible_controls
from kvforensics.stages.scope import iso

MAX_ROWS = 50  # rows a view shows in a notebook; the frame holds them all
# the stage that writes each table a view reads beyond the ingest's (sql/schema.sql creates those)
STAGE_OF_TABLE = {
    "request_tiers": "detect",
    "affected_responses": "scope",
    "suspect_responses": "scope",
    "possible_sources": "scope",
    "content_matches": "scope",
    "notifications": "scope",
    "account_behaviour": "scope",
    "account_classes": "scope",
    "analysed_requests": "scope",
    "log_gaps": "scope",
    "prefix_sources": "scope",
    "prefix_possible_sources": "scope",
}
_MISSING_TABLE = re.compile(r"Table with name (\w+) does not exist")
F = TypeVar("F", bound=Callable[..., Any])


def read_frame(con: duckdb.DuckDBPyConnection, query: str, params: dict | None = None) -> pd.DataFrame:
    """A fixed query's rows; every value from outside goes in *params* (DuckDB named parameters)."""
    return con.execute(query, params).df() if params else con.execute(query).df()


def reads(function: F) -> F:
    """A view of a stage's tables asked for before the stage ran says which stage to build, not a DuckDB
    catalog error."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except duckdb.CatalogException as e:
            found = _MISSING_TABLE.search(str(e))
            table = found.group(1) if found else "a table"
            stage = STAGE_OF_TABLE.get(table, "ingest")
            raise InputError(
                f"{function.__name__} reads {table}, which the '{stage}' stage writes and this "
                f"evidence database lacks: open the folder with "
                f"Investigation.open_or_build(incident, out_dir, "
                f"through=\"{stage}\") (or run `kvforensics {stage}`) first"
            ) from None

    return wrapper  # type: ignore[return-value]


def html_text(value: Any) -> str:
    """Untrusted text (account, request, instance names) for HTML: control characters made visible, then
    escaped, so ``<b>`` reads as ``<b>`` and never as markup."""
    return escape(visible_controls(str(value)))


def when(value: Any) -> str:
    """A timestamp of a frame as the outputs write it (ISO 8601 UTC); missing: ``?``."""
    if value is None or value is pd.NaT or (isinstance(value, float) and value != value):
        return "?"
    return iso(pd.Timestamp(value).to_pydatetime()) or "?"


def shown(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame as a notebook table shows it: text cells with their control characters made visible, a missing
    value as an empty cell (never ``None``, ``NaN`` or ``NaT``), and a column of whole numbers that a NULL turned
    into floats written as integers (``23``, not ``23.0``)."""
    out = frame.copy()
    for column in out.columns:
        values = out[column]
        if pd.api.types.is_float_dtype(values.dtype):
            present = values.dropna()
            if len(present) and (present == present.round()).all() and present.abs().max() < 2**53:
                out[column] = values.astype("Int64")
        elif values.dtype == object or pd.api.types.is_string_dtype(values.dtype):
            out[column] = [visible_controls(v) if isinstance(v, str) else v for v in values]
    return out.astype(object).where(out.notna(), "")


@dataclass
class View:
    """``frame``: the rows (every one, as the evidence database holds them). ``note``: how to read them, or why
    there are none. ``chart``: an Altair chart of them, where one helps (display it in its own cell)."""

    title: str
    frame: pd.DataFrame
    note: str = ""
    chart: Any = None

    @property
    def empty(self) -> bool:
        return self.frame.empty

    def __len__(self) -> int:
        return len(self.frame)

    def _repr_html_(self) -> str:
        parts = [f"<h4>{html_text(self.title)}</h4>"]
        if self.note:
            parts.append(f"<p>{html_text(self.note)}</p>")
        if not self.frame.empty:
            more = len(self.frame) - MAX_ROWS
            parts.append(shown(self.frame.head(MAX_ROWS)).to_html(index=False, escape=True, na_rep=""))
            if more > 0:
                parts.append(f"<p><i>{more:,} more rows: <code>.frame</code> holds them all.</i></p>")
        return "\n".join(parts)

    def __repr__(self) -> str:
        head = f"{self.title}\n{self.note}\n" if self.note else f"{self.title}\n"
        return head + (shown(self.frame.head(MAX_ROWS)).to_string(index=False) if not self.frame.empty else "")
