"""Engine logs through a vectorised path: the per-request lines of an SGLang log read column-wise.

The Python parsers (:mod:`~kvforensics.sources.engine_logs.sglang.parser`, :mod:`~kvforensics.sources.engine_logs.vllm.parser`) are the
reference: they read a log line by line. Most lines of a busy SGLang prefill log are
``[stamp TPn] ReqTimeStats(rid=..., input_len=N, ...)`` lines, one per request, and such a line
changes nothing a start-up needs beyond the time and ranks last seen. This reader takes the lines
of a file in batches, lets DuckDB pick out (with SQL regular expressions, on every core) the
ReqTimeStats lines whose reading is certain, and reads them there: stamp, rank, rid, input_len and
the detail text; and the prefill batch lines (one per prefill step, :mod:`~kvforensics.sources.engine_logs.sglang.batches`)
in the same way. Every other line goes to the Python parser in file order, and each run of lines
read in DuckDB is handed to it as one step (:meth:`SglangParser.feed_request_run`), so start-ups,
quarantined lines, notes and events are the parser's own.

A batch reaches DuckDB without a Python object per line: :meth:`LineStream.batches` cuts the bytes
at newlines by offsets into one Arrow column, and only the lines the parser reads are decoded.
The parser's exclusions are matched by Arrow (one RE2 pattern, about half DuckDB's time for it),
and the column is registered in record batches that DuckDB's threads scan side by side. With an
:class:`EvidenceSink` (what ingest passes), the rows read here are inserted into the evidence
tables batch by batch, so a file of any size needs the memory of one batch; ingest parses several
files at once, each on its own cursor (kvforensics/stages/ingest.py).

A line is read in DuckDB only when all of these hold, and otherwise by the parser:

* it is valid UTF-8 and ASCII (so character counts and truncation agree), without control
  characters other than tab;
* it has SGLang's dated envelope ``[YYYY-MM-DD HH:MM:SS[.ffffff] <ranks>]``, a real date and time,
  in a local hour with no daylight-saving change (:meth:`LocalClock.hour_shift_us`);
* its message starts with ``ReqTimeStats(`` and the body is plain ``key=value`` pairs, the first
  ``rid=<id>``, with at most one ``input_len`` of at most 18 digits;
* the line holds none of the texts another reading looks for (start-up, shutdown, role, version,
  other events: :data:`~kvforensics.sources.engine_logs.sglang.parser.SELF_CONTAINED_EXCLUDES`);
* or its message starts with ``Prefill batch``, ``[iter]``, ``,`` or ``.``, and the rest is plain
  ``key: value`` parts joined by ``", "`` whose ``#new-seq``, ``#new-token`` and ``#cached-token``
  are numbers of at most 18 digits, and it holds none of the texts of
  :data:`~kvforensics.sources.engine_logs.sglang.parser.BATCH_LINE_EXCLUDES` (its role hint, the PD queue counts, is
  read here and handed over with the run);
* the line before it is also read in DuckDB (the first line of each run goes through the parser,
  which closes whatever the line before left open, such as a wrapped server_args dump).

Whole files fall back to :func:`~kvforensics.sources.engine_logs.parse.parse_engine_file`: vLLM logs
(their per-request lines are rare aborts), files in a collection envelope (the envelope's clock
reorders records per instance before parsing, see :mod:`~kvforensics.sources.engine_logs.envelopes.parse`) and files
whose engine cannot be recognised (the same error as the reference). Compressed files are read as
the reference reads them (:func:`~kvforensics.sources.engine_logs.lines.open_lines`): gzip and zstd,
and a truncated stream ends in the same note and quarantined partial line.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from kvforensics.sources.engine_logs.contract import (
    BATCH_COLUMNS,
    DETAIL_LIMIT,
    EVENT_COLUMNS,
    EngineFileParse,
    InstanceNamer,
)
from kvforensics.sources.engine_logs.envelopes.parse import sniff_envelope
from kvforensics.sources.engine_logs.lines import SNIFF_LINES, LineBatch, open_lines
from kvforensics.sources.engine_logs.parse import add_truncation, engine_format, parse_engine_file
from kvforensics.sources.engine_logs.sglang.batches import DECODE_FIELDS, PREFILL_FIELDS
from kvforensics.sources.engine_logs.sglang.parser import (
    BATCH_LINE_EXCLUDES,
    ROLE_HINTS,
    SELF_CONTAINED_EXCLUDES,
    RequestRun,
    SglangParser,
)
from kvforensics.sources.engine_logs.startup_bounds import refuse_impossible_values

__all__ = ["BATCH_LINES", "EvidenceSink", "parse_engine_file_columnar"]

BATCH_LINES = 200_000
BATCH_BYTES = 64 << 20  # a batch ends at BATCH_LINES lines or this many bytes, whichever comes first
# What parsing one file holds outside DuckDB's buffers, at most: the batch as read and as Arrow text
# (twice BATCH_BYTES), and DuckDB's own working memory for it, which its memory_limit does not count
# (measured: 280 MB for a 66 MB batch of a 10M-request prefill log). Ingest sets this much aside from
# DuckDB's limit per file parsed at once (kvforensics/stages/ingest.py).
HELD_PER_FILE = 5 * BATCH_BYTES
_SCAN_CHUNK = 25_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1970, 1, 1)


@dataclass(frozen=True)
class EvidenceSink:
    """Where the rows read column-wise go as each batch is read, instead of being kept in the parse:
    the ``engine_events`` and ``prefill_batches`` tables of the caller's connection, as read from
    *file* of *source*. A file's size then bounds nothing but the batch in memory."""

    source: str
    file: str

    def store(self, con: duckdb.DuckDBPyConnection, parsed: EngineFileParse) -> None:
        """The rest of the file's rows, those the parser read (its events and prefill batches)."""
        params = {"source": self.source, "file": self.file}
        for table, insert in ((parsed.event_table(), _EVENTS_INSERT), (parsed.batch_table(), _BATCHES_INSERT)):
            if table.num_rows:
                con.register("engine_rows_batch", table)
                try:
                    con.execute(insert.format(ts="ts", rows="SELECT * FROM engine_rows_batch"), params)
                finally:
                    con.unregister("engine_rows_batch")


def _re2_literal(text: str) -> str:
    """*text* as a literal inside an RE2 pattern."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$" else c for c in text)


# Control characters other than tab are excluded too: Python's \s and str.strip() count \v and
# \x1c-\x1f as white space, RE2's \s does not.
def _exclude(needles: tuple[str, ...]) -> str:
    return "|".join([*(_re2_literal(n) for n in needles if n.isprintable()), r"[\x00-\x08\x0a-\x1f\x7f]"])


_EXCLUDE = _exclude(SELF_CONTAINED_EXCLUDES)

# What Arrow checks of every line of a batch (each a kernel over the whole column, without a Python
# object per line), given to DuckDB as columns beside it:
# * shaped: SGLang's dated envelope then a ReqTimeStats message whose body (up to the first ')') is
#   plain key=value pairs, the first rid=<id>; the envelope ends at the first ']' (nothing in it may
#   be one);
# * excluded: the line holds one of the texts another reading looks for (the parser's constants);
# * ascii: character and byte counts agree (so truncating the detail agrees);
# * input_lens / cached_lens: how often ", input_len=" / ", cached_input_len=" occur in the line. A
#   line with either twice is left to the parser; with once, only a body that holds it has a count.
_SHAPE = (
    r"^\[\d{4}-\d{2}-\d{2} \d{2}:[0-5]\d:[0-5]\d(?:[.,]\d{1,6})?(?: +[^\]\s]+)* *\] ?"
    r"ReqTimeStats\(rid=[^,=\s)]+(?:, \w+=[^,=)]*)*\)"
)


def _line_checks(column: pa.Array) -> dict[str, pa.Array]:
    candidates = pc.match_substring(column, "ReqTimeStats(")
    if not pc.any(candidates).as_py():
        false = pa.array([False] * len(column), pa.bool_())
        return {
            "shaped": false,
            "excluded": false,
            "ascii": false,
            "input_lens": pa.nulls(len(column), pa.int32()),
            "cached_lens": pa.nulls(len(column), pa.int32()),
        }
    return {
        "shaped": pc.match_substring_regex(column, _SHAPE),
        "excluded": pc.match_substring_regex(column, _EXCLUDE),
        "ascii": pc.string_is_ascii(column),
        "input_lens": pc.count_substring(column, ", input_len=").cast(pa.int32()),
        "cached_lens": pc.count_substring(column, ", cached_input_len=").cast(pa.int32()),
    }


# One pass over a batch: the lines DuckDB reads, with their stamp, ranks, rid, input_len and detail.
_SELF_CONTAINED_SQL = f"""
WITH headed AS (
    SELECT n, line, position(']' IN line) + CASE WHEN substr(line, position(']' IN line) + 1, 1) = ' ' THEN 14 ELSE 13 END
               AS head_len
    FROM batch
    WHERE shaped AND ascii AND NOT excluded AND input_lens <= 1 AND cached_lens <= 1
), stamped AS (
    SELECT n, substr(line, 1, head_len) AS head, substr(line, head_len - 12) AS msg,
           split_part(substr(line, head_len + 1), ')', 1) AS body
    FROM headed
), fields AS (
    SELECT n, head, msg,
           CASE WHEN substr(head, 21, 1) IN ('.', ',') THEN regexp_extract(substr(head, 22, 7), '^\\d+', 0) ELSE '' END
               AS frac,
           substr(split_part(body, ',', 1), 5) AS rid,
           CASE WHEN contains(body, ', input_len=') THEN split_part(split_part(body, ', input_len=', 2), ',', 1) END
               AS input_len,
           CASE WHEN contains(body, ', cached_input_len=')
                THEN split_part(split_part(body, ', cached_input_len=', 2), ',', 1) END AS cached_len
    FROM stamped
    WHERE substr(head, 2, 4) >= '0001' AND NOT contains(body, ', rid=')
)
SELECT n, substr(head, 2, 13) AS hour,
       (CAST(substr(head, 16, 2) AS BIGINT) * 60 + CAST(substr(head, 19, 2) AS BIGINT)) * 1000000
           + CAST(rpad(CASE WHEN frac = '' THEN '0' ELSE frac END, 6, '0') AS BIGINT) AS within_us,
       substr(head, 2, CASE WHEN frac = '' THEN 19 ELSE 20 + strlen(frac) END) AS stamp,
       split_part(substr(head, CASE WHEN frac = '' THEN 21 ELSE 22 + strlen(frac) END), ']', 1) AS extra,
       rid, CAST(input_len AS BIGINT) AS input_len, CAST(cached_len AS BIGINT) AS cached_len,
       CASE WHEN strlen(msg) <= {DETAIL_LIMIT} THEN msg ELSE msg[1:{DETAIL_LIMIT - 1}] || '\u2026' END AS detail
FROM fields
WHERE (input_len IS NULL OR regexp_full_match(input_len, '\\d{{1,18}}'))
  AND (cached_len IS NULL OR regexp_full_match(cached_len, '\\d{{1,18}}'))
"""


def _sql_text(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _field(key: str) -> str:
    """The value of the first ``key: value`` part of ``parts`` (``", "`` + the parts), '' when none."""
    return f"regexp_extract(parts, {_sql_text(', ' + _re2_literal(key) + ': ([^,]*)')}, 1)"


def _count(key: str) -> str:
    return f"CASE WHEN regexp_full_match({_field(key)}, '[0-9]{{1,18}}') THEN CAST({_field(key)} AS BIGINT) END"


def _any_field(keys: tuple[str, ...]) -> str:
    return f"regexp_matches(parts, {_sql_text(', (?:' + '|'.join(_re2_literal(k) for k in keys) + '): ')})"


_USAGE = (
    "CASE WHEN contains(parts, ', token usage: ') THEN "
    + _field("token usage")
    + " ELSE "
    + _field("full token usage")
    + " END"
)
# The role hint the parser would take from the line (sglang.ROLE_HINTS, in their order).
_HINTS = " ".join(
    f"WHEN regexp_matches(msg, {_sql_text(pattern.pattern)}) THEN "
    f"[{_sql_text(role)}, regexp_extract(msg, {_sql_text(pattern.pattern)}, 0)]"
    for pattern, role in ROLE_HINTS
)

# One pass over a batch: the prefill batch lines DuckDB reads (sglang_batches.match_prefill_batch), with
# their stamp, ranks and counts.
_BATCH_LINES_SQL = f"""
WITH headed AS (
    SELECT n, line, position(']' IN line) AS close
    FROM batch
    WHERE line IS NOT NULL AND starts_with(line, '[') AND contains(line, 'Prefill batch')
      AND strlen(line) = length(line) AND NOT regexp_matches(line, {_sql_text(_exclude(BATCH_LINE_EXCLUDES))})
), split AS (
    SELECT n, substr(line, 1, close) AS head,
           substr(line, close + CASE WHEN substr(line, close + 1, 1) = ' ' THEN 2 ELSE 1 END) AS msg
    FROM headed
    WHERE close > 0
), fields AS (
    SELECT n, head, msg, ', ' || regexp_extract(msg, '^Prefill batch(?: ?\\[\\d+\\])?[.,] (.*)$', 1) AS parts,
           CASE WHEN substr(head, 21, 1) IN ('.', ',') THEN regexp_extract(substr(head, 22, 7), '^\\d+', 0) ELSE '' END
               AS frac
    FROM split
    WHERE substr(head, 2, 4) >= '0001'
      AND regexp_full_match(head,
          '\\[\\d{{4}}-\\d{{2}}-\\d{{2}} \\d{{2}}:[0-5]\\d:[0-5]\\d(?:[.,]\\d{{1,6}})?(?: +[^\\]\\s]+)* *\\]')
      AND regexp_full_match(msg, 'Prefill batch(?: ?\\[\\d+\\])?[.,] [^,:]+: [^,]*(?:, [^,:]+: [^,]*)*(?:, )?')
), counted AS (
    SELECT *, {_count("#new-seq")} AS new_seq, {_count("#new-token")} AS new_token,
           {_count("#cached-token")} AS cached_token
    FROM fields
)
SELECT n, substr(head, 2, 13) AS hour,
       (CAST(substr(head, 16, 2) AS BIGINT) * 60 + CAST(substr(head, 19, 2) AS BIGINT)) * 1000000
           + CAST(rpad(CASE WHEN frac = '' THEN '0' ELSE frac END, 6, '0') AS BIGINT) AS within_us,
       substr(head, 2, CASE WHEN frac = '' THEN 19 ELSE 20 + strlen(frac) END) AS stamp,
       split_part(substr(head, CASE WHEN frac = '' THEN 21 ELSE 22 + strlen(frac) END), ']', 1) AS extra,
       new_seq, new_token, cached_token, {_count("#running-req")} AS running_req, {_count("#queue-req")} AS queue_req,
       CASE WHEN regexp_full_match({_USAGE}, '[0-9]{{1,6}}(?:\\.[0-9]{{1,6}})?') THEN CAST({_USAGE} AS DOUBLE) END
           AS token_usage,
       CASE WHEN {_any_field(PREFILL_FIELDS)} THEN 'prefill' WHEN {_any_field(DECODE_FIELDS)} THEN 'decode' END AS role,
       CASE {_HINTS} END AS hint
FROM counted
WHERE new_seq IS NOT NULL AND new_token IS NOT NULL AND cached_token IS NOT NULL
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
    sink: EvidenceSink | None = None,
) -> EngineFileParse:
    """Parse one engine log file as :func:`~kvforensics.sources.engine_logs.parse.parse_engine_file`
    does (same arguments, same result), reading self-contained per-request SGLang lines in DuckDB.

    ``con`` is the DuckDB connection to run the SQL on (a private in-memory one if None). With a
    ``sink`` (which needs ``con``), the rows read column-wise are inserted into ``con``'s evidence
    tables batch by batch and are not part of the result; everything else is.
    """
    if sink is not None and con is None:
        raise ValueError("a sink needs the connection of its evidence database")
    with contextlib.closing(open_lines(path)) as sniffing:
        head = list(itertools.islice(sniffing, SNIFF_LINES))
    found = sniff_envelope(head) if head and envelope == "auto" else envelope
    if not head or found != "none" or engine_format(fmt, [t for _, t, _ in head], path) != "sglang":
        return parse_engine_file(
            path, fmt=fmt, instance=instance, tz=tz, year=year, clock_offset_s=clock_offset_s, envelope=envelope
        )
    name = instance if isinstance(instance, str) else instance(None)
    parser = SglangParser(name, tz, clock_offset_s)
    stream = open_lines(path)
    db = duckdb.connect() if con is None else con.cursor()
    try:
        for batch in stream.batches(batch_lines, BATCH_BYTES):
            _read_batch(db, parser, batch, sink)
            del batch  # not held while the next one is read
    finally:
        stream.close()
        db.close()
    parse = parser.finish()
    result = EngineFileParse(envelope="none", instances={name: parse}, lines_read=parse.lines_read)
    add_truncation(result, stream)
    refuse_impossible_values(result)
    return result


# Self-contained lines in hours with one UTC offset, numbered into islands of consecutive lines. The
# first line of each island is left to the parser (it reads it after whatever came before); the
# rest of an island is a run read here.
_ISLANDS_SQL = """
CREATE OR REPLACE TEMP TABLE kvf_islands AS
WITH lines AS (
    SELECT n, hour, within_us, stamp, extra, 'stats' AS kind, NULL::VARCHAR[] AS hint, NULL::BIGINT AS cached_token
    FROM kvf_self_contained
    UNION ALL
    SELECT n, hour, within_us, stamp, extra, 'batch', hint, cached_token FROM kvf_batch_lines
), placed AS (
    SELECT l.n, l.extra, h.base_us + l.within_us - h.shift_us AS utc_us, l.stamp, l.kind, l.hint, l.cached_token
    FROM lines l JOIN kvf_hours h USING (hour) WHERE h.shift_us IS NOT NULL
), numbered AS (
    SELECT *, n - row_number() OVER (ORDER BY n) AS island FROM placed
)
SELECT *, min(n) OVER (PARTITION BY island) AS island_first FROM numbered
"""
# One row per run (an island without its first line): its ends, its first ReqTimeStats line, its first
# role hint, its first prefix-cache hit and its first batch line without a role hint (a unified server's).
_RUNS_SQL = """
SELECT island, min(n) AS first, max(n) AS last, arg_min(utc_us, n) AS first_us, arg_max(utc_us, n) AS last_us,
       arg_max(stamp, n) AS last_stamp, min(n) FILTER (kind = 'stats') AS first_stats,
       arg_min(hint, n) FILTER (hint IS NOT NULL) AS hint, min(n) FILTER (hint IS NOT NULL) AS hint_line,
       min(n) FILTER (cached_token > 0) AS first_cached, min(n) FILTER (kind = 'batch' AND hint IS NULL) AS first_plain
FROM kvf_islands WHERE n > island_first GROUP BY island ORDER BY first
"""
# the first line of a prefix in each island (the island's own first line included: the parser saw
# it before the run, so it changes nothing)
_RUN_RANKS_SQL = """
SELECT island, min(n) AS first, extra FROM kvf_islands WHERE extra <> '' GROUP BY island, extra ORDER BY first
"""
_RUN_EVENTS_SQL = """
SELECT $instance AS instance, i.utc_us AS ts, 'req_time_stats' AS kind, s.rid AS request_id,
       s.input_len AS prompt_tokens, CAST(NULL AS BIGINT) AS limit_tokens, s.detail, s.n AS line,
       s.cached_len AS cached_tokens
FROM kvf_self_contained s JOIN kvf_islands i USING (n)
WHERE i.n > i.island_first
"""
# the rank text as sglang.rank_tags gives it
# The inserts of an engine log's rows, from rows with EVENT_COLUMNS / BATCH_COLUMNS ({rows}), their times
# as {ts}: read column-wise (microseconds) or by the parser (an Arrow table of timestamps).
_EVENTS_INSERT = """
INSERT INTO engine_events (instance, ts, kind, request_id, prompt_tokens, limit_tokens, detail, source, source_file,
                           source_line, cached_tokens)
SELECT instance, {ts}, kind, request_id, prompt_tokens, limit_tokens, detail, $source, $file, line, cached_tokens
FROM ({rows}) AS engine_rows
"""
_BATCHES_INSERT = """
INSERT INTO prefill_batches (instance, ts, new_seq, new_token, cached_token, running_req, queue_req, token_usage, role,
                             ranks, source, source_file, source_line)
SELECT instance, {ts}, new_seq, new_token, cached_token, running_req, queue_req, token_usage, role, ranks,
       $source, $file, line
FROM ({rows}) AS engine_rows
"""
_MICROSECONDS = "to_timestamp(0) + to_microseconds(ts)"
_SINK_EVENTS_SQL = _EVENTS_INSERT.format(ts=_MICROSECONDS, rows=_RUN_EVENTS_SQL)
_RUN_BATCHES_SQL = """
SELECT $instance AS instance, i.utc_us AS ts, b.n AS line, b.new_seq, b.new_token, b.cached_token, b.running_req,
       b.queue_req, b.token_usage, b.role,
       array_to_string(regexp_extract_all(b.extra, '\\b(?:DP|PP|ATTN_CP|MOE_DP|TP|EP)\\d+\\b'), ' ') AS ranks
FROM kvf_batch_lines b JOIN kvf_islands i USING (n)
WHERE i.n > i.island_first
"""


_SINK_BATCHES_SQL = _BATCHES_INSERT.format(ts=_MICROSECONDS, rows=_RUN_BATCHES_SQL)


def _with_utc(table: pa.Table, schema: pa.Schema) -> pa.Table:
    i = table.schema.get_field_index("ts")
    ts = table.column(i).combine_chunks().view(pa.timestamp("us", tz="UTC"))
    return table.set_column(i, "ts", ts).select(schema.names).cast(schema)


def _read_batch(
    db: duckdb.DuckDBPyConnection, parser: SglangParser, batch: LineBatch, sink: EvidenceSink | None
) -> None:
    first_number, texts, raws = batch.first, batch.texts, batch.raws
    # in record batches, which DuckDB's threads scan side by side (one chunk is read by one thread)
    lines = pa.table(
        {"n": pa.arange(first_number, first_number + len(texts)), "line": batch.column, **_line_checks(batch.column)}
    )
    db.register("batch", pa.Table.from_batches(lines.to_batches(max_chunksize=_SCAN_CHUNK)))
    try:
        db.execute(f"CREATE OR REPLACE TEMP TABLE kvf_self_contained AS {_SELF_CONTAINED_SQL}")
        db.execute(f"CREATE OR REPLACE TEMP TABLE kvf_batch_lines AS {_BATCH_LINES_SQL}")
    finally:
        db.unregister("batch")
    hours = [
        h
        for (h,) in db.execute(
            "SELECT DISTINCT hour FROM kvf_self_contained UNION SELECT DISTINCT hour FROM kvf_batch_lines"
        ).fetchall()
    ]
    shifts = [_hour_shift(parser, h) for h in hours]
    db.register(
        "kvf_hours",
        pa.table(
            {
                "hour": pa.array(hours, type=pa.string()),
                "shift_us": pa.array(shifts, type=pa.int64()),
                "base_us": pa.array(
                    [None if shift is None else _hour_start_us(h) for h, shift in zip(hours, shifts, strict=True)],
                    type=pa.int64(),
                ),
            }
        ),
    )
    try:
        db.execute(_ISLANDS_SQL)
    finally:
        db.unregister("kvf_hours")
    runs = db.execute(_RUNS_SQL).fetchall()
    if runs:
        ranks: dict[int, list[tuple[int, str]]] = {}
        for island, first, extra in db.execute(_RUN_RANKS_SQL).fetchall():
            ranks.setdefault(island, []).append((first, extra))
        params = {"instance": parser.instance}
        if sink is not None:
            params.update(source=sink.source, file=sink.file)
            db.execute(_SINK_EVENTS_SQL, params)
            db.execute(_SINK_BATCHES_SQL, params)
        else:
            events = db.sql(_RUN_EVENTS_SQL, params=params).to_arrow_table()
            if events.num_rows:
                parser.out.event_tables.append(_with_utc(events, EVENT_COLUMNS))
            batches = db.sql(_RUN_BATCHES_SQL, params=params).to_arrow_table()
            if batches.num_rows:
                parser.out.batch_tables.append(_with_utc(batches, BATCH_COLUMNS))
    i = 0
    for (
        island,
        first,
        last,
        first_us,
        last_us,
        last_stamp,
        first_stats,
        hint,
        hint_line,
        first_cached,
        first_plain,
    ) in runs:
        while i < first - first_number:
            parser.feed(first_number + i, texts[i], raws[i])
            i += 1
        parser.feed_request_run(
            RequestRun(
                first,
                last,
                _utc(first_us),
                _utc(last_us),
                last_stamp,
                tuple(ranks.get(island, ())),
                first_stats_line=first_stats,
                role_hint=(hint[0], hint_line, hint[1]) if hint else None,
                first_cached_batch_line=first_cached,
                first_plain_batch_line=first_plain,
            )
        )
        i = last - first_number + 1
    while i < len(texts):
        parser.feed(first_number + i, texts[i], raws[i])
        i += 1


def _utc(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _hour_start_us(hour: str) -> int:
    """The naive stamp of the start of *hour* ('YYYY-MM-DD HH', a real date) in microseconds since 1970."""
    start = datetime(int(hour[0:4]), int(hour[5:7]), int(hour[8:10]), int(hour[11:13]))
    return (start - _NAIVE_EPOCH) // timedelta(microseconds=1)


def _hour_shift(parser: SglangParser, hour: str) -> int | None:
    return parser.clock.hour_shift_us(int(hour[0:4]), int(hour[5:7]), int(hour[8:10]), int(hour[11:13]))
