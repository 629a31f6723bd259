-- A fragment, not a script (kvforensics/sources/kv_events/bulk.py): the CTEs that read each event of
-- `events_in` (line, seq, as_array, instance, dp_rank, msg_seq, ts, events, f: an array event's
-- fields as JSON text, m: a map event's) the way the reference does (kvforensics/sources/kv_events/reference.py:
-- _event and _blocks), ending in `events_read`. `plain` says the event loads (a line with an event that does
-- not is left to the reference, so nothing here says why: only that every check the reference makes passes).
-- A row with seq -1 is its line's (the message).
ev_fields AS (
    SELECT line, seq, as_array, instance, dp_rank, msg_seq, ts, events, f IS NULL AND m IS NULL AS f_missing,
           f IS NOT NULL AS as_array_event, CASE WHEN f IS NOT NULL THEN len(f) ELSE 0 END AS shape,
           f IS NOT NULL OR m IS NOT NULL AS parsed,
           coalesce(f[1], m.type) AS tag_text,
           coalesce(f[2], m.block_hashes) AS hashes_text,
           CASE WHEN f IS NULL THEN m.parent_block_hash ELSE f[3] END AS parent_text,
           CASE WHEN f IS NULL THEN m.token_ids ELSE f[4] END AS tokens,
           CASE WHEN f IS NULL THEN m.block_size ELSE f[5] END AS size_text,
           CASE WHEN f IS NULL THEN m.lora_id ELSE f[6] END AS lora_id,
           CASE WHEN f IS NULL THEN m.medium WHEN f[1] = '"BlockRemoved"' THEN f[3] ELSE f[7] END AS medium_text,
           CASE WHEN f IS NULL THEN m.lora_name ELSE f[8] END AS slot7,
           CASE WHEN f IS NULL THEN m.extra_keys ELSE f[9] END AS extra_text,
           CASE WHEN f IS NULL THEN m.group_idx WHEN f[1] = '"BlockRemoved"' THEN f[4] ELSE f[10] END AS group_text,
           CASE WHEN f IS NULL THEN m.kv_cache_spec_kind ELSE f[11] END AS spec_kind,
           CASE WHEN f IS NULL THEN m.kv_cache_spec_sliding_window ELSE f[12] END AS sliding_window,
           -- SGLang's {"cache_salt": ...} in the slot of vLLM's lora_name, or a map's "metadata"
           CASE WHEN f IS NULL THEN m.metadata WHEN f[8][1] = '{' THEN f[8] END AS metadata,
           m.cache_salt
    FROM events_in
), ev_typed AS (
    SELECT *,
           CASE tag_text WHEN '"BlockStored"' THEN 'stored' WHEN '"BlockRemoved"' THEN 'removed'
                         WHEN '"AllBlocksCleared"' THEN 'cleared' END AS kind,
           -- integers (the common case) split as they are; anything else each by the reference's rules
           CASE WHEN regexp_full_match(hashes_text, '\[(0|-?[1-9][0-9]*)(,(0|-?[1-9][0-9]*))*\]')
                THEN string_split(hashes_text[2:-2], ',')
                ELSE list_transform(from_json(hashes_text, '["JSON"]')::VARCHAR[], lambda h: {canonical_h}) END
               AS hashes,
           CASE WHEN parent_text IS NULL THEN NULL WHEN TRY_CAST(parent_text AS HUGEINT)::VARCHAR = parent_text
                THEN parent_text ELSE {canonical_parent} END AS parent,
           coalesce(metadata[1] = '{', false) AS has_metadata,
           CASE WHEN metadata[1] = '{' AND len(json_keys(metadata)) = len(list_distinct(json_keys(metadata)))
                THEN from_json(metadata, '{"cache_salt": "JSON"}').cache_salt::VARCHAR END AS metadata_salt,
           CASE WHEN metadata[1] = '{' THEN NULL ELSE slot7 END AS lora_name_text,
           CASE WHEN extra_text[1] = '[' THEN from_json(extra_text, '["JSON"]')::VARCHAR[] END AS extra,
           -- token ids: non-negative integers only, as text ("101,102,103")
           CASE WHEN regexp_full_match(tokens, '\[([0-9]+(,[0-9]+)*)?\]') THEN tokens[2:-2] END AS ids,
           CASE WHEN TRY_CAST(size_text AS INTEGER)::VARCHAR = size_text AND TRY_CAST(size_text AS INTEGER) > 0
                THEN TRY_CAST(size_text AS INTEGER) END AS size,
           CASE WHEN medium_text[1] = '"' THEN medium_text[2:-2] END AS medium,
           CASE WHEN TRY_CAST(group_text AS INTEGER)::VARCHAR = group_text AND TRY_CAST(group_text AS INTEGER) >= 0
                THEN TRY_CAST(group_text AS INTEGER) END AS kv_group,
           TRY_CAST(lora_id AS BIGINT)::VARCHAR = lora_id AND TRY_CAST(lora_id AS BIGINT) >= 0 AS lora_id_ok
    FROM ev_fields
), ev_checked AS (
    SELECT *,
           CASE WHEN lora_name_text[1] = '"' THEN lora_name_text[2:-2] END AS lora_name,
           CASE WHEN has_metadata THEN metadata_salt WHEN as_array_event THEN NULL ELSE cache_salt END AS salt_text,
           CASE WHEN ids = '' THEN 0 ELSE length(ids) - length(replace(ids, ',', '')) + 1 END AS id_count,
           len(hashes) > 0 AND list_bool_and(list_transform(hashes, lambda h: h IS NOT NULL)) AS hashes_ok
    FROM ev_typed
), events_read AS (
    SELECT line, seq, as_array, instance, dp_rank, msg_seq, ts, events, f_missing, kind, tag_text[2:-2] AS tag, shape,
           coalesce(parsed AND CASE kind
               WHEN 'cleared' THEN NOT as_array_event OR shape = 1
               WHEN 'removed' THEN (NOT as_array_event OR shape BETWEEN 2 AND 4) AND hashes_ok
                   AND (medium_text IS NULL OR medium IS NOT NULL) AND (group_text IS NULL OR kv_group IS NOT NULL)
               WHEN 'stored' THEN (NOT as_array_event OR shape BETWEEN 6 AND 12) AND hashes_ok
                   AND (parent_text IS NULL OR parent IS NOT NULL) AND ids IS NOT NULL AND size IS NOT NULL
                   AND (id_count = 0 OR (len(hashes) - 1) * size < id_count AND id_count <= len(hashes) * size)
                   AND (lora_id IS NULL OR lora_id_ok)
                   AND (medium_text IS NULL OR medium IS NOT NULL)
                   AND (lora_name_text IS NULL OR lora_name IS NOT NULL)
                   AND (NOT has_metadata OR len(json_keys(metadata)) = len(list_distinct(json_keys(metadata))))
                   AND (salt_text IS NULL OR salt_text[1] = '"')
                   AND (group_text IS NULL OR kv_group IS NOT NULL)
                   AND (extra_text IS NULL OR len(extra) = len(hashes)
                        AND list_bool_and(list_transform(extra, lambda e: e IS NULL OR e[1] = '[')))
                   AND (spec_kind IS NULL OR spec_kind[1] = '"')
                   AND (sliding_window IS NULL OR regexp_full_match(sliding_window, '0|-?[1-9][0-9]*'))
               END, false) AS plain,
           hashes, parent, ids, id_count, size,
           CASE WHEN kind = 'stored' THEN coalesce(lora_name, CASE WHEN lora_id_ok THEN lora_id END) END AS lora,
           lora_name, medium, kv_group, nullif(salt_text[2:-2], '') AS salt, extra
    FROM ev_checked
)
