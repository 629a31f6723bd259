"""Engine logs through a vectorised path: the per-request lines of an SGLang log read column-wise.

The Python parsers (:mod:`~kvforensics.loaders.sglang`, :mod:`~kvforensics.loaders.vllm`) are the
reference: they read a log line by line. Most lines of a busy SGLang prefill log are
``[stamp TPn] ReqTimeStats(rid=..., input_len=N, ...)`` lines, one per request, and such a line
changes nothing a start-up needs beyond the time and ranks last seen. This reader takes the lines
of a file in batches, lets DuckDB pick out (with SQL regular expressions, on every core) the
ReqTimeStats lines whose reading is certain, and reads them there: stamp, rank, rid, input_len and
the detail text. Every other line goes to the Python parser in file order, and each run of lines
read in DuckDB is handed to it as one step (:meth:`SglangParser.feed_request_run`), so start-ups,
quarantined lines, notes and events are the parser's own.

A line is read in DuckDB only when all of these hold, and otherwise by the parser:

* it is valid UTF-8 and ASCII (so character counts and truncation agree), without control
  characters other than tab;
* it has SGLang's dated envelope ``[YYYY-MM-DD HH:MM:SS[.ffffff] <ranks>]``, a real date and time,
  in a local hour with no daylight-saving change (:meth:`LocalClock.hour_shift_us`);
* its message starts with ``ReqTimeStats(`` and the body is plain ``key=value`` pairs, the first
  ``rid=<id>``, with at most one ``input_len`` of at most 18 digits;
* the line holds none of the texts another reading looks for (start-up, shutdown, role, version,
  other events: :data:`~kvforensics.loaders.sglang.SELF_CONTAINED_EXCLUDES`);
* the line before it is also read in DuckDB (the first line of each run goes through the parser,
  which closes whatever the line before left open, such as a wrapped server_args dump).

Whole files fall back to :func:`~kvforensics.loaders.engine_common.parse_engine_file`: vLLM logs
(their per-request lines are rare aborts), files in a collection envelope (the envelope's clock
reorders records per instance before parsing, see :mod:`~kvforensics.loaders.envelopes`) and files
whose engine cannot be recognised (the same error as the reference). Compressed files are read as
the reference reads them (:func:`~kvforensics.loaders.engine_lines.open_lines`): gzip and zstd,
and a truncated stream ends in the same note and quarantined partial line.
"""

from __future__ import annotations

import contextlib
import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import duckdb
import pyarrow as pa

from kvforensics.loaders.engine_common import add_truncation, engine_format, parse_engine_file
from kvforensics.loaders.engine_lines import SNIFF_LINES, LineBatch, open_lines
from kvforensics.loaders.engine_types import DETAIL_LIMIT, EVENT_COLUMNS, EngineFileParse, InstanceNamer
from kvforensics.loaders.envelopes import sniff_envelope
from kvforensics.loaders.sglang import SELF_CONTAINED_EXCLUDES, RequestRun, SglangParser

__all__ = ["BATCH_LINES", "parse_engine_file_columnar"]

BATCH_LINES = 200_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _re2_literal(text: str) -> str:
    """*text* as a literal inside an RE2 pattern."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$" else c for c in text)


# Control characters other than tab are excluded too: Python's \s and str.strip() count \v and
# \x1c-\x1f as white space, RE2's \s does not.
_EXCLUDE = "|".join([*(_re2_literal(n) for n in SELF_CONTAINED_EXCLUDES if n.isprintable()), r"[\x00-\x08\x0a-\x1f\x7f]"])

# One pass over a batch: the lines DuckDB reads, with their stamp, ranks, rid, input_len and detail.
# The patterns are literals (a pattern given as a parameter is compiled again for every row); the
# exclusions are the parser's own constants, never input text.
_SELF_CONTAINED_SQL = f"""
WITH headed AS (
    -- the envelope ends at the first ']' (nothing in it may be one); the message must follow it
    SELECT n, line, position(']' IN line) + CASE
               WHEN substr(line, position(']' IN line) + 1, 13) = 'ReqTimeStats(' THEN 13
               WHEN substr(line, position(']' IN line) + 1, 14) = ' ReqTimeStats(' THEN 14 ELSE 0 END AS head_len
    FROM batch
    WHERE line IS NOT NULL AND starts_with(line, '[') AND contains(line, 'ReqTimeStats(')
      AND strlen(line) = length(line) AND NOT regexp_matches(line, '{_EXCLUDE.replace("'", "''")}')
), stamped AS (
    SELECT n, substr(line, 1, head_len) AS head, substr(line, head_len - 12) AS msg,
           split_part(substr(line, head_len + 1), ')', 1) AS body
    FROM headed
    WHERE head_len > 13 AND contains(substr(line, head_len + 1), ')')
), fields AS (
    SELECT n, head, msg,
           CASE WHEN substr(head, 21, 1) IN ('.', ',') THEN regexp_extract(substr(head, 22, 7), '^\\d+', 0) ELSE '' END
               AS frac,
           try_strptime(substr(head, 2, 19), '%Y-%m-%d %H:%M:%S') AS local,
           substr(split_part(body, ',', 1), 5) AS rid,
           split_part(split_part(body, ', input_len=', 2), ',', 1) AS input_len,
           strlen(body) - strlen(replace(body, ', input_len=', '')) AS input_len_chars
    FROM stamped
    WHERE substr(head, 2, 4) >= '0001' AND NOT contains(body, ', rid=')
      AND regexp_matches(head,
          '^\\[\\d{{4}}-\\d{{2}}-\\d{{2}} \\d{{2}}:\\d{{2}}:\\d{{2}}(?:[.,]\\d{{1,6}})?(?: +[^\\]\\s]+)* *\\] ?ReqTimeStats\\($')
      AND regexp_full_match(body, 'rid=[^,=\\s]+(?:, \\w+=[^,=]*)*')
)
SELECT n, substr(head, 2, 13) AS hour,
       epoch_us(local) + CAST(rpad(CASE WHEN frac = '' THEN '0' ELSE frac END, 6, '0') AS BIGINT) AS local_us,
       substr(head, 2, CASE WHEN frac = '' THEN 19 ELSE 20 + strlen(frac) END) AS stamp,
       split_part(substr(head, CASE WHEN frac = '' THEN 21 ELSE 22 + strlen(frac) END), ']', 1) AS extra,
       rid, CASE WHEN input_len_chars = 0 THEN NULL ELSE CAST(input_len AS BIGINT) END AS input_len,
       CASE WHEN length(msg) <= {DETAIL_LIMIT} THEN msg ELSE msg[1:{DETAIL_LIMIT - 1}] || '\u2026' END AS detail
FROM fields
WHERE local IS NOT NULL AND (input_len_chars = 0 OR (input_len_chars = 12 AND regexp_full_match(input_len, '\\d{{1,18}}')))
"""


def parse_engine_file_columnar(
    path: Path,
    *,
    fmt: str,
    instance: str | InstanceNamer,
    tz: ZoneInfo,
    year: int | None = None,
    clock_offset_s: float = 0.0,
    envelope: str = "auto",
    con: duckdb.DuckDBPyConnection | None = None,
    batch_lines: int = BATCH_LINES,
) -> EngineFileParse:
    """Parse one engine log file as :func:`~kvforensics.loaders.engine_common.parse_engine_file`
    does (same arguments, same result), reading self-contained per-request SGLang lines in DuckDB.

    ``con`` is the DuckDB connection to run the SQL on (a private in-memory one if None).
    """
    with contextlib.closing(open_lines(path)) as sniffing:
        head = list(itertools.islice(sniffing, SNIFF_LINES))
    found = sniff_envelope(head) if head and envelope == "auto" else envelope
    if not head or found != "none" or engine_format(fmt, [t for _, t, _ in head], path) != "sglang":
        return parse_engine_file(path, fmt=fmt, instance=instance, tz=tz, year=year,
                                 clock_offset_s=clock_offset_s, envelope=envelope)
    name = instance if isinstance(instance, str) else instance(None)
    parser = SglangParser(name, tz, clock_offset_s)
    stream = open_lines(path)
    db = duckdb.connect() if con is None else con.cursor()
    try:
        for batch in stream.batches(batch_lines):
            _read_batch(db, parser, batch)
    finally:
        stream.close()
        db.close()
    parse = parser.finish()
    result = EngineFileParse(envelope="none", instances={name: parse}, lines_read=parse.lines_read)
    add_truncation(result, stream)
    return result


# Self-contained lines in hours with one UTC offset, numbered into islands of consecutive lines. The
# first line of each island is left to the parser (it reads it after whatever came before); the
# rest of an island is a run read here.
_ISLANDS_SQL = """
CREATE OR REPLACE TEMP TABLE kvf_islands AS
SELECT n, extra, utc_us, stamp, n - row_number() OVER (ORDER BY n) AS island
FROM (SELECT s.n, s.extra, s.local_us - h.shift_us AS utc_us, s.stamp
      FROM kvf_self_contained s JOIN kvf_hours h USING (hour) WHERE h.shift_us IS NOT NULL)
"""
_RUNS_SQL = """
SELECT min(n) + 1 AS first, max(n) AS last, island FROM kvf_islands GROUP BY island HAVING count(*) > 1 ORDER BY first
"""
_RUN_ENDS_SQL = """
SELECT n, utc_us, stamp FROM kvf_islands SEMI JOIN kvf_run_ends USING (n)
"""
# the first line of a prefix in each island (the island's own first line included: the parser saw
# it before the run, so it changes nothing)
_RUN_RANKS_SQL = """
SELECT island, min(n) AS first, extra FROM kvf_islands WHERE extra <> '' GROUP BY island, extra ORDER BY first
"""
_RUN_EVENTS_SQL = """
SELECT $instance AS instance, i.utc_us AS ts, 'req_time_stats' AS kind, s.rid AS request_id,
       s.input_len AS prompt_tokens, CAST(NULL AS BIGINT) AS limit_tokens, s.detail, s.n AS line
FROM kvf_self_contained s JOIN kvf_islands i USING (n)
WHERE s.n NOT IN (SELECT min(n) FROM kvf_islands GROUP BY island)
"""


def _read_batch(db: duckdb.DuckDBPyConnection, parser: SglangParser, batch: LineBatch) -> None:
    first_number, texts, raws = batch.first, batch.texts, batch.raws
    db.register("batch", pa.table({"n": pa.arange(first_number, first_number + len(texts)),
                                   "line": pa.array(texts, type=pa.string())}))
    try:
        db.execute(f"CREATE OR REPLACE TEMP TABLE kvf_self_contained AS {_SELF_CONTAINED_SQL}")
    finally:
        db.unregister("batch")
    hours = [h for (h,) in db.execute("SELECT DISTINCT hour FROM kvf_self_contained").fetchall()]
    db.register("kvf_hours", pa.table({"hour": pa.array(hours, type=pa.string()),
                                       "shift_us": pa.array([_hour_shift(parser, h) for h in hours], type=pa.int64())}))
    try:
        db.execute(_ISLANDS_SQL)
    finally:
        db.unregister("kvf_hours")
    runs = db.execute(_RUNS_SQL).fetchall()
    if runs:
        db.register("kvf_run_ends", pa.table({"n": pa.array([n for first, last, _ in runs for n in (first, last)],
                                                             type=pa.int64())}))
        try:
            ends = {n: (us, stamp) for n, us, stamp in db.execute(_RUN_ENDS_SQL).fetchall()}
        finally:
            db.unregister("kvf_run_ends")
        ranks: dict[int, list[tuple[int, str]]] = {}
        for island, first, extra in db.execute(_RUN_RANKS_SQL).fetchall():
            ranks.setdefault(island, []).append((first, extra))
        table = db.sql(_RUN_EVENTS_SQL, params={"instance": parser.instance}).to_arrow_table()
        ts = table.column("ts").combine_chunks().view(pa.timestamp("us", tz="UTC"))
        parser.out.event_tables.append(table.set_column(1, "ts", ts).cast(EVENT_COLUMNS))
    i = 0
    for first, last, island in runs:
        while i < first - first_number:
            parser.feed(first_number + i, texts[i], raws[i])
            i += 1
        parser.feed_request_run(RequestRun(first, last, _utc(ends[first][0]), _utc(ends[last][0]), ends[last][1],
                                           tuple(ranks.get(island, ()))))
        i = last - first_number + 1
    while i < len(texts):
        parser.feed(first_number + i, texts[i], raws[i])
        i += 1


def _utc(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _hour_shift(parser: SglangParser, hour: str) -> int | None:
    return parser.clock.hour_shift_us(int(hour[0:4]), int(hour[5:7]), int(hour[8:10]), int(hour[11:13]))
