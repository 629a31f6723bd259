-- A request whose prefix-cache hit reused blocks that, on a cache it could read, only other
-- tenants had stored. The reused blocks are the prompt's leading blocks (request_blocks) that its
-- cached_tokens cover. A block is foreign when an earlier request of another account sent the same
-- prefix up to that block (equal chain_fp) and neither the requester's own account nor one of the
-- provider's internal accounts ([scope] internal_accounts: a shared system prompt) had sent it before.
-- The store it came from: the earliest such request on the request's own instance under the same salt
-- (its own cache), else (a hit nothing there explains, or $shared_store) the store whose keys drop the salt: its
-- entry is the earliest send on an instance that then had it, foreign when another account's (not internal, not a
-- shared namespace) and the requester's namespace had not sent the block on its own instance.
-- Weak, from cached_tokens alone: a hit of at least $min_cached_tokens on a request whose blocks
-- are unknown or unexplained, whose account never had that many tokens in the model's cache before (a prompt and
-- its output: an engine caches both when a request finishes, and a conversation's next turn hits them), that
-- no internal account could have stored, and whose length fewer than $shared_length_accounts
-- accounts' unexplained hits share (a prefix every tenant gets from the cache is a shared one).
-- Only through a path across tenants open on the request's instance when it was served (prefix_windows,
-- sql/prefix_paths.sql): its own cache (no salt, a client's salt, a build that ignores it) for a store on
-- its instance, a store whose keys drop the salt for one on any instance; with no start-up to judge, both.
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
), {{ fragment('prefix_senders') }}, {{ fragment('prefix_paths') }}, stores AS (
    -- each foreign block's store, through a path open on the requester's instance then (prefix_windows):
    -- the earliest send on its own cache (instance and salt) when that cache crossed tenants, else (nothing
    -- there explains it, or $shared_store) the earliest on any instance of the model when a store whose
    -- keys drop the salt was in force
    -- (through a store whose keys drop the salt, the block is the store's entry: its first writer's, the earliest
    -- send on an instance that had the store, foreign unless that is the requester's account, an internal one or a
    -- shared namespace; never when the requester's own namespace had sent it on that instance, its own cache)
    SELECT s.request_id, s.position,
           CASE WHEN s.any_local = 1 AND p.local_path = 1 AND NOT $shared_store THEN 1 ELSE 0 END AS any_local,
           CASE WHEN s.any_local = 1 AND p.local_path = 1 AND NOT $shared_store THEN s.local_account
                WHEN p.store_path = 1 OR $shared_store THEN s.store_account
                ELSE s.first_account END AS sender_account
    FROM block_senders s JOIN request_paths p ON p.request_id = s.request_id
    WHERE CASE WHEN s.any_local = 1 AND p.local_path = 1 AND NOT $shared_store THEN s.benign = 0
               WHEN p.store_path = 1 OR $shared_store
               THEN s.store_id IS NOT NULL AND s.store_benign = 0 AND s.any_local = 0
               ELSE p.local_path = 1 AND s.benign = 0 END
), foreign_blocks AS (
    SELECT request_id, count(*) AS blocks, min(position) AS first_position, max(position) AS last_position,
           count(DISTINCT sender_account) AS source_accounts, min(any_local) AS all_local
    FROM stores GROUP BY request_id
), explained AS (
    SELECT request_id FROM block_senders GROUP BY request_id
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
), earlier_own AS (
    -- per account, model and arrival time, the longest prompt the account sent on the model strictly before
    -- it: the running maximum over the earlier arrival times (one row per time, so requests that arrived
    -- together are not each other's "before"); a correlated NOT EXISTS on the time was quadratic in the
    -- account's requests. A prompt's length counts with its output's (completion_tokens, 0 when not logged)
    SELECT account_id, model, ts,
           max(longest) OVER (PARTITION BY account_id, model ORDER BY ts NULLS LAST
                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS longest_before
    FROM (SELECT account_id, model, ts, max(prompt_tokens + coalesce(completion_tokens, 0)) AS longest
          FROM requests WHERE ts IS NOT NULL GROUP BY account_id, model, ts) t
), internal_times AS (
    -- per model, the internal accounts' longest prompt at each time, beside the unexplained hits' times
    SELECT o.model, o.ts, max(o.prompt_tokens + coalesce(o.completion_tokens, 0)) AS longest
    FROM requests o JOIN internal i ON i.account_id = o.account_id
    WHERE o.ts IS NOT NULL GROUP BY o.model, o.ts
    UNION ALL
    SELECT model, ts, NULL AS longest FROM unexplained WHERE ts IS NOT NULL
), earlier_internal AS (
    -- per model and time, the longest prompt an internal account sent on the model strictly before it
    SELECT model, ts,
           max(longest) OVER (PARTITION BY model ORDER BY ts NULLS LAST
                              ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS longest_before
    FROM (SELECT model, ts, max(longest) AS longest FROM internal_times GROUP BY model, ts) t
), first_time AS (
    -- a hit whose account never had that many tokens cached on the model before (prompt and output), and that no
    -- internal account could have stored (no internal prompt and output that long on the model before it)
    SELECT u.request_id, u.account_id, u.model, u.cached_tokens
    FROM unexplained u
    LEFT JOIN earlier_own e ON e.account_id = u.account_id AND e.model = u.model AND e.ts = u.ts
    LEFT JOIN earlier_internal n ON n.model = u.model AND n.ts = u.ts
    WHERE NOT coalesce(e.longest_before >= u.cached_tokens, false)
      AND NOT coalesce(n.longest_before >= u.cached_tokens, false)
), lengths AS (
    SELECT model, cached_tokens, count(DISTINCT account_id) AS accounts FROM first_time GROUP BY model, cached_tokens
), weak AS (
    SELECT f.request_id, 'weak' AS strength,
           {{ json_object('basis', 'cached_tokens_only', 'cached_tokens', f.cached_tokens,
                          'accounts_with_this_hit_length', l.accounts) }} AS evidence
    FROM first_time f JOIN lengths l ON l.model = f.model AND l.cached_tokens = f.cached_tokens
    JOIN request_paths p ON p.request_id = f.request_id
    WHERE l.accounts < $shared_length_accounts AND (p.local_path = 1 OR p.store_path = 1)
      AND NOT EXISTS (SELECT 1 FROM strong s WHERE s.request_id = f.request_id)
)
SELECT request_id, strength, evidence FROM strong
UNION ALL
SELECT request_id, strength, evidence FROM weak
