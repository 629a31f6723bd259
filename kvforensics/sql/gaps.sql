-- Gaps in the evidence: periods the logs do not cover. Parameter: $min_hourly (median requests per
-- hour above which an empty hour is a gap rather than a quiet hour).

-- 1. Gateway: runs of empty hours inside the logged period of a busy source.
CREATE OR REPLACE TEMP TABLE hourly_counts AS
WITH span AS (
    SELECT source, date_trunc('hour', min(ts)) AS lo, date_trunc('hour', max(ts)) AS hi FROM requests GROUP BY 1
), hours AS (
    SELECT s.source, {{ hour_series(s.lo, s.hi) }} AS hour FROM span s
), counts AS (
    SELECT source, date_trunc('hour', ts) AS hour, count(*) AS n FROM requests GROUP BY 1, 2
)
SELECT h.source, h.hour, coalesce(c.n, 0) AS n
FROM hours h LEFT JOIN counts c ON c.source = h.source AND c.hour = h.hour;

CREATE OR REPLACE TABLE log_gaps AS
WITH busy AS (
    SELECT source FROM hourly_counts GROUP BY 1 HAVING {{ median(n) }} >= $min_hourly
), empty AS (
    SELECT h.source, h.hour,
           {{ add_hours(h.hour, -row_number() OVER (PARTITION BY h.source ORDER BY h.hour NULLS LAST)) }} AS island
    FROM hourly_counts h JOIN busy b ON b.source = h.source
    WHERE h.n = 0
)
SELECT source, CAST(NULL AS STRING) AS instance, min(hour) AS start, {{ add_hours(max(hour), 1) }} AS {{ column('end') }},
       0 AS requests,
       'no gateway records for ' || CAST(count(*) AS STRING) || ' hour(s) in an otherwise busy log' AS description
FROM empty GROUP BY source, island
UNION ALL
-- 2. Engine logs: requests served by an instance at times no start-up of its log covers.
SELECT 'engine_log' AS source, r.prefill_instance AS instance, min(r.ts) AS start, max(r.ts) AS {{ column('end') }},
       count(*) AS requests,
       'requests name this prefill instance, but no start-up in its engine log covers them: its KV pool is unknown then'
FROM requests r
-- an outer join keeping the requests no start-up covers (a correlated NOT EXISTS on the timestamp had
-- DuckDB deduplicate every (instance, ts) pair first: 36 s at 100M requests)
LEFT JOIN capacity c ON c.instance = r.prefill_instance
                    AND c.valid_from <= r.ts AND (c.valid_to IS NULL OR r.ts < c.valid_to)
WHERE r.prefill_instance IS NOT NULL AND c.instance IS NULL
GROUP BY r.prefill_instance
ORDER BY start NULLS LAST;
