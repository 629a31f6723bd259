-- KV transfer failures, checksum mismatches or context corruption the engine tied to a request that
-- the client nevertheless received with 2xx. Checksum and corruption findings are strong evidence of
-- foreign or stale KV content; a bare transfer failure is weak.
-- Output: request_id, strength, evidence (JSON).
WITH hits AS (
    SELECT r.request_id, e.kind, e.instance, e.detail, e.source_file, e.source_line,
           row_number() OVER (PARTITION BY r.request_id
                              ORDER BY CASE WHEN e.kind = 'transfer_failure' THEN 1 ELSE 0 END NULLS LAST,
                                       e.ts NULLS LAST, e.source_line NULLS LAST) AS pick
    FROM requests r
    JOIN engine_events e ON e.request_id = r.request_id
    WHERE r.status BETWEEN 200 AND 299
      AND e.kind IN ('transfer_failure', 'checksum_mismatch', 'context_corruption', 'canary_mismatch')
)
SELECT request_id,
       CASE WHEN kind = 'transfer_failure' THEN 'weak' ELSE 'strong' END AS strength,
       {{ json_object('engine_event', kind, 'instance', instance, 'detail', left(detail, 200),
                      'log_line', source_file || ':' || CAST(source_line AS STRING)) }} AS evidence
FROM hits
WHERE pick = 1
