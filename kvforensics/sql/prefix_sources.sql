-- Prefix-reuse attribution: whose prefix-cache blocks each flagged request reused (the prefix_reuse
-- mechanism's sources). One row per recipient request and source request with the block positions
-- reused from it (position_from .. position_to) and the basis:
--   block_fingerprints: the reused block's prefix (request_blocks.chain_fp) was first sent by that
--     request, on the recipient's instance under its salt (its own cache), else (nothing there explains
--     it: a shared store or a lost salt) on any instance of the model; the recipient's own account and the provider's internal accounts
--     never count (their earlier sends make the block the tenant's own or a shared system prompt);
--   colliding_block: the block the engine matched under a colliding hash (rule block_hash_collision)
--     was stored by that request: the latest request on the instance with a block of the stored
--     block's fingerprint, sent before it was stored. The matched block is the one last stored, before
--     the recipient, under the hash its reused block's content was stored under on the instance (the same
--     content at the same chain position under its salt, at any time), else under the parent hash of the
--     recipient's own first stored block (its last reused block). A hit on a hash no event shows (the
--     recipient stored nothing and its content never reached that cache) has no determinable source.
-- Reads findings (the flagged requests), requests, request_blocks, kv_events, account_classes.
--   shared_store_pages: the recipient loaded pages from a shared store (rule cross_tenant_store_load) that
--     another namespace had written there first: that namespace's request on the writing instance that
--     arrived last before the write (table prefix_store_loads, above), else its account alone.
-- Parameters: $store_window_s (the block_hash_collision rule's), $load_window_s and $clock_skew_s (the
-- cross_tenant_store_load rule's).
-- Loads from a shared store of pages another namespace wrote there (sql/prefix_store_loads.sql: the
-- cross_tenant_store_load rule's method), one row per loaded foreign page with the response it served
-- (request_id NULL: no request of the loading namespace arrived near the load, which the gate reports as
-- prefix_store_loads_unmatched; a pick by arrival among candidates of which a successful one has no
-- cached_tokens is prefix_store_loads_ambiguous).
CREATE OR REPLACE TABLE prefix_store_loads AS
WITH RECURSIVE internal AS (
    SELECT account_id FROM account_classes WHERE account_class = 'internal'
), {{ fragment('prefix_store_loads') }}
SELECT f.instance, f.ts, f.salt, f.leaf, f.position, f.num_tokens, f.owner_salt, f.owner_instance, f.written,
       c.request_id, c.matched_by, c.candidates, c.unsized
FROM foreign_pages f
LEFT JOIN load_requests c ON c.instance = f.instance AND c.ts = f.ts AND c.salt = f.salt AND c.leaf = f.leaf
                         AND c.nearest = 1;

CREATE OR REPLACE TABLE prefix_sources AS
WITH flagged AS (
    SELECT DISTINCT request_id FROM findings
    WHERE rule_id IN ('cross_tenant_prefix_hit', 'prefix_salt_mismatch', 'block_hash_collision')
       OR rule_id = 'cross_tenant_store_load'
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
), {{ fragment('prefix_senders') }}, hits AS (
    SELECT r.request_id, r.ts, r.prefill_instance
    FROM flagged f JOIN requests r ON r.request_id = f.request_id
), {{ fragment('prefix_paths') }}, stores AS (
    -- through the paths open on the recipient's instance (as the rules judge): the earliest send on its own
    -- cache (instance and salt) when that cache crossed tenants, else, when a store whose keys drop the salt was
    -- in force, the store's entry: the earliest send on an instance that then had the store. A response the KV
    -- events show loading pages from a shared store is attributed by those loads (shared_store_pages below),
    -- which name the store's writer.
    SELECT s.request_id, s.position, 'block_fingerprints' AS basis,
           CASE WHEN s.any_local = 1 AND p.local_path = 1 THEN s.local_id
                WHEN p.store_path = 1 THEN s.store_id ELSE s.first_id END AS sender_id,
           CASE WHEN s.any_local = 1 AND p.local_path = 1 THEN s.local_account
                WHEN p.store_path = 1 THEN s.store_account ELSE s.first_account END AS sender_account
    FROM block_senders s JOIN request_paths p ON p.request_id = s.request_id
    WHERE CASE WHEN s.any_local = 1 AND p.local_path = 1 THEN s.benign = 0
               WHEN p.store_path = 1 THEN s.store_id IS NOT NULL AND s.store_benign = 0 AND s.any_local = 0
               ELSE p.local_path = 1 AND s.benign = 0 END
      AND s.request_id NOT IN (SELECT request_id FROM findings WHERE rule_id = 'cross_tenant_store_load')
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
), {{ fragment('prefix_block_hashes') }}, overwritten AS (
    -- a collision the recipient's own store does not show: the block last stored, before it, under the
    -- hash its reused block's content was stored under (sql/prefix_block_hashes.sql)
    SELECT h.request_id, h.position, u.prefill_instance, h.block_fp, h.held_fp AS matched_fp, h.held_ts AS matched_ts,
           h.latest
    FROM held_hashes h
    JOIN reused u ON u.request_id = h.request_id AND u.position = h.position
    WHERE EXISTS (SELECT 1 FROM findings x WHERE x.request_id = h.request_id AND x.rule_id = 'block_hash_collision')
), matched_any AS (
    SELECT request_id, position, prefill_instance, block_fp, matched_fp, matched_ts, 1 AS priority
    FROM overwritten WHERE latest = 1 AND matched_fp <> block_fp
    UNION ALL
    SELECT request_id, position, prefill_instance, block_fp, matched_fp, matched_ts, 2 AS priority
    FROM collided WHERE latest = 1
), matched_blocks AS (
    SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY request_id, position ORDER BY priority NULLS LAST) AS pick
                   FROM matched_any) m WHERE pick = 1
), collision_stores AS (
    SELECT c.request_id, c.position, p.request_id AS sender_id, p.account_id AS sender_account,
           'colliding_block' AS basis,
           row_number() OVER (PARTITION BY c.request_id, c.position
                              ORDER BY p.ts DESC NULLS LAST, p.request_id NULLS LAST) AS earliest
    FROM matched_blocks c
    JOIN request_blocks pb ON pb.block_fp = c.matched_fp
    JOIN requests p ON p.request_id = pb.request_id
    WHERE c.matched_fp <> c.block_fp AND p.prefill_instance = c.prefill_instance
      AND p.ts <= {{ add_milliseconds(c.matched_ts, 1000 * $store_window_s) }} AND p.request_id <> c.request_id
), store_pages AS (
    -- pages a flagged response loaded from a shared store that another namespace wrote
    SELECT request_id, position, owner_salt, owner_instance, written
    FROM prefix_store_loads
    WHERE request_id IN (SELECT request_id FROM findings WHERE rule_id = 'cross_tenant_store_load')
), salt_accounts AS (
    SELECT cache_salt, min(account_id) AS account_id FROM requests WHERE cache_salt IS NOT NULL GROUP BY cache_salt
), store_writers AS (
    -- each page's writer: the owner namespace's request on the writing instance that arrived last before
    -- the write (within $load_window_s), else the namespace's account alone
    SELECT p.request_id, p.position, r.request_id AS sender_id,
           coalesce(r.account_id, a.account_id) AS sender_account,
           row_number() OVER (PARTITION BY p.request_id, p.position
                              ORDER BY r.ts DESC NULLS LAST, r.request_id NULLS LAST) AS latest
    FROM store_pages p
    LEFT JOIN salt_accounts a ON a.cache_salt = p.owner_salt
    LEFT JOIN requests r ON r.cache_salt = p.owner_salt AND r.prefill_instance = p.owner_instance
                        AND r.ts <= {{ add_milliseconds(p.written, 1000 * $clock_skew_s) }}
                        AND r.ts >= {{ add_milliseconds(p.written, -1000 * $load_window_s) }}
), chosen AS (
    SELECT request_id, coalesce(position, 0) AS position, sender_id, sender_account,
           'shared_store_pages' AS basis
    FROM store_writers WHERE latest = 1 AND sender_account IS NOT NULL
    UNION ALL
    SELECT request_id, position, sender_id, sender_account, basis FROM stores
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
;

-- Possible sources of a collision whose matched block no event names (rule block_hash_collision flagged
-- the request, prefix_sources has no colliding_block row for it: it stored nothing and its content never
-- reached that cache, so the hash the engine matched is unknown): every block resident in the instance's
-- cache when the request was served could have been the one, so the requests that stored them are
-- possible sources (as the turnover horizon gives the stale-pages mechanism's). Resident: stored on the
-- instance before the request and neither removed (same hash) nor cleared since. Its storer: the latest
-- request on the instance with a block of that content, sent at most $store_window_s after the store.
-- The recipient's own account and the provider's internal accounts are never sources.
CREATE OR REPLACE TABLE prefix_possible_sources AS
WITH unattributed AS (
    SELECT r.request_id, r.ts, r.account_id, r.prefill_instance
    FROM requests r
    WHERE r.request_id IN (SELECT request_id FROM findings WHERE rule_id = 'block_hash_collision')
      AND r.request_id NOT IN (SELECT request_id FROM prefix_sources WHERE basis = 'colliding_block')
), held AS (
    -- per recipient, each hash's last store on its instance before it
    SELECT * FROM (
        SELECT u.request_id, u.ts, u.account_id, u.prefill_instance, e.block_hash, e.block_fp, e.ts AS stored_ts,
               e.batch, e.seq,
               row_number() OVER (PARTITION BY u.request_id, e.block_hash
                                  ORDER BY e.ts DESC NULLS LAST, e.batch DESC NULLS LAST, e.seq DESC NULLS LAST) AS latest
        FROM unattributed u
        JOIN kv_events e ON e.instance = u.prefill_instance AND e.kind = 'stored' AND e.ts < u.ts) l
    WHERE latest = 1
), dropped AS (
    -- a removal of that hash, or a clear of the cache, after that store and before the request
    SELECT h.request_id, h.block_hash
    FROM held h
    JOIN kv_events x ON x.instance = h.prefill_instance AND x.kind = 'removed' AND x.block_hash = h.block_hash
    WHERE x.ts < h.ts AND (x.ts > h.stored_ts OR (x.ts = h.stored_ts AND (x.batch > h.batch
                                                  OR (x.batch = h.batch AND x.seq > h.seq))))
    UNION
    SELECT h.request_id, h.block_hash
    FROM held h
    JOIN kv_events x ON x.instance = h.prefill_instance AND x.kind = 'cleared'
    WHERE x.ts < h.ts AND (x.ts > h.stored_ts OR (x.ts = h.stored_ts AND (x.batch > h.batch
                                                  OR (x.batch = h.batch AND x.seq > h.seq))))
), resident AS (
    SELECT h.* FROM held h
    WHERE NOT EXISTS (SELECT 1 FROM dropped d WHERE d.request_id = h.request_id AND d.block_hash = h.block_hash)
), storers AS (
    SELECT s.request_id, s.account_id AS recipient_account, p.request_id AS source_request_id,
           p.account_id AS source_account,
           row_number() OVER (PARTITION BY s.request_id, s.block_hash
                              ORDER BY p.ts DESC NULLS LAST, p.request_id NULLS LAST) AS latest
    FROM resident s
    JOIN request_blocks pb ON pb.block_fp = s.block_fp
    JOIN requests p ON p.request_id = pb.request_id AND p.prefill_instance = s.prefill_instance
    WHERE p.ts <= {{ add_milliseconds(s.stored_ts, 1000 * $store_window_s) }} AND p.request_id <> s.request_id
)
-- (the columns of possible_sources, whose stale-pages columns do not apply here, and the basis)
SELECT DISTINCT s.request_id AS affected_request_id, s.recipient_account AS recipient_account_id,
       s.source_request_id, s.source_account AS source_account_id, CAST(NULL AS STRING) AS kv_group,
       CAST(NULL AS BIGINT) AS tokens_written_since, CAST(NULL AS BIGINT) AS pool_tokens,
       'resident_on_instance' AS basis
FROM storers s
WHERE s.latest = 1 AND s.source_account <> s.recipient_account
  AND s.source_account NOT IN (SELECT account_id FROM account_classes WHERE account_class = 'internal')
