-- The floor of the content ingest (issue 16): DuckDB reads the same content files and hashes the
-- same shingles kvforensics fingerprints (core/fingerprint.py: lower-cased \w+ words, every run of 8
-- consecutive words, a text of fewer words as one shingle), each with a keyed cryptographic hash:
-- SHA-256 of the key followed by the shingle, its first 64 bits (one SHA-256 per shingle, where
-- an HMAC takes two). The hashes are aggregated, so none can be skipped; nothing is stored.
-- RE2's \w is ASCII-only where Python's is Unicode: the same words for the simulator's text.
-- steps.py fills in {reader} (read_json of $files), the quoted request_id / prompt / output
-- columns and {fingerprint}: the keyed SHA-256 above, or (a lower bound, reported beside it)
-- DuckDB's non-cryptographic hash(shingle, $key_int); the key is a parameter.
WITH texts AS (
    SELECT {request_id} AS request_id, unnest([{prompt}, {output}]) AS text FROM {reader}
), words AS (
    SELECT request_id, regexp_extract_all(lower(text), '\w+') AS w FROM texts WHERE text IS NOT NULL
), shingles AS (
    SELECT request_id,
           unnest(CASE WHEN len(w) >= 8
                       THEN list_transform(range(1, len(w) - 6), lambda i: array_to_string(w[i:i + 7], ' '))
                       WHEN len(w) > 0 THEN [array_to_string(w, ' ')]
                       ELSE [] END) AS shingle
    FROM words
)
SELECT count(DISTINCT request_id) AS records,
       count(*) AS shingles,
       bit_xor({fingerprint}) AS fingerprints
FROM shingles;
