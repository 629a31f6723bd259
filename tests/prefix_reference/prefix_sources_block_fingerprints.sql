-- Reference for tests/test_prefix_scale.py: the block_fingerprints rows of sql/prefix_sources.sql written
-- directly, each reused block joined to every earlier send of its prefix (quadratic in a widely shared
-- prefix). The shipped script's rows of that basis must be the same. A query over findings, requests,
-- request_blocks and account_classes.
WITH flagged AS (
    SELECT DISTINCT request_id FROM findings
    WHERE rule_id IN ('cross_tenant_prefix_hit', 'prefix_salt_mismatch', 'block_hash_collision')
), internal AS (
    SELECT account_id FROM account_classes WHERE account_class = 'internal'
), reused AS (
    SELECT r.request_id, r.ts, r.account_id, r.model, r.prefill_instance, r.cache_salt, b.position, b.chain_fp,
           b.block_fp
    FROM flagged f
    JOIN requests r ON r.request_id = f.request_id
    JOIN (SELECT request_id, position, chain_fp, block_fp,
                 sum(num_tokens) OVER (PARTITION BY request_id ORDER BY position NULLS LAST
                                       ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS end_token
          FROM request_blocks) b ON b.request_id = r.request_id
    WHERE b.end_token <= r.cached_tokens
), sent AS (
    SELECT u.request_id, u.position, e.request_id AS sender_id, e.account_id AS sender_account, e.ts AS sender_ts,
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
    SELECT request_id, position, max(benign_send) AS benign, max(local_send) AS any_local
    FROM sent GROUP BY request_id, position
), hits AS (
    SELECT DISTINCT request_id, ts, prefill_instance FROM reused
), paths AS (
    -- tests/prefix_reference/paths.sql
    {{ direct_paths }}
), stores AS (
    -- the earliest send on the recipient's own cache when that cache crossed tenants; else, through a store whose
    -- keys drop the salt, the store's entry (the earliest send on an instance that then had the store), foreign
    -- unless its account is the recipient's, internal or a shared namespace, and never when the recipient's
    -- namespace had sent the block on its own instance; else the earliest send on any instance. A response
    -- attributed by its shared-store loads is not attributed here
    SELECT s.request_id, s.position, s.sender_id, s.sender_account, 'block_fingerprints' AS basis, s.benign_send,
           b.benign, b.any_local AS own_local,
           CASE WHEN b.any_local = 1 AND p.local_path = 1 THEN 'local'
                WHEN p.store_path = 1 THEN 'store' ELSE 'any' END AS branch,
           row_number() OVER (PARTITION BY s.request_id, s.position
                              ORDER BY s.sender_ts NULLS LAST, s.sender_id NULLS LAST) AS earliest
    FROM sent s JOIN per_block b ON b.request_id = s.request_id AND b.position = s.position
    JOIN paths p ON p.request_id = s.request_id
    WHERE CASE WHEN b.any_local = 1 AND p.local_path = 1 THEN s.local_send = 1
               WHEN p.store_path = 1 THEN s.store_send = 1
               ELSE p.local_path = 1 END
      AND s.request_id NOT IN (SELECT request_id FROM findings WHERE rule_id = 'cross_tenant_store_load')
), chosen AS (
    SELECT request_id, position, sender_id, sender_account, basis FROM stores
    WHERE earliest = 1 AND CASE WHEN branch = 'store' THEN benign_send = 0 AND own_local = 0 ELSE benign = 0 END
), runs AS (
    -- consecutive positions reused from one source request form one row
    SELECT *, position - row_number() OVER (PARTITION BY request_id, sender_id, basis
                                            ORDER BY position NULLS LAST) AS run
    FROM chosen
)
SELECT request_id, sender_id AS source_request_id, sender_account AS source_account,
       min(position) AS position_from, max(position) AS position_to, basis
FROM runs
GROUP BY request_id, sender_id, sender_account, basis, run
