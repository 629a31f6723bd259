-- PROTOTYPE (benchmarks only, not kvforensics): the possible sources of sql/scope.sql, computed on
-- the part of the timeline that can matter and joined without a per-group blow-up. Needs kv_writes
-- and group_pools as scope.sql builds them. Parameters: $horizon_factor.
--  * only groups (decode instances) that hold an affected response, and only their events up to
--    the group's last affected allocation: a cumulative sum at an event depends only on earlier ones;
--  * positions and cumulative written tokens are numbered over all kept groups in one order
--    (group, t, marker, request_id), so "same group, freed before the allocation, fewer than
--    horizon tokens written since" becomes three inequalities on two numbers (gpos, gcum): an
--    inequality join of a few hundred windows against the free events, with no equality on the
--    group that would pair every affected response with every request of its instance.
CREATE OR REPLACE TEMP TABLE proto_groups AS
SELECT kv_group, max(alloc_ts) AS last_alloc FROM kv_writes WHERE is_affected GROUP BY kv_group;

CREATE OR REPLACE TEMP TABLE proto_timeline AS
WITH ev AS (
    SELECT w.kv_group, w.alloc_ts AS t, 0 AS marker, w.written_tokens AS w, w.request_id, w.account_id, w.is_affected
    FROM kv_writes w JOIN proto_groups g ON g.kv_group = w.kv_group WHERE w.alloc_ts <= g.last_alloc
    UNION ALL
    SELECT w.kv_group, w.free_ts AS t, 1 AS marker, 0 AS w, w.request_id, w.account_id, w.is_affected
    FROM kv_writes w JOIN proto_groups g ON g.kv_group = w.kv_group WHERE w.free_ts <= g.last_alloc
)
SELECT *,
       row_number() OVER (ORDER BY kv_group, t, marker, request_id) AS gpos,
       sum(w) OVER (ORDER BY kv_group, t, marker, request_id ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS gcum
FROM ev;

CREATE OR REPLACE TEMP TABLE proto_windows AS
WITH starts AS (       -- per group: position and cumulative sum just before its first event
    SELECT kv_group, min(gpos) - 1 AS start_pos, min(gcum - w) AS start_cum FROM proto_timeline GROUP BY kv_group
), last_at_t AS (      -- frees at the allocation's instant sort after it and still count as before it
    SELECT kv_group, t, max(gpos) AS hi FROM proto_timeline GROUP BY kv_group, t
)
SELECT a.request_id, a.account_id, a.kv_group, p.pool_tokens,
       s.start_pos, l.hi,
       a.gcum - a.w - $horizon_factor * coalesce(p.pool_tokens, 0) AS lower_gcum,
       a.gcum - a.w - s.start_cum AS cum_before
FROM proto_timeline a
JOIN group_pools p ON p.request_id = a.request_id
JOIN starts s ON s.kv_group = a.kv_group
JOIN last_at_t l ON l.kv_group = a.kv_group AND l.t = a.t
WHERE a.marker = 0 AND a.is_affected;

CREATE OR REPLACE TABLE proto_possible_sources AS
SELECT a.request_id AS affected_request_id, a.account_id AS recipient_account_id,
       f.request_id AS source_request_id, f.account_id AS source_account_id, a.kv_group,
       a.cum_before - (f.gcum - st.start_cum) AS tokens_written_since, a.pool_tokens
FROM proto_windows a
JOIN proto_timeline f
  ON f.gpos <= a.hi AND f.gcum > a.lower_gcum AND f.gpos > a.start_pos
JOIN (SELECT kv_group, min(gcum - w) AS start_cum FROM proto_timeline GROUP BY kv_group) st
  ON st.kv_group = a.kv_group
WHERE f.marker = 1 AND NOT f.is_affected AND f.request_id <> a.request_id;
