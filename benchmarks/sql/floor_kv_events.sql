-- The floor of the KV-event ingest (issue 30), for files of vLLM's KVEventBatch in msgspec's array form ([ts,
-- [event, ...], dp_rank], the vllm-array shape of benchmarks/kv_events.py): the least work any reader of these files
-- must do to load what kvforensics loads, with none of the checks. DuckDB reads the lines (read_csv with a delimiter
-- no line holds, no quoting), parses each message and its events (the hashes and token ids split as text, the
-- cheapest way), cuts every stored event's token ids into its blocks, and writes one row per block with the two
-- keyed fingerprints the evidence holds: the block's (HMAC-SHA-256 of its token ids, as
-- kvforensics.sources.kv_events.chains.Fingerprints computes it) and its chain's (HMAC-SHA-256 of the block's
-- fingerprint and its parent's hash, in one pass: the real chain fingerprint needs the parent's chain fingerprint
-- first, a depth at a time, which is more work than this). Nothing is typed beyond what the rows need, nothing is
-- checked, nothing is left to a reference reader, no message row is written. $file: the file; $ipad, $opad: the HMAC
-- key's pads.
CREATE OR REPLACE TEMP TABLE floor_kv_rows AS
WITH lines AS (
    SELECT raw FROM read_csv($file, columns = {'raw': 'VARCHAR'}, header = false, delim = chr(1), quote = '',
                             escape = '', auto_detect = false, strict_mode = false)
), events AS (
    SELECT m[1] AS ts, m[3] AS rank, unnest(from_json(m[2], '[["JSON"]]')::VARCHAR[][]) AS ev
    FROM (SELECT from_json(raw, '["JSON"]')::VARCHAR[] AS m FROM lines)
), cut AS (
    SELECT ts, rank, ev[1] AS tag, ev[3] AS parent, string_split(ev[2][2:-2], ',') AS hashes,
           CASE WHEN ev[1] = '"BlockStored"' THEN string_split(ev[4][2:-2], ',') END AS ids, ev[5]::INTEGER AS size
    FROM events
), blocks AS (
    SELECT ts, rank, tag, parent, ids, size, unnest(hashes) AS block_hash, generate_subscripts(hashes, 1) - 1 AS i
    FROM cut
), fingerprinted AS (
    SELECT ts, rank, tag, block_hash, parent,
           CASE WHEN ids IS NOT NULL THEN sha256($opad || unhex(sha256($ipad
               || encode(array_to_string(ids[i * size + 1:(i + 1) * size], ','))))) END AS block_fp
    FROM blocks
)
SELECT ts::DOUBLE AS ts, rank::INTEGER AS rank, tag, block_hash, block_fp,
       CASE WHEN block_fp IS NOT NULL
            THEN sha256($opad || unhex(sha256($ipad || encode(block_fp || coalesce(parent, ''))))) END AS chain_fp
FROM fingerprinted;
