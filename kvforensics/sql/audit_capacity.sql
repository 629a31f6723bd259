-- Deployment audit: every start-up (configuration interval) in the capacity table, in time order
-- per instance, with how the ingest ended it. The column order is what
-- kvforensics.audit.audit_database unpacks.
SELECT instance, role, model, engine_model, valid_from, valid_to, kv_pool_tokens, context_length,
       page_size, engine, engine_version, version_source, tp_size, dp_size,
       CAST(flags AS VARCHAR) AS flags, startup_refused, source, source_file, source_line,
       pool_source_line, end_reason, end_file, end_line, successor
FROM capacity
ORDER BY instance, valid_from NULLS LAST, source_file, source_line
