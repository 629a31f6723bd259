-- A 2xx response whose prompt the engine could not have prefilled: prompt_tokens at or above the
-- engine's reject limit min(kv_pool_tokens, context_length) - $reject_margin on the prefill instance
-- in force (or, for requests that carry no instance, on the prefill instances serving the model then);
-- also a prompt larger than the decode instance's pool.
-- Output: request_id, strength ('strong' | 'weak'), evidence (JSON). One row per request.
WITH lowest_limit AS (
    -- no pool anywhere rejects a smaller prompt, so only prompts at or above this can be flagged: the
    -- joins and rankings below see only those (at 100M requests, all served requests spilled)
    SELECT min(LEAST(kv_pool_tokens, coalesce(context_length, kv_pool_tokens))) - $reject_margin AS tokens
    FROM capacity
    WHERE kv_pool_tokens IS NOT NULL
), served AS (
    SELECT r.request_id, r.ts, r.model, r.prompt_tokens, r.prefill_instance, r.decode_instance
    FROM requests r
    JOIN lowest_limit l ON r.prompt_tokens >= l.tokens
    WHERE r.status BETWEEN 200 AND 299
), on_prefill AS (
    SELECT s.request_id, s.prompt_tokens, c.instance, c.kv_pool_tokens, c.context_length,
           'prefill_instance' AS basis, 1 AS priority
    FROM served s
    JOIN capacity c ON c.instance = s.prefill_instance
                   AND c.valid_from <= s.ts AND (c.valid_to IS NULL OR s.ts < c.valid_to)
    WHERE c.role = 'prefill' AND c.kv_pool_tokens IS NOT NULL
), on_decode AS (
    SELECT s.request_id, s.prompt_tokens, c.instance, c.kv_pool_tokens, c.context_length,
           'decode_instance' AS basis, 2 AS priority
    FROM served s
    JOIN capacity c ON c.instance = s.decode_instance
                   AND c.valid_from <= s.ts AND (c.valid_to IS NULL OR s.ts < c.valid_to)
    WHERE c.role = 'decode' AND c.kv_pool_tokens IS NOT NULL
), model_pools AS (
    SELECT s.request_id, s.prompt_tokens, c.instance, c.kv_pool_tokens, c.context_length,
           row_number() OVER (PARTITION BY s.request_id ORDER BY c.kv_pool_tokens NULLS LAST,
                                                                c.instance NULLS LAST) AS smallest_first,
           max(LEAST(c.kv_pool_tokens, coalesce(c.context_length, c.kv_pool_tokens)))
               OVER (PARTITION BY s.request_id) AS largest_limit
    FROM served s
    JOIN capacity c ON c.model = s.model
                   AND c.valid_from <= s.ts AND (c.valid_to IS NULL OR s.ts < c.valid_to)
    WHERE s.prefill_instance IS NULL AND c.role = 'prefill' AND c.kv_pool_tokens IS NOT NULL
), on_model AS (
    SELECT request_id, prompt_tokens, instance, kv_pool_tokens, context_length,
           CASE WHEN prompt_tokens >= largest_limit - $reject_margin THEN 'every_prefill_pool_of_model'
                ELSE 'smallest_prefill_pool_of_model' END AS basis,
           3 AS priority
    FROM model_pools WHERE smallest_first = 1
), candidates AS (
    SELECT * FROM on_prefill
    UNION ALL SELECT * FROM on_decode
    UNION ALL SELECT * FROM on_model
), exceeded AS (
    SELECT *,
           LEAST(kv_pool_tokens, coalesce(context_length, kv_pool_tokens)) - $reject_margin AS engine_limit_tokens,
           row_number() OVER (PARTITION BY request_id ORDER BY priority NULLS LAST) AS pick
    FROM candidates
    WHERE prompt_tokens >= LEAST(kv_pool_tokens, coalesce(context_length, kv_pool_tokens)) - $reject_margin
)
SELECT request_id,
       CASE WHEN basis = 'smallest_prefill_pool_of_model' THEN 'weak' ELSE 'strong' END AS strength,
       {{ json_object('basis', basis, 'instance', instance, 'kv_pool_tokens', kv_pool_tokens,
                      'context_length', context_length, 'engine_limit_tokens', engine_limit_tokens,
                      'prompt_tokens', prompt_tokens) }} AS evidence
FROM exceeded
WHERE pick = 1
