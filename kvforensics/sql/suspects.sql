-- The accounts suspected of deliberate exploitation, one row per account and mechanism: customers whose traffic has
-- the stale-pages probing pattern (account_behaviour.looks_deliberate) or the prefix-cache probing one
-- (probing_assessment: likely; a table of its own only when prefix_reuse is investigated, so that part is added by
-- kvforensics/stages/scope.py). Internal and reporter accounts are never suspects. Their notices go to the provider's
-- trust-and-safety team, not to them (kvforensics/report/notices.py); notifications.csv marks them.
CREATE OR REPLACE TABLE suspected_exploiters AS
SELECT account_id, 'stale_pages' AS mechanism,
       format('{:,} prompts at or beyond an exposed KV pool, {:.0f}% of them within {:.0f}% above it; up to {:,} in '
              || 'one hour; {}; {}',
              oversize_requests, 100 * near_pool_share, 100 * $near_pool_fraction, max_oversize_per_hour,
              CASE WHEN max_identical_prompt_length >= 2
                   THEN format('one prompt length sent {:,} times', max_identical_prompt_length)
                   ELSE 'no prompt length repeated' END,
              CASE WHEN affected_responses = 1 THEN '1 affected response'
                   ELSE format('{:,} affected responses', affected_responses) END) AS why
FROM account_behaviour
WHERE looks_deliberate AND account_class = 'customer';
