-- The landing floor of ingest: the gateway files typed into a table of a persistent DuckDB file in
-- one CREATE TABLE AS, no validation, no quarantine, no dedup. What writing the rows costs at all.
-- steps.py fills in {reader} (read_json / read_parquet of $files) and the quoted source columns.
CREATE OR REPLACE TABLE requests AS
SELECT CAST({request_id} AS VARCHAR) AS request_id, CAST({ts} AS TIMESTAMPTZ) AS ts,
       CAST({account_id} AS VARCHAR) AS account_id, CAST({model} AS VARCHAR) AS model,
       CAST({status} AS INTEGER) AS status, CAST({prompt_tokens} AS BIGINT) AS prompt_tokens,
       CAST({completion_tokens} AS BIGINT) AS completion_tokens, CAST({cached_tokens} AS BIGINT) AS cached_tokens,
       CAST({ttft_ms} AS DOUBLE) AS ttft_ms, CAST({latency_ms} AS DOUBLE) AS latency_ms,
       CAST({prefill_instance} AS VARCHAR) AS prefill_instance, CAST({decode_instance} AS VARCHAR) AS decode_instance
FROM {reader};
