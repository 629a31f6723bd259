-- Requests name the engine instance their gateway name was matched to (table instance_names, filled by
-- kvforensics/stages/instances.py), so that the rules' joins on capacity.instance work unchanged.
-- sql/instance_restore.sql undoes it before the next ingest: by name where an engine instance was
-- renamed from one gateway name only (and is no gateway name itself), else from the gateway's own
-- values of each such request, kept in instance_renames.
CREATE OR REPLACE TEMP TABLE renamed_names AS
WITH renamed AS (
    SELECT gateway_name, engine_instance, count(*) OVER (PARTITION BY engine_instance) AS sources
    FROM instance_names
    WHERE engine_instance IS NOT NULL AND engine_instance <> gateway_name
)
SELECT gateway_name, engine_instance,
       sources > 1 OR engine_instance IN (SELECT gateway_name FROM instance_names) AS kept_per_request
FROM renamed;

INSERT INTO instance_renames
SELECT r.request_id, r.prefill_instance, r.decode_instance
FROM requests r
WHERE r.prefill_instance IN (SELECT gateway_name FROM renamed_names WHERE kept_per_request)
   OR r.decode_instance IN (SELECT gateway_name FROM renamed_names WHERE kept_per_request);

UPDATE requests SET prefill_instance = n.engine_instance
FROM renamed_names n WHERE n.gateway_name = requests.prefill_instance;

UPDATE requests SET decode_instance = n.engine_instance
FROM renamed_names n WHERE n.gateway_name = requests.decode_instance;

DROP TABLE renamed_names;
