-- PROTOTYPE (benchmarks only, not kvforensics): stage one JSONL file into `staging_requests`
-- with DuckDB's readers instead of Python. Every physical line is a row (a delimiter that valid
-- JSON cannot contain unescaped, no quoting), numbered by WITH ORDINALITY, so blank, malformed and
-- non-object lines keep their line numbers; each document is parsed once for all fields
-- (json_extract_string / json_type with a list of paths). steps.py fills in {fields}: one
-- "v[i] AS <field>_raw" per canonical field, and {wrong_type}: the per-field type checks (a
-- Python format template: literal braces are doubled).
CREATE OR REPLACE TEMP TABLE staging_requests AS
WITH lines AS (
    SELECT ordinality AS line, raw
    FROM read_csv($file, columns = {{'raw': 'VARCHAR'}}, header = false, delim = chr(1), quote = '',
                  escape = '', auto_detect = false) WITH ORDINALITY
), checked AS (
    SELECT line, raw,
           CASE WHEN NOT json_valid(raw) THEN 'malformed JSON'
                WHEN json_type(raw) <> 'OBJECT' THEN 'not a JSON object' END AS problem
    FROM lines WHERE raw IS NOT NULL AND trim(raw) <> ''
), typed AS (
    SELECT line, raw, problem, CASE WHEN problem IS NULL THEN json_type(raw, $paths) END AS t
    FROM checked
), valued AS (
    SELECT line, raw, coalesce(problem, CASE {wrong_type} END) AS problem,
           CASE WHEN problem IS NULL THEN json_extract_string(raw, $paths) END AS v
    FROM typed
)
SELECT line, raw, problem, {fields}
FROM valued;
