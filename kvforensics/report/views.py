"""The small frames behind the interactive views (timeline, per account), aggregated in DuckDB.

The report and the notebooks draw them with :func:`kvforensics.report.charts.timeline_chart` and
:func:`~kvforensics.report.charts.account_chart`. Affected responses are drawn one dot each up to
``max_points`` (a deterministic sample by request id beyond that, said in the chart's title); the
hourly counts always cover every affected response. Text from the inputs (account ids, model and
instance names, change descriptions) has its control characters made visible; times are UTC.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pandas as pd

from kvforensics.config import Incident
from kvforensics.core.escaping import visible_controls
from kvforensics.core.timestamps import iso

MAX_POINTS = 4000  # dots drawn per view (one per affected response)
MAX_ACCOUNTS = 50  # accounts in the per-account view's list, most affected responses first
# Every other element of a view is bounded too (a chart embeds at most 5,000 rows per dataset, and a page of tens of
# thousands of marks is not read): beyond its limit it is sampled evenly in time or aggregated, and its title says so.
MAX_EVENTS = 2000  # event ticks on the timeline: the incident file's first, then start-ups and restarts, then changes
MAX_WINDOWS = 1000  # exposure windows on the timeline
MAX_BARS = 2000  # bars of affected responses per hour; per day (then week, month) when the hours are more
_BAR_UNITS = ("hour", "day", "week", "month")
_EVENT_PRIORITY = ("incident file", "start-up", "restart", "config change")

_AFFECTED_COLUMNS = (
    "ts, request_id, account_id, account_class, model, confidence, prompt_tokens, "
    "coalesce(prefill_instance, pool_instance) AS instance"
)


@dataclass(frozen=True)
class TimelineFrames:
    """``windows``: lane, instance, role, model, start, end, pool_tokens, context_length (exposure windows).
    ``events``: ts, kind (start-up, restart, config change, incident file), title, detail.
    ``affected``: ts, request_id, account_id, account_class, model, confidence, prompt_tokens, instance.
    ``hourly``: hour, model, responses (per ``bar_unit``: hour, or day, week, month when the hours are more than
    ``MAX_BARS``). ``affected_total``: every affected response, drawn or not; ``events_total`` and
    ``windows_total`` every event and exposure window, drawn or not (beyond ``MAX_EVENTS`` / ``MAX_WINDOWS``, an even
    sample in time). Every frame also has a ``time`` (or ``from``/``to``) column: its timestamps as ISO 8601 UTC
    text."""

    windows: pd.DataFrame
    events: pd.DataFrame
    affected: pd.DataFrame
    hourly: pd.DataFrame
    affected_total: int
    events_total: int | None = None  # None: every event is drawn
    windows_total: int | None = None
    bar_unit: str = "hour"

    def bounds_note(self) -> str:
        """What the view leaves out, for its title: '' when it draws everything."""
        notes = [
            f"{len(frame):,} of {total:,} {what} drawn, {how}"
            for frame, total, what, how in (
                (
                    self.events,
                    self.events_total,
                    "events",
                    "the incident file's first, then start-ups, then changes, evenly in time",
                ),
                (self.windows, self.windows_total, "exposure windows", "evenly in time"),
            )
            if total is not None and total > len(frame)
        ]
        return "; ".join(notes)


@dataclass(frozen=True)
class AccountFrames:
    """``accounts``: account_id, account_class, responses, first, last, models (the ``MAX_ACCOUNTS`` most
    affected). ``affected``: their affected responses, as in :class:`TimelineFrames`.
    ``accounts_total`` / ``affected_total``: every account that received an affected response / their responses."""

    accounts: pd.DataFrame
    affected: pd.DataFrame
    accounts_total: int
    affected_total: int


def _frame(con: duckdb.DuckDBPyConnection, query: str, params: dict | None = None) -> pd.DataFrame:
    df = con.execute(query, params).df() if params else con.execute(query).df()
    for column in df.columns:
        if df[column].dtype == object:
            df[column] = [visible_controls(v) if isinstance(v, str) else v for v in df[column]]
    return df


def _with_text_times(df: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """Timestamp columns as UTC (pandas) plus their ISO 8601 text for tooltips (``{ts: time}``)."""
    for column, text in columns.items():
        df[column] = pd.to_datetime(df[column], utc=True)
        df[text] = [iso(v.to_pydatetime()) if not pd.isna(v) else "" for v in df[column]]
    return df


def _affected(con: duckdb.DuckDBPyConnection, where: str, params: dict, max_points: int) -> pd.DataFrame:
    """Affected responses matching ``where`` (a fixed clause with named parameters), at most ``max_points``."""
    df = _frame(
        con,
        f"""SELECT * FROM (SELECT {_AFFECTED_COLUMNS} FROM affected_responses WHERE {where}
                                         ORDER BY hash(request_id), request_id LIMIT $n)
                         ORDER BY ts, request_id""",
        {**params, "n": max_points},
    )
    return _with_text_times(df, {"ts": "time"})


def timeline_frames(
    con: duckdb.DuckDBPyConnection, incident: Incident | None = None, *, max_points: int = MAX_POINTS
) -> TimelineFrames:
    """Exposure windows, start-ups and restarts, config changes, the incident file's events (reports, fixes) and
    affected responses of an evidence database, for :func:`~kvforensics.report.charts.timeline_chart`."""
    windows = _frame(
        con,
        """
        SELECT instance || ' (' || coalesce(role, 'role unknown') || ', pool ' || format('{:,}', kv_pool_tokens) || ')'
                   AS lane,
               instance, role, model, valid_from AS start,
               coalesce(valid_to, greatest(valid_from, (SELECT max(ts) FROM requests))) AS "end",
               kv_pool_tokens AS pool_tokens, context_length
        FROM capacity c WHERE valid_from IS NOT NULL AND EXISTS (SELECT 1 FROM exposure_windows w WHERE w.instance = c.instance AND w.valid_from IS NOT DISTINCT FROM c.valid_from)
        ORDER BY valid_from, instance""",
    )
    windows = _with_text_times(windows, {"start": "from", "end": "to"})
    windows_total = len(windows)
    windows = _evenly(windows, MAX_WINDOWS)
    startups = _frame(
        con,
        """
        SELECT valid_from AS ts,
               CASE WHEN row_number() OVER (PARTITION BY instance ORDER BY valid_from) = 1 THEN 'start-up'
                    ELSE 'restart' END AS kind,
               instance || ' (' || coalesce(role, 'role unknown') || '): KV pool ' ||
                   coalesce(format('{:,}', kv_pool_tokens), 'unknown') ||
                   CASE WHEN kv_pool_tokens < context_length THEN ' < context ' ELSE ', context ' END ||
                   coalesce(format('{:,}', context_length), 'unknown') ||
                   CASE WHEN EXISTS (SELECT 1 FROM exposure_windows w WHERE w.instance = c.instance AND w.valid_from IS NOT DISTINCT FROM c.valid_from) THEN ': EXPOSED' ELSE '' END AS title,
               coalesce(model, 'model unknown') AS detail
        FROM capacity c WHERE valid_from IS NOT NULL""",
    )
    # a long change log: an even sample in time, taken in DuckDB (the rest are counted)
    changes = _frame(
        con,
        """SELECT ts, kind, title, detail FROM (
                                 SELECT ts, 'config change' AS kind, description AS title,
                                        concat_ws(' ', model, instance, details) AS detail,
                                        row_number() OVER (ORDER BY ts, description, details) - 1 AS n,
                                        count(*) OVER () AS total
                                 FROM changes)
                             WHERE total <= $k OR n % ceil(total / $k) = 0""",
        {"k": MAX_EVENTS},
    )
    changes_total = con.execute("SELECT count(*) FROM changes").fetchall()[0][0]
    noted = pd.DataFrame(
        [
            {
                "ts": e.ts,
                "kind": "incident file",
                "title": visible_controls(e.title),
                "detail": visible_controls(e.description),
            }
            for e in (incident.events if incident else [])
        ],
        columns=["ts", "kind", "title", "detail"],
    )
    events_total = len(startups) + changes_total + len(noted)
    present = [f for f in (startups, changes, noted) if not f.empty]
    events = pd.concat(present, ignore_index=True) if present else noted
    # a total order: start-ups of the same second come from the database in no fixed order
    events = (
        _with_text_times(events, {"ts": "time"})
        .sort_values(["ts", "kind", "title", "detail"], kind="stable")
        .reset_index(drop=True)
    )
    events = _events_within(events, MAX_EVENTS)
    for unit in _BAR_UNITS:  # per hour, or coarser when the hours are too many to draw
        hourly = _frame(
            con,
            f"SELECT date_trunc('{unit}', ts) AS hour, model, count(*) AS responses "
            "FROM affected_responses GROUP BY 1, 2 ORDER BY 1, 2",
        )
        if len(hourly) <= MAX_BARS:
            break
    hourly = _with_text_times(hourly, {"hour": "time"})
    total = con.execute("SELECT count(*) FROM affected_responses").fetchall()[0][0]
    return TimelineFrames(
        windows=windows,
        events=events,
        affected=_affected(con, "true", {}, max_points),
        hourly=hourly,
        affected_total=int(total),
        events_total=events_total,
        windows_total=windows_total,
        bar_unit=unit,
    )


def _evenly(frame: pd.DataFrame, limit: int) -> pd.DataFrame:
    """At most *limit* rows of *frame*, evenly spaced in its order (the first and the last kept)."""
    if len(frame) <= limit:
        return frame
    if limit <= 1:
        return frame.iloc[:limit]
    picks = sorted({round(i * (len(frame) - 1) / (limit - 1)) for i in range(limit)})
    return frame.iloc[picks].reset_index(drop=True)


def _events_within(events: pd.DataFrame, limit: int) -> pd.DataFrame:
    """At most *limit* events: each kind in ``_EVENT_PRIORITY`` order takes what it needs of what is left, evenly
    in time when it needs more; the result in time order."""
    if len(events) <= limit:
        return events
    kept = []
    for kind in _EVENT_PRIORITY:
        taken = _evenly(events[events["kind"] == kind], limit - sum(len(k) for k in kept))
        kept.append(taken)
    return pd.concat(kept).sort_values(["ts", "kind", "title", "detail"], kind="stable").reset_index(drop=True)


def account_frames(
    con: duckdb.DuckDBPyConnection,
    *,
    account: str | None = None,
    max_accounts: int = MAX_ACCOUNTS,
    max_points: int = MAX_POINTS,
) -> AccountFrames:
    """The accounts that received affected responses (most first) and their responses, for
    :func:`~kvforensics.report.charts.account_chart`; ``account``: that account only."""
    where = "account_id = $account" if account is not None else "true"
    params = {"account": account} if account is not None else {}
    accounts = _frame(
        con,
        f"""
        SELECT account_id, account_class, count(*) AS responses, min(ts) AS first, max(ts) AS last,
               string_agg(DISTINCT model, ', ' ORDER BY model) AS models
        FROM affected_responses WHERE {where} GROUP BY 1, 2
        ORDER BY responses DESC, account_id LIMIT $k""",
        {**params, "k": max_accounts},
    )
    accounts = _with_text_times(accounts, {"first": "first_time", "last": "last_time"})
    accounts_total, affected_total = con.execute(
        f"SELECT count(DISTINCT account_id), count(*) FROM affected_responses WHERE {where}", params
    ).fetchall()[0]
    listed = (
        f"account_id IN (SELECT account_id FROM affected_responses WHERE {where} GROUP BY 1 "
        "ORDER BY count(*) DESC, account_id LIMIT $k)"
    )
    affected = _affected(con, f"{where} AND {listed}", {**params, "k": max_accounts}, max_points)
    return AccountFrames(
        accounts=accounts, affected=affected, accounts_total=int(accounts_total), affected_total=int(affected_total)
    )


def exposure_period(frames: TimelineFrames, margin_days: float = 2) -> tuple[pd.Timestamp, pd.Timestamp] | None:
    """The span of the exposure windows and affected responses, widened by ``margin_days`` on each side: the period
    a timeline shows first (earlier and later events are a zoom or pan away). None when there is neither."""
    times = pd.concat([frames.windows["start"], frames.windows["end"], frames.hourly["hour"]]).dropna()
    if times.empty:
        return None
    margin = pd.Timedelta(days=margin_days)
    return times.min() - margin, times.max() + pd.Timedelta(hours=1) + margin
