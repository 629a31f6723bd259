-- The paths across tenants open on each hit's instance when it was served (table prefix_windows, the
-- prefix_reuse exposure windows): a CTE shared by the prefix_reuse rules, included with
-- {{ fragment('prefix_paths') }}.
-- Reads the CTE hits (request_id, ts, prefill_instance, ...) of the query that includes it.
-- Defines request_paths: one row per hit with
--   local_path      1 when the instance's own cache crossed tenants (no salt, a client's salt, a build that
--                   ignores the salt), else 0;
--   store_path      1 when it read a store whose keys drop the salt (an L3 / LMCache store), else 0;
--   collision_path  1 when its block hashes can collide (a weak hash), else 0;
--   undetermined    1 when no start-up covers the hit (no engine log, no instance) or the one that does
--                   could not be judged: every path counts then, and the gate says so (prefix_path_undetermined).
request_paths AS (
    SELECT h.request_id,
           max(CASE WHEN w.reach IN ('local', 'any') OR w.instance IS NULL THEN 1 ELSE 0 END) AS local_path,
           max(CASE WHEN w.reach IN ('shared_store', 'any') OR w.instance IS NULL THEN 1 ELSE 0 END) AS store_path,
           max(CASE WHEN w.reach IN ('collision', 'any') OR w.instance IS NULL THEN 1 ELSE 0 END) AS collision_path,
           max(CASE WHEN w.reach = 'any' OR w.instance IS NULL THEN 1 ELSE 0 END) AS undetermined
    FROM hits h
    LEFT JOIN prefix_windows w ON w.instance = h.prefill_instance
                              AND (w.valid_from IS NULL OR w.valid_from <= h.ts)
                              AND (w.valid_to IS NULL OR h.ts < w.valid_to)
    GROUP BY h.request_id
)
