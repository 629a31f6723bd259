-- The lines of a KV-event file (temp table kv_bulk_lines: line, raw) read in bulk (kvforensics/sources/kv_events/bulk.py)
-- into kv_bulk_events (a row per event, each with its message's parts) and kv_bulk_blocks (a row per block). Only what
-- the Python reference (kvforensics/sources/kv_events/reference.py) would load whole is kept: a line with anything
-- to judge is left out, for the reference to read. The placeholders in braces are SQL the loader writes from the
-- source's columns (every key in it a parameter), and the event checks are the fragment sql/kv_events_bulk_event.sql.
-- Parameters: $lenient, $paths (the JSON paths of an object batch's ts, seq, instance and rank), $k<i> (keys no
-- line may hold twice), $c<i> (arrays a key indexes), $e<i> and $events_fields / $events_texts (where the events
-- are), $instance (the source's instance for the file), $offset_us, $ts_min / $ts_max (epoch seconds of years 1
-- and 9999), $map (an event map's structure), $ipad / $opad (the HMAC key's pads).

-- Each message whose batch the bulk reader reads (its text free of escapes, of what DuckDB's JSON reader accepts
-- and Python's does not, and of keys written twice), and each of its events given as an array. The timestamp as
-- the reference reads it: epoch seconds (milli-, micro-, nanoseconds by magnitude) split into whole seconds and
-- microseconds rounded half to even, as CPython's datetime.fromtimestamp does. A message is its first event's
-- row (seq 0; a message without events is left to the reference); one with an event that is not an array has its
-- events read as texts by the next statement.
CREATE OR REPLACE TEMP TABLE kv_bulk_events AS
WITH candidates AS (
    SELECT line, raw, left(ltrim(raw, ' \t'), 1) AS opening FROM kv_bulk_lines
    WHERE raw IS NOT NULL AND strpos(raw, '\') = 0 AND NOT regexp_matches(raw, $lenient)
), parsed AS MATERIALIZED (
    SELECT line, opening = '[' AS as_array,
           CASE WHEN opening = '[' THEN try(json_extract(raw, ['$[0]', '$[2]']))::VARCHAR[]
                ELSE try(json_extract(raw, $paths))::VARCHAR[] END AS scalars,
           CASE WHEN opening = '[' THEN try(from_json(raw, '[[["JSON"]]]'))::VARCHAR[][][] END AS arr,
           CASE WHEN opening <> '[' THEN try({events_fields}) END AS obj_events
    FROM candidates
    WHERE (opening = '[' AND {array_ok}) OR (opening = '{' AND {once} AND {containers})
), parts AS (
    SELECT line, as_array,
           CASE WHEN as_array THEN arr[2] ELSE obj_events END AS events_fields,
           nullif(CASE WHEN as_array THEN scalars[1] ELSE {ts} END, 'null') AS ts,
           nullif(CASE WHEN as_array THEN scalars[2] ELSE {rank} END, 'null') AS rank,
           nullif(CASE WHEN as_array THEN NULL ELSE {instance} END, 'null') AS instance,
           nullif(CASE WHEN as_array THEN NULL ELSE {seq} END, 'null') AS seq
    FROM parsed
    WHERE scalars IS NOT NULL AND (NOT as_array OR len(arr) IN (2, 3))
), seconds AS (
    SELECT *, ts_number / CASE WHEN abs(ts_number) >= 1e17 THEN 1e9 WHEN abs(ts_number) >= 1e14 THEN 1e6
                               WHEN abs(ts_number) >= 1e11 THEN 1e3 ELSE 1.0 END AS x
    FROM (SELECT *, CASE WHEN regexp_full_match(ts, '-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?')
                         THEN TRY_CAST(ts AS DOUBLE) END AS ts_number FROM parts)
), split AS (
    SELECT *, CASE WHEN isfinite(x) THEN trunc(x) END AS whole, round_even((x - trunc(x)) * 1e6, 0) AS micro
    FROM seconds
), typed AS (
    SELECT line, as_array, events_fields,
           whole + CASE WHEN micro >= 1e6 THEN 1 WHEN micro < 0 THEN -1 ELSE 0 END AS epoch_s,
           micro - CASE WHEN micro >= 1e6 THEN 1e6 WHEN micro < 0 THEN -1e6 ELSE 0 END AS epoch_us,
           CASE WHEN regexp_full_match(rank, '0|[1-9][0-9]{0,9}') AND TRY_CAST(rank AS BIGINT) < 2147483648
                THEN TRY_CAST(rank AS INTEGER) END AS dp_rank, rank IS NULL AS no_rank,
           CASE WHEN as_array OR NOT {instance_mapped} THEN $instance
                WHEN instance[1] = '"' AND length(instance) > 2 THEN instance[2:-2] END AS instance,
           CASE WHEN regexp_full_match(seq, '0|[1-9][0-9]{0,17}') THEN TRY_CAST(seq AS BIGINT)
                WHEN regexp_full_match(seq, '"[0-9]{1,18}"') THEN TRY_CAST(seq[2:-2] AS BIGINT) END AS msg_seq,
           seq IS NULL AS no_seq
    FROM split
), timed AS (
    SELECT *, CASE WHEN epoch_s BETWEEN $ts_min AND $ts_max
                   THEN epoch_s::BIGINT * 1000000 + epoch_us::BIGINT + $offset_us END AS ts_us
    FROM typed
    WHERE (dp_rank IS NOT NULL OR no_rank) AND instance IS NOT NULL
      AND (msg_seq IS NOT NULL OR (no_seq AND NOT {seq_mapped})) AND events_fields IS NOT NULL
), events_in AS (
    SELECT line, as_array, instance, dp_rank, msg_seq, to_timestamp(0) + to_microseconds(ts_us) AS ts,
           len(events_fields) AS events, unnest(events_fields) AS f,
           generate_subscripts(events_fields, 1) - 1 AS seq, NULL::{map_type} AS m
    FROM timed WHERE ts_us BETWEEN $ts_min * 1000000 AND $ts_max * 1000000 + 999999
), {event_checks}
SELECT *, events AS loaded, f_missing AS texts FROM events_read;

-- The events of the messages with one that is not an array, read as texts: each an array or a map (a map with a
-- key written twice is left to the reference: Python keeps the last, DuckDB the first).
CREATE OR REPLACE TEMP TABLE kv_bulk_texts AS
SELECT line, as_array, instance, dp_rank, msg_seq, ts, events FROM kv_bulk_events
WHERE seq = 0 AND line IN (SELECT line FROM kv_bulk_events WHERE texts);

DELETE FROM kv_bulk_events WHERE line IN (SELECT line FROM kv_bulk_texts);

INSERT INTO kv_bulk_events BY NAME
WITH texts AS (
    SELECT line, as_array, instance, dp_rank, msg_seq, ts, events,
           CASE WHEN as_array THEN (from_json(raw, '[["JSON"]]')::VARCHAR[][])[2] ELSE {events_texts} END AS evs
    FROM kv_bulk_texts JOIN kv_bulk_lines USING (line)
), events_in AS MATERIALIZED (
    SELECT line, as_array, instance, dp_rank, msg_seq, ts, events, seq,
           CASE WHEN ev[1] = '[' THEN from_json(ev, '["JSON"]')::VARCHAR[] END AS f,
           CASE WHEN ev[1] = '{' AND len(json_keys(ev)) = len(list_distinct(json_keys(ev)))
                THEN from_json(ev, $map)::{map_type} END AS m
    FROM (SELECT *, unnest(evs) AS ev, generate_subscripts(evs, 1) - 1 AS seq FROM texts)
), {event_checks}
SELECT *, events AS loaded, false AS texts FROM events_read;

DROP TABLE kv_bulk_texts;

-- The messages read in bulk: those whose every event loads.
DELETE FROM kv_bulk_events WHERE line IN (SELECT line FROM kv_bulk_events WHERE NOT plain);

-- A row per block, a stored block's fingerprint computed once per distinct token ids, its own cache salt: its
-- event's, else vLLM's in its extra keys (a string that is not the LoRA name), else none (its parent's).
CREATE OR REPLACE TEMP TABLE kv_bulk_blocks AS
WITH split_ids AS (
    SELECT *, CASE WHEN kind = 'stored' AND len(hashes) > 1 AND id_count > 0 THEN string_split(ids, ',') END
                  AS tokens
    FROM kv_bulk_events
), events AS MATERIALIZED (
    SELECT line, seq, kind, hashes, parent, size, lora, medium, kv_group, instance, dp_rank, ts, msg_seq,
           CASE WHEN kind <> 'stored' OR id_count = 0 THEN NULL WHEN len(hashes) = 1 THEN [ids]
                ELSE list_transform(range(len(hashes)), lambda i:
                         array_to_string(tokens[i * size + 1:(i + 1) * size], ',')) END AS cut,
           CASE WHEN kind <> 'stored' THEN NULL WHEN extra IS NULL THEN [salt]
                ELSE list_transform(extra, lambda x: coalesce(salt, nullif(CASE
                    WHEN x IS NULL OR x = '[]' THEN NULL
                    WHEN lora_name IS NOT NULL
                         AND list_filter(from_json(x, '["JSON"]')::VARCHAR[], lambda k: k[1] = '"')[1][2:-2] = lora_name
                        THEN list_filter(from_json(x, '["JSON"]')::VARCHAR[], lambda k: k[1] = '"')[2][2:-2]
                    ELSE list_filter(from_json(x, '["JSON"]')::VARCHAR[], lambda k: k[1] = '"')[1][2:-2] END, ''))) END
               AS salts
    FROM split_ids
), blocks AS (
    SELECT line, seq, kind, instance, dp_rank, ts, msg_seq, medium, kv_group, lora, hashes, parent AS event_parent,
           unnest(CASE WHEN kind = 'cleared' THEN [NULL] ELSE hashes END) AS block_hash,
           unnest(cut) AS block_ids,
           unnest(CASE WHEN len(salts) > 1 THEN salts END) AS block_salt,
           generate_subscripts(CASE WHEN kind = 'cleared' THEN [NULL] ELSE hashes END, 1) - 1 AS i,
           salts[1] AS first_salt, len(salts) > 1 AS many_salts
    FROM events
), fingerprints AS (
    SELECT ids, {fingerprint} AS block_fp
    FROM (SELECT DISTINCT block_ids AS ids FROM blocks WHERE block_ids IS NOT NULL)
)
SELECT line, seq, i, kind, instance, dp_rank, ts, msg_seq, block_hash,
       CASE WHEN kind <> 'stored' THEN NULL WHEN i = 0 THEN event_parent ELSE hashes[i] END AS parent,
       CASE WHEN block_ids IS NOT NULL THEN length(block_ids) - length(replace(block_ids, ',', '')) + 1 END
           AS num_tokens,
       f.block_fp, CASE WHEN kind <> 'stored' THEN NULL WHEN many_salts THEN block_salt ELSE first_salt END AS own_salt,
       lora, medium, kv_group
FROM blocks LEFT JOIN fingerprints f ON f.ids = blocks.block_ids;
