-- Keyed fingerprints of one batch of content texts, in bulk: the values fingerprint.fingerprints()
-- gives, one row per distinct fingerprint of each text. kvforensics/loaders/content.py registers
-- content_batch (request_id, part, and either text: an ASCII text, or words: the lower-cased words
-- of any other text joined by single spaces), in many small Arrow batches that DuckDB's threads
-- take in parallel.
-- Words: [a-z0-9_]+ runs of the lower-cased text (Python's \w+ on ASCII, lower-cased). Shingles:
-- every run of $width consecutive words joined by a space; a text of fewer words is one shingle.
-- Fingerprint: HMAC-SHA256 = SHA256($outer || SHA256($inner || shingle)) ($inner, $outer: the key
-- blocks of fingerprint.hmac_blocks), its first 64 bits big-endian, shifted right by one.
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
                THEN list_transform(range(1, len(w) - $width + 2),
                                    lambda i: array_to_string(w[i:i + $width - 1], ' '))
                WHEN len(w) > 0 THEN [array_to_string(w, ' ')]
                ELSE [] END AS s
    FROM words
)
SELECT request_id, part,
       list_distinct(list_transform(s, lambda x: (('0x' || left(sha256($outer || unhex(sha256($inner || encode(x)))),
                                                                16))::UBIGINT >> 1)::BIGINT)) AS fps
FROM shingles;

INSERT INTO content_fingerprints SELECT request_id, part, unnest(fps) FROM content_batch_fp;

-- every text gets its count of distinct shingles, 0 for a text without words
INSERT INTO content_stats SELECT request_id, part, len(fps) FROM content_batch_fp;

DROP TABLE content_batch_fp;
