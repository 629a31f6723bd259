-- PROTOTYPE (benchmarks only, not kvforensics): stage one Parquet file into `staging_requests`
-- with read_parquet instead of Python row lists. The row number is the line; `raw` is the record's
-- mapped columns as JSON (only quarantined records need it). steps.py fills in {fields}: one
-- "CAST(<column> AS VARCHAR) AS <field>_raw" per canonical field ("NULL" when absent), and {raw}.
CREATE OR REPLACE TEMP TABLE staging_requests AS
SELECT ordinality AS line, {raw} AS raw, CAST(NULL AS VARCHAR) AS problem, {fields}
FROM read_parquet($file) WITH ORDINALITY;
