-- Put the gateway's own instance names back into the requests an earlier ingest renamed
-- (sql/instance_rename.sql, with the instance_names of that ingest), before new request files are
-- compared with what was loaded.
UPDATE requests SET prefill_instance = o.prefill_instance, decode_instance = o.decode_instance
FROM instance_renames o WHERE o.request_id = requests.request_id;

DELETE FROM instance_renames;

CREATE OR REPLACE TEMP TABLE restored_names AS
WITH renamed AS (
    SELECT gateway_name, engine_instance, count(*) OVER (PARTITION BY engine_instance) AS sources
    FROM instance_names
    WHERE engine_instance IS NOT NULL AND engine_instance <> gateway_name
)
SELECT gateway_name, engine_instance FROM renamed
WHERE sources = 1 AND engine_instance NOT IN (SELECT gateway_name FROM instance_names);

UPDATE requests SET prefill_instance = n.gateway_name
FROM restored_names n WHERE n.engine_instance = requests.prefill_instance;

UPDATE requests SET decode_instance = n.gateway_name
FROM restored_names n WHERE n.engine_instance = requests.decode_instance;

DROP TABLE restored_names;
DELETE FROM instance_names;
