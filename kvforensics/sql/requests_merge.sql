-- Merge a batch of typed records (`kvf_batch.typed_all`: every record of the batch's files, `kvf_batch.load_files`:
-- file_no -> file name, in load order) into `requests`. Parameters: $source.
-- A request id seen before with identical canonical values is a duplicate (at-least-once shipping);
-- with different values it is quarantined as a conflict, naming where the kept record came from.
-- The record kept is the one loaded earliest: a record already in `requests`, else the first of the
-- batch in load order (file, then line). Only ids that occur more than once, or were loaded
-- before, go through that comparison; every other record is inserted as it is. Ids are found by their
-- hash (typed_all.id_hash): ids whose hash repeats are compared by their text in `repeated`, so a hash
-- collision between two different ids only sends both through the comparison, where each is the
-- first of its own id and is loaded.

CREATE OR REPLACE TEMP TABLE repeated_ids AS
SELECT id_hash FROM kvf_batch.typed_all WHERE reason IS NULL GROUP BY id_hash HAVING count(*) > 1
UNION
SELECT t.id_hash FROM kvf_batch.typed_all t SEMI JOIN (SELECT hash(request_id) AS id_hash FROM requests) r
    ON r.id_hash = t.id_hash WHERE t.reason IS NULL;

CREATE OR REPLACE TEMP TABLE repeated AS
WITH candidates AS (
    SELECT -1 AS file_no, r.source_file AS file, r.source_line AS line, r.request_id, r.ts, r.account_id, r.model,
           r.status, r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.ttft_ms, r.latency_ms,
           r.prefill_instance, r.decode_instance, r.cache_salt
    FROM requests r SEMI JOIN repeated_ids i ON i.id_hash = hash(r.request_id)
    UNION ALL
    SELECT t.file_no, f.file, t.line, t.request_id, t.ts, t.account_id, t.model,
           t.status, t.prompt_tokens, t.completion_tokens, t.cached_tokens, t.ttft_ms, t.latency_ms,
           t.prefill_instance, t.decode_instance, t.cache_salt
    FROM kvf_batch.typed_all t SEMI JOIN repeated_ids i ON i.id_hash = t.id_hash
    JOIN kvf_batch.load_files f ON f.file_no = t.file_no
    WHERE t.reason IS NULL
), ranked AS (
    SELECT *, row_number() OVER (PARTITION BY request_id ORDER BY file_no, line) AS nth FROM candidates
)
SELECT c.*, w.file || ':' || CAST(w.line AS VARCHAR) AS kept_at,
       CASE WHEN c.nth = 1 THEN CASE WHEN c.file_no = -1 THEN 'earlier' ELSE 'loaded' END
            WHEN c.ts IS NOT DISTINCT FROM w.ts AND c.account_id IS NOT DISTINCT FROM w.account_id
                 AND c.model IS NOT DISTINCT FROM w.model AND c.status IS NOT DISTINCT FROM w.status
                 AND c.prompt_tokens IS NOT DISTINCT FROM w.prompt_tokens
                 AND c.completion_tokens IS NOT DISTINCT FROM w.completion_tokens
                 AND c.cached_tokens IS NOT DISTINCT FROM w.cached_tokens
                 AND c.ttft_ms IS NOT DISTINCT FROM w.ttft_ms AND c.latency_ms IS NOT DISTINCT FROM w.latency_ms
                 AND c.prefill_instance IS NOT DISTINCT FROM w.prefill_instance
                 AND c.decode_instance IS NOT DISTINCT FROM w.decode_instance
                 AND c.cache_salt IS NOT DISTINCT FROM w.cache_salt THEN 'duplicate'
            ELSE 'conflict' END AS outcome
FROM ranked c JOIN ranked w ON w.request_id = c.request_id AND w.nth = 1;

INSERT INTO requests
SELECT t.request_id, t.ts, t.account_id, t.model, t.status, t.prompt_tokens, t.completion_tokens, t.cached_tokens,
       t.ttft_ms, t.latency_ms, t.prefill_instance, t.decode_instance, $source, f.file, t.line, t.cache_salt,
       CASE WHEN t.cached_tokens IS NOT NULL THEN 'gateway' END
FROM kvf_batch.typed_all t ANTI JOIN repeated_ids i ON i.id_hash = t.id_hash
JOIN kvf_batch.load_files f ON f.file_no = t.file_no
WHERE t.reason IS NULL
UNION ALL
SELECT request_id, ts, account_id, model, status, prompt_tokens, completion_tokens, cached_tokens,
       ttft_ms, latency_ms, prefill_instance, decode_instance, $source, file, line, cache_salt,
       CASE WHEN cached_tokens IS NOT NULL THEN 'gateway' END
FROM repeated WHERE outcome = 'loaded';

INSERT INTO quarantine
SELECT $source, f.file, t.line, t.reason, t.raw
FROM kvf_batch.typed_all t JOIN kvf_batch.load_files f ON f.file_no = t.file_no
WHERE t.reason IS NOT NULL;

-- the raw text of these (rare) records is filled in by the loader, which reads their lines again
INSERT INTO quarantine
SELECT $source, file, line, 'duplicate request_id with conflicting values (kept the record at ' || kept_at || ')', NULL
FROM repeated WHERE outcome = 'conflict';

-- ... and their typed values, for the gate (reason conflicting_duplicate: does either copy decide a finding?)
INSERT INTO request_conflicts
SELECT request_id, ts, account_id, model, status, prompt_tokens, ttft_ms, latency_ms, $source, file, line, kept_at
FROM repeated WHERE outcome = 'conflict';

-- what happened to each file's records: read = loaded + duplicates + quarantined
CREATE OR REPLACE TEMP TABLE merge_counts AS
WITH typed AS (
    SELECT file_no, count(*) AS records_read, count(reason) AS refused,
           count(*) FILTER (WHERE reason IS NULL AND ts_naive) AS naive
    FROM kvf_batch.typed_all GROUP BY file_no
), decided AS (
    SELECT file_no, count(*) FILTER (WHERE outcome = 'duplicate') AS duplicates,
           count(*) FILTER (WHERE outcome = 'conflict') AS conflicts
    FROM repeated WHERE file_no >= 0 GROUP BY file_no
)
SELECT f.file_no, coalesce(t.records_read, 0) AS records_read,
       coalesce(t.refused, 0) + coalesce(d.conflicts, 0) AS quarantined,
       coalesce(d.duplicates, 0) AS duplicates,
       coalesce(t.records_read, 0) - coalesce(t.refused, 0) - coalesce(d.conflicts, 0) - coalesce(d.duplicates, 0)
           AS loaded,
       coalesce(t.naive, 0) AS naive
FROM kvf_batch.load_files f LEFT JOIN typed t ON t.file_no = f.file_no LEFT JOIN decided d ON d.file_no = f.file_no;
