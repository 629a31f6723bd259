-- Loads from a shared KV store of pages another namespace wrote there, and the response each load served:
-- CTEs shared by the cross_tenant_store_load rule and sql/prefix_sources.sql, included with
-- {{ fragment('prefix_store_loads') }}. The method is the rule's (its SQL file's header).
-- Reads the CTE internal (account_id) of the query that includes it: the provider's own accounts.
-- The including query's WITH must be WITH RECURSIVE (load_paths follows the loaded pages' parents).
-- Parameters: $load_window_s, $clock_skew_s.
-- A load is one chain of pages: the pages one namespace loaded at one moment on one instance, from a page
-- no other of them is the parent of (its leaf) up through their parent hashes. Two requests of one
-- namespace whose loads an engine publishes in one batch (one scheduler step) are two loads, each matched
-- to its own request; a prefix two of them share counts in both.
-- An engine that publishes no host store (vLLM: a KV connector's load, LMCache's, is cached with the blocks
-- the step computed, in one device store of the requester's namespace, vllm/v1/core/block_pool.py
-- cache_full_blocks; LMCache publishes its saves, never its loads) shows a load as a device store of pages the
-- instance held nowhere: one event, loaded and computed pages alike. Its loaded pages are those the request it
-- served had cached (its cached_tokens cover them): tokens served from a cache the instance did not hold. Such
-- an event's pages are a load only on an instance whose events hold no host store (CPU_PINNED), so HiCache's
-- computed pages (a device store, then its backup) never are.
-- Defines, among others:
--   foreign_pages (instance, ts, salt, leaf, position, num_tokens, chain_fp, owner_salt, owner_instance,
--     written): each page of each load whose content another namespace wrote first to the store
--     (owner_salt, on owner_instance at written);
--   load_requests (instance, ts, salt, leaf, pages, last_position, tokens, owners, request_id,
--     cached_tokens, matched_by, candidates, unsized, nearest): the requests of the loading namespace near
--     each load (matched_by: 'prefix_end' or 'arrival'; candidates: how many; unsized: the successful ones
--     among them without cached_tokens); nearest = 1 on the one it served.
ordered AS (
    -- every event of an instance in publication order
    SELECT instance, ts, kind, block_hash, parent_block_hash, medium, salt, position, num_tokens, chain_fp,
           source_file, batch, seq,
           row_number() OVER (PARTITION BY instance ORDER BY ts NULLS LAST, batch NULLS LAST, seq NULLS LAST,
                                                         block_hash NULLS LAST) AS ord
    FROM kv_events
), cleared AS (
    -- the instance's last clear at or before each event
    SELECT o.*,
           max(CASE WHEN o.kind = 'cleared' THEN o.ord END) OVER (PARTITION BY o.instance ORDER BY o.ord
                                                                  ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
               AS cleared_ord
    FROM ordered o
), startups AS (
    SELECT instance, valid_from, valid_to,
           max(CASE WHEN reach IN ('shared_store', 'any') THEN 1 ELSE 0 END) AS shared_store,
           max(model) AS model
    FROM prefix_windows GROUP BY instance, valid_from, valid_to
), blocks AS (
    -- block events with the start of their instance's start-up (its caches begin empty), the previous
    -- event of the same hash on the device and in host memory
    SELECT c.*,
           max(CASE WHEN c.medium IS NULL OR c.medium = 'GPU' THEN c.ord END)
               OVER (PARTITION BY c.instance, c.block_hash ORDER BY c.ord
                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_device,
           max(CASE WHEN c.medium = 'CPU_PINNED' THEN c.ord END)
               OVER (PARTITION BY c.instance, c.block_hash ORDER BY c.ord
                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_host
    FROM cleared c
    WHERE c.kind IN ('stored', 'removed') AND c.block_hash IS NOT NULL
), placed AS (
    SELECT b.*, s.valid_from AS started, s.shared_store, s.model,
           CASE WHEN s.instance IS NULL THEN 1 ELSE 0 END AS no_startup
    FROM blocks b
    LEFT JOIN startups s ON s.instance = b.instance
                        AND (s.valid_from IS NULL OR s.valid_from <= b.ts) AND (s.valid_to IS NULL OR b.ts < s.valid_to)
), held AS (
    -- is the page on the device / in host memory just before this event (stored since the start-up and
    -- the last clear, not removed since)?
    SELECT p.*,
           CASE WHEN d.kind = 'stored' AND d.ord > coalesce(p.cleared_ord, 0)
                     AND (p.started IS NULL OR d.ts >= p.started) THEN 1 ELSE 0 END AS on_device,
           CASE WHEN h.kind = 'stored' AND h.ord > coalesce(p.cleared_ord, 0)
                     AND (p.started IS NULL OR h.ts >= p.started) THEN 1 ELSE 0 END AS in_host
    FROM placed p
    LEFT JOIN ordered d ON d.instance = p.instance AND d.ord = p.prev_device
    LEFT JOIN ordered h ON h.instance = p.instance AND h.ord = p.prev_host
), load_pages AS (
    -- host stores of pages held nowhere: read from the shared store
    SELECT instance, ts, salt, block_hash, parent_block_hash, position, num_tokens, chain_fp, model
    FROM held
    WHERE kind = 'stored' AND medium = 'CPU_PINNED' AND on_device = 0 AND in_host = 0
      AND chain_fp IS NOT NULL AND salt IS NOT NULL
), host_publishers AS (
    -- instances whose engine publishes host stores: a load from the store shows there as one
    SELECT DISTINCT instance FROM kv_events WHERE medium = 'CPU_PINNED'
), device_pages AS (
    -- elsewhere, device stores of pages held nowhere while a store whose keys drop the salt was in force (or no
    -- start-up says): computed, or loaded from the store; each event's pages in chain order
    SELECT instance, ts, salt, source_file, batch, seq, block_hash, position, num_tokens, chain_fp, model,
           row_number() OVER (PARTITION BY instance, ts, salt, source_file, batch, seq
                              ORDER BY position DESC NULLS LAST, block_hash NULLS LAST) AS from_end
    FROM held
    WHERE kind = 'stored' AND (medium IS NULL OR medium = 'GPU') AND on_device = 0
      AND (shared_store = 1 OR no_startup = 1) AND chain_fp IS NOT NULL AND salt IS NOT NULL
      AND position IS NOT NULL AND num_tokens IS NOT NULL
      AND instance NOT IN (SELECT instance FROM host_publishers)
), instance_steps AS (
    -- each moment an instance published at, and the one before it: a scheduler step and the step before
    SELECT instance, ts, lag(ts) OVER (PARTITION BY instance ORDER BY ts) AS prev_ts
    FROM (SELECT DISTINCT instance, ts FROM kv_events WHERE ts IS NOT NULL) t
), device_events AS (
    -- one device store event: its first page, the tokens up to its last page, its last page (the event's leaf),
    -- its rank among its namespace's events of that moment, and the moment the instance published before
    SELECT e.*, st.prev_ts
    FROM (SELECT instance, ts, salt, source_file, batch, seq, min(position) AS first_position,
                 max(num_tokens) AS block_tokens, (max(position) + 1) * max(num_tokens) AS end_tokens,
                 max(CASE WHEN from_end = 1 THEN block_hash END) AS leaf,
                 row_number() OVER (PARTITION BY instance, ts, salt
                                    ORDER BY source_file NULLS LAST, batch NULLS LAST, seq NULLS LAST) AS ev_rank
          FROM device_pages
          GROUP BY instance, ts, salt, source_file, batch, seq) e
    LEFT JOIN instance_steps st ON st.instance = e.instance AND st.ts = e.ts
), device_candidates AS (
    -- the requests of its namespace on the instance, from $load_window_s before each event to $clock_skew_s after,
    -- that the engine worked on (not refused); those that arrived since the instance's previous moment and had a
    -- full block of their prompt to compute (a request whose cached_tokens cover every full block stores
    -- nothing) are new in its step, numbered by arrival (a step takes its new requests in order: the n-th event
    -- of a namespace in a step is most likely its n-th new request's)
    SELECT c.*,
           CASE WHEN c.is_new = 1
                THEN sum(c.is_new) OVER (PARTITION BY c.instance, c.ts, c.salt, c.source_file, c.batch, c.seq
                                         ORDER BY c.arrived NULLS LAST, c.request_id NULLS LAST
                                         ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) END AS new_rank
    FROM (SELECT d.instance, d.ts, d.salt, d.source_file, d.batch, d.seq, d.leaf, d.first_position, d.block_tokens,
                 d.end_tokens, d.ev_rank, r.request_id, r.ts AS arrived, r.cached_tokens, r.prompt_tokens,
                 r.completion_tokens,
                 CASE WHEN r.ts <= d.ts AND (d.prev_ts IS NULL OR r.ts > d.prev_ts)
                           AND (r.cached_tokens IS NULL OR r.prompt_tokens IS NULL
                                OR r.cached_tokens < floor(r.prompt_tokens / d.block_tokens) * d.block_tokens)
                      THEN 1 ELSE 0 END AS is_new
          FROM device_events d
          JOIN requests r ON r.prefill_instance = d.instance AND r.cache_salt = d.salt
                         AND r.ts >= {{ add_milliseconds(d.ts, -1000 * $load_window_s) }}
                         AND r.ts <= {{ add_milliseconds(d.ts, 1000 * $clock_skew_s) }}
                         AND (r.status IS NULL OR r.status NOT BETWEEN 400 AND 498)) c
), device_claims AS (
    -- the request each such event stored the prompt of, by preference: its cached_tokens cover the pages before
    -- the event's first (held, so they were hits); its prompt (and output: a finished request's pages) holds the
    -- event's pages; new in the event's step, the one whose number among them is the event's among its
    -- namespace's events there; the last to arrive before the event, else (clocks apart) the first after it
    SELECT instance, ts, salt, source_file, batch, seq, leaf, cached_tokens, request_id,
           row_number() OVER (PARTITION BY instance, ts, salt, source_file, batch, seq
                              ORDER BY CASE WHEN cached_tokens < first_position * block_tokens THEN 1 ELSE 0 END,
                                       CASE WHEN prompt_tokens IS NULL
                                                 OR prompt_tokens + coalesce(completion_tokens, 0) >= end_tokens
                                            THEN 0 ELSE 1 END,
                                       CASE WHEN is_new = 1 THEN 0 ELSE 1 END,
                                       abs(coalesce(new_rank, 0) - ev_rank),
                                       CASE WHEN arrived <= ts THEN 0 ELSE 1 END,
                                       abs({{ epoch_us(ts) }} - {{ epoch_us(arrived) }}) NULLS LAST,
                                       request_id NULLS LAST) AS pick
    FROM device_candidates
), device_claimed AS (
    -- each claimed event's pages; for a request that logs no cached_tokens (a client that disconnected, a streamed
    -- response without usage), whether the store held the page's content then: stored before the event on an
    -- instance whose start-up had the store (the store keeps what is written to it, as the owners below assume)
    SELECT p.instance, p.ts, p.salt, p.source_file, p.batch, p.seq, c.leaf, p.position, p.num_tokens, p.chain_fp,
           p.model, c.cached_tokens, c.request_id,
           CASE WHEN c.cached_tokens IS NOT NULL THEN NULL
                WHEN EXISTS (SELECT 1 FROM held w
                             WHERE w.chain_fp = p.chain_fp AND w.kind = 'stored' AND w.ts < p.ts
                               AND (w.shared_store = 1 OR w.no_startup = 1)
                               AND (w.model = p.model OR w.model IS NULL OR p.model IS NULL)) THEN 1
                ELSE 0 END AS in_store
    FROM device_pages p
    JOIN device_claims c ON c.instance = p.instance AND c.ts = p.ts AND c.salt = p.salt
                        AND c.source_file = p.source_file AND c.batch = p.batch AND c.seq = p.seq AND c.pick = 1
), device_unsized_ends AS (
    -- where the store's prefix of such an event ends: its first page the store did not hold
    SELECT instance, ts, salt, source_file, batch, seq, min(CASE WHEN in_store = 0 THEN position END) AS first_missing
    FROM device_claimed WHERE cached_tokens IS NULL
    GROUP BY instance, ts, salt, source_file, batch, seq
), device_loads AS (
    -- the pages of each claimed event its request had cached, loaded from the store; for a request that logs no
    -- cached_tokens, the event's leading pages the store held (the engine asks the store for the longest prefix
    -- it holds before it computes); the request claimed it
    SELECT p.instance, p.ts, p.salt, p.leaf, p.position, p.num_tokens, p.chain_fp, p.model, p.request_id AS claimed
    FROM device_claimed p
    LEFT JOIN device_unsized_ends e ON e.instance = p.instance AND e.ts = p.ts AND e.salt = p.salt
                                   AND e.source_file = p.source_file AND e.batch = p.batch AND e.seq = p.seq
    WHERE (p.position + 1) * p.num_tokens <= p.cached_tokens
       OR (p.cached_tokens IS NULL AND (e.first_missing IS NULL OR p.position < e.first_missing))
), load_links AS (
    SELECT DISTINCT instance, ts, salt, block_hash, parent_block_hash, position FROM load_pages
), load_paths AS (
    -- each load's leaf (a page no other page of the moment names as its parent), then its parents among
    -- the pages loaded at that moment, a position down at each step (so a cycle of colliding hashes ends;
    -- a loaded page's position is known: its chain_fp is)
    SELECT l.instance, l.ts, l.salt, l.block_hash AS leaf, l.block_hash, l.parent_block_hash, l.position
    FROM load_links l
    WHERE NOT EXISTS (SELECT 1 FROM load_links c
                      WHERE c.instance = l.instance AND c.ts = l.ts AND c.salt = l.salt
                        AND c.parent_block_hash = l.block_hash AND c.position = l.position + 1)
    UNION ALL
    SELECT p.instance, p.ts, p.salt, p.leaf, l.block_hash, l.parent_block_hash, l.position
    FROM load_paths p
    JOIN load_links l ON l.instance = p.instance AND l.ts = p.ts AND l.salt = p.salt
                     AND l.block_hash = p.parent_block_hash AND l.position = p.position - 1
), loads AS (
    -- each loaded page once per load it is on (every page is on one: the top of its chain is a leaf, and a
    -- page without a position is a leaf of its own); a device store's load keeps the request that claimed it
    SELECT DISTINCT l.instance, l.ts, l.salt, p.leaf, l.position, l.num_tokens, l.chain_fp, l.model,
           CAST(NULL AS STRING) AS claimed
    FROM load_pages l
    JOIN load_paths p ON p.instance = l.instance AND p.ts = l.ts AND p.salt = l.salt AND p.block_hash = l.block_hash
    UNION ALL
    SELECT instance, ts, salt, leaf, position, num_tokens, chain_fp, model, claimed FROM device_loads
), writes AS (
    -- pages the namespace computed (a device store of a page not in host memory) or backed up (a host
    -- store of a page on the device), on instances whose start-up had a shared store: pages put in the
    -- store. A device store of a page in host memory is a load (from host memory, or the second step of a
    -- load from the store), no computation; so is a device store's page its response had cached (device_loads).
    SELECT h.instance, h.ts, h.salt, h.chain_fp, h.model
    FROM held h
    WHERE h.kind = 'stored' AND h.chain_fp IS NOT NULL AND (h.shared_store = 1 OR h.no_startup = 1)
      AND ((h.medium = 'CPU_PINNED' AND h.on_device = 1)
           OR ((h.medium IS NULL OR h.medium <> 'CPU_PINNED') AND h.in_host = 0))
      AND NOT EXISTS (SELECT 1 FROM device_loads d
                      WHERE d.instance = h.instance AND d.ts = h.ts AND d.salt = h.salt AND d.chain_fp = h.chain_fp)
), first_writes AS (
    -- per content (and model), each namespace's first write, and where it was made
    SELECT chain_fp, model, salt, ts, instance
    FROM (SELECT w.*, row_number() OVER (PARTITION BY w.chain_fp, w.model, w.salt
                                         ORDER BY w.ts NULLS LAST, w.instance NULLS LAST) AS pick
          FROM writes w) f
    WHERE pick = 1
), owners AS (
    -- per loaded page, the namespace that wrote it first before the load: the store keeps the first write
    -- of a key (it checks that a key exists before it sets it), so that namespace's KV is what was read
    SELECT l.instance, l.ts, l.salt, l.leaf, l.position, l.num_tokens, l.chain_fp, f.salt AS owner_salt,
           f.ts AS written, f.instance AS owner_instance,
           row_number() OVER (PARTITION BY l.instance, l.ts, l.salt, l.leaf, l.chain_fp
                              ORDER BY f.ts NULLS LAST, f.salt NULLS LAST) AS first
    FROM loads l
    JOIN first_writes f ON f.chain_fp = l.chain_fp AND f.ts < l.ts
                       AND (f.model = l.model OR f.model IS NULL OR l.model IS NULL)
), salt_accounts AS (
    SELECT cache_salt, min(account_id) AS account_id FROM requests WHERE cache_salt IS NOT NULL GROUP BY cache_salt
), foreign_pages AS (
    SELECT o.*
    FROM owners o
    LEFT JOIN salt_accounts a ON a.cache_salt = o.owner_salt
    WHERE o.first = 1 AND o.owner_salt IS NOT NULL AND o.owner_salt <> o.salt
      AND NOT EXISTS (SELECT 1 FROM prefix_shared_namespaces n WHERE {{ glob_match(o.owner_salt, n.pattern) }})
      AND (a.account_id IS NULL OR a.account_id NOT IN (SELECT account_id FROM internal))
), load_extents AS (
    -- what each load put in host memory, foreign or not: the request it served had at least those tokens
    -- cached, and exactly the tokens up to its last page when the load ended its cached prefix
    SELECT instance, ts, salt, leaf, sum(num_tokens) AS loaded_tokens,
           (max(position) + 1) * max(num_tokens) AS prefix_tokens, max(claimed) AS claimed
    FROM loads GROUP BY instance, ts, salt, leaf
), load_groups AS (
    -- the foreign pages of each load
    SELECT f.instance, f.ts, f.salt, f.leaf, count(*) AS pages, max(f.position) AS last_position,
           sum(f.num_tokens) AS tokens, count(DISTINCT f.owner_salt) AS owners,
           any_value(e.loaded_tokens) AS loaded_tokens, any_value(e.prefix_tokens) AS prefix_tokens,
           any_value(e.claimed) AS claimed
    FROM foreign_pages f
    JOIN load_extents e ON e.instance = f.instance AND e.ts = f.ts AND e.salt = f.salt AND e.leaf = f.leaf
    GROUP BY f.instance, f.ts, f.salt, f.leaf
), load_moments AS (
    -- each moment a namespace's loads were published at on an instance, and its moment before there (its previous
    -- stores: a request of the namespace that arrived before that was served in an earlier step)
    SELECT g.instance, g.ts, g.salt, max(e.ts) AS prev_ts
    FROM (SELECT DISTINCT instance, ts, salt FROM load_groups) g
    LEFT JOIN kv_events e ON e.instance = g.instance AND e.salt = g.salt AND e.kind = 'stored' AND e.ts < g.ts
    GROUP BY g.instance, g.ts, g.salt
), load_requests AS (
    SELECT g.*, r.request_id, r.cached_tokens,
           -- how a response would be picked: its cached_tokens end with the load, else by arrival (the order below)
           CASE WHEN r.cached_tokens = g.prefix_tokens THEN 'prefix_end' ELSE 'arrival' END AS matched_by,
           -- the candidates, and the successful ones with no cached_tokens (a streamed response without usage):
           -- when the pick is by arrival, such a one could as well be the response the load served
           count(*) OVER (PARTITION BY g.instance, g.ts, g.salt, g.leaf) AS candidates,
           sum(CASE WHEN r.cached_tokens IS NULL AND r.status BETWEEN 200 AND 299 THEN 1 ELSE 0 END)
               OVER (PARTITION BY g.instance, g.ts, g.salt, g.leaf) AS unsized,
           row_number() OVER (PARTITION BY g.instance, g.ts, g.salt, g.leaf
                              -- the request a device store's load was claimed by (device_claims), then one
                              -- whose cached prefix ends with the load (of several that arrived before it, one
                              -- that arrived since its namespace's previous stores there, else served in an
                              -- earlier step; of those the first: it asked for the pages, the later ones hit the
                              -- copy it brought in), then the last to arrive before the load, else (clocks
                              -- apart) the first after it
                              ORDER BY CASE WHEN r.request_id = g.claimed THEN 0 ELSE 1 END,
                                       CASE WHEN r.cached_tokens = g.prefix_tokens THEN 0 ELSE 1 END,
                                       CASE WHEN r.ts <= g.ts THEN 0 ELSE 1 END,
                                       CASE WHEN r.cached_tokens = g.prefix_tokens AND r.ts <= g.ts
                                                 AND (m.prev_ts IS NULL OR r.ts > m.prev_ts) THEN 0 ELSE 1 END,
                                       CASE WHEN r.cached_tokens = g.prefix_tokens AND r.ts <= g.ts
                                            THEN {{ epoch_us(r.ts) }} END NULLS LAST,
                                       abs({{ epoch_us(g.ts) }} - {{ epoch_us(r.ts) }}) NULLS LAST,
                                       r.request_id NULLS LAST) AS nearest
    FROM load_groups g
    -- (a response the client did not get, e.g. a disconnect, may carry no usage: cached_tokens NULL)
    JOIN requests r ON r.prefill_instance = g.instance AND r.cache_salt = g.salt
                   AND r.ts >= {{ add_milliseconds(g.ts, -1000 * $load_window_s) }}
                   AND r.ts <= {{ add_milliseconds(g.ts, 1000 * $clock_skew_s) }}
                   AND (r.cached_tokens IS NULL OR r.cached_tokens >= g.loaded_tokens)
                   AND (r.status IS NULL OR r.status NOT BETWEEN 400 AND 498)  -- refused: the engine never ran it
    JOIN load_moments m ON m.instance = g.instance AND m.ts = g.ts AND m.salt = g.salt
)
