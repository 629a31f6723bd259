-- A request whose prefix-cache hit reused blocks stored under another cache salt: the
-- isolation the salt should give was lost (a store or router that drops the salt, salts never
-- delivered to the scheduler). The reused blocks are the prompt's leading blocks its cached_tokens
-- cover (request_blocks). Two bases, each strong:
--   request_salt: the earliest earlier request of another account that sent the same prefix up to the
--   block (on the request's instance, else any instance of the model) carried a different cache_salt;
--   kv_event_salt: no KV-cache event stored the block (same position, same block fingerprint) under
--   the request's salt before it, but one stored it under another salt, on the request's instance or,
--   with $shared_store, any instance.
-- A prefix the requester's own account or one of the provider's internal accounts had sent before is
-- never counted (a shared system prompt). A request without a salt counts only when the requests
-- source logs salts at all (some request carries one).
-- Only through a path across tenants open on the request's instance when it was served (prefix_windows,
-- sql/prefix_paths.sql); with no start-up to judge, any.
-- Output: request_id, strength ('strong' | 'weak'), evidence (JSON). One row per request.
WITH internal AS (
    SELECT DISTINCT a.account_id
    FROM (SELECT DISTINCT account_id FROM requests) a
    JOIN account_patterns p ON {{ glob_match(a.account_id, p.pattern) }}
    WHERE p.account_class = 'internal'
), salts_logged AS (
    SELECT count(*) AS salted FROM requests WHERE cache_salt IS NOT NULL
), hits AS (
    SELECT r.request_id, r.ts, r.account_id, r.model, r.prefill_instance, r.cache_salt, r.cached_tokens
    FROM requests r CROSS JOIN salts_logged l
    WHERE r.cached_tokens > 0 AND (r.cache_salt IS NOT NULL OR l.salted > 0)
), blocks AS (
    SELECT request_id, position, block_fp, chain_fp,
           sum(num_tokens) OVER (PARTITION BY request_id ORDER BY position NULLS LAST
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS end_token
    FROM request_blocks
), reused AS (
    SELECT h.*, b.position, b.block_fp, b.chain_fp
    FROM hits h JOIN blocks b ON b.request_id = h.request_id
    WHERE b.end_token <= h.cached_tokens
), {{ fragment('prefix_senders') }}, {{ fragment('prefix_paths') }}, by_request_salt AS (
    -- the block's store (the earliest send on the requester's own cache, else on any instance) had another salt
    SELECT u.request_id, count(*) AS blocks, min(u.position) AS first_position, 1 AS priority,
           'request_salt' AS basis
    FROM reused u JOIN block_senders s ON s.request_id = u.request_id AND s.position = u.position
    JOIN request_paths p ON p.request_id = u.request_id
    WHERE s.benign = 0 AND (p.local_path = 1 OR p.store_path = 1 OR $shared_store)
      AND (CASE WHEN s.any_local = 1 THEN s.local_salt ELSE s.first_salt END) IS DISTINCT FROM u.cache_salt
    GROUP BY u.request_id
), event_stores AS (
    SELECT u.request_id, u.position,
           max(CASE WHEN k.salt = u.cache_salt THEN 1 ELSE 0 END) AS same_salt,
           max(CASE WHEN k.salt IS DISTINCT FROM u.cache_salt AND k.salt IS NOT NULL THEN 1 ELSE 0 END) AS other_salt
    FROM reused u
    JOIN kv_events k ON k.block_fp = u.block_fp AND k.position = u.position AND k.kind = 'stored'
    WHERE k.ts <= u.ts AND (k.instance = u.prefill_instance OR u.prefill_instance IS NULL OR $shared_store)
      AND NOT EXISTS (SELECT 1 FROM block_senders b WHERE b.request_id = u.request_id AND b.position = u.position
                                                      AND b.benign = 1)
    GROUP BY u.request_id, u.position
), by_event_salt AS (
    SELECT request_id, count(*) AS blocks, min(position) AS first_position, 2 AS priority, 'kv_event_salt' AS basis
    FROM event_stores e
    WHERE same_salt = 0 AND other_salt = 1
      AND EXISTS (SELECT 1 FROM request_paths p WHERE p.request_id = e.request_id
                                                  AND (p.local_path = 1 OR p.store_path = 1))
    GROUP BY request_id
), found AS (
    SELECT * FROM by_request_salt
    UNION ALL SELECT * FROM by_event_salt
), ranked AS (
    SELECT f.*, row_number() OVER (PARTITION BY f.request_id ORDER BY f.priority NULLS LAST) AS pick
    FROM found f
)
SELECT h.request_id, 'strong' AS strength,
       {{ json_object('basis', r.basis, 'cached_tokens', h.cached_tokens, 'mismatched_blocks', r.blocks,
                      'first_mismatched_block', r.first_position, 'request_salted', h.cache_salt IS NOT NULL) }}
           AS evidence
FROM ranked r JOIN hits h ON h.request_id = r.request_id
WHERE r.pick = 1
