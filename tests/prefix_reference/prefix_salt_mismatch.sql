-- Reference for tests/test_prefix_scale.py: the rule written directly, each reused block joined to every
-- earlier send of its prefix (quadratic in a widely shared prefix). The shipped rule must return the same rows.
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
), sent AS (
    SELECT u.request_id, u.position, e.account_id AS sender_account, e.cache_salt AS sender_salt, e.ts AS sender_ts,
           e.request_id AS sender_id,
           CASE WHEN e.prefill_instance = u.prefill_instance AND e.cache_salt IS NOT DISTINCT FROM u.cache_salt
                THEN 1 ELSE 0 END AS local_send,
           CASE WHEN e.account_id = u.account_id OR i.account_id IS NOT NULL
                  OR EXISTS (SELECT 1 FROM prefix_shared_namespaces n
                             WHERE {{ glob_match(e.cache_salt, n.pattern) }}) THEN 1 ELSE 0 END AS benign_send
    FROM reused u
    JOIN request_blocks eb ON eb.chain_fp = u.chain_fp AND eb.position = u.position
    JOIN requests e ON e.request_id = eb.request_id
    LEFT JOIN internal i ON i.account_id = e.account_id
    WHERE e.ts < u.ts AND e.model = u.model AND e.request_id <> u.request_id
), per_block AS (
    SELECT request_id, position, max(benign_send) AS benign, max(local_send) AS any_local
    FROM sent GROUP BY request_id, position
), stores AS (
    SELECT s.*, row_number() OVER (PARTITION BY s.request_id, s.position
                                   ORDER BY s.local_send DESC NULLS LAST, s.sender_ts NULLS LAST,
                                            s.sender_id NULLS LAST) AS pick
    FROM sent s JOIN per_block b ON b.request_id = s.request_id AND b.position = s.position
    WHERE b.benign = 0 AND (s.local_send = 1 OR b.any_local = 0 OR $shared_store)
), paths AS (
    -- tests/prefix_reference/paths.sql
    {{ direct_paths }}
), by_request_salt AS (
    SELECT u.request_id, count(*) AS blocks, min(u.position) AS first_position, 1 AS priority,
           'request_salt' AS basis
    FROM reused u JOIN stores s ON s.request_id = u.request_id AND s.position = u.position AND s.pick = 1
    JOIN paths p ON p.request_id = u.request_id
    WHERE s.sender_salt IS DISTINCT FROM u.cache_salt AND (p.local_path = 1 OR p.store_path = 1 OR $shared_store)
    GROUP BY u.request_id
), event_stores AS (
    SELECT u.request_id, u.position,
           max(CASE WHEN k.salt = u.cache_salt THEN 1 ELSE 0 END) AS same_salt,
           max(CASE WHEN k.salt IS DISTINCT FROM u.cache_salt AND k.salt IS NOT NULL THEN 1 ELSE 0 END) AS other_salt
    FROM reused u
    JOIN kv_events k ON k.block_fp = u.block_fp AND k.position = u.position AND k.kind = 'stored'
    WHERE k.ts <= u.ts AND (k.instance = u.prefill_instance OR u.prefill_instance IS NULL OR $shared_store)
      AND NOT EXISTS (SELECT 1 FROM per_block b WHERE b.request_id = u.request_id AND b.position = u.position
                                                  AND b.benign = 1)
    GROUP BY u.request_id, u.position
), by_event_salt AS (
    SELECT e.request_id, count(*) AS blocks, min(e.position) AS first_position, 2 AS priority,
           'kv_event_salt' AS basis
    FROM event_stores e JOIN paths p ON p.request_id = e.request_id
    WHERE same_salt = 0 AND other_salt = 1 AND (p.local_path = 1 OR p.store_path = 1)
    GROUP BY e.request_id
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
