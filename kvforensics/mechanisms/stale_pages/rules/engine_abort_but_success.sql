-- The engine logged an abort or rejection for the request id, yet the client got 2xx.
-- Output: request_id, strength, evidence (JSON).
WITH hits AS (
    SELECT r.request_id, r.status, r.prompt_tokens, e.kind, e.instance, e.prompt_tokens AS engine_prompt_tokens,
           e.limit_tokens, e.source_file, e.source_line,
           row_number() OVER (PARTITION BY r.request_id ORDER BY e.ts NULLS LAST, e.source_file NULLS LAST,
                                               e.source_line NULLS LAST) AS pick
    FROM requests r
    JOIN engine_events e ON e.request_id = r.request_id
    WHERE r.status BETWEEN 200 AND 299
      AND e.kind IN ('abort_input_too_long', 'abort_other')
)
SELECT request_id, 'strong' AS strength,
       {{ json_object('engine_event', kind, 'instance', instance, 'engine_prompt_tokens', engine_prompt_tokens,
                      'engine_limit_tokens', limit_tokens, 'client_status', status,
                      'log_line', source_file || ':' || CAST(source_line AS STRING)) }} AS evidence
FROM hits
WHERE pick = 1
