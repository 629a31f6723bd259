-- The engine's prompt token count for the request differs from the gateway's (for example 1, the
-- placeholder a rejected request is swapped for) by more than a tokenizer/template difference.
-- Output: request_id, strength, evidence (JSON).
WITH hits AS (
    SELECT r.request_id, r.prompt_tokens, e.prompt_tokens AS engine_prompt_tokens, e.instance,
           e.source_file, e.source_line,
           row_number() OVER (PARTITION BY r.request_id ORDER BY e.ts NULLS LAST, e.source_file NULLS LAST,
                                               e.source_line NULLS LAST) AS pick
    FROM requests r
    JOIN engine_events e ON e.request_id = r.request_id
    WHERE r.status BETWEEN 200 AND 299
      AND e.kind = 'req_time_stats'
      AND e.prompt_tokens IS NOT NULL
      AND abs(e.prompt_tokens - r.prompt_tokens) > GREATEST($min_abs_diff, $max_rel_diff * r.prompt_tokens)
)
SELECT request_id, 'weak' AS strength,
       {{ json_object('gateway_prompt_tokens', prompt_tokens, 'engine_prompt_tokens', engine_prompt_tokens,
                      'instance', instance, 'log_line', source_file || ':' || CAST(source_line AS STRING)) }} AS evidence
FROM hits
WHERE pick = 1
