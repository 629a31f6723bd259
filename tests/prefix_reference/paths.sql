-- Reference for tests/test_prefix_scale.py: the paths CTE body the other references include (direct_paths).
    -- the paths across tenants open on each hit's instance when it was served, written directly: a start-up's
    -- window (prefix_windows) covering the hit; none (no start-up to judge) opens every path
    SELECT h.request_id,
           CASE WHEN NOT EXISTS (SELECT 1 FROM prefix_windows w WHERE w.instance = h.prefill_instance
                                   AND (w.valid_from IS NULL OR w.valid_from <= h.ts)
                                   AND (w.valid_to IS NULL OR h.ts < w.valid_to))
                  OR EXISTS (SELECT 1 FROM prefix_windows w WHERE w.instance = h.prefill_instance
                                   AND (w.valid_from IS NULL OR w.valid_from <= h.ts)
                                   AND (w.valid_to IS NULL OR h.ts < w.valid_to) AND w.reach IN ('local', 'any'))
                THEN 1 ELSE 0 END AS local_path,
           CASE WHEN NOT EXISTS (SELECT 1 FROM prefix_windows w WHERE w.instance = h.prefill_instance
                                   AND (w.valid_from IS NULL OR w.valid_from <= h.ts)
                                   AND (w.valid_to IS NULL OR h.ts < w.valid_to))
                  OR EXISTS (SELECT 1 FROM prefix_windows w WHERE w.instance = h.prefill_instance
                                   AND (w.valid_from IS NULL OR w.valid_from <= h.ts)
                                   AND (w.valid_to IS NULL OR h.ts < w.valid_to)
                                   AND w.reach IN ('shared_store', 'any'))
                THEN 1 ELSE 0 END AS store_path
    FROM hits h
