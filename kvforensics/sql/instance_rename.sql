-- Requests name the engine instance their gateway name was matched to (table instance_names, filled by
-- kvforensics/instances.py), so that the rules' joins on capacity.instance work unchanged. The gateway's
-- own values of every renamed request are kept in instance_renames (sql/instance_restore.sql puts them back).
CREATE OR REPLACE TEMP TABLE renamed_names AS
SELECT gateway_name, engine_instance FROM instance_names
WHERE engine_instance IS NOT NULL AND engine_instance <> gateway_name;

INSERT INTO instance_renames
SELECT r.request_id, r.prefill_instance, r.decode_instance
FROM requests r
WHERE r.prefill_instance IN (SELECT gateway_name FROM renamed_names)
   OR r.decode_instance IN (SELECT gateway_name FROM renamed_names);

UPDATE requests SET prefill_instance = n.engine_instance
FROM renamed_names n WHERE n.gateway_name = requests.prefill_instance;

UPDATE requests SET decode_instance = n.engine_instance
FROM renamed_names n WHERE n.gateway_name = requests.decode_instance;

DROP TABLE renamed_names;
