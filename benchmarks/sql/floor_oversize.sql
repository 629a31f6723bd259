-- The DuckDB floor of the pipeline (issue 8): one bare scan of the gateway files computing the
-- oversize predicate of rule prompt_exceeds_kv_pool: a 2xx response whose prompt_tokens reach
-- min(kv_pool_tokens, context_length) - $reject_margin of the prefill instance in force.
-- `capacity` is the start-up intervals our engine-log parser read (a few dozen rows).
-- steps.py fills in {reader} (read_json / read_parquet of $files) and the quoted source column
-- names from the incident file's column mapping; values are parameters.
WITH r AS (
    SELECT {request_id} AS request_id, CAST({ts} AS TIMESTAMPTZ) AS ts, CAST({status} AS INTEGER) AS status,
           CAST({prompt_tokens} AS BIGINT) AS prompt_tokens, {prefill_instance} AS prefill_instance
    FROM {reader}
), judged AS (
    SELECT r.request_id, r.status,
           r.status BETWEEN 200 AND 299
           AND r.prompt_tokens >= LEAST(c.kv_pool_tokens, coalesce(c.context_length, c.kv_pool_tokens)) - $reject_margin
               AS oversize
    FROM r LEFT JOIN capacity c
      ON c.instance = r.prefill_instance AND c.role = 'prefill' AND c.kv_pool_tokens IS NOT NULL
     AND c.valid_from <= r.ts AND (c.valid_to IS NULL OR r.ts < c.valid_to)
)
SELECT count(*) AS rows,
       count(*) FILTER (WHERE status BETWEEN 200 AND 299) AS served_2xx,
       count(DISTINCT request_id) FILTER (WHERE oversize) AS oversize
FROM judged;
