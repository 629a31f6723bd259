-- A response computed on pages its engine loaded from a shared KV store (an SGLang HiCache storage
-- backend, an L3 store several instances read) that another tenant's request had put there: the store
-- keys pages by their tokens alone, so a request of one namespace (cache salt) reads pages another
-- namespace wrote. Read from the engines' KV events (kv_events), not from request content:
--   * a load from the store is a host store (medium CPU_PINNED) of a page the instance held nowhere
--     (neither on the device nor in host memory since its start-up and its last AllBlocksCleared),
--     published in the requester's namespace (its salt);
--   * the pages put in the store are the other stores (a computed page, its write-through backup) of
--     instances whose start-up had a shared store (prefix_windows reach shared_store, or undetermined);
--   * a loaded page and a written one are the same content when their chain fingerprints are equal
--     (kv_events.chain_fp: the keyed hash of the token ids from the chain's first page; salted chains
--     carry other hashes for the same tokens, so hashes never match across namespaces);
--   * the page's owner is the namespace that wrote it first (the store keeps a key's first write: it
--     checks that a key exists before it sets it). The load is foreign when that namespace is not the
--     requester's, is not a shared namespace ([prefix_cache] shared_namespaces) and its account is not
--     one of the provider's internal accounts;
--   * a load is one chain of the pages one namespace loaded at one moment on one instance (a page no
--     other of them names as its parent, and its parents among them): an engine that publishes two
--     requests' loads in one batch (one scheduler step) shows two loads;
--   * the response is a request of the loading namespace on that instance (not refused: 400-498), from
--     $load_window_s before the load to $clock_skew_s after it, with cached_tokens covering every page of the load, or none logged (a
--     client that disconnected gets no usage): for a device store's load (an engine without host stores), the
--     request the store was given to; else the one whose cached_tokens end exactly with the load's last page
--     (of several before the load, one that arrived after the namespace's previous stores on the instance, else
--     an earlier step served it; of those the first: the later ones hit the copy it brought in), else the one
--     whose arrival is nearest the load; requests.cache_salt names the namespace.
-- Output: request_id, strength ('strong'), evidence (JSON). One row per request.
WITH RECURSIVE internal AS (
    SELECT DISTINCT a.account_id
    FROM (SELECT DISTINCT account_id FROM requests) a
    JOIN account_patterns p ON {{ glob_match(a.account_id, p.pattern) }}
    WHERE p.account_class = 'internal'
), {{ fragment('prefix_store_loads') }}
SELECT request_id, 'strong' AS strength,
       {{ json_object('basis', 'foreign_pages_loaded_from_shared_store', 'instance', min(instance),
                      'cached_tokens', max(cached_tokens), 'pages_loaded', sum(pages),
                      'tokens_loaded', sum(tokens), 'owner_namespaces', max(owners)) }} AS evidence
FROM load_requests
WHERE nearest = 1
GROUP BY request_id
