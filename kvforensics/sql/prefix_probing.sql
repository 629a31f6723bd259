-- Prefix-cache probing: per account, how much its traffic looks like a timing attack on a shared prefix
-- cache, where a tenant sends a long prefix it guesses another tenant cached, varies the continuation a
-- token at a time, asks for a token or two and reads the time to first token back (a cache hit answers
-- sooner), then sends the next guess:
--   PromptPeek: G. Wu et al., "I Know What You Asked: Prompt Leakage via KV-Cache Sharing in Multi-Tenant
--     LLM Serving", NDSS 2025, https://www.ndss-symposium.org/ndss-paper/i-know-what-you-asked-prompt-leakage-via-kv-cache-sharing-in-multi-tenant-llm-serving/
--   L. Song et al., "The Early Bird Catches the Leak: Unveiling Timing Side Channels in LLM Serving
--     Systems", arXiv 2409.20002, https://arxiv.org/abs/2409.20002 (token-by-token search of shared prefixes)
--   X. Zheng et al., "InputSnatch: Stealing Input in LLM Services via Timing Side-Channel Attacks",
--     arXiv 2411.18191, https://arxiv.org/abs/2411.18191 (candidate inputs built over a cached prefix)
-- Inputs (temporary views made by kvforensics/stages/probing.py): probe_requests (the analysed requests),
-- probe_accounts (account classes), probe_blocks (request_blocks, or none), probe_hits (requests of the
-- prefix_reuse rules' findings and attributions, with the source account where known).
-- Parameters (kvforensics/stages/probing.py, PROBING_PARAMETERS): $probe_max_output_tokens, $probe_min_requests,
-- $probe_min_short_share, $probe_min_cached_fraction, $probe_min_cached_share, $probe_max_length_step,
-- $probe_min_small_step_share, $probe_min_continuations, $probe_max_gap_seconds, $probe_min_read_back_share,
-- $probe_min_foreign_hits, $probe_min_rises, $probe_min_rising_share.

-- The probe-shaped requests: answered (2xx) with at most a few output tokens, in each account's order.
CREATE OR REPLACE TEMP TABLE probe_candidates AS
SELECT r.request_id, r.account_id, r.ts, r.prompt_tokens, r.ttft_ms, r.latency_ms,
       coalesce(r.cached_tokens, 0) > 0
         AND coalesce(r.cached_tokens, 0) >= $probe_min_cached_fraction * r.prompt_tokens AS long_cached_prefix,
       row_number() OVER (PARTITION BY r.account_id ORDER BY r.ts ASC NULLS LAST, r.request_id ASC NULLS LAST) AS seq
FROM probe_requests r
WHERE r.status BETWEEN 200 AND 299 AND r.completion_tokens IS NOT NULL
  AND r.completion_tokens <= $probe_max_output_tokens;

-- Consecutive probes of one account: did the prompt length move by a few tokens at most (a continuation
-- varied token by token), and was the next one sent after the previous first token came back and soon
-- after it (the attacker reads the timing before choosing the next guess)?
CREATE OR REPLACE TEMP TABLE probe_steps AS
SELECT n.account_id,
       abs(n.prompt_tokens - p.prompt_tokens) <= $probe_max_length_step AS small_step,
       n.prompt_tokens >= p.prompt_tokens AS not_shrinking,
       n.prompt_tokens - p.prompt_tokens > $probe_max_length_step AS rise,
       n.ts >= {{ add_milliseconds(p.ts, coalesce(p.ttft_ms, p.latency_ms, 0)) }}
         AND n.ts <= {{ add_milliseconds(p.ts, coalesce(p.ttft_ms, p.latency_ms, 0) + $probe_max_gap_seconds * 1000) }}
         AS read_back
FROM probe_candidates p
JOIN probe_candidates n ON n.account_id = p.account_id AND n.seq = p.seq + 1;

-- With prefix blocks: each probe's last block and the chain of blocks before it. Many different last
-- blocks after one common chain are continuations varied over one shared prefix.
CREATE OR REPLACE TEMP TABLE probe_last_blocks AS
WITH ordered AS (
    SELECT b.request_id, b.block_fp, b.chain_fp,
           row_number() OVER (PARTITION BY b.request_id ORDER BY b.position DESC NULLS LAST) AS from_end
    FROM probe_blocks b
    WHERE b.request_id IN (SELECT request_id FROM probe_candidates)
)
SELECT c.account_id, c.request_id, l.block_fp AS last_block, p.chain_fp AS prefix_chain
FROM probe_candidates c
JOIN ordered l ON l.request_id = c.request_id AND l.from_end = 1
LEFT JOIN ordered p ON p.request_id = c.request_id AND p.from_end = 2;

CREATE OR REPLACE TEMP TABLE probe_continuations AS
SELECT account_id, max(continuations) AS max_continuations
FROM (SELECT account_id, prefix_chain, count(DISTINCT last_block) AS continuations
      FROM probe_last_blocks WHERE prefix_chain IS NOT NULL GROUP BY account_id, prefix_chain) g
GROUP BY account_id;

CREATE OR REPLACE TABLE probing_assessment AS
WITH totals AS (
    SELECT account_id, count(*) AS requests FROM probe_requests GROUP BY account_id
), probes AS (
    SELECT account_id, count(*) AS short_requests,
           count(CASE WHEN long_cached_prefix THEN 1 END) AS cached_prefix_requests,
           count(DISTINCT prompt_tokens) AS prompt_lengths
    FROM probe_candidates GROUP BY account_id
), steps AS (
    SELECT account_id, count(*) AS pairs,
           count(CASE WHEN small_step THEN 1 END) AS small_steps,
           count(CASE WHEN not_shrinking THEN 1 END) AS not_shrinking, count(CASE WHEN rise THEN 1 END) AS rises,
           count(CASE WHEN read_back THEN 1 END) AS read_backs
    FROM probe_steps GROUP BY account_id
), blocks AS (
    SELECT account_id, count(*) AS probes_with_blocks FROM probe_last_blocks GROUP BY account_id
), hits AS (
    SELECT r.account_id, count(DISTINCT h.request_id) AS cross_tenant_hits,
           count(DISTINCT h.source_account) AS source_accounts,
           count(DISTINCT CASE WHEN h.request_id IN (SELECT request_id FROM probe_candidates) THEN h.request_id END)
               AS foreign_probe_hits
    FROM probe_hits h JOIN probe_requests r ON r.request_id = h.request_id
    WHERE h.source_account IS NULL OR h.source_account <> r.account_id
    GROUP BY r.account_id
), features AS (
    SELECT t.account_id, coalesce(ac.account_class, 'customer') AS account_class, t.requests,
           coalesce(p.short_requests, 0) AS short_requests,
           {{ round_double(coalesce(p.short_requests, 0) / GREATEST(t.requests, 1), 4) }} AS short_share,
           {{ round_double(coalesce(p.cached_prefix_requests, 0) / GREATEST(coalesce(p.short_requests, 0), 1), 4) }}
             AS cached_prefix_share,
           CASE WHEN coalesce(b.probes_with_blocks, 0) > 0 THEN 'prefix blocks' ELSE 'prompt lengths' END
             AS continuation_basis,
           coalesce(c.max_continuations, 0) AS max_continuations,
           coalesce(p.prompt_lengths, 0) AS prompt_lengths,
           {{ round_double(coalesce(s.small_steps, 0) / GREATEST(coalesce(s.pairs, 0), 1), 4) }} AS small_step_share,
           {{ round_double(coalesce(s.read_backs, 0) / GREATEST(coalesce(s.pairs, 0), 1), 4) }} AS read_back_share,
           {{ round_double(coalesce(s.not_shrinking, 0) / GREATEST(coalesce(s.pairs, 0), 1), 4) }} AS rising_share,
           coalesce(s.rises, 0) AS rises,
           coalesce(x.foreign_probe_hits, 0) AS foreign_probe_hits,
           coalesce(x.cross_tenant_hits, 0) AS cross_tenant_hits,
           coalesce(x.source_accounts, 0) AS source_accounts
    FROM totals t
    LEFT JOIN probe_accounts ac ON ac.account_id = t.account_id
    LEFT JOIN probes p ON p.account_id = t.account_id
    LEFT JOIN steps s ON s.account_id = t.account_id
    LEFT JOIN blocks b ON b.account_id = t.account_id
    LEFT JOIN probe_continuations c ON c.account_id = t.account_id
    LEFT JOIN hits x ON x.account_id = t.account_id
), signals AS (
    SELECT f.*,
           f.short_requests >= $probe_min_requests AND f.short_share >= $probe_min_short_share AS many_short,
           f.cached_prefix_share >= $probe_min_cached_share AS long_prefix,
           -- request_blocks holds full blocks only: a guess inside the last, partial block shows in the
           -- prompt lengths alone, so either measure may show the variation
           f.max_continuations >= $probe_min_continuations
             OR (f.prompt_lengths >= $probe_min_continuations
                 AND f.small_step_share >= $probe_min_small_step_share) AS varied,
           f.read_back_share >= $probe_min_read_back_share AS read_back,
           -- probes on content the account had not sent itself: its short requests reused other tenants' blocks
           f.foreign_probe_hits >= $probe_min_foreign_hits AND f.foreign_probe_hits > 0 AS foreign_prefixes,
           -- the known prefix grows (by a block after each hit): lengths never shrink and rise step by step
           f.rises >= $probe_min_rises AND f.rising_share >= $probe_min_rising_share AS growing
    FROM features f
    WHERE f.short_requests > 0 OR f.cross_tenant_hits > 0
)
SELECT account_id, account_class, requests, short_requests, short_share, cached_prefix_share, continuation_basis,
       max_continuations, prompt_lengths, small_step_share, read_back_share, cross_tenant_hits, source_accounts,
       rising_share, rises, foreign_probe_hits,
       many_short, long_prefix, varied, read_back, foreign_prefixes, growing,
       CAST(many_short AS INTEGER) + CAST(long_prefix AS INTEGER) + CAST(varied AS INTEGER)
         + CAST(read_back AS INTEGER) + CAST(foreign_prefixes AS INTEGER) + CAST(growing AS INTEGER) AS signals,
       -- probing reads other tenants' content: without short requests on it, no shape of traffic alone
       -- (an evaluation harness, autocomplete, keep-alives, retries) is probing
       CASE WHEN many_short AND foreign_prefixes AND long_prefix AND (varied OR growing) AND (read_back OR growing)
                THEN 'likely'
            WHEN many_short AND foreign_prefixes AND (varied OR growing OR long_prefix OR read_back) THEN 'possible'
            ELSE 'no' END AS probing,
       coalesce(nullif(concat_ws('; ',
           CASE WHEN many_short THEN CAST(short_requests AS STRING) || ' of ' || CAST(requests AS STRING)
                || ' requests answered with at most ' || CAST($probe_max_output_tokens AS STRING)
                || ' output tokens' END,
           CASE WHEN long_prefix THEN CAST(CAST({{ round_double(100 * cached_prefix_share, 0) }} AS BIGINT) AS STRING)
                || '% of them reused a cached prefix of at least '
                || CAST(CAST({{ round_double(100 * $probe_min_cached_fraction, 0) }} AS BIGINT) AS STRING)
                || '% of the prompt' END,
           CASE WHEN varied AND max_continuations >= $probe_min_continuations THEN CAST(max_continuations AS STRING)
                || ' different last blocks after one common prefix'
                WHEN varied THEN CAST(prompt_lengths AS STRING) || ' prompt lengths, '
                || CAST(CAST({{ round_double(100 * small_step_share, 0) }} AS BIGINT) AS STRING)
                || '% of consecutive ones within ' || CAST($probe_max_length_step AS STRING) || ' tokens'
                WHEN many_short THEN 'but no continuations varied over one common prefix' END,
           CASE WHEN read_back THEN CAST(CAST({{ round_double(100 * read_back_share, 0) }} AS BIGINT) AS STRING)
                || '% sent after the previous first token and within ' || CAST($probe_max_gap_seconds AS STRING)
                || ' s of it' END,
           CASE WHEN growing THEN 'the prompt grew ' || CAST(rises AS STRING)
                || ' times by more than ' || CAST($probe_max_length_step AS STRING) || ' tokens and never shrank in '
                || CAST(CAST({{ round_double(100 * rising_share, 0) }} AS BIGINT) AS STRING)
                || '% of consecutive short requests' END,
           CASE WHEN foreign_prefixes THEN CAST(foreign_probe_hits AS STRING)
                || ' short requests reused prefixes stored by other tenants'
                WHEN many_short THEN 'but no short request reused another tenant''s prefix' END), ''),
           'no probing signal') AS why
FROM signals;
