-- Confirmed sources of every investigated mechanism, one row per affected response, source request and
-- basis: 'output_shingles' (sql/scope.sql: the response's output repeats the source's text) and the
-- prefix_reuse attribution (sql/prefix_sources.sql: the response reused prefix-cache blocks the source
-- stored, basis 'block_fingerprints', 'colliding_block' or 'shared_store_pages'; the shingle columns do not apply there).
CREATE OR REPLACE TABLE content_matches AS
SELECT affected_request_id, recipient_account_id, source_request_id, source_account_id, matching_shingles,
       output_shingles, match_fraction, confirmed, within_horizon, 'output_shingles' AS basis
FROM output_matches
UNION ALL
SELECT p.request_id AS affected_request_id, a.account_id AS recipient_account_id, p.source_request_id,
       p.source_account AS source_account_id, CAST(NULL AS BIGINT) AS matching_shingles,
       CAST(NULL AS BIGINT) AS output_shingles, CAST(NULL AS DOUBLE) AS match_fraction, TRUE AS confirmed,
       CAST(NULL AS BOOLEAN) AS within_horizon, p.basis
FROM prefix_sources p JOIN affected_responses a ON a.request_id = p.request_id
GROUP BY p.request_id, a.account_id, p.source_request_id, p.source_account, p.basis;

-- One row per (account, role) to notify. Sources exclude the recipient's own account: a response
-- carrying your own earlier data is not an exposure of your data to someone else.
CREATE OR REPLACE TABLE notifications AS
WITH received AS (
    SELECT account_id, account_class, 'received_foreign_data' AS role, count(*) AS responses,
           min(ts) AS first_ts, max(ts) AS last_ts,
           {{ string_agg_ordered(request_id, ' ', ts, request_id) }} AS request_ids
    FROM affected_responses GROUP BY account_id, account_class
), confirmed AS (
    SELECT DISTINCT m.source_account_id AS account_id, m.source_request_id AS request_id
    FROM content_matches m
    WHERE m.confirmed AND m.source_account_id <> m.recipient_account_id
), possible AS (
    SELECT DISTINCT p.source_account_id AS account_id, p.source_request_id AS request_id
    FROM (SELECT source_account_id, source_request_id, recipient_account_id FROM possible_sources
          UNION ALL  -- a prefix-cache collision whose matched block no event names (sql/prefix_sources.sql)
          SELECT source_account_id, source_request_id, recipient_account_id FROM prefix_possible_sources) p
    WHERE p.source_account_id <> p.recipient_account_id
      AND p.source_account_id NOT IN (SELECT account_id FROM confirmed)
), sourced AS (
    SELECT 'data_exposed_confirmed' AS role, * FROM confirmed
    UNION ALL SELECT 'data_exposed_possible' AS role, * FROM possible
), exposed AS (
    SELECT s.account_id, ac.account_class, s.role, count(*) AS responses, min(r.ts) AS first_ts, max(r.ts) AS last_ts,
           {{ string_agg_ordered(s.request_id, ' ', r.ts, s.request_id) }} AS request_ids
    FROM sourced s JOIN requests r ON r.request_id = s.request_id
    JOIN account_classes ac ON ac.account_id = s.account_id
    GROUP BY s.account_id, ac.account_class, s.role
)
SELECT * FROM received
UNION ALL SELECT * FROM exposed
ORDER BY role DESC NULLS LAST, account_class NULLS LAST, account_id NULLS LAST;
