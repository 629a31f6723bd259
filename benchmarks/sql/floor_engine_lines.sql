-- The floor of the engine-log ingest (issue 16): DuckDB reads the same engine log files as lines
-- (read_csv with a delimiter no log line holds, no quoting) and applies ONE regular expression per
-- line, extracting the envelope time and the request id and numbers of the per-request lines:
-- SGLang's ReqTimeStats(...) (input_len, cached_input_len, queue and forward durations, entry
-- time) and the scheduler's abort ("Input length (N tokens) exceeds ... (M tokens) ... self.rid=").
-- Everything extracted is aggregated, so no part of it can be skipped; nothing is typed, checked
-- or stored. $files: the engine_log sources' files.
WITH m AS (
    SELECT regexp_extract(
               line,
               '^\[([^\]]+)\] (?:ReqTimeStats\(rid=([^,]+), bootstrap_room=\d+, input_len=(\d+), '
               || 'cached_input_len=(\d+).*?queue_duration=([\d.]+)ms, forward_duration=([\d.]+)ms, '
               || 'entry_time=([\d.]+)|Input length \((\d+) tokens\) exceeds the maximum allowed length '
               || '\((\d+) tokens\).*self\.rid=''([^'']+)'')',
               ['ts', 'rid', 'input_len', 'cached', 'queue_ms', 'forward_ms', 'entry', 'prompt', 'limit',
                'abort_rid']) AS x
    FROM read_csv($files, columns = {'line': 'VARCHAR'}, header = false, delim = chr(1), quote = '',
                  escape = '', auto_detect = false, strict_mode = false)
)
SELECT count(*) AS lines,
       count(*) FILTER (WHERE x.rid <> '') AS stats_lines,
       count(*) FILTER (WHERE x.abort_rid <> '') AS abort_lines,
       sum(TRY_CAST(x.input_len AS BIGINT)) AS input_tokens,
       sum(TRY_CAST(x.cached AS BIGINT)) AS cached_tokens,
       sum(TRY_CAST(x.queue_ms AS DOUBLE) + TRY_CAST(x.forward_ms AS DOUBLE)) AS prefill_ms,
       max(TRY_CAST(x.entry AS DOUBLE)) AS last_entry,
       sum(TRY_CAST(x.prompt AS BIGINT) - TRY_CAST(x."limit" AS BIGINT)) AS over_limit_tokens,
       bit_xor(hash(x.rid || x.abort_rid || x.ts)) AS ids
FROM m;
