-- Reference for tests/test_prefix_scale.py: the rule written directly, each reused block joined to every
-- earlier send of its prefix (quadratic in a widely shared prefix). The shipped rule must return the same rows.
-- A request whose prefix-cache hit reused blocks that, on a cache it could read, only other
-- tenants had stored. The reused blocks are the prompt's leading blocks (request_blocks) that its
-- cached_tokens cover. A block is foreign when an earlier request of another account sent the same
-- prefix up to that block (equal chain_fp) and neither the requester's own account nor one of the
-- provider's internal accounts ([scope] internal_accounts: a shared system prompt) had sent it before.
-- The store it came from: the earliest such request on the request's own instance under the same salt
-- (its own cache), else (a hit nothing there explains, or $shared_store) on any instance of the model.
-- Weak, from cached_tokens alone: a hit of at least $min_cached_tokens on a request whose blocks
-- are unknown or unexplained, whose account never sent a prompt and output that long on the model before, that
-- no internal account could have stored, and whose length fewer than $shared_length_accounts
-- accounts' unexplained hits share (a prefix every tenant gets from the cache is a shared one).
-- Output: request_id, strength ('strong' | 'weak'), evidence (JSON). One row per request.
WITH internal AS (
    SELECT DISTINCT a.account_id
    FROM (SELECT DISTINCT account_id FROM requests) a
    JOIN account_patterns p ON {{ glob_match(a.account_id, p.pattern) }}
    WHERE p.account_class = 'internal'
), hits AS (
    -- cached_tokens says the engine served these tokens from its cache, whatever the client got after
    SELECT request_id, ts, account_id, model, prefill_instance, cache_salt, cached_tokens
    FROM requests
    WHERE cached_tokens >= $min_cached_tokens
), blocks AS (
    SELECT request_id, position, num_tokens, chain_fp,
           sum(num_tokens) OVER (PARTITION BY request_id ORDER BY position NULLS LAST
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS end_token
    FROM request_blocks
), reused AS (
    SELECT h.request_id, h.ts, h.account_id, h.model, h.prefill_instance, h.cache_salt, b.position, b.chain_fp
    FROM hits h JOIN blocks b ON b.request_id = h.request_id
    WHERE b.end_token <= h.cached_tokens
), sent AS (
    -- every earlier send of the same prefix up to a reused block, on any instance of the model
    SELECT u.request_id, u.position, u.account_id, e.request_id AS sender_id, e.account_id AS sender_account,
           e.ts AS sender_ts,
           CASE WHEN e.prefill_instance = u.prefill_instance AND e.cache_salt IS NOT DISTINCT FROM u.cache_salt
                THEN 1 ELSE 0 END AS local_send,
           CASE WHEN NOT EXISTS (SELECT 1 FROM prefix_windows w WHERE w.instance = e.prefill_instance
                                   AND (w.valid_from IS NULL OR w.valid_from <= e.ts)
                                   AND (w.valid_to IS NULL OR e.ts < w.valid_to))
                  OR EXISTS (SELECT 1 FROM prefix_windows w WHERE w.instance = e.prefill_instance
                                   AND (w.valid_from IS NULL OR w.valid_from <= e.ts)
                                   AND (w.valid_to IS NULL OR e.ts < w.valid_to)
                                   AND w.reach IN ('shared_store', 'any'))
                THEN 1 ELSE 0 END AS store_send,
           CASE WHEN e.account_id = u.account_id OR i.account_id IS NOT NULL
                  OR EXISTS (SELECT 1 FROM prefix_shared_namespaces n
                             WHERE {{ glob_match(e.cache_salt, n.pattern) }}) THEN 1 ELSE 0 END AS benign_send
    FROM reused u
    JOIN request_blocks eb ON eb.chain_fp = u.chain_fp AND eb.position = u.position
    JOIN requests e ON e.request_id = eb.request_id
    LEFT JOIN internal i ON i.account_id = e.account_id
    WHERE e.ts < u.ts AND e.model = u.model AND e.request_id <> u.request_id
), per_block AS (
    SELECT request_id, position, max(benign_send) AS benign, max(local_send) AS any_local, count(*) AS sends
    FROM sent GROUP BY request_id, position
), paths AS (
    -- tests/prefix_reference/paths.sql
    {{ direct_paths }}
), stores AS (
    -- the earliest send on the requester's own cache when that cache crossed tenants (and no shared store is
    -- assumed); else, through a store whose keys drop the salt, the store's entry: the earliest send on an
    -- instance that then had the store, foreign unless its account is the requester's, internal or a shared
    -- namespace, and never when the requester's namespace had sent the block on its own instance; else the
    -- earliest send on any instance
    SELECT s.request_id, s.position, s.sender_id, s.sender_account, s.benign_send, b.benign, b.any_local AS own_local,
           CASE WHEN b.any_local = 1 AND p.local_path = 1 AND NOT $shared_store THEN 'local'
                WHEN p.store_path = 1 OR $shared_store THEN 'store' ELSE 'any' END AS branch,
           row_number() OVER (PARTITION BY s.request_id, s.position
                              ORDER BY s.sender_ts NULLS LAST, s.sender_id NULLS LAST) AS earliest
    FROM sent s JOIN per_block b ON b.request_id = s.request_id AND b.position = s.position
    JOIN paths p ON p.request_id = s.request_id
    WHERE CASE WHEN b.any_local = 1 AND p.local_path = 1 AND NOT $shared_store THEN s.local_send = 1
               WHEN p.store_path = 1 OR $shared_store THEN s.store_send = 1
               ELSE p.local_path = 1 END
), chosen AS (
    SELECT *, CASE WHEN branch = 'local' THEN 1 ELSE 0 END AS any_local FROM stores
    WHERE earliest = 1 AND CASE WHEN branch = 'store' THEN benign_send = 0 AND own_local = 0 ELSE benign = 0 END
), foreign_blocks AS (
    SELECT request_id, count(*) AS blocks, min(position) AS first_position, max(position) AS last_position,
           count(DISTINCT sender_account) AS source_accounts, min(any_local) AS all_local
    FROM chosen GROUP BY request_id
), explained AS (
    SELECT request_id FROM per_block GROUP BY request_id
), strong AS (
    SELECT h.request_id, 'strong' AS strength,
           {{ json_object('basis', CASE WHEN f.all_local = 1 THEN 'block_fingerprints_same_instance'
                                        ELSE 'block_fingerprints_shared_store' END,
                          'cached_tokens', h.cached_tokens, 'foreign_blocks', f.blocks,
                          'first_foreign_block', f.first_position, 'last_foreign_block', f.last_position,
                          'source_accounts', f.source_accounts) }} AS evidence
    FROM hits h JOIN foreign_blocks f ON f.request_id = h.request_id
), unexplained AS (
    -- hits no block fingerprint explains: the request has no blocks, or no earlier request sent its reused prefix
    SELECT h.* FROM hits h
    WHERE NOT EXISTS (SELECT 1 FROM explained x WHERE x.request_id = h.request_id)
), first_time AS (
    SELECT u.request_id, u.account_id, u.model, u.cached_tokens
    FROM unexplained u
    WHERE NOT EXISTS (SELECT 1 FROM requests o
                      WHERE o.account_id = u.account_id AND o.model = u.model AND o.ts < u.ts
                        AND o.prompt_tokens + coalesce(o.completion_tokens, 0) >= u.cached_tokens
                        AND o.request_id <> u.request_id)
      AND NOT EXISTS (SELECT 1 FROM requests o JOIN internal i ON i.account_id = o.account_id
                      WHERE o.model = u.model AND o.ts < u.ts
                        AND o.prompt_tokens + coalesce(o.completion_tokens, 0) >= u.cached_tokens)
), lengths AS (
    SELECT model, cached_tokens, count(DISTINCT account_id) AS accounts FROM first_time GROUP BY model, cached_tokens
), weak AS (
    SELECT f.request_id, 'weak' AS strength,
           {{ json_object('basis', 'cached_tokens_only', 'cached_tokens', f.cached_tokens,
                          'accounts_with_this_hit_length', l.accounts) }} AS evidence
    FROM first_time f JOIN lengths l ON l.model = f.model AND l.cached_tokens = f.cached_tokens
    JOIN paths p ON p.request_id = f.request_id
    WHERE l.accounts < $shared_length_accounts AND (p.local_path = 1 OR p.store_path = 1)
      AND NOT EXISTS (SELECT 1 FROM strong s WHERE s.request_id = f.request_id)
)
SELECT request_id, strength, evidence FROM strong
UNION ALL
SELECT request_id, strength, evidence FROM weak
