-- Keyed fingerprints of one batch of content texts, in bulk: the values fingerprint.fingerprints()
-- gives, one row per distinct fingerprint of each text. kvforensics/sources/content/load.py registers
-- content_batch (request_id, part, and either text: an ASCII text, or words: the lower-cased words
-- of any other text joined by single spaces), in many small Arrow batches that DuckDB's threads
-- take in parallel; the bulk reader (sources/content/bulk.py) gives it as a view.
-- Words: [a-z0-9_]+ runs of the lower-cased text (Python's \w+ on ASCII, lower-cased). Shingles:
-- every run of $width consecutive words joined by a space ({shingle}: concat_ws of the $width words,
-- written out by load.fingerprint_script); a text of fewer words is one shingle.
-- Fingerprint of a shingle (fingerprint.shingle_fingerprint): SHA256($key || shingle) ($key:
-- fingerprint.fingerprint_key, one 64-byte block), its first 64 bits big-endian, shifted right by one.
-- Winnowing ($window, fingerprint.winnow), by the fingerprints themselves: of every window of $window
-- consecutive shingles the one of least fingerprint is kept (fingerprint.winnow keeps the rightmost of
-- equal ones: the same value); so the fingerprints kept are the windows' least values ({window_min}:
-- least() of the window's values written out, or list_min of its slice for a wide window); a text of
-- fewer shingles than $window is one window. $window = 1 keeps every shingle.
-- The distinct fingerprints of each text are one list of its row (list_distinct, text by text):
-- no hash aggregate over the batch and no join back to the texts.
-- Only fingerprints are kept: the texts stay in the registered batch, which is never stored.
CREATE OR REPLACE TEMP TABLE content_batch_fp AS
WITH words AS (
    SELECT request_id, part,
           CASE WHEN text IS NOT NULL THEN regexp_extract_all(lower(text), '[a-z0-9_]+')
                WHEN words = '' THEN []
                ELSE string_split(words, ' ') END AS w
    FROM content_batch
), shingles AS (
    SELECT request_id, part,
           CASE WHEN len(w) >= $width
                THEN list_transform(range(1, len(w) - $width + 2), lambda i: {shingle})
                WHEN len(w) > 0 THEN [array_to_string(w, ' ')]
                ELSE [] END AS s
    FROM words
), hashed AS (
    SELECT request_id, part,
           list_transform(s, lambda x: ((('0x' || left(sha256($key || encode(x)), 16))::UBIGINT >> 1)::BIGINT)) AS h
    FROM shingles
)
SELECT request_id, part,
       list_distinct(CASE WHEN $window = 1 THEN h
                          WHEN len(h) >= $window
                          THEN list_transform(range(1, len(h) - $window + 2), lambda i: {window_min})
                          WHEN len(h) > 0 THEN [list_min(h)]
                          ELSE [] END) AS fps
FROM hashed;

INSERT INTO content_fingerprints SELECT request_id, part, unnest(fps) FROM content_batch_fp;

-- every text gets its count of distinct fingerprints kept, 0 for a text without words
INSERT INTO content_stats SELECT request_id, part, len(fps) FROM content_batch_fp;

DROP TABLE content_batch_fp;
