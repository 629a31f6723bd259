-- Prefix-reuse attribution: whose prefix-cache blocks each flagged request reused (the prefix_reuse
-- mechanism's sources). One row per recipient request and source request with the block positions
-- reused from it (position_from .. position_to) and the basis:
--   block_fingerprints: the reused block's prefix (request_blocks.chain_fp) was first sent by that
--     request, on the recipient's instance under its salt (its own cache), else (nothing there explains
--     it: a shared store or a lost salt) on any instance of the model; the recipient's own account and the provider's internal accounts
--     never count (their earlier sends make the block the tenant's own or a shared system prompt);
--   colliding_block: the block the engine matched under a colliding hash (rule block_hash_collision)
--     was stored by that request: the latest request on the instance with a block of the stored
--     block's fingerprint, sent before it was stored. The matched block is the one last stored under
--     the parent hash of the recipient's own first stored block, else (it stored nothing) the block
--     last stored with other content under the hash its previous block was stored under.
-- Reads findings (the flagged requests), requests, request_blocks, kv_events, account_classes.
-- Parameters: $store_window_s (the block_hash_collision rule's default).
CREATE OR REPLACE TABLE prefix_sources AS
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
           CASE WHEN e.account_id = u.account_id OR i.account_id IS NOT NULL THEN 1 ELSE 0 END AS benign_send
    FROM reused u
    JOIN request_blocks eb ON eb.chain_fp = u.chain_fp AND eb.position = u.position
    JOIN requests e ON e.request_id = eb.request_id
    LEFT JOIN internal i ON i.account_id = e.account_id
    WHERE e.ts < u.ts AND e.model = u.model AND e.request_id <> u.request_id
), per_block AS (
    SELECT request_id, position, max(benign_send) AS benign, max(local_send) AS any_local
    FROM sent GROUP BY request_id, position
), stores AS (
    SELECT s.request_id, s.position, s.sender_id, s.sender_account, 'block_fingerprints' AS basis,
           row_number() OVER (PARTITION BY s.request_id, s.position
                              ORDER BY s.sender_ts NULLS LAST, s.sender_id NULLS LAST) AS earliest
    FROM sent s JOIN per_block b ON b.request_id = s.request_id AND b.position = s.position
    WHERE b.benign = 0 AND (s.local_send = 1 OR b.any_local = 0)
), collided AS (
    -- the block stored under the hash the recipient matched (the parent of its own first stored block)
    SELECT u.request_id, u.position, u.prefill_instance, u.block_fp, e.block_fp AS matched_fp, e.ts AS matched_ts,
           row_number() OVER (PARTITION BY u.request_id
                              ORDER BY e.ts DESC NULLS LAST, e.batch DESC NULLS LAST, e.seq DESC NULLS LAST) AS latest
    FROM reused u
    JOIN request_blocks nb ON nb.request_id = u.request_id AND nb.position = u.position + 1
    JOIN kv_events k ON k.instance = u.prefill_instance AND k.kind = 'stored' AND k.block_fp = nb.block_fp
                    AND k.ts >= {{ add_milliseconds(u.ts, -1000 * $store_window_s) }}
                    AND k.ts <= {{ add_milliseconds(u.ts, 1000 * $store_window_s) }}
    JOIN kv_events e ON e.instance = k.instance AND e.kind = 'stored' AND e.block_hash = k.parent_block_hash
    WHERE EXISTS (SELECT 1 FROM findings x WHERE x.request_id = u.request_id AND x.rule_id = 'block_hash_collision')
      AND u.position = (SELECT max(l.position) FROM reused l WHERE l.request_id = u.request_id)
      AND (e.ts < k.ts OR (e.ts = k.ts AND (e.batch < k.batch OR (e.batch = k.batch AND e.seq < k.seq))))
), never_sent AS (
    -- a collision the recipient's own store does not show: its first reused block no earlier request sent
    SELECT u.request_id, min(u.position) AS position
    FROM reused u
    WHERE EXISTS (SELECT 1 FROM findings x WHERE x.request_id = u.request_id AND x.rule_id = 'block_hash_collision')
      AND NOT EXISTS (SELECT 1 FROM collided c WHERE c.request_id = u.request_id)
      AND NOT EXISTS (SELECT 1 FROM request_blocks eb JOIN requests e ON e.request_id = eb.request_id
                      WHERE eb.chain_fp = u.chain_fp AND eb.position = u.position AND e.ts < u.ts
                        AND e.request_id <> u.request_id)
    GROUP BY u.request_id
), parent_hash AS (
    -- the hash the block before it was stored under on the instance, last before the request
    SELECT n.request_id, n.position, k.block_hash,
           row_number() OVER (PARTITION BY n.request_id
                              ORDER BY k.ts DESC NULLS LAST, k.batch DESC NULLS LAST, k.seq DESC NULLS LAST) AS latest
    FROM never_sent n
    JOIN reused prev ON prev.request_id = n.request_id AND prev.position = n.position - 1
    JOIN kv_events k ON k.instance = prev.prefill_instance AND k.kind = 'stored' AND k.block_fp = prev.block_fp
                    AND k.ts < prev.ts
), sibling AS (
    -- what was stored under that parent with other content before the request: the block it matched
    SELECT u.request_id, u.position, u.prefill_instance, u.block_fp, e.block_fp AS matched_fp, e.ts AS matched_ts,
           row_number() OVER (PARTITION BY u.request_id
                              ORDER BY e.ts DESC NULLS LAST, e.batch DESC NULLS LAST, e.seq DESC NULLS LAST) AS latest
    FROM parent_hash h
    JOIN reused u ON u.request_id = h.request_id AND u.position = h.position
    JOIN kv_events e ON e.instance = u.prefill_instance AND e.kind = 'stored' AND e.parent_block_hash = h.block_hash
                    AND e.block_fp <> u.block_fp AND e.ts < u.ts
    WHERE h.latest = 1
), matched_blocks AS (
    SELECT request_id, position, prefill_instance, block_fp, matched_fp, matched_ts FROM collided WHERE latest = 1
    UNION ALL
    SELECT request_id, position, prefill_instance, block_fp, matched_fp, matched_ts FROM sibling WHERE latest = 1
), collision_stores AS (
    SELECT c.request_id, c.position, p.request_id AS sender_id, p.account_id AS sender_account,
           'colliding_block' AS basis,
           row_number() OVER (PARTITION BY c.request_id
                              ORDER BY p.ts DESC NULLS LAST, p.request_id NULLS LAST) AS earliest
    FROM matched_blocks c
    JOIN request_blocks pb ON pb.block_fp = c.matched_fp
    JOIN requests p ON p.request_id = pb.request_id
    WHERE c.matched_fp <> c.block_fp AND p.prefill_instance = c.prefill_instance
      AND p.ts <= {{ add_milliseconds(c.matched_ts, 1000 * $store_window_s) }} AND p.request_id <> c.request_id
), chosen AS (
    SELECT request_id, position, sender_id, sender_account, basis FROM stores WHERE earliest = 1
    UNION ALL
    SELECT request_id, position, sender_id, sender_account, basis FROM collision_stores WHERE earliest = 1
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
