-- A request whose prefix-cache hit reused a block with a different content under the same
-- block hash: a collision in the engine's block keys (a predictable or truncated hash), so the
-- request was computed on another prompt's KV. The reused blocks are the prompt's leading blocks its
-- cached_tokens cover (request_blocks); the block hashes come from the KV-cache events (kv_events).
-- The block the engine matched for the last reused block is read from the request's own store: the
-- first block it computed (position = reused blocks, its block fingerprint, on its instance, from
-- $store_window_s before to $store_window_s after the request) names the hash of its parent, and the
-- latest block stored under that hash before is what was reused. Its fingerprint differs from the
-- request's block at that position: a collision. Also flagged: a reused block whose fingerprint the
-- events stored under a hash that, last before the request on its instance, held another fingerprint,
-- and a reused block whose prefix no earlier request sent at all and whose content the events of its
-- instance (covering the request's time) never stored before it (the request stored nothing itself).
-- Every basis counts only where the request's start-up hashed blocks with an algorithm that allows
-- collisions (prefix_windows path weak_hash): a SHA-256 chain gives no collision to find, so a block
-- fingerprint that seems to differ there is a matching artefact (two requests whose next block is the same
-- after different blocks, a probe's candidates), never a finding. Where no start-up says, the last basis
-- (absence of evidence) is weak; the first two are one hash seen with two contents.
-- Output: request_id, strength ('strong' | 'weak'), evidence (JSON). One row per request.
WITH hits AS (
    SELECT request_id, ts, prefill_instance, cache_salt, cached_tokens
    FROM requests
    WHERE cached_tokens > 0
), blocks AS (
    SELECT request_id, position, block_fp, chain_fp,
           sum(num_tokens) OVER (PARTITION BY request_id ORDER BY position NULLS LAST
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS end_token
    FROM request_blocks
), reused AS (
    SELECT h.request_id, h.ts, h.prefill_instance, h.cache_salt, b.position, b.block_fp, b.chain_fp
    FROM hits h JOIN blocks b ON b.request_id = h.request_id
    WHERE b.end_token <= h.cached_tokens
), last_reused AS (
    SELECT request_id, ts, prefill_instance, block_fp, position,
           row_number() OVER (PARTITION BY request_id ORDER BY position DESC NULLS LAST) AS pick
    FROM reused
), own_store AS (
    -- the request's first computed block, stored on its instance: its parent is the matched hash
    SELECT l.request_id, l.ts, l.prefill_instance, l.position, l.block_fp, k.parent_block_hash, k.batch, k.seq,
           k.ts AS stored_ts,
           row_number() OVER (PARTITION BY l.request_id ORDER BY k.ts NULLS LAST, k.batch NULLS LAST,
                                                                k.seq NULLS LAST) AS pick
    FROM last_reused l
    JOIN blocks nb ON nb.request_id = l.request_id AND nb.position = l.position + 1
    -- (not by position: the events number a chain from the block it hangs on, a colliding one's too)
    JOIN kv_events k ON k.instance = l.prefill_instance AND k.kind = 'stored' AND k.block_fp = nb.block_fp
    WHERE l.pick = 1 AND k.parent_block_hash IS NOT NULL
      AND k.ts >= {{ add_milliseconds(l.ts, -1000 * $store_window_s) }}
      AND k.ts <= {{ add_milliseconds(l.ts, 1000 * $store_window_s) }}
), matched AS (
    SELECT o.request_id, o.position, o.block_fp, e.block_fp AS matched_fp,
           row_number() OVER (PARTITION BY o.request_id ORDER BY e.ts DESC NULLS LAST, e.batch DESC NULLS LAST,
                                                                e.seq DESC NULLS LAST) AS latest
    FROM own_store o
    JOIN kv_events e ON e.instance = o.prefill_instance AND e.kind = 'stored' AND e.block_hash = o.parent_block_hash
    WHERE o.pick = 1 AND (e.ts < o.stored_ts OR (e.ts = o.stored_ts AND (e.batch < o.batch
                                                 OR (e.batch = o.batch AND e.seq < o.seq))))
), by_own_store AS (
    SELECT request_id, position, 1 AS priority, 'parent_of_own_store' AS basis
    FROM matched WHERE latest = 1 AND matched_fp <> block_fp
), {{ fragment('prefix_block_hashes') }}, by_hash AS (
    SELECT request_id, min(position) AS position, 2 AS priority, 'same_hash_other_fingerprint' AS basis
    FROM held_hashes WHERE latest = 1 AND held_fp <> block_fp
    GROUP BY request_id
), colliding_hashes AS (
    SELECT instance, count(*) AS hashes
    FROM (SELECT instance, block_hash FROM kv_events WHERE kind = 'stored' AND block_fp IS NOT NULL
          GROUP BY instance, block_hash HAVING count(DISTINCT block_fp) > 1) c
    GROUP BY instance
), first_sent AS (
    -- when each prefix (up to a block) was first sent, by any request
    SELECT eb.chain_fp, eb.position, min(e.ts) AS first_ts
    FROM request_blocks eb JOIN requests e ON e.request_id = eb.request_id
    GROUP BY eb.chain_fp, eb.position
), unexplained AS (
    -- reused blocks whose prefix no earlier request sent anywhere: the cache held no such prefix
    SELECT u.request_id, u.prefill_instance, min(u.position) AS position
    FROM reused u
    JOIN first_sent f ON f.chain_fp = u.chain_fp AND f.position = u.position
    WHERE f.first_ts >= u.ts
    GROUP BY u.request_id, u.prefill_instance
), first_stored AS (
    SELECT instance, block_fp, min(ts) AS first_ts FROM kv_events WHERE kind = 'stored' GROUP BY instance, block_fp
), instance_events AS (
    SELECT instance, min(ts) AS first_ts, max(ts) AS last_ts FROM kv_events GROUP BY instance
), {{ fragment('prefix_paths') }}, by_unexplained AS (
    -- and the events of its instance, which cover the request's time, never stored that block before
    -- it: the cache held no such block, so the engine matched another under the same hash
    SELECT x.request_id, x.position, 3 AS priority, 'hit_on_a_block_never_stored' AS basis
    FROM unexplained x
    JOIN hits h ON h.request_id = x.request_id
    JOIN reused u ON u.request_id = x.request_id AND u.position = x.position
    JOIN instance_events i ON i.instance = x.prefill_instance AND i.first_ts < h.ts AND h.ts < i.last_ts
    LEFT JOIN first_stored s ON s.instance = x.prefill_instance AND s.block_fp = u.block_fp
    -- absence of evidence proves a collision only where the block hash allows one (a weak hash)
    JOIN request_paths p ON p.request_id = x.request_id AND p.collision_path = 1
    WHERE s.first_ts IS NULL OR s.first_ts >= h.ts
), found AS (
    SELECT * FROM by_own_store
    UNION ALL SELECT * FROM by_hash
    UNION ALL SELECT * FROM by_unexplained
), ranked AS (
    SELECT f.*, row_number() OVER (PARTITION BY f.request_id ORDER BY f.priority NULLS LAST) AS pick
    FROM found f
)
SELECT h.request_id,
       CASE WHEN r.basis = 'hit_on_a_block_never_stored' AND p.undetermined = 1 THEN 'weak' ELSE 'strong' END
           AS strength,
       {{ json_object('basis', r.basis, 'instance', h.prefill_instance, 'cached_tokens', h.cached_tokens,
                      'colliding_block', r.position, 'hashes_with_several_contents', coalesce(c.hashes, 0)) }}
           AS evidence
FROM ranked r
JOIN hits h ON h.request_id = r.request_id
JOIN request_paths p ON p.request_id = r.request_id AND p.collision_path = 1
LEFT JOIN colliding_hashes c ON c.instance = h.prefill_instance
WHERE r.pick = 1
