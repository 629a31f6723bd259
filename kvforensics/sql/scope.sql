-- Scope: affected responses and who they concern. Parameters: $start, $end (analysed period,
-- NULL = open), $horizon_factor, $min_matching_shingles, $max_accounts_per_shingle.

-- Every account with its class: reporter and internal globs from the incident file, else customer.
CREATE OR REPLACE TABLE account_classes AS
WITH a AS (SELECT DISTINCT account_id FROM requests),
m AS (
    SELECT a.account_id, p.account_class,
           row_number() OVER (PARTITION BY a.account_id ORDER BY p.priority NULLS LAST, p.pattern NULLS LAST) AS pick
    FROM a JOIN account_patterns p ON {{ glob_match(a.account_id, p.pattern) }}
)
SELECT a.account_id, coalesce(m.account_class, 'customer') AS account_class
FROM a LEFT JOIN m ON m.account_id = a.account_id AND m.pick = 1;

CREATE OR REPLACE TABLE analysis_period AS
SELECT {{ as_timestamp($start) }} AS period_start, {{ as_timestamp($end) }} AS period_end;

-- The requests of the analysed period: a view on DuckDB (the requests are not copied).
CREATE OR REPLACE TABLE analysed_requests AS
-- portable: view
SELECT r.* FROM requests r CROSS JOIN analysis_period p
WHERE (p.period_start IS NULL OR r.ts >= p.period_start)
  AND (p.period_end IS NULL OR r.ts < p.period_end);

-- The expected (fastest real) prefill time of each request's uncached tokens, where a model exists.
CREATE OR REPLACE TEMP TABLE expected_prefill AS
SELECT r.request_id,
       m.a_ms + m.b_ms_per_token * LEAST(r.prompt_tokens - coalesce(r.cached_tokens, 0), m.max_tokens)
              + m.c_ms_per_token2 * LEAST(r.prompt_tokens - coalesce(r.cached_tokens, 0), m.max_tokens)
                                  * LEAST(r.prompt_tokens - coalesce(r.cached_tokens, 0), m.max_tokens) AS expected_ttft_ms
FROM analysed_requests r JOIN latency_model m ON m.model = r.model AND m.usable;

CREATE OR REPLACE TABLE affected_responses AS
SELECT r.request_id, r.ts, r.account_id, ac.account_class, r.model, r.prompt_tokens, r.completion_tokens,
       r.cached_tokens,
       CAST({{ json_text(f.evidence, 'kv_pool_tokens') }} AS BIGINT) AS pool_tokens,
       {{ json_text(f.evidence, 'instance') }} AS pool_instance,
       r.ttft_ms, r.latency_ms, {{ round_double(e.expected_ttft_ms, 1) }} AS expected_ttft_ms, t.confidence, t.rules,
       r.prefill_instance, r.decode_instance, r.status
FROM request_tiers t
JOIN analysed_requests r ON r.request_id = t.request_id
JOIN account_classes ac ON ac.account_id = r.account_id
LEFT JOIN findings f ON f.request_id = t.request_id AND f.rule_id = 'prompt_exceeds_kv_pool'
LEFT JOIN expected_prefill e ON e.request_id = t.request_id
WHERE t.confidence IN ('confirmed', 'probable');

-- The affected responses the stale_pages mechanism's rules flagged: only these are attributed by the
-- turnover horizon and by their output's shingles below (another mechanism's finding has its own
-- attribution: a prefix-cache hit's sources are sql/prefix_sources.sql's; a response flagged by both has
-- both). Findings from before mechanisms have none recorded and count as stale_pages.
CREATE OR REPLACE TEMP TABLE stale_page_responses AS
SELECT a.request_id, a.account_id, a.ts FROM affected_responses a
WHERE EXISTS (SELECT 1 FROM findings f
              WHERE f.request_id = a.request_id AND coalesce(f.mechanism, 'stale_pages') = 'stale_pages');

CREATE OR REPLACE TABLE suspect_responses AS
SELECT r.request_id, r.ts, r.account_id, ac.account_class, r.model, r.prompt_tokens, t.confidence, t.rules
FROM request_tiers t
JOIN analysed_requests r ON r.request_id = t.request_id
JOIN account_classes ac ON ac.account_id = r.account_id
WHERE t.confidence = 'possible';

-- Possible sources of the stale_pages responses. On decode instance D, a page freed at time f survives until D has allocated
-- (and written) about a pool's worth of tokens after f. The turnover horizon of an affected response
-- at time t is therefore: requests on D whose pages were freed before t, after which fewer than
-- horizon_factor x pool(D) tokens were written on D. Affected responses write only 1 + output tokens
-- (the stub), so their reservations do not count as overwriting. Requests without a decode instance
-- are grouped by model, with the sum of the model's decode pools.
-- Only the groups that served an affected response matter, and in them only what was written up to
-- the last affected allocation (later events change no earlier running total); the rest of the
-- traffic is left out before the timeline's sort, and so are the minutes no affected response's
-- horizon reaches (kv_windows below). tests/test_sample.py checks the pairs against a brute-force
-- running total over each group's whole timeline.
CREATE OR REPLACE TEMP TABLE kv_writes AS
WITH w AS (
SELECT r.request_id, r.account_id, r.model,
       coalesce(r.decode_instance, '(model) ' || r.model) AS kv_group,
       r.decode_instance IS NOT NULL AS instance_known,
       {{ add_milliseconds(r.ts, coalesce(r.ttft_ms, 0)) }} AS alloc_ts,
       {{ add_milliseconds(r.ts, coalesce(r.latency_ms, r.ttft_ms, 0)) }} AS free_ts,
       CASE WHEN a.request_id IS NOT NULL THEN 1 + coalesce(r.completion_tokens, 0)
            ELSE r.prompt_tokens + coalesce(r.completion_tokens, 0) END AS written_tokens,
       a.request_id IS NOT NULL AS is_affected
FROM requests r
LEFT JOIN stale_page_responses a ON a.request_id = r.request_id
WHERE r.status BETWEEN 200 AND 299
), reach AS (
    -- from the affected responses themselves, not from w: a second reference to w would have it
    -- materialised, every served request of the period (which spilled at 100M requests)
    SELECT coalesce(r.decode_instance, '(model) ' || r.model) AS kv_group,
           max({{ add_milliseconds(r.ts, coalesce(r.ttft_ms, 0)) }}) AS last_alloc
    FROM requests r
    JOIN stale_page_responses a ON a.request_id = r.request_id
    WHERE r.status BETWEEN 200 AND 299
    GROUP BY 1
)
SELECT w.* FROM w JOIN reach ON reach.kv_group = w.kv_group
WHERE w.alloc_ts <= reach.last_alloc OR w.free_ts <= reach.last_alloc;

CREATE OR REPLACE TEMP TABLE group_pools AS
WITH a AS (SELECT * FROM kv_writes WHERE is_affected)
SELECT a.request_id,
       CASE WHEN a.instance_known THEN max(CASE WHEN c.instance = a.kv_group THEN c.kv_pool_tokens END)
            ELSE sum(CASE WHEN c.model = a.model AND c.role = 'decode' THEN c.kv_pool_tokens END) END AS pool_tokens
FROM a LEFT JOIN capacity c
  ON c.valid_from <= a.alloc_ts AND (c.valid_to IS NULL OR a.alloc_ts < c.valid_to)
 AND (c.instance = a.kv_group OR c.model = a.model)
GROUP BY a.request_id, a.instance_known, a.kv_group;

-- Where each affected response's horizon can reach. Tokens written per group and minute, and their
-- running total: an affected response cannot have read pages freed before the latest minute B after
-- which (up to its own minute) at least the horizon was written, since all of that was written
-- after those pages were freed. Only the minutes from B to the response's own need the exact,
-- per-event running total below; a response with no such B keeps its group's whole history.
CREATE OR REPLACE TEMP TABLE kv_minutes AS
WITH ev AS (
    SELECT kv_group, date_trunc('minute', alloc_ts) AS minute, written_tokens AS w FROM kv_writes
    UNION ALL
    SELECT kv_group, date_trunc('minute', free_ts) AS minute, 0 AS w FROM kv_writes
), per_minute AS (
    SELECT kv_group, minute, sum(w) AS w FROM ev GROUP BY kv_group, minute
)
SELECT kv_group, minute,
       sum(w) OVER (PARTITION BY kv_group ORDER BY minute NULLS LAST ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
           AS cum_to_end
FROM per_minute;

CREATE OR REPLACE TEMP TABLE kv_windows AS
WITH a AS (
    SELECT w.request_id, w.kv_group, date_trunc('minute', w.alloc_ts) AS minute,
           $horizon_factor * coalesce(p.pool_tokens, 0) AS horizon
    FROM kv_writes w JOIN group_pools p ON p.request_id = w.request_id
    WHERE w.is_affected
), before_own AS (
    SELECT a.request_id, max(m.cum_to_end) AS cum_prev
    FROM a JOIN kv_minutes m ON m.kv_group = a.kv_group AND m.minute < a.minute
    GROUP BY a.request_id
), cut AS (
    SELECT a.request_id, max(m.minute) AS start_minute
    FROM a
    JOIN before_own b ON b.request_id = a.request_id
    JOIN kv_minutes m ON m.kv_group = a.kv_group AND m.minute < a.minute AND b.cum_prev - m.cum_to_end >= a.horizon
    GROUP BY a.request_id
)
SELECT a.request_id, a.kv_group, a.minute, c.start_minute
FROM a LEFT JOIN cut c ON c.request_id = a.request_id;

CREATE OR REPLACE TEMP TABLE kv_kept_minutes AS
SELECT DISTINCT m.kv_group, m.minute
FROM kv_minutes m
JOIN kv_windows k ON k.kv_group = m.kv_group AND m.minute <= k.minute
                 AND (k.start_minute IS NULL OR m.minute >= k.start_minute);

CREATE OR REPLACE TEMP TABLE kv_timeline AS
WITH ev AS (
    SELECT kv_group, alloc_ts AS t, 0 AS marker, written_tokens AS w, request_id FROM kv_writes
    UNION ALL
    SELECT kv_group, free_ts AS t, 1 AS marker, 0 AS w, request_id FROM kv_writes
), kept AS (
    SELECT ev.* FROM ev
    JOIN kv_kept_minutes k ON k.kv_group = ev.kv_group AND k.minute = date_trunc('minute', ev.t)
)
SELECT kv_group, t, marker, request_id,
       sum(w) OVER (PARTITION BY kv_group ORDER BY t NULLS LAST, marker NULLS LAST, request_id NULLS LAST
                    ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum_written
FROM kept;

-- Responses whose horizon the pools cannot give (no decode pool known for their group: no decode engine log, a
-- decode instance no log names): the turnover horizon would be 0 and hide every source, so every other request
-- their group served since the earliest start-up of the model then in force is a possible source instead, with
-- that basis (pages older than it may still have been held by a decode node no log shows: the report says so).
CREATE OR REPLACE TEMP TABLE unbounded_responses AS
SELECT w.request_id, w.kv_group, w.alloc_ts, min(c.valid_from) AS since
FROM kv_writes w
JOIN group_pools p ON p.request_id = w.request_id
LEFT JOIN capacity c ON c.model = w.model AND c.valid_from <= w.alloc_ts
                    AND (c.valid_to IS NULL OR w.alloc_ts < c.valid_to)
WHERE w.is_affected AND coalesce(p.pool_tokens, 0) <= 0
GROUP BY w.request_id, w.kv_group, w.alloc_ts;

-- basis: 'turnover_horizon' (freed within horizon_factor x the pool's tokens of writes before the response) or
-- 'no_horizon_since_startup' (unbounded_responses above)
CREATE OR REPLACE TABLE possible_sources AS
WITH a AS (
    SELECT w.request_id, w.account_id, w.kv_group, w.alloc_ts, tl.cum_written - w.written_tokens AS cum_before,
           p.pool_tokens
    FROM kv_writes w
    JOIN kv_timeline tl ON tl.request_id = w.request_id AND tl.marker = 0
    JOIN group_pools p ON p.request_id = w.request_id
    WHERE w.is_affected AND p.pool_tokens > 0
), s AS (
    SELECT w.request_id, w.account_id, w.kv_group, w.free_ts, w.is_affected, tl.cum_written AS cum_at_free
    FROM kv_writes w
    JOIN kv_timeline tl ON tl.request_id = w.request_id AND tl.marker = 1
)
SELECT a.request_id AS affected_request_id, a.account_id AS recipient_account_id,
       s.request_id AS source_request_id, s.account_id AS source_account_id, a.kv_group,
       a.cum_before - s.cum_at_free AS tokens_written_since,
       a.pool_tokens, 'turnover_horizon' AS basis
FROM a JOIN kv_windows r ON r.request_id = a.request_id
JOIN s
  ON s.kv_group = a.kv_group
 AND (r.start_minute IS NULL OR s.free_ts >= r.start_minute)
 AND s.free_ts <= a.alloc_ts
 AND s.request_id <> a.request_id
 AND NOT s.is_affected
 AND a.cum_before - s.cum_at_free < $horizon_factor * coalesce(a.pool_tokens, 0)
UNION ALL
SELECT u.request_id AS affected_request_id, a.account_id AS recipient_account_id, s.request_id AS source_request_id,
       s.account_id AS source_account_id, u.kv_group, CAST(NULL AS BIGINT) AS tokens_written_since,
       CAST(NULL AS BIGINT) AS pool_tokens, 'no_horizon_since_startup' AS basis
FROM unbounded_responses u
JOIN kv_writes a ON a.request_id = u.request_id
JOIN kv_writes s ON s.kv_group = u.kv_group AND s.free_ts <= u.alloc_ts AND (u.since IS NULL OR s.free_ts >= u.since)
                AND s.request_id <> u.request_id AND NOT s.is_affected;

-- Confirmed sources: shingles of an affected response's output found in an earlier request's prompt
-- or output. Shingles shared by many accounts' own texts are boilerplate and do not count (affected
-- outputs are left out of that count: they repeat other accounts' text by definition).
-- sql/notifications.sql joins these with the prefix_reuse attribution (prefix_sources) in content_matches.
-- The fingerprints of the stale-page responses' outputs (stale_output_fps) are the only ones matched
-- below, so only those are counted (a count per fingerprint over every row of content_fingerprints
-- spilled 1.9 GB at 10M requests and filled the disk at 100M).
CREATE OR REPLACE TEMP TABLE stale_output_fps AS
SELECT a.request_id, a.account_id, a.ts, c.fp
FROM stale_page_responses a JOIN content_fingerprints c ON c.request_id = a.request_id AND c.part = 'output';

CREATE OR REPLACE TEMP TABLE common_shingles AS
WITH asked AS (
    SELECT DISTINCT fp FROM stale_output_fps
), accounts AS (
    SELECT DISTINCT c.fp, r.account_id
    FROM content_fingerprints c JOIN asked s ON s.fp = c.fp JOIN requests r ON r.request_id = c.request_id
    WHERE c.request_id NOT IN (SELECT request_id FROM affected_responses)
)
SELECT fp FROM accounts GROUP BY fp HAVING count(account_id) >= $max_accounts_per_shingle;

CREATE OR REPLACE TEMP TABLE output_matches AS
WITH out_fp AS (
    SELECT * FROM stale_output_fps WHERE fp NOT IN (SELECT fp FROM common_shingles)
), hits AS (
    SELECT o.request_id AS affected_request_id, o.account_id AS recipient_account_id,
           c.request_id AS source_request_id, r.account_id AS source_account_id,
           count(DISTINCT o.fp) AS matching_shingles
    FROM out_fp o
    JOIN content_fingerprints c ON c.fp = o.fp AND c.request_id <> o.request_id
    JOIN requests r ON r.request_id = c.request_id AND r.ts < o.ts
    WHERE c.request_id NOT IN (SELECT request_id FROM stale_page_responses)  -- their KV was a 1-token stub
    GROUP BY 1, 2, 3, 4
), horizon AS (
    SELECT DISTINCT affected_request_id, source_request_id FROM possible_sources
)
SELECT h.*, s.shingles AS output_shingles,
       {{ round_double(h.matching_shingles / GREATEST(s.shingles, 1), 4) }} AS match_fraction,
       h.matching_shingles >= $min_matching_shingles AS confirmed,
       p.affected_request_id IS NOT NULL AS within_horizon
FROM hits h
LEFT JOIN content_stats s ON s.request_id = h.affected_request_id AND s.part = 'output'
LEFT JOIN horizon p ON p.affected_request_id = h.affected_request_id AND p.source_request_id = h.source_request_id;
