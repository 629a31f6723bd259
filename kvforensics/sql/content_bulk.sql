-- The records of one chunk of a content file's lines (content_bulk_lines: line, raw) that the bulk reader
-- takes (kvforensics/sources/content/bulk.py): a line is taken only when nothing in its text is left to judge,
-- so that Python's reader would give the same record. No \u escape (a lone surrogate, or a key spelled with
-- escapes), nothing DuckDB's JSON reader accepts that Python's refuses ($lenient), each key the reader reads at
-- most once (Python keeps the last, DuckDB the first: {once}), no token ids ($ids_key: their checks are
-- Python's), a JSON object whose request id is a non-empty string, and a prompt and an output each absent,
-- null or a string that cannot be a chat-messages array (no '[' after a run of anything but letters and
-- digits). Every other line is read by the Python reader, which loads or quarantines it.
CREATE OR REPLACE TEMP TABLE content_bulk AS
WITH candidates AS (
    SELECT line, raw
    FROM content_bulk_lines
    WHERE raw IS NOT NULL
      AND strpos(raw, '\u') = 0
      AND NOT regexp_matches(raw, $lenient)
      AND strpos(raw, '"' || $ids_key || '"') = 0
      AND {once}
      AND json_valid(raw)
), extracted AS MATERIALIZED (
    -- materialized: each record is parsed here once; inlined, the optimizer parsed it again for every use of v below
    SELECT line, json_type(raw) = 'OBJECT' AS object, json_extract(raw, [$id_path, $prompt_path, $output_path]) AS v
    FROM candidates
), typed AS (
    SELECT line, object,
           json_type(v[1]) AS id_type, json_type(v[2]) AS prompt_type, json_type(v[3]) AS output_type,
           v[1] ->> '$' AS request_id, v[2] ->> '$' AS prompt, v[3] ->> '$' AS output
    FROM extracted
)
SELECT line, request_id, prompt, output
FROM typed
WHERE object
  AND id_type = 'VARCHAR' AND request_id <> ''
  AND (prompt_type IS NULL OR prompt_type = 'NULL'
       OR (prompt_type = 'VARCHAR' AND NOT regexp_matches(prompt, '^[^a-zA-Z0-9]*\[')))
  AND (output_type IS NULL OR output_type = 'NULL'
       OR (output_type = 'VARCHAR' AND NOT regexp_matches(output, '^[^a-zA-Z0-9]*\[')));

-- the texts of the records taken, each with whether it is ASCII (tokenised in SQL) or not (by Python)
CREATE OR REPLACE TEMP TABLE content_bulk_texts AS
SELECT request_id, part, text, NOT regexp_matches(text, '[^\x00-\x7F]') AS ascii
FROM (
    SELECT request_id, 'prompt' AS part, prompt AS text FROM content_bulk WHERE prompt <> ''
    UNION ALL
    SELECT request_id, 'output' AS part, output AS text FROM content_bulk WHERE output <> ''
);

CREATE OR REPLACE TEMP VIEW content_batch AS
SELECT request_id, part, text, NULL::VARCHAR AS words FROM content_bulk_texts WHERE ascii;
