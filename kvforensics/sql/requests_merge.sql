-- Merge typed records of one file into `requests`. Parameters: $source, $file.
-- A request id seen before with identical canonical values is a duplicate (at-least-once shipping);
-- with different values it is quarantined as a conflict, naming where the kept record came from.
CREATE OR REPLACE TEMP TABLE merged_requests AS
WITH good AS (
    SELECT *, md5(concat_ws('|', request_id, CAST(epoch_us(ts) AS VARCHAR), account_id, model,
                            CAST(status AS VARCHAR), CAST(prompt_tokens AS VARCHAR),
                            coalesce(CAST(completion_tokens AS VARCHAR), ''), coalesce(CAST(cached_tokens AS VARCHAR), ''),
                            coalesce(CAST(ttft_ms AS VARCHAR), ''), coalesce(CAST(latency_ms AS VARCHAR), ''),
                            coalesce(prefill_instance, ''), coalesce(decode_instance, ''))) AS row_hash,
           row_number() OVER (PARTITION BY request_id ORDER BY line) AS nth
    FROM typed_requests WHERE reason IS NULL
), firsts AS (
    SELECT g.request_id, g.line, g.row_hash
    FROM good g WHERE g.nth = 1
), kept AS (      -- the record each request id resolves to: an earlier load wins, else this file's first
    SELECT f.request_id,
           coalesce(r.row_hash, f.row_hash) AS row_hash,
           coalesce(r.source_file || ':' || CAST(r.source_line AS VARCHAR), $file || ':' || CAST(f.line AS VARCHAR)) AS kept_at,
           r.request_id IS NOT NULL AS existed
    FROM firsts f LEFT JOIN requests r ON r.request_id = f.request_id
)
SELECT g.*, k.kept_at,
       CASE WHEN NOT k.existed AND g.nth = 1 THEN 'loaded'
            WHEN g.row_hash = k.row_hash THEN 'duplicate'
            ELSE 'quarantined' END AS outcome
FROM good g JOIN kept k USING (request_id);

INSERT INTO requests
SELECT request_id, ts, account_id, model, status, prompt_tokens, completion_tokens, cached_tokens, ttft_ms,
       latency_ms, prefill_instance, decode_instance, $source, $file, line, row_hash
FROM merged_requests WHERE outcome = 'loaded';

INSERT INTO quarantine
SELECT $source, $file, line, 'duplicate request_id with conflicting values (kept the record at ' || kept_at || ')', left(raw, 2000)
FROM merged_requests WHERE outcome = 'quarantined';

INSERT INTO quarantine
SELECT $source, $file, line, reason, left(raw, 2000) FROM typed_requests WHERE reason IS NOT NULL;

-- count the refused records too, so loaded + duplicates + quarantined = records read
INSERT INTO merged_requests (line, raw, reason, outcome)
SELECT line, raw, reason, 'quarantined' FROM typed_requests WHERE reason IS NOT NULL;
