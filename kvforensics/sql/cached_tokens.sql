-- requests.cached_tokens where the gateway gives none, from the engines' own evidence; run by ingest once the
-- engine logs are loaded and the gateway's instance names matched (a re-ingest, such as verify's, runs it
-- the same way). Before the next request files are merged, ingest sets the values filled here back to NULL
-- (the gateway's own value), so that re-delivered records compare equal with what was loaded.
-- requests.cached_tokens_source says where each value came from:
--   gateway         the requests source;
--   engine_request  the engine's per-request count (SGLang ReqTimeStats cached_input_len=) of the same request
--                   id on its prefill instance, for the same prompt (input_len = prompt_tokens);
--   engine_batch    a prefill batch of that request alone (#new-seq: 1) on its prefill instance, stamped between
--                   the request's arrival (less one second: stamps are cut to the second) and its first token
--                   (else its end), with #new-token + #cached-token = its prompt_tokens, when that batch fits no
--                   other request and the request no other batch. A prompt prefilled in chunks has no such batch.

-- prefill batches whose line does not say their role take their start-up's (the latest one begun before them)
UPDATE prefill_batches SET role = placed.role
FROM (
    SELECT b.source_file, b.source_line, arg_max(c.role, c.valid_from) AS role
    FROM prefill_batches b
    JOIN capacity c ON c.instance = b.instance AND c.valid_from <= b.ts AND (c.valid_to IS NULL OR b.ts < c.valid_to)
    WHERE b.role IS NULL
    GROUP BY b.source_file, b.source_line
) placed
WHERE prefill_batches.role IS NULL AND prefill_batches.source_file = placed.source_file
  AND prefill_batches.source_line = placed.source_line;

UPDATE requests SET cached_tokens_source = 'gateway' WHERE cached_tokens IS NOT NULL AND cached_tokens_source IS NULL;

-- the engine's count per request and instance, when its lines agree (several ranks or attempts may log one)
DELETE FROM engine_cached_tokens;
INSERT INTO engine_cached_tokens
WITH per_instance AS (
    SELECT request_id, instance, min(prompt_tokens) AS prompt_tokens, min(cached_tokens) AS engine_cached,
           min(source_file) AS source_file, min(source_line) AS source_line,
           count(*) OVER (PARTITION BY request_id) AS instances
    FROM engine_events
    WHERE kind = 'req_time_stats' AND request_id IS NOT NULL AND cached_tokens IS NOT NULL
    GROUP BY request_id, instance
    -- one count each (min = max: the same as count(DISTINCT) = 1 here, where neither is null, and cheaper)
    HAVING min(prompt_tokens) = max(prompt_tokens) AND min(cached_tokens) = max(cached_tokens)
       AND count(prompt_tokens) = count(*)
)
SELECT r.request_id, e.instance, e.engine_cached, r.cached_tokens, e.source_file, e.source_line
FROM requests r JOIN per_instance e ON e.request_id = r.request_id
WHERE e.prompt_tokens = r.prompt_tokens AND e.engine_cached <= r.prompt_tokens
  AND (e.instance = r.prefill_instance OR (r.prefill_instance IS NULL AND e.instances = 1));

UPDATE requests SET cached_tokens = e.engine_cached, cached_tokens_source = 'engine_request'
FROM engine_cached_tokens e
WHERE e.request_id = requests.request_id AND requests.cached_tokens IS NULL;

CREATE OR REPLACE TEMP TABLE kvf_batch_fits AS
WITH fits AS (
    SELECT r.request_id, b.source_file, b.source_line, b.cached_token, r.cached_tokens
    FROM prefill_batches b
    JOIN requests r ON r.prefill_instance = b.instance AND r.prompt_tokens = b.new_token + b.cached_token
    WHERE b.new_seq = 1 AND b.ts > r.ts - INTERVAL 1 SECOND
      AND b.ts <= r.ts + to_microseconds(CAST(round(1000 * coalesce(r.ttft_ms, r.latency_ms)) AS BIGINT))
)
SELECT * FROM (SELECT *, count(*) OVER (PARTITION BY source_file, source_line) AS requests,
                         count(*) OVER (PARTITION BY request_id) AS batches FROM fits)
WHERE requests = 1 AND batches = 1 AND cached_tokens IS NULL;

UPDATE requests SET cached_tokens = f.cached_token, cached_tokens_source = 'engine_batch'
FROM kvf_batch_fits f
WHERE f.request_id = requests.request_id AND requests.cached_tokens IS NULL;

DROP TABLE kvf_batch_fits;
