-- PROTOTYPE (benchmarks only, not kvforensics): resolve duplicates once per source, after every
-- file was typed into `typed_all` (file_no, line, typed columns, raw only for refused records),
-- instead of once per file against the growing `requests` table. Only request ids seen more than
-- once (or already loaded earlier) go through the window; every other good record is inserted
-- directly. Parameters: $source. `proto_files` maps file_no to the file name.
CREATE OR REPLACE TEMP TABLE repeated_ids AS
SELECT request_id FROM typed_all WHERE reason IS NULL GROUP BY request_id HAVING count(*) > 1
UNION
SELECT t.request_id FROM typed_all t JOIN requests r ON r.request_id = t.request_id WHERE t.reason IS NULL;

CREATE OR REPLACE TEMP TABLE repeated AS
SELECT t.*, md5(concat_ws('|', t.request_id, CAST(epoch_us(t.ts) AS VARCHAR), t.account_id, t.model,
                          CAST(t.status AS VARCHAR), CAST(t.prompt_tokens AS VARCHAR),
                          coalesce(CAST(t.completion_tokens AS VARCHAR), ''), coalesce(CAST(t.cached_tokens AS VARCHAR), ''),
                          coalesce(CAST(t.ttft_ms AS VARCHAR), ''), coalesce(CAST(t.latency_ms AS VARCHAR), ''),
                          coalesce(t.prefill_instance, ''), coalesce(t.decode_instance, ''))) AS row_hash,
       row_number() OVER (PARTITION BY t.request_id ORDER BY t.file_no, t.line) AS nth,
       r.request_id IS NOT NULL AS existed, r.row_hash AS existing_hash
FROM typed_all t SEMI JOIN repeated_ids USING (request_id)
LEFT JOIN requests r ON r.request_id = t.request_id
WHERE t.reason IS NULL;

INSERT INTO requests
SELECT t.request_id, t.ts, t.account_id, t.model, t.status, t.prompt_tokens, t.completion_tokens, t.cached_tokens,
       t.ttft_ms, t.latency_ms, t.prefill_instance, t.decode_instance, $source, f.file, t.line,
       md5(concat_ws('|', t.request_id, CAST(epoch_us(t.ts) AS VARCHAR), t.account_id, t.model,
                     CAST(t.status AS VARCHAR), CAST(t.prompt_tokens AS VARCHAR),
                     coalesce(CAST(t.completion_tokens AS VARCHAR), ''), coalesce(CAST(t.cached_tokens AS VARCHAR), ''),
                     coalesce(CAST(t.ttft_ms AS VARCHAR), ''), coalesce(CAST(t.latency_ms AS VARCHAR), ''),
                     coalesce(t.prefill_instance, ''), coalesce(t.decode_instance, '')))
FROM typed_all t ANTI JOIN repeated_ids USING (request_id) JOIN proto_files f USING (file_no)
WHERE t.reason IS NULL
UNION ALL
SELECT r.request_id, r.ts, r.account_id, r.model, r.status, r.prompt_tokens, r.completion_tokens, r.cached_tokens,
       r.ttft_ms, r.latency_ms, r.prefill_instance, r.decode_instance, $source, f.file, r.line, r.row_hash
FROM repeated r JOIN proto_files f USING (file_no)
WHERE r.nth = 1 AND NOT r.existed;

-- conflicts: the raw text of these (rare) records would be re-read from their file and line
INSERT INTO quarantine
SELECT $source, f.file, r.line, 'duplicate request_id with conflicting values', NULL
FROM repeated r JOIN proto_files f USING (file_no)
JOIN (SELECT request_id, coalesce(any_value(existing_hash), arg_min(row_hash, nth)) AS kept_hash
      FROM repeated GROUP BY 1) k USING (request_id)
WHERE (r.nth > 1 OR r.existed) AND r.row_hash <> k.kept_hash;

INSERT INTO quarantine
SELECT $source, f.file, t.line, t.reason, left(t.raw, 2000)
FROM typed_all t JOIN proto_files f USING (file_no) WHERE t.reason IS NOT NULL;
