-- Deployment audit: the engine events each start-up saw, one row per start-up and event kind,
-- with the count, the first occurrence and the range of reported limits.
-- An event belongs to the last start-up before it in the same file; an event with no start-up
-- before it in its file (a rotated log) belongs to the start-up of its instance running at its time.
-- "scheduler_abort" is an abort_input_too_long line carrying the scheduler's maximum allowed length.
WITH startups AS (
    SELECT instance, source_file, source_line, valid_from, valid_to,
           lead(source_line) OVER (PARTITION BY instance, source_file ORDER BY source_line) AS next_line
    FROM capacity
),
audited AS (
    SELECT instance, ts, source_file, source_line, limit_tokens,
           CASE WHEN kind = 'abort_input_too_long' AND detail LIKE '%maximum allowed length%'
                THEN 'scheduler_abort' ELSE kind END AS kind
    FROM engine_events
    WHERE kind IN ('abort_input_too_long', 'input_truncated', 'checksum_mismatch', 'canary_violation',
                   'context_corruption')
),
by_line AS (
    SELECT s.instance, s.source_file AS startup_file, s.source_line AS startup_line, e.kind,
           e.source_file, e.source_line, e.limit_tokens
    FROM audited e
    JOIN startups s
      ON e.instance = s.instance AND e.source_file = s.source_file
     AND e.source_line >= s.source_line AND (s.next_line IS NULL OR e.source_line < s.next_line)
),
by_time AS (
    SELECT s.instance, s.source_file AS startup_file, s.source_line AS startup_line, e.kind,
           e.source_file, e.source_line, e.limit_tokens
    FROM audited e
    JOIN startups s
      ON e.instance = s.instance AND s.valid_from <= e.ts AND (s.valid_to IS NULL OR e.ts < s.valid_to)
    WHERE NOT EXISTS (SELECT 1 FROM startups f
                      WHERE f.instance = e.instance AND f.source_file = e.source_file
                        AND f.source_line <= e.source_line)
),
assigned AS (
    SELECT * FROM by_line
    UNION ALL
    SELECT * FROM by_time
),
ranked AS (
    SELECT *,
           row_number() OVER (PARTITION BY instance, startup_file, startup_line, kind
                              ORDER BY source_file, source_line) AS rn,
           count(*) OVER (PARTITION BY instance, startup_file, startup_line, kind) AS n,
           min(limit_tokens) OVER (PARTITION BY instance, startup_file, startup_line, kind) AS min_limit,
           max(limit_tokens) OVER (PARTITION BY instance, startup_file, startup_line, kind) AS max_limit
    FROM assigned
)
SELECT instance, startup_file, startup_line, kind, n, source_file, source_line, min_limit, max_limit
FROM ranked
WHERE rn = 1
ORDER BY instance, startup_file, startup_line, kind
