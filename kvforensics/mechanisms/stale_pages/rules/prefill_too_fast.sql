-- A 2xx response whose time to first token is far below the fastest real prefill of its uncached
-- prompt tokens: observed < $max_fraction x the latency model's lower envelope. When TTFT was not
-- measured, end-to-end latency minus a decode floor bounds it from above; with neither, the request
-- is unknown, never fast. The envelope is evaluated at min(uncached, max_tokens): a lower bound is
-- never extrapolated beyond the largest prompt it was fitted on.
-- Output: request_id, strength, evidence (JSON).
WITH r AS (
    SELECT q.request_id, q.model, q.ttft_ms, q.latency_ms, q.completion_tokens,
           q.prompt_tokens - coalesce(q.cached_tokens, 0) AS uncached_tokens
    FROM requests q
    WHERE q.status BETWEEN 200 AND 299
), bounded AS (
    SELECT r.*, m.a_ms, m.b_ms_per_token, m.c_ms_per_token2, m.max_tokens,
           LEAST(r.uncached_tokens, m.max_tokens) AS n_eval,
           CASE WHEN r.ttft_ms IS NOT NULL THEN r.ttft_ms
                WHEN r.latency_ms IS NOT NULL
                    THEN r.latency_ms - coalesce(r.completion_tokens, 0) * $decode_ms_per_token_floor
           END AS observed_ms,
           CASE WHEN r.ttft_ms IS NOT NULL THEN 'ttft_ms' ELSE 'latency_ms minus decode floor' END AS measure
    FROM r
    JOIN latency_model m ON m.model = r.model AND m.usable
    WHERE r.uncached_tokens >= $min_uncached_tokens
), judged AS (
    SELECT *, a_ms + b_ms_per_token * n_eval + c_ms_per_token2 * n_eval * n_eval AS expected_min_ms
    FROM bounded
)
SELECT request_id, 'weak' AS strength,
       {{ json_object('measure', measure, 'observed_ms', {{ round_double(observed_ms, 1) }},
                      'expected_min_ms', {{ round_double(expected_min_ms, 1) }}, 'uncached_tokens', uncached_tokens,
                      'evaluated_at_tokens', n_eval,
                      'speedup', {{ round_double(expected_min_ms / GREATEST(observed_ms, 1), 1) }}) }} AS evidence
FROM judged
WHERE observed_ms IS NOT NULL AND observed_ms < $max_fraction * expected_min_ms
