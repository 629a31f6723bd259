-- Put the gateway's own instance names back into the requests an earlier ingest renamed
-- (sql/instance_rename.sql), before new request files are compared with what was loaded.
UPDATE requests SET prefill_instance = o.prefill_instance, decode_instance = o.decode_instance
FROM instance_renames o WHERE o.request_id = requests.request_id;

DELETE FROM instance_renames;
