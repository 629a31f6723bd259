-- Who had sent each reused prefix-cache block before the request that reused it: CTEs shared by the
-- prefix_reuse rules and sql/prefix_sources.sql, included with {{ fragment('prefix_senders') }}.
-- Each prefix block's first send is kept per account, instance and salt, so a reused block is answered
-- by lookups of a bounded size, never by a join to every earlier send of its prefix (a provider-wide
-- system prompt or a public template is sent by thousands of requests).
-- Reads two CTEs of the query that includes it:
--   reused (request_id, ts, account_id, model, prefill_instance, cache_salt, position, chain_fp): the
--     blocks each request reused from the cache;
--   internal (account_id): the provider's own accounts.
-- Defines block_senders: one row per reused block that an earlier request of the same model sent (same
-- position and chain_fp: the same prefix up to the block), with
--   benign     1 when the requester's own account, an internal account or a shared namespace ([prefix_cache]
--              shared_namespaces) had sent it before, else 0;
--   any_local  1 when a request on the requester's prefill_instance under its cache_salt (NULL equal to
--              NULL) had sent it before: its own cache; else 0;
--   first_id, first_account, first_salt   the earliest earlier send, on any instance of the model;
--   local_id, local_account, local_salt   the earliest earlier send on its own cache (NULL without one);
--   store_id, store_account, store_salt   the earliest earlier send on an instance whose start-up then had a store
--              whose keys drop the salt (prefix_windows reach shared_store or any, or no start-up judges it): its
--              first write to that store, which keeps a key's first write (NULL without one);
--   store_benign 1 when that writer is the requester's own account, an internal account or a shared namespace.
-- Earliest is by ts, then request id.
prefix_sends AS (
    -- every send of a prefix block some request reused
    SELECT e.model, eb.position, eb.chain_fp, e.account_id, e.prefill_instance, e.cache_salt, e.ts, e.request_id
    FROM request_blocks eb
    JOIN requests e ON e.request_id = eb.request_id
    WHERE EXISTS (SELECT 1 FROM reused x
                  WHERE x.chain_fp = eb.chain_fp AND x.position = eb.position AND x.model = e.model)
), first_sends AS (
    -- each prefix block's first send per account, instance and salt
    SELECT model, position, chain_fp, account_id, prefill_instance, cache_salt, ts, request_id
    FROM (SELECT s.*, row_number() OVER (PARTITION BY s.model, s.position, s.chain_fp, s.account_id,
                                                      s.prefill_instance, s.cache_salt
                                         ORDER BY s.ts NULLS LAST, s.request_id NULLS LAST) AS pick
          FROM prefix_sends s) f
    WHERE pick = 1
), first_any AS (
    SELECT model, position, chain_fp, account_id, cache_salt, ts, request_id
    FROM (SELECT f.*, row_number() OVER (PARTITION BY f.model, f.position, f.chain_fp
                                         ORDER BY f.ts NULLS LAST, f.request_id NULLS LAST) AS pick
          FROM first_sends f) a
    WHERE pick = 1
), first_local AS (
    SELECT model, position, chain_fp, prefill_instance, cache_salt, account_id, ts, request_id
    FROM (SELECT f.*, row_number() OVER (PARTITION BY f.model, f.position, f.chain_fp, f.prefill_instance,
                                                      f.cache_salt
                                         ORDER BY f.ts NULLS LAST, f.request_id NULLS LAST) AS pick
          FROM first_sends f) l
    WHERE pick = 1
), first_by_account AS (
    SELECT model, position, chain_fp, account_id, min(ts) AS ts
    FROM first_sends GROUP BY model, position, chain_fp, account_id
), first_internal AS (
    -- the first send by an internal account, or under a namespace the provider documents as shared by every
    -- tenant ([prefix_cache] shared_namespaces: a public playground): its blocks are nobody's data
    SELECT f.model, f.position, f.chain_fp, min(f.ts) AS ts
    FROM first_sends f
    WHERE f.account_id IN (SELECT account_id FROM internal)
       OR EXISTS (SELECT 1 FROM prefix_shared_namespaces n WHERE {{ glob_match(f.cache_salt, n.pattern) }})
    GROUP BY f.model, f.position, f.chain_fp
), store_sends AS (
    -- sends on an instance whose start-up then had a store whose keys drop the salt, or that no start-up covers
    SELECT s.model, s.position, s.chain_fp, s.account_id, s.cache_salt, s.ts, s.request_id
    FROM prefix_sends s
    WHERE EXISTS (SELECT 1 FROM prefix_windows w
                  WHERE w.instance = s.prefill_instance AND w.reach IN ('shared_store', 'any')
                    AND (w.valid_from IS NULL OR w.valid_from <= s.ts) AND (w.valid_to IS NULL OR s.ts < w.valid_to))
       OR NOT EXISTS (SELECT 1 FROM prefix_windows w
                      WHERE w.instance = s.prefill_instance
                        AND (w.valid_from IS NULL OR w.valid_from <= s.ts) AND (w.valid_to IS NULL OR s.ts < w.valid_to))
), first_store AS (
    SELECT model, position, chain_fp, account_id, cache_salt, ts, request_id
    FROM (SELECT s.*, row_number() OVER (PARTITION BY s.model, s.position, s.chain_fp
                                         ORDER BY s.ts NULLS LAST, s.request_id NULLS LAST) AS pick
          FROM store_sends s) f
    WHERE pick = 1
), block_senders AS (
    SELECT u.request_id, u.position,
           CASE WHEN o.ts < u.ts OR n.ts < u.ts THEN 1 ELSE 0 END AS benign,
           CASE WHEN l.ts IS NOT NULL THEN 1 ELSE 0 END AS any_local,
           a.request_id AS first_id, a.account_id AS first_account, a.cache_salt AS first_salt,
           l.request_id AS local_id, l.account_id AS local_account, l.cache_salt AS local_salt,
           st.request_id AS store_id, st.account_id AS store_account, st.cache_salt AS store_salt,
           CASE WHEN st.account_id = u.account_id OR st.account_id IN (SELECT account_id FROM internal)
                     OR EXISTS (SELECT 1 FROM prefix_shared_namespaces n WHERE {{ glob_match(st.cache_salt, n.pattern) }})
                THEN 1 ELSE 0 END AS store_benign
    FROM reused u
    JOIN first_any a ON a.model = u.model AND a.position = u.position AND a.chain_fp = u.chain_fp AND a.ts < u.ts
    LEFT JOIN first_local l ON l.model = u.model AND l.position = u.position AND l.chain_fp = u.chain_fp
                           AND l.prefill_instance = u.prefill_instance
                           AND l.cache_salt IS NOT DISTINCT FROM u.cache_salt AND l.ts < u.ts
    LEFT JOIN first_by_account o ON o.model = u.model AND o.position = u.position AND o.chain_fp = u.chain_fp
                                AND o.account_id = u.account_id
    LEFT JOIN first_internal n ON n.model = u.model AND n.position = u.position AND n.chain_fp = u.chain_fp
    LEFT JOIN first_store st ON st.model = u.model AND st.position = u.position AND st.chain_fp = u.chain_fp
                            AND st.ts < u.ts
)
