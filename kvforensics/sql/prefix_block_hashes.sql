-- The hashes reused prefix-cache blocks were stored under, and what each hash held last before the
-- request that reused the block: CTEs shared by the block_hash_collision rule and sql/prefix_sources.sql,
-- included with {{ fragment('prefix_block_hashes') }}.
-- Reads the CTE reused (request_id, ts, prefill_instance, cache_salt, position, block_fp) of the query
-- that includes it: the blocks each request reused from the cache.
-- Defines held_hashes: per reused block and each hash its content was stored under on the request's
-- instance (a KV event storing the same content at the same chain position under the request's salt, at
-- any time: a block's hash does not change; without a salt on either side, under any salt), the block
-- stored under that hash last before the request: held_fp, held_ts, and latest = 1 on that store.
-- held_fp other than the block's own fingerprint: the engine matched another block under its hash.
held_hashes AS (
    SELECT u.request_id, u.position, u.block_fp, k.block_hash, e.block_fp AS held_fp, e.ts AS held_ts,
           row_number() OVER (PARTITION BY u.request_id, u.position, k.block_hash
                              ORDER BY e.ts DESC NULLS LAST, e.batch DESC NULLS LAST, e.seq DESC NULLS LAST) AS latest
    FROM reused u
    JOIN (SELECT DISTINCT instance, block_fp, position, salt, block_hash FROM kv_events WHERE kind = 'stored') k
      ON k.block_fp = u.block_fp AND k.position = u.position AND k.instance = u.prefill_instance
     AND (k.salt IS NULL OR u.cache_salt IS NULL OR k.salt = u.cache_salt)
    JOIN kv_events e ON e.kind = 'stored' AND e.block_hash = k.block_hash AND e.instance = u.prefill_instance
                    AND e.ts <= u.ts
)
