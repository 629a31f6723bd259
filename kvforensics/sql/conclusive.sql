-- The conclusiveness gate: can this run's evidence support its answer? Runs on the evidence
-- database after scope. The statements before the first check prepare what the checks share;
-- each `-- reason: <code>` statement is one check and returns one row per problem found: `message`
-- (one line: what was seen and what to do) and the numbers behind it (every other column).
-- Parameters: $quarantine_limits, a list of {kind, max_fraction, fix}: the share of a source's records of that
-- kind that may be quarantined; $needs, a list of {rule, fields}: a rule cannot judge a
-- model's responses when every field of its group is NULL for all of them; $prefix_needs, what the
-- prefix_reuse mechanism's rules and probing need of the requests they judge (conclusive.PREFIX_NEEDS);
-- $kv_event_mechanism and $kv_event_rules, the mechanism whose responses lost KV events leave unexplained, its rules.

-- timestamps in messages: UTC ISO-8601 to the second
CREATE OR REPLACE TEMP MACRO gate_ts(t) AS coalesce(strftime(t, '%Y-%m-%dT%H:%M:%SZ'), 'still running');

-- a list of untrusted names for a message: the first three, quoted, and how many more
CREATE OR REPLACE TEMP MACRO gate_names(names) AS
    array_to_string(list_transform(names[1:3], lambda x: '''' || left(x, 80) || ''''), ', ')
    || CASE WHEN len(names) > 3 THEN format(' and {:,} more', len(names) - 3) ELSE '' END;

-- exposure windows that can be placed (a model and a start time; a start-up lacking them is a
-- reason of its own): the start-ups audit check 1 fails (table exposure_windows, kvforensics/audit/exposure.py;
-- a start-up the engine refused never served, a unified server refuses a prompt beyond its pool)
CREATE OR REPLACE TEMP TABLE gate_windows AS
SELECT instance, role, model, valid_from, valid_to, kv_pool_tokens, context_length
FROM exposure_windows
WHERE model IS NOT NULL AND valid_from IS NOT NULL;

-- per exposure window: the requests of its model in it, and how many successful ones (the ones the
-- rules judge) carry each optional field (one join of the windows with the requests, shared)
CREATE OR REPLACE TEMP TABLE gate_window_requests AS
SELECT w.instance, w.valid_from, any_value(w.model) AS model, count(r.request_id) AS requests,
       count(r.request_id) FILTER (WHERE r.status BETWEEN 200 AND 299) AS successful,
       count(r.ttft_ms) FILTER (WHERE r.status BETWEEN 200 AND 299) AS ttft_ms,
       count(r.latency_ms) FILTER (WHERE r.status BETWEEN 200 AND 299) AS latency_ms,
       count(r.cached_tokens) FILTER (WHERE r.status BETWEEN 200 AND 299) AS cached_tokens,
       count(r.completion_tokens) FILTER (WHERE r.status BETWEEN 200 AND 299) AS completion_tokens,
       count(r.prefill_instance) FILTER (WHERE r.status BETWEEN 200 AND 299) AS prefill_instance,
       count(r.decode_instance) FILTER (WHERE r.status BETWEEN 200 AND 299) AS decode_instance
FROM gate_windows w
LEFT JOIN analysed_requests r ON r.model = w.model AND r.ts >= w.valid_from AND (w.valid_to IS NULL OR r.ts < w.valid_to)
GROUP BY w.instance, w.valid_from;

-- per requested model: how many requests, the largest prompt
CREATE OR REPLACE TEMP TABLE gate_models AS
SELECT model, count(*) AS requests, max(prompt_tokens) AS largest_prompt FROM analysed_requests GROUP BY model;

-- the requests the prefix_reuse mechanism judges, when it is investigated: every successful request of
-- the analysed period (cached_tokens says whether it hit), and its hits (cached_tokens > 0) for the
-- salt and block needs. Per model, hit or not and the list of what each request carries, counted:
-- its optional fields, 'request_blocks' (its prompt cut into blocks), 'kv_events' (its instance, any
-- instance when it names none, published KV events in the hour it was served) and 'kv_events.salt'
-- (one of those events carried a salt)
CREATE OR REPLACE TEMP TABLE gate_prefix_requests AS
WITH event_hours AS (
    SELECT instance, date_trunc('hour', ts) AS hour, bool_or(salt IS NOT NULL) AS salted
    FROM kv_events GROUP BY 1, 2
), any_instance AS (
    SELECT hour, bool_or(salted) AS salted FROM event_hours GROUP BY hour
), judged AS (
    SELECT r.model, coalesce(r.cached_tokens, 0) > 0 AS hit,
           list_filter([CASE WHEN r.cached_tokens IS NOT NULL THEN 'cached_tokens' END,
                        CASE WHEN r.cache_salt IS NOT NULL THEN 'cache_salt' END,
                        CASE WHEN r.prefill_instance IS NOT NULL THEN 'prefill_instance' END,
                        CASE WHEN r.ttft_ms IS NOT NULL THEN 'ttft_ms' END,
                        CASE WHEN r.latency_ms IS NOT NULL THEN 'latency_ms' END,
                        CASE WHEN r.request_id IN (SELECT request_id FROM request_blocks) THEN 'request_blocks' END,
                        CASE WHEN coalesce(e.hour, a.hour) IS NOT NULL THEN 'kv_events' END,
                        CASE WHEN coalesce(e.salted, a.salted) THEN 'kv_events.salt' END],
                       lambda x: x IS NOT NULL) AS present
    FROM analysed_requests r
    LEFT JOIN event_hours e ON e.instance = r.prefill_instance AND e.hour = date_trunc('hour', r.ts)
    LEFT JOIN any_instance a ON r.prefill_instance IS NULL AND a.hour = date_trunc('hour', r.ts)
    WHERE r.status BETWEEN 200 AND 299
      AND EXISTS (SELECT 1 FROM mechanisms m WHERE m.id = 'prefix_reuse' AND m.selected)
)
SELECT model, hit, present, count(*) AS requests FROM judged GROUP BY model, hit, present;

-- reason: quarantine_share
-- any kind of source: its limit is $quarantine_limits' (conclusive.QUARANTINE_FIXES: what to fix; [quarantine] <kind>,
-- else [settings] max_quarantine_fraction)
WITH limits AS (
    SELECT l.kind, l.max_fraction, l.fix FROM (SELECT unnest($quarantine_limits) AS l)
), per_source AS (
    SELECT source, any_value(kind) AS kind, sum(records_read) AS records_read, sum(quarantined) AS quarantined
    FROM load_report GROUP BY source
), reasons AS (
    -- a reason without the value it quotes, so one mapping problem counts once
    SELECT source, regexp_replace(reason, ': ''.*$', '') AS reason, count(*) AS records
    FROM quarantine GROUP BY 1, 2
), top AS (
    SELECT *, row_number() OVER (PARTITION BY source ORDER BY records DESC, reason) AS k FROM reasons
)
SELECT format('{} source ''{}'': {:,} of {:,} records quarantined ({:.1f}%, above its limit {:.1f}%), most often "{}" '
              || '({:,}): {}, or raise [quarantine] {} (default: [settings] max_quarantine_fraction) if losing them '
              || 'is acceptable', p.kind, p.source, p.quarantined, p.records_read, 100.0 * p.quarantined / p.records_read,
              100.0 * l.max_fraction, coalesce(t.reason, 'unknown'), coalesce(t.records, 0), l.fix, p.kind) AS message,
       p.source, p.kind, p.records_read, p.quarantined, round(p.quarantined / p.records_read, 4) AS fraction,
       l.max_fraction AS max_quarantine_fraction, t.reason AS top_reason, t.records AS top_reason_records
FROM per_source p JOIN limits l ON l.kind = p.kind LEFT JOIN top t ON t.source = p.source AND t.k = 1
WHERE p.records_read > 0 AND p.quarantined > l.max_fraction * p.records_read
ORDER BY p.source;

-- reason: truncated_file
WITH notes AS (
    SELECT source, kind, file, list_filter(string_split(notes, '; '),
                                           lambda x: regexp_matches(x, 'ends early|truncated after line'))[1] AS note
    FROM load_report WHERE notes IS NOT NULL
)
SELECT format('{} file ''{}'' of source ''{}'' is incomplete ({}): whatever it held after that point is missing; '
              || 'collect the complete file and run again', kind, regexp_extract(file, '[^/]+$'), source, note) AS message,
       source, kind, file, note
FROM notes WHERE note IS NOT NULL
ORDER BY source, file;

-- reason: no_requests
SELECT format('no request in the analysed period ({:,} records read from requests sources, {:,} loaded, {:,} quarantined): '
              || 'no answer can be given; check the requests sources'' paths, mapping and [scope] start/end '
              || '(quarantine.csv says why records were refused)', n_read, n_loaded, n_quarantined) AS message,
       n_read AS records_read, n_loaded AS requests_loaded, n_quarantined AS quarantined, 0 AS requests_analysed
FROM (SELECT (SELECT coalesce(sum(records_read), 0) FROM load_report WHERE kind = 'requests') AS n_read,
             (SELECT count(*) FROM requests) AS n_loaded,
             (SELECT coalesce(sum(quarantined), 0) FROM load_report WHERE kind = 'requests') AS n_quarantined,
             (SELECT count(*) FROM analysed_requests) AS n_analysed)
WHERE n_analysed = 0;

-- reason: model_without_capacity
WITH unserved AS (SELECT list(DISTINCT coalesce(engine_model, '?') ORDER BY coalesce(engine_model, '?')) AS names
                  FROM capacity WHERE model IS NULL OR model NOT IN (SELECT model FROM gate_models))
SELECT format('model ''{}'': {:,} requests (largest prompt {:,} tokens) but no engine start-up serves it, so its KV pool '
              || 'is unknown and none of its responses can be judged against one; add its engine logs, or map the '
              || 'engine''s model name to it with [models] aliases{}', m.model, m.requests, m.largest_prompt,
              CASE WHEN len(u.names) > 0 THEN ' (the engine logs name ' || gate_names(u.names) || ')' ELSE '' END)
           AS message,
       m.model, m.requests, m.largest_prompt
FROM gate_models m CROSS JOIN unserved u
WHERE m.model NOT IN (SELECT model FROM capacity WHERE model IS NOT NULL)
ORDER BY m.model;

-- reason: startup_incomplete
WITH missing AS (
    SELECT c.instance, c.source_file, c.source_line,
           list_filter([CASE WHEN c.model IS NULL THEN 'model' END,
                        CASE WHEN c.valid_from IS NULL THEN 'start time' END,
                        CASE WHEN c.kv_pool_tokens IS NULL THEN 'KV pool size' END,
                        CASE WHEN c.context_length IS NULL THEN 'context length' END], lambda x: x IS NOT NULL) AS what
    FROM capacity c
    WHERE NOT coalesce(c.startup_refused, false)
      -- a KV pool or context length refused as impossible is reason startup_value_refused
      AND NOT (c.model IS NOT NULL AND c.valid_from IS NOT NULL
               AND (c.kv_pool_tokens IS NOT NULL OR contains(coalesce(c.flags->>'$.refused_fields', ''), 'kv_pool_tokens'))
               AND (c.context_length IS NOT NULL OR contains(coalesce(c.flags->>'$.refused_fields', ''), 'context_length')))
      -- a start-up of an unknown model may serve any; one of a model nobody requested cannot matter
      AND (c.model IS NULL OR (c.model IN (SELECT model FROM gate_models)
           AND (c.valid_from IS NULL OR c.kv_pool_tokens IS NULL OR c.context_length IS NULL)))
)
SELECT format('engine instance ''{}'': {:,} start-up(s) without a {} (first at {} line {}): whether and when it was exposed '
              || 'cannot be told; check that its log holds the whole start-up (server_args, KV cache allocation) '
              || 'and set the source''s model, timezone or year where the log does not say', instance, count(*),
              array_to_string(list_sort(list_distinct(flatten(list(what)))), ', '), regexp_extract(min(source_file), '[^/]+$'),
              coalesce(CAST(min(source_line) AS VARCHAR), '?')) AS message,
       instance, count(*) AS startups, list_sort(list_distinct(flatten(list(what)))) AS missing
FROM missing
GROUP BY instance
ORDER BY instance;

-- reason: window_without_requests
SELECT format('exposure window of {} ({}, model ''{}'', KV pool {:,} < context {:,}) from {} to {} holds no loaded '
              || 'request of its model: the gateway log does not cover it, or names the model differently; add the '
              || 'gateway logs of that period or map the model names', w.instance, w.role, w.model, w.kv_pool_tokens,
              w.context_length, gate_ts(w.valid_from), gate_ts(w.valid_to)) AS message,
       w.instance, w.role, w.model, w.valid_from AS start, w.valid_to AS "end", w.kv_pool_tokens AS pool_tokens,
       w.context_length
FROM gate_windows w
JOIN gate_window_requests n ON n.instance = w.instance AND n.valid_from = w.valid_from
CROSS JOIN analysis_period p
WHERE n.requests = 0
  AND (p.period_end IS NULL OR w.valid_from < p.period_end)
  AND (p.period_start IS NULL OR w.valid_to IS NULL OR w.valid_to > p.period_start)
ORDER BY w.valid_from, w.instance;

-- reason: rule_field_missing
WITH per_model AS (
    -- windows of one model overlap (its prefill and decode instances): the busiest one's count is
    -- a lower bound of the model's successful requests in its windows
    SELECT model, max(successful) AS successful, sum(ttft_ms) AS ttft_ms, sum(latency_ms) AS latency_ms,
           sum(cached_tokens) AS cached_tokens, sum(completion_tokens) AS completion_tokens,
           sum(prefill_instance) AS prefill_instance, sum(decode_instance) AS decode_instance
    FROM gate_window_requests GROUP BY model HAVING max(successful) > 0
), present AS (
    UNPIVOT (SELECT * EXCLUDE (successful) FROM per_model) ON COLUMNS(* EXCLUDE (model)) INTO NAME field VALUE n
), needs AS (
    SELECT n.rule, n.fields, unnest(n.fields) AS field FROM (SELECT unnest($needs) AS n)
), windows AS (
    SELECT format('model ''{}'': {} empty for every successful request in its exposure windows (at least {:,}), so rule {} '
                  || 'cannot judge them; map the field in the requests source''s columns (or a preset), or check its '
                  || 'null tokens', p.model, array_to_string(n.fields, ' and '), any_value(m.successful), n.rule) AS message,
           p.model, n.rule, n.fields, any_value(m.successful) AS requests
    FROM needs n JOIN present p USING (field) JOIN per_model m ON m.model = p.model
    GROUP BY p.model, n.rule, n.fields
    HAVING sum(p.n) = 0
), prefix_needs AS (
    -- $prefix_needs (conclusive.PREFIX_NEEDS): a need is missing for a model when its fields are all empty
    -- for the requests it judges (its hits, or every successful request), or present for fewer than
    -- min_share of them; when_logged: only when some request of the period carries one of them (a salt
    -- nobody logs is not missing, it was never set)
    SELECT unnest($prefix_needs) AS n
), prefix AS (
    SELECT p.n.rule AS rule, p.n.fields AS fields, p.n.hits_only AS hits_only, p.n.min_share AS min_share,
           p.n.when_logged AS when_logged, p.n.when_store AS when_store, p.n.consequence AS consequence, g.model,
           sum(g.requests) AS requests,
           coalesce(sum(g.requests) FILTER (WHERE list_has_any(g.present, p.n.fields)), 0) AS with_fields
    FROM prefix_needs p JOIN gate_prefix_requests g ON g.hit OR NOT p.n.hits_only
    GROUP BY ALL
)
SELECT * FROM windows
UNION ALL
SELECT format('model ''{}'': {} empty for {:,} of its {:,} {} in the analysed period, so {}', model,
              array_to_string(fields, ' and '), requests - with_fields, requests,
              CASE WHEN hits_only THEN 'prefix-cache hits (cached_tokens > 0)' ELSE 'successful requests' END,
              consequence) AS message,
       model, rule, fields, requests
FROM prefix
WHERE requests > 0 AND (with_fields = 0 OR with_fields < min_share * requests)
  AND (NOT when_logged
       OR EXISTS (SELECT 1 FROM gate_prefix_requests x WHERE list_has_any(x.present, fields)))
  AND (NOT when_store OR EXISTS (SELECT 1 FROM prefix_windows w WHERE w.path = 'salt_blind_store'))
ORDER BY model, rule;

-- reason: unknown_instances
WITH named AS (
    SELECT 'prefill_instance' AS field, prefill_instance AS instance FROM analysed_requests WHERE prefill_instance IS NOT NULL
    UNION ALL
    SELECT 'decode_instance', decode_instance FROM analysed_requests WHERE decode_instance IS NOT NULL
), unknown AS (
    SELECT field, instance, count(*) AS requests FROM named
    WHERE instance NOT IN (SELECT instance FROM capacity) GROUP BY 1, 2
), known AS (SELECT list(DISTINCT instance ORDER BY instance) AS names FROM capacity)
SELECT format('{:,} requests name {:,} {} value(s) that no engine log knows ({}){}: their KV pools cannot be looked '
              || 'up; map the names with [instances] match, or add those instances'' engine logs',
              sum(u.requests), count(*), u.field, gate_names(list(u.instance ORDER BY u.requests DESC, u.instance)),
              CASE WHEN len(any_value(k.names)) > 0
                   THEN '; the engine logs know ' || gate_names(any_value(k.names)) ELSE '; there are no engine logs' END)
           AS message,
       u.field, count(*) AS instances, sum(u.requests) AS requests,
       list(u.instance ORDER BY u.requests DESC, u.instance)[1:10] AS examples
FROM unknown u CROSS JOIN known k
GROUP BY u.field
ORDER BY u.field DESC;

-- reason: affected_outside_window
-- (exposure windows are the stale_pages mechanism's: a response another mechanism's rules flagged, such as a
-- prefix-cache hit, needs none; findings from before mechanisms have none recorded and count as stale_pages)
WITH outside AS (
    SELECT a.model, a.ts FROM affected_responses a
    WHERE NOT EXISTS (SELECT 1 FROM gate_windows w
                      WHERE w.model = a.model AND a.ts >= w.valid_from AND (w.valid_to IS NULL OR a.ts < w.valid_to))
      AND NOT EXISTS (SELECT 1 FROM findings f
                      WHERE f.request_id = a.request_id AND coalesce(f.mechanism, 'stale_pages') <> 'stale_pages')
), spans AS (
    SELECT model, count(*) AS windows, min(valid_from) AS first_start,
           CASE WHEN bool_or(valid_to IS NULL) THEN NULL ELSE max(valid_to) END AS last_end
    FROM gate_windows GROUP BY model
)
SELECT format('model ''{}'': {:,} affected responses ({} to {}) lie outside every exposure window of the model ({}): '
              || 'the gateway and engine-log clocks disagree (check each source''s timezone and clock_offset_s) or the '
              || 'exposure came from elsewhere; windows and sources are unreliable until this is explained',
              o.model, count(*), gate_ts(min(o.ts)), gate_ts(max(o.ts)),
              CASE WHEN any_value(s.windows) IS NULL THEN 'it has none'
                   ELSE format('{:,} window(s), {} to {}', any_value(s.windows), gate_ts(any_value(s.first_start)),
                               gate_ts(any_value(s.last_end))) END) AS message,
       o.model, count(*) AS responses, min(o.ts) AS first, max(o.ts) AS last,
       any_value(s.first_start) AS windows_start, any_value(s.last_end) AS windows_end
FROM outside o LEFT JOIN spans s ON s.model = o.model
GROUP BY o.model
ORDER BY o.model;

-- reason: requests_outside_startups
SELECT format('{:,} requests name prefill instance ''{}'' from {} to {}, when no start-up in its engine log covers them: '
              || 'its KV pool then is unknown; add the missing part of its log, or check the engine log''s timezone '
              || 'and clock_offset_s', g.requests, g.instance, gate_ts(g.start), gate_ts(g."end")) AS message,
       g.instance, g.requests, g.start, g."end"
FROM log_gaps g
WHERE g.source = 'engine_log' AND g.instance IN (SELECT instance FROM capacity)
ORDER BY g.start, g.instance;

-- reason: gateway_gap
SELECT format('requests source ''{}'' has no records from {} to {} ({}), inside an exposure window: responses served '
              || 'then cannot be judged; collect the missing gateway logs', g.source, gate_ts(g.start),
              gate_ts(g."end"), g.description) AS message,
       g.source, g.start, g."end"
FROM log_gaps g
WHERE g.instance IS NULL
  AND EXISTS (SELECT 1 FROM gate_windows w WHERE g."end" > w.valid_from AND (w.valid_to IS NULL OR g.start < w.valid_to))
ORDER BY g.source, g.start;

-- reason: kv_event_gap
-- messages a KV-event publisher numbered but the archive lacks (kv_event_gaps: a sequence gap, or the first messages
-- after a restart), in a span that holds responses the prefix_reuse mechanism judges on that instance (any instance
-- when the request names none): flagged by one of its rules ($kv_event_rules, from the rule registry), or prefix-cache
-- hits (cached_tokens > 0) served while a path across tenants was open on the instance (prefix_windows, or no
-- start-up says). Which blocks they reused and whose they were rests on the events that are missing
WITH lost AS (
    SELECT instance, dp_rank, seq_before, seq_after, missing, from_ts, to_ts,
           coalesce(from_ts, TIMESTAMPTZ '-infinity') AS lo, coalesce(to_ts, TIMESTAMPTZ 'infinity') AS hi
    FROM kv_event_gaps
    WHERE missing > 0 AND EXISTS (SELECT 1 FROM mechanisms m WHERE m.id = $kv_event_mechanism AND m.selected)
), flagged AS (
    SELECT DISTINCT request_id FROM findings WHERE list_contains($kv_event_rules, rule_id)
), open_paths AS (
    -- a hit can only have crossed tenants where its instance's start-up had a path across them (prefix_windows):
    -- where no start-up says, it could have been
    SELECT r.request_id
    FROM analysed_requests r
    WHERE EXISTS (SELECT 1 FROM lost)  -- no gap: no request to look at (a scan of every request spared)
      AND r.status BETWEEN 200 AND 299 AND r.cached_tokens > 0
      AND (EXISTS (SELECT 1 FROM prefix_windows w
                   WHERE w.instance = r.prefill_instance AND w.reach <> 'none'
                     AND (w.valid_from IS NULL OR w.valid_from <= r.ts) AND (w.valid_to IS NULL OR r.ts < w.valid_to))
           OR NOT EXISTS (SELECT 1 FROM prefix_windows w
                          WHERE w.instance = r.prefill_instance
                            AND (w.valid_from IS NULL OR w.valid_from <= r.ts) AND (w.valid_to IS NULL OR r.ts < w.valid_to)))
), judged AS (
    SELECT r.request_id, r.ts, r.prefill_instance, r.request_id IN (SELECT request_id FROM flagged) AS flagged
    FROM analysed_requests r
    WHERE r.request_id IN (SELECT request_id FROM open_paths) OR r.request_id IN (SELECT request_id FROM flagged)
), inside AS (
    SELECT DISTINCT l.instance, l.dp_rank, j.request_id, j.flagged
    FROM lost l JOIN judged j ON j.ts >= l.lo AND j.ts <= l.hi
                             AND (j.prefill_instance = l.instance OR j.prefill_instance IS NULL)
), per_rank AS (
    SELECT instance, dp_rank, count(*) AS gaps, sum(missing) AS missing, min(from_ts) AS first, max(to_ts) AS last,
           arg_min(seq_before, lo) AS seq_before, arg_min(seq_after, lo) AS seq_after
    FROM lost GROUP BY instance, dp_rank
), responses AS (
    SELECT instance, dp_rank, count(*) AS responses, count(*) FILTER (WHERE flagged) AS flagged
    FROM inside GROUP BY instance, dp_rank
)
SELECT format('KV events of instance ''{}''{}: {:,} message(s) lost in {:,} break(s) of the publisher''s sequence '
              || '(the first from seq {} to {}), from {} to {}, a span holding {:,} response(s) on that instance ({:,} '
              || 'flagged by the {} rules, {:,} other prefix-cache hits): which blocks they reused and whose they '
              || 'were rests on the lost events; recover the lost messages from the publisher''s replay buffer (its '
              || 'replay_endpoint keeps the last batches while the engine runs) or the subscriber''s other copy, and '
              || 'add them to the source', p.instance,
              CASE WHEN p.dp_rank IS NULL THEN '' ELSE format(' (dp rank {})', p.dp_rank) END, p.missing, p.gaps,
              p.seq_before, p.seq_after, gate_ts(p.first), gate_ts(p.last), r.responses, r.flagged,
              $kv_event_mechanism, r.responses - r.flagged) AS message,
       p.instance, p.dp_rank, p.gaps, p.missing, p.first, p.last, r.responses, r.flagged,
       r.responses - r.flagged AS hits
FROM per_rank p JOIN responses r ON r.instance = p.instance AND r.dp_rank IS NOT DISTINCT FROM p.dp_rank
ORDER BY p.instance, p.dp_rank NULLS FIRST;

-- reason: mechanism_inputs_missing
SELECT format('mechanism ''{}'' is named in the incident file but the evidence lacks {}: its rules cannot judge every '
              || 'response, so finding nothing is not an all-clear; add the source(s) that carry it, or remove the '
              || 'mechanism from mechanisms', m.id, array_to_string(m.missing_inputs, ' and ')) AS message,
       m.id AS mechanism, m.missing_inputs
FROM mechanisms m
WHERE m.named AND len(m.missing_inputs) > 0
ORDER BY m.id;

-- reason: cached_tokens_disagree
-- the gateway's cached_tokens against the engine's own count for the same request and prompt (table
-- engine_cached_tokens, sql/cached_tokens.sql): a few differences are an ingest warning; more than
-- $max_cached_tokens_disagree_fraction of the requests both count make the two sources contradict each other
WITH compared AS (
    SELECT e.request_id, e.engine_cached <> e.gateway_cached AS differ
    FROM engine_cached_tokens e SEMI JOIN analysed_requests r ON r.request_id = e.request_id
    WHERE e.gateway_cached IS NOT NULL
)
SELECT format('cached_tokens: the gateway''s count and the engines'' own count (ReqTimeStats cached_input_len) differ '
              || 'for {:,} of the {:,} requests both count ({:.1f}%, above {:.1f}%; e.g. {}): the prefix-cache hits '
              || 'and expected prefill times rest on two contradicting sources; check which engine the gateway''s '
              || 'number comes from (a PD decode instance may report its own) and map the field that holds the '
              || 'prefill''s count', count(*) FILTER (WHERE differ), count(*),
              100.0 * count(*) FILTER (WHERE differ) / count(*), 100.0 * $max_cached_tokens_disagree_fraction,
              gate_names(list(request_id ORDER BY request_id) FILTER (WHERE differ))) AS message,
       count(*) FILTER (WHERE differ) AS differing, count(*) AS compared,
       round(count(*) FILTER (WHERE differ) / count(*), 4) AS fraction,
       $max_cached_tokens_disagree_fraction AS max_fraction
FROM compared
HAVING count(*) > 0 AND count(*) FILTER (WHERE differ) > $max_cached_tokens_disagree_fraction * count(*);

-- reason: prompt_tokens_disagree
-- the gateway's prompt_tokens against the engines' own count of the same successful request (SGLang ReqTimeStats
-- input_len), beyond the engine_token_count_mismatch rule's tolerance, on the requests the incident does not
-- explain: the engine logged no abort for them and no other rule flagged them (a rejected prompt's 1-token stub
-- is the incident's own signal). More than $max_prompt_tokens_disagree_fraction of them differing means the
-- gateway's count is not the prompt the engine prefilled (a total, or the uncached part, mapped to
-- prompt_tokens?), and every comparison with a KV pool rests on it
WITH counted AS (
    SELECT request_id, min(prompt_tokens) AS engine_prompt
    FROM engine_events
    WHERE kind = 'req_time_stats' AND request_id IS NOT NULL AND prompt_tokens IS NOT NULL
    GROUP BY request_id
    HAVING min(prompt_tokens) = max(prompt_tokens)  -- one count (count(DISTINCT) = 1 here, and cheaper)
), compared AS (
    SELECT r.request_id,
           abs(c.engine_prompt - r.prompt_tokens) > greatest($token_min_abs_diff, $token_max_rel_diff * r.prompt_tokens)
               AS differ
    FROM analysed_requests r JOIN counted c ON c.request_id = r.request_id
    WHERE r.status BETWEEN 200 AND 299
      AND NOT EXISTS (SELECT 1 FROM engine_events a WHERE a.request_id = r.request_id AND a.kind LIKE 'abort%')
      AND NOT EXISTS (SELECT 1 FROM findings f WHERE f.request_id = r.request_id
                                                 AND f.rule_id <> 'engine_token_count_mismatch')
)
SELECT format('prompt_tokens: the gateway''s count and the engines'' own count (ReqTimeStats input_len) differ by more '
              || 'than {:,} tokens and {:.0f}% for {:,} of the {:,} successful requests both count that no engine '
              || 'aborted and no other rule flagged ({:.1f}%, above {:.1f}%; e.g. {}): the prompt lengths compared with '
              || 'the KV pools contradict the engines''; check that prompt_tokens maps the prompt''s own token count '
              || '(not a total with the completion, nor the uncached part)',
              $token_min_abs_diff, 100.0 * $token_max_rel_diff, count(*) FILTER (WHERE differ), count(*),
              100.0 * count(*) FILTER (WHERE differ) / count(*), 100.0 * $max_prompt_tokens_disagree_fraction,
              gate_names(list(request_id ORDER BY request_id) FILTER (WHERE differ))) AS message,
       count(*) FILTER (WHERE differ) AS differing, count(*) AS compared,
       round(count(*) FILTER (WHERE differ) / count(*), 4) AS fraction,
       $max_prompt_tokens_disagree_fraction AS max_fraction
FROM compared
HAVING count(*) > 0 AND count(*) FILTER (WHERE differ) > $max_prompt_tokens_disagree_fraction * count(*);

-- reason: prefix_path_undetermined
-- prefix_reuse responses counted as affected whose instance had no start-up the investigation could judge
-- when they were served (no engine log covers them, or the isolation facts are not stated): whether a path
-- across tenants was open then is unknown, so the finding cannot be told from a tenant's own reuse
WITH flagged AS (
    SELECT DISTINCT a.request_id, a.ts, a.prefill_instance
    FROM affected_responses a JOIN findings f ON f.request_id = a.request_id AND f.mechanism = 'prefix_reuse'
), judged AS (
    SELECT x.request_id,
           max(CASE WHEN w.instance IS NULL OR w.reach = 'any' THEN 1 ELSE 0 END) AS undetermined,
           list(DISTINCT w.sentence) FILTER (WHERE w.reach = 'any') AS why
    FROM flagged x
    LEFT JOIN prefix_windows w ON w.instance = x.prefill_instance
                              AND (w.valid_from IS NULL OR w.valid_from <= x.ts) AND (w.valid_to IS NULL OR x.ts < w.valid_to)
    GROUP BY x.request_id
)
SELECT format('prefix_reuse: {:,} affected response(s) were served where no engine start-up says whether a path across '
              || 'tenants was open (e.g. {}{}): add the engine logs of those instances and state the deployment''s '
              || 'isolation facts in [prefix_cache] (tenants, cache_salt, engine_version)',
              count(*), gate_names(list(request_id ORDER BY request_id)),
              coalesce('; ' || any_value(why[1]), '')) AS message,
       count(*) AS responses
FROM judged WHERE undetermined = 1
HAVING count(*) > 0;

-- reason: prefix_affected_outside_window
-- prefix_reuse responses counted as affected on an instance whose start-up, when they were served, had no path
-- across tenants (salted per tenant, no shared store, a sound hash): the KV events and the engine logs (or the
-- isolation facts) contradict each other
WITH flagged AS (
    SELECT DISTINCT a.request_id, a.ts, a.prefill_instance
    FROM affected_responses a JOIN findings f ON f.request_id = a.request_id AND f.mechanism = 'prefix_reuse'
), judged AS (
    SELECT x.request_id, x.prefill_instance, count(w.instance) AS startups,
           count(*) FILTER (WHERE w.reach <> 'none') AS open_paths
    FROM flagged x
    JOIN prefix_windows w ON w.instance = x.prefill_instance
                         AND (w.valid_from IS NULL OR w.valid_from <= x.ts) AND (w.valid_to IS NULL OR x.ts < w.valid_to)
    GROUP BY x.request_id, x.prefill_instance
)
SELECT format('prefix_reuse: {:,} affected response(s) were served on instance(s) {} while their start-up had no path '
              || 'across tenants (e.g. {}): the KV events and the start-ups contradict each other; check the start-up '
              || 'logs (a storage backend or salt setting not logged) and [prefix_cache] (kv_store_keys_salt, '
              || 'engine_version)', count(*), gate_names(list(DISTINCT prefill_instance ORDER BY prefill_instance)),
              gate_names(list(request_id ORDER BY request_id))) AS message,
       count(*) AS responses
FROM judged WHERE open_paths = 0
HAVING count(*) > 0;

-- reason: prefix_window_unseen
-- a start-up with a store whose keys drop the salt, served cache hits, and published pages whose content
-- another namespace had stored first, but no response counted as affected by prefix_reuse falls in it: the reuse through the store
-- left no signature this run can read (a build that publishes host stores for its backups but none for a load,
-- events lost), so
-- "none affected" there is not shown
WITH windows AS (
    SELECT DISTINCT instance, valid_from, valid_to FROM prefix_windows WHERE path = 'salt_blind_store'
), first_stores AS (
    SELECT chain_fp, salt, min(ts) AS ts FROM kv_events
    WHERE kind = 'stored' AND chain_fp IS NOT NULL AND salt IS NOT NULL GROUP BY chain_fp, salt
), crossed AS (
    SELECT w.instance, w.valid_from, count(DISTINCT e.chain_fp) AS pages
    FROM windows w
    JOIN kv_events e ON e.instance = w.instance AND e.kind = 'stored' AND e.salt IS NOT NULL
                    AND (w.valid_from IS NULL OR e.ts >= w.valid_from) AND (w.valid_to IS NULL OR e.ts < w.valid_to)
    WHERE EXISTS (SELECT 1 FROM first_stores f WHERE f.chain_fp = e.chain_fp AND f.salt <> e.salt AND f.ts < e.ts)
    GROUP BY w.instance, w.valid_from
), silent AS (
    SELECT c.* FROM crossed c
    WHERE EXISTS (SELECT 1 FROM analysed_requests r
                  WHERE r.prefill_instance = c.instance AND r.cached_tokens > 0
                    AND (c.valid_from IS NULL OR r.ts >= c.valid_from))
      AND NOT EXISTS (SELECT 1 FROM affected_responses r JOIN findings f ON f.request_id = r.request_id
                      JOIN windows w ON w.instance = c.instance AND w.valid_from IS NOT DISTINCT FROM c.valid_from
                      WHERE f.mechanism = 'prefix_reuse' AND r.prefill_instance = c.instance
                        AND (w.valid_from IS NULL OR r.ts >= w.valid_from) AND (w.valid_to IS NULL OR r.ts < w.valid_to))
)
SELECT format('prefix_reuse: {:,} start-up(s) with a store that drops the cache salt ({}) served cache hits and '
              || 'published {:,} page(s) another namespace had stored first, yet no response there is flagged: '
              || 'the loads from the store left no signature in the KV events (a build that publishes host stores '
              || 'for its backups but none for a load, or lost events); check the engine build and the event archive',
              count(*), gate_names(list(instance ORDER BY instance)), sum(pages)) AS message,
       count(*) AS startups, sum(pages) AS pages
FROM silent
HAVING count(*) > 0;

-- reason: prefix_window_without_events
-- a start-up with a store whose keys drop the salt served cache hits, but the KV-event archive holds no event of
-- its instance from that start-up while it holds other instances' events: its loads from the store, the only
-- signature of a reuse there, cannot be read (an archive file missing, a subscriber not connected to it)
WITH windows AS (
    SELECT DISTINCT instance, valid_from, valid_to FROM prefix_windows WHERE path = 'salt_blind_store'
), unseen AS (
    SELECT w.instance, w.valid_from,
           (SELECT count(*) FROM analysed_requests r
            WHERE r.prefill_instance = w.instance AND r.cached_tokens > 0
              AND (w.valid_from IS NULL OR r.ts >= w.valid_from) AND (w.valid_to IS NULL OR r.ts < w.valid_to)) AS hits
    FROM windows w
    WHERE EXISTS (SELECT 1 FROM kv_events)
      AND NOT EXISTS (SELECT 1 FROM kv_events e
                      WHERE e.instance = w.instance
                        AND (w.valid_from IS NULL OR e.ts >= w.valid_from) AND (w.valid_to IS NULL OR e.ts < w.valid_to))
)
SELECT format('prefix_reuse: {:,} start-up(s) with a store that drops the cache salt ({}) served {:,} cache hit(s), '
              || 'but the KV events hold nothing of their instances then: loads from the store there cannot be '
              || 'read, so "none affected" there is not shown; add those instances'' KV-event archives',
              count(*), gate_names(list(instance ORDER BY instance)), sum(hits)) AS message,
       count(*) AS startups, sum(hits) AS hits
FROM unseen
WHERE hits > 0
HAVING count(*) > 0;

-- reason: prefix_store_loads_unmatched
-- the KV events show loads from a shared store of pages another namespace wrote (table prefix_store_loads), but
-- no request of the loading namespace arrived on that instance near the load: a response received another
-- tenant's pages and the run cannot say which (the gateway does not log cache_salt or the instance, its log
-- misses that period, or the clocks are far apart)
SELECT format('prefix_reuse: the KV events show {:,} load(s) of {:,} page(s) another namespace wrote to a shared store '
              || '(instances {}, from {} to {}) that no request of the loading namespace explains: a response received '
              || 'another tenant''s pages and the run cannot say which; map requests.cache_salt and the instance in the '
              || 'gateway source, add the gateway log of that period, or check the clocks (clock_offset_s)',
              count(DISTINCT (instance, ts, salt, leaf)), count(*), gate_names(list(DISTINCT instance ORDER BY instance)),
              gate_ts(min(ts)), gate_ts(max(ts))) AS message,
       count(DISTINCT (instance, ts, salt, leaf)) AS loads, count(*) AS pages
FROM prefix_store_loads
WHERE request_id IS NULL
HAVING count(*) > 0;

-- reason: prefix_store_loads_ambiguous
-- a load from a shared store of pages another namespace wrote was given to the request of the loading namespace
-- nearest in time, but another successful request of that namespace near it logs no cached_tokens (a streamed
-- response without usage): nothing shows which of them received the foreign pages, so the recipients (and the
-- notices) may name the wrong account
SELECT format('prefix_reuse: {:,} load(s) of pages another namespace wrote to a shared store (instances {}, from {} '
              || 'to {}) could have served either of two or more requests of the loading namespace: the run took '
              || 'the nearest in time, but a successful request near each logs no cached_tokens and may be the '
              || 'one; map cached_tokens for every successful request (streamed responses: '
              || 'stream_options.include_usage)',
              count(*), gate_names(list(DISTINCT instance ORDER BY instance)), gate_ts(min(ts)),
              gate_ts(max(ts))) AS message,
       count(*) AS loads
FROM (SELECT DISTINCT instance, ts, salt, leaf FROM prefix_store_loads
      WHERE request_id IS NOT NULL AND matched_by = 'arrival' AND candidates > 1 AND unsized > 0)
HAVING count(*) > 0;

-- reason: admission_contradicted
-- successful responses whose prompt is longer than the KV pool of the unified start-up that served them (the
-- request names it as its prefill or decode instance; a request naming none, when every start-up of its model then
-- in force is unified and the prompt is longer than the largest of their pools). A unified server's own admission
-- refuses such a prompt (SGLang answers it with an error, validate_input_length; vLLM refuses to start with a KV
-- cache that cannot hold max_model_len and never schedules a prompt it cannot allocate), so audit check 1 and the
-- exposure windows say nothing was served from stale KV there, and prompt_exceeds_kv_pool judges only
-- disaggregated roles: a 2xx for such a prompt contradicts that story, and "none affected" cannot be shown until
-- it is explained (a pool or context misread, a gateway count or instance that is not the engine's, or a response
-- that is not a completion of the prompt: vLLM V0 answers a prompt it ignores with no tokens)
WITH unified AS (
    SELECT c.instance, c.model, c.engine, c.engine_version, c.valid_from, c.valid_to, c.kv_pool_tokens,
           c.context_length
    FROM capacity c
    WHERE c.role = 'unified' AND c.kv_pool_tokens IS NOT NULL AND c.valid_from IS NOT NULL
      AND NOT coalesce(c.startup_refused, false)
      AND NOT EXISTS (SELECT 1 FROM exposure_windows w
                      WHERE w.instance = c.instance AND w.valid_from IS NOT DISTINCT FROM c.valid_from)
), named AS (
    SELECT r.request_id, r.ts, r.model, r.prompt_tokens, u.instance, u.engine, u.engine_version,
           u.kv_pool_tokens, u.context_length
    FROM analysed_requests r
    JOIN unified u ON u.instance IN (r.prefill_instance, r.decode_instance)
                  AND r.ts >= u.valid_from AND (u.valid_to IS NULL OR r.ts < u.valid_to)
    WHERE r.status BETWEEN 200 AND 299 AND r.prompt_tokens > u.kv_pool_tokens
), unified_floor AS (
    -- a request naming no instance is judged only when its prompt is longer than every pool in force, all of them
    -- unified start-ups' pools: so it is longer than the least unified pool of its model (an exact pre-filter)
    SELECT model, min(kv_pool_tokens) AS least_pool FROM capacity
    WHERE role = 'unified' AND kv_pool_tokens IS NOT NULL AND NOT coalesce(startup_refused, false)
    GROUP BY model
), unnamed AS (
    SELECT r.request_id, r.ts, r.model, r.prompt_tokens,
           '(any server of the model)' AS instance, any_value(c.engine) AS engine,
           any_value(c.engine_version) AS engine_version, max(c.kv_pool_tokens) AS kv_pool_tokens,
           max(c.context_length) AS context_length
    FROM analysed_requests r
    JOIN unified_floor f ON f.model = r.model AND r.prompt_tokens > f.least_pool
    JOIN capacity c ON c.model = r.model AND c.valid_from <= r.ts AND (c.valid_to IS NULL OR r.ts < c.valid_to)
                   AND NOT coalesce(c.startup_refused, false)
    WHERE r.status BETWEEN 200 AND 299 AND r.prefill_instance IS NULL AND r.decode_instance IS NULL
    GROUP BY r.request_id, r.ts, r.model, r.prompt_tokens
    HAVING bool_and(c.role = 'unified' AND c.kv_pool_tokens IS NOT NULL
                    AND NOT EXISTS (SELECT 1 FROM exposure_windows w
                                    WHERE w.instance = c.instance AND w.valid_from IS NOT DISTINCT FROM c.valid_from))
       AND r.prompt_tokens > max(c.kv_pool_tokens)
), served AS (
    SELECT * FROM named UNION ALL SELECT * FROM unnamed
), grouped AS (
    SELECT s.model, s.instance, any_value(s.engine) AS engine, any_value(s.engine_version) AS engine_version,
           max(s.kv_pool_tokens) AS pool_tokens, max(s.context_length) AS context_length, count(*) AS responses,
           max(s.prompt_tokens) AS largest_prompt, min(s.ts) AS first, max(s.ts) AS last,
           count(*) FILTER (WHERE EXISTS (SELECT 1 FROM findings f WHERE f.request_id = s.request_id)) AS flagged,
           list(s.request_id ORDER BY s.ts, s.request_id)[1:10] AS examples
    FROM served s GROUP BY s.model, s.instance
)
SELECT format('{} (unified, model ''{}'', {} {}, KV pool {:,}{}) answered {:,} request(s) with HTTP 2xx '
              || 'although the prompt (largest {:,} tokens, {} to {}) is longer than the KV pool, which a unified server '
              || 'never serves: {}; {}; the evidence contradicts itself (the pool or context read from the log, the '
              || 'gateway''s prompt_tokens or instance, or the response itself: an ignored prompt answered with no '
              || 'tokens), so whether these responses carried another customer''s data cannot be told; compare the '
              || 'start-up''s pool with /get_server_info and these responses'' completion_tokens with the engine''s '
              || 'request log',
              CASE WHEN g.instance = '(any server of the model)'
                   THEN 'the servers of the model in force, for requests naming no instance'
                   ELSE 'engine instance ''' || g.instance || '''' END,
              g.model, coalesce(g.engine, 'engine'), coalesce(regexp_replace(g.engine_version, ' \(.*$', ''), 'version unknown'),
              g.pool_tokens,
              CASE WHEN g.context_length IS NOT NULL THEN format(', context {:,}', g.context_length) ELSE '' END,
              g.responses, g.largest_prompt, gate_ts(g.first), gate_ts(g.last),
              CASE WHEN g.engine = 'vllm'
                   THEN 'vLLM refuses to start with a KV cache that cannot hold max_model_len and never schedules a '
                        || 'prompt it cannot allocate (vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory, '
                        || 'vllm/v1/core/sched/scheduler.py; V0: vllm/worker/worker.py raise_if_cache_size_invalid, '
                        || 'vllm/core/scheduler.py)'
                   ELSE 'SGLang''s scheduler refuses a prompt beyond the pool with an error (validate_input_length)' END,
              CASE WHEN g.flagged > 0 THEN format('{:,} of them flagged by a rule', g.flagged)
                   WHEN lm.usable THEN 'no rule flagged them (prompt_exceeds_kv_pool judges only disaggregated roles; '
                                       || 'prefill_too_fast found them no faster than a real prefill)'
                   ELSE 'no rule could judge them (prompt_exceeds_kv_pool judges only disaggregated roles; '
                        || 'prefill_too_fast has no usable latency model for the model: '
                        || coalesce(lm.reason, 'none fitted') || ')' END) AS message,
       g.model, g.instance, g.pool_tokens, g.context_length, g.responses, g.largest_prompt, g.first, g.last,
       g.flagged, g.examples
FROM grouped g LEFT JOIN latency_model lm ON lm.model = g.model
ORDER BY g.model, g.instance;

-- reason: window_unjudged
-- an exposure window (table exposure_windows: audit check 1 fails) holding successful requests of its model none of
-- which any stale_pages rule can judge: prompt_exceeds_kv_pool needs them placed on the window (a prefill window:
-- requests naming it, or naming no prefill instance; a decode window: requests naming it as their decode instance,
-- and a window whose role no line shows: none), prefill_too_fast a usable latency model of the model (enough points)
-- and a timing, the engine-event rules per-request lines of that instance naming the gateway's request ids. A
-- window no rule can judge is not "none affected"
WITH per_window AS (
    SELECT w.instance, w.valid_from, any_value(w.role) AS role, any_value(w.model) AS model,
           any_value(w.valid_to) AS valid_to, any_value(w.kv_pool_tokens) AS pool_tokens,
           any_value(w.context_length) AS context_length, count(*) AS successful,
           count(*) FILTER (WHERE (w.role = 'prefill' AND (r.prefill_instance = w.instance OR r.prefill_instance IS NULL))
                               OR (w.role = 'decode' AND r.decode_instance = w.instance)) AS by_pool,
           count(*) FILTER (WHERE coalesce(r.ttft_ms, r.latency_ms) IS NOT NULL) AS timed
    FROM gate_windows w
    JOIN analysed_requests r ON r.model = w.model AND r.ts >= w.valid_from AND (w.valid_to IS NULL OR r.ts < w.valid_to)
    WHERE r.status BETWEEN 200 AND 299
    GROUP BY w.instance, w.valid_from
), judged AS (
    SELECT p.*, coalesce(lm.usable, false) AND p.timed > 0 AS by_latency, lm.reason AS latency_reason
    FROM per_window p LEFT JOIN latency_model lm ON lm.model = p.model
), unjudged AS (
    -- the engine-event rules are asked last, and only of the windows neither other rule judges: their lines joined to
    -- the gateway's request ids are a join of two large tables
    SELECT j.* FROM judged j
    WHERE j.by_pool = 0 AND NOT j.by_latency
      AND NOT EXISTS (SELECT 1 FROM engine_events e JOIN requests q ON q.request_id = e.request_id
                      WHERE e.instance = j.instance)
)
SELECT format('exposure window of {} ({}, model ''{}'', KV pool {:,} < context {:,}) from {} to {}: no rule can judge any '
              || 'of its {:,} successful request(s), so "none affected" there is not shown: prompt_exceeds_kv_pool {}; '
              || 'prefill_too_fast {}; the engine-event rules find no per-request line of that instance naming a '
              || 'gateway request id; {}',
              instance, role, model, pool_tokens, context_length, gate_ts(valid_from), gate_ts(valid_to), successful,
              CASE WHEN role = 'decode' THEN 'needs requests naming it as their decode_instance, and none does'
                   WHEN role = 'prefill' THEN 'needs requests naming it as their prefill_instance, or naming none, and none does'
                   ELSE 'judges only start-ups whose log shows their role (prefill or decode)' END,
              CASE WHEN timed = 0 THEN 'needs ttft_ms or latency_ms, which none carries'
                   ELSE 'has no usable latency model for the model (' || coalesce(latency_reason, 'none fitted') || ')' END,
              CASE WHEN role IN ('prefill', 'decode')
                   THEN 'map prefill_instance and decode_instance in the gateway source, add requests with timings, or '
                        || 'add the engine''s request log'
                   ELSE 'add the start-up''s server_args line (its role), map the instances in the gateway source, or '
                        || 'add requests with timings' END) AS message,
       instance, role, model, valid_from AS start, valid_to AS "end", pool_tokens, context_length, successful,
       by_pool, timed, latency_reason
FROM unjudged
ORDER BY valid_from, instance;

-- reason: cache_salt_unlogged
-- with prefix_reuse investigated and some requests logging a cache_salt: successful requests logging none that
-- computed at least one page (prompt_tokens beyond cached_tokens by the least page of the instance's stores that
-- hour), on an instance whose KV events hold stores then, yet no unsalted store on that instance from
-- $clock_skew_s before to $load_window_s after their arrival (the cross_tenant_store_load rule's window): the
-- engine stored their pages under a salt the gateway log does not show (a field the export drops on some
-- records, or a value blanked). Loads from a shared store are given to the requests of the loading namespace
-- (cache_salt), so a request without one can never be given a load: the recipients are not shown when a hit
-- logging no cache_salt arrived in the window before a foreign load on its instance, or when the requests shown to
-- have lost their salt are more than $max_cache_salt_unlogged_fraction of the requests judged
WITH logged AS (
    SELECT count(*) > 0 AS any_salt FROM analysed_requests WHERE cache_salt IS NOT NULL
), pages AS (
    SELECT instance, date_trunc('hour', ts) AS hour, min(num_tokens) AS page_tokens
    FROM kv_events WHERE kind = 'stored' AND num_tokens > 0
    GROUP BY 1, 2
), judged AS (
    SELECT r.request_id, r.ts, r.prefill_instance AS instance,
           r.cache_salt IS NULL AND r.prompt_tokens - r.cached_tokens >= p.page_tokens AS computed_unsalted
    FROM analysed_requests r
    JOIN pages p ON p.instance = r.prefill_instance AND p.hour = date_trunc('hour', r.ts)
    WHERE r.status BETWEEN 200 AND 299 AND r.cached_tokens IS NOT NULL
      AND (SELECT any_salt FROM logged)
      AND EXISTS (SELECT 1 FROM mechanisms m WHERE m.id = 'prefix_reuse' AND m.selected)
), unlogged AS (
    SELECT j.request_id, j.ts, j.instance
    FROM judged j
    WHERE j.computed_unsalted
      AND NOT EXISTS (SELECT 1 FROM kv_events e
                      WHERE e.instance = j.instance AND e.kind = 'stored' AND e.salt IS NULL
                        AND e.ts >= j.ts - to_seconds($clock_skew_s) AND e.ts <= j.ts + to_seconds($load_window_s))
), near_loads AS (
    -- hits logging no cache_salt in the window before a load of foreign pages on their instance: each may be the
    -- load's response (asked only when some request is shown to have lost its salt)
    SELECT DISTINCT r.request_id
    FROM analysed_requests r
    JOIN (SELECT DISTINCT instance, ts FROM prefix_store_loads) l
      ON l.instance = r.prefill_instance AND r.ts >= l.ts - to_seconds($load_window_s)
     AND r.ts <= l.ts + to_seconds($clock_skew_s)
    WHERE r.cache_salt IS NULL AND r.cached_tokens > 0 AND r.status BETWEEN 200 AND 299
      AND EXISTS (SELECT 1 FROM unlogged)
), counted AS (
    SELECT (SELECT count(*) FROM judged) AS judged, count(*) AS unlogged,
           (SELECT count(*) FROM near_loads) AS near_loads,
           list(request_id ORDER BY ts, request_id)[1:10] AS examples,
           list(DISTINCT instance ORDER BY instance) AS instances, min(ts) AS first, max(ts) AS last
    FROM unlogged
)
SELECT format('cache_salt: {:,} of the {:,} successful requests on instances whose KV events were salted log no '
              || 'cache_salt although they computed pages and their instance stored no unsalted page then ({:.1f}%; '
              || '{:,} hit(s) logging none arrived just before a load of another namespace''s pages from the shared store; '
              || 'instances {}, {} to {}; e.g. {}): the engine stored their pages under a salt the gateway log does '
              || 'not show, so the loads cannot be given to the right requests and the recipients may be wrong; map '
              || 'requests.cache_salt for every record (check the export for a field it drops or blanks)',
              unlogged, judged, 100.0 * unlogged / judged, near_loads, gate_names(instances), gate_ts(first),
              gate_ts(last), gate_names(examples)) AS message,
       unlogged AS requests, judged, near_loads, round(unlogged / judged, 4) AS fraction,
       $max_cache_salt_unlogged_fraction AS max_fraction, examples
FROM counted
WHERE unlogged > 0 AND (near_loads > 0 OR unlogged > $max_cache_salt_unlogged_fraction * judged);

-- reason: gateway_requests_missing
-- with prefix_reuse investigated: device stores (GPU) of a salted namespace on an instance the requests name, inside
-- the analysed period, that no request of that namespace on that instance can have made: none arrived before it
-- (up to $clock_skew_s after), or every one that did had ended more than $load_window_s before it (arrival plus
-- latency_ms, when logged). An engine stores a request's pages while it runs, so the gateway log lacks requests the
-- engines served (lines lost, another gateway, a filter): a response that received foreign pages may be missing
-- from the answer, and a load can be given to another request of its namespace. More than
-- $max_orphan_store_fraction of those stores
WITH period AS (
    SELECT min(ts) AS lo, max(ts) AS hi FROM analysed_requests
), served AS (
    -- per namespace and instance, in arrival order: until when one of its requests that arrived by then ran
    SELECT prefill_instance AS instance, cache_salt AS salt, ts AS arrived,
           max(ts + to_milliseconds(coalesce(CAST(latency_ms AS BIGINT), 0)))
               OVER (PARTITION BY prefill_instance, cache_salt ORDER BY ts
                     ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS busy_until
    FROM analysed_requests
    WHERE cache_salt IS NOT NULL AND prefill_instance IS NOT NULL
      AND (status IS NULL OR status NOT BETWEEN 400 AND 498)
), stores AS (
    SELECT DISTINCT e.instance, e.ts, e.salt
    FROM kv_events e CROSS JOIN period p
    WHERE e.kind = 'stored' AND e.salt IS NOT NULL AND (e.medium IS NULL OR e.medium = 'GPU')
      AND e.ts BETWEEN p.lo AND p.hi
      AND e.instance IN (SELECT DISTINCT prefill_instance FROM analysed_requests)
      AND EXISTS (SELECT 1 FROM mechanisms m WHERE m.id = 'prefix_reuse' AND m.selected)
), judged AS (
    SELECT s.instance, s.ts,
           r.arrived IS NULL OR r.busy_until + to_seconds($load_window_s) < s.ts AS orphan
    FROM stores s
    ASOF LEFT JOIN served r ON r.instance = s.instance AND r.salt = s.salt
                           AND s.ts + to_seconds($clock_skew_s) >= r.arrived
), counted AS (
    SELECT count(*) AS stores, count(*) FILTER (WHERE orphan) AS orphans,
           list(DISTINCT instance ORDER BY instance) FILTER (WHERE orphan) AS instances,
           min(ts) FILTER (WHERE orphan) AS first, max(ts) FILTER (WHERE orphan) AS last
    FROM judged
)
SELECT format('KV events: {:,} of the {:,} device stores of salted namespaces on instances the requests name ({:.1f}%, '
              || 'above {:.1f}%; instances {}, {} to {}) have no request of their namespace on that instance that '
              || 'could have made them (none arrived before, or all had ended {:,} s before): the gateway log lacks '
              || 'requests the engines served (lost lines, another gateway, a filter), so responses that received '
              || 'another tenant''s pages may be missing and loads given to the wrong request; add the missing '
              || 'gateway records (or map cache_salt and the instance for them)', orphans, stores,
              100.0 * orphans / stores, 100.0 * $max_orphan_store_fraction, gate_names(instances), gate_ts(first),
              gate_ts(last), $load_window_s) AS message,
       orphans AS stores_unexplained, stores, round(orphans / stores, 4) AS fraction,
       $max_orphan_store_fraction AS max_fraction, first, last
FROM counted
WHERE stores > 0 AND orphans > $max_orphan_store_fraction * stores;

-- reason: startup_value_refused
-- a start-up value no engine can have (a KV pool or context length of 0, a number beyond 2^40 tokens:
-- kvforensics/sources/engine_logs/startup_bounds.py) was refused, its line quarantined: the start-up's pool or context is
-- unknown, so whether and when it was exposed cannot be told (a start-up of an unknown model may serve any; one of a
-- model nobody requested cannot matter)
WITH refused AS (
    SELECT c.instance, c.source_file, c.source_line, json_extract_string(c.flags, '$.refused_values') AS refused
    FROM capacity c
    WHERE (contains(coalesce(c.flags->>'$.refused_fields', ''), 'kv_pool_tokens')
           OR contains(coalesce(c.flags->>'$.refused_fields', ''), 'context_length'))
      AND (c.model IS NULL OR c.model IN (SELECT model FROM gate_models))
)
SELECT format('engine instance ''{}'': {:,} start-up(s) with a value no engine can have, refused ({}; start-up at {} '
              || 'line {}): its KV pool or context length is unknown, so whether and when it was exposed cannot be '
              || 'told; check those lines of the engine log (corrupt, edited or cut?) against the engine''s own '
              || 'record of the start-up, and add the log that holds its true values', instance, count(*),
              left(string_agg(refused, '; ' ORDER BY source_line), 300), regexp_extract(min(source_file), '[^/]+$'),
              min(source_line)) AS message,
       instance, count(*) AS startups, list(refused ORDER BY source_line) AS refused
FROM refused
GROUP BY instance
ORDER BY instance;

-- reason: conflicting_duplicate
-- a request id logged more than once with different values (request_conflicts: the copies quarantined as conflicting
-- duplicates; the copy kept is the one loaded first, which a forged line in an earlier file wins) where either copy
-- decides a finding: the kept copy is flagged by a rule or matched as a source or recipient of content, or either
-- copy is a successful request of a model inside one of its exposure windows (the rules judge it by its values)
WITH copies AS (
    SELECT c.request_id, c.source_file, c.source_line, c.kept_at, 'quarantined' AS copy, c.ts, c.model, c.status
    FROM request_conflicts c
    UNION ALL
    SELECT r.request_id, c.source_file, c.source_line, c.kept_at, 'kept', r.ts, r.model, r.status
    FROM request_conflicts c JOIN requests r USING (request_id)
), deciding AS (
    SELECT DISTINCT request_id, source_file, source_line, kept_at
    FROM copies p
    WHERE EXISTS (SELECT 1 FROM gate_windows w WHERE w.model = p.model AND p.ts >= w.valid_from
                    AND (w.valid_to IS NULL OR p.ts < w.valid_to) AND p.status BETWEEN 200 AND 299)
       OR (p.copy = 'kept' AND (p.request_id IN (SELECT request_id FROM findings)
                                OR p.request_id IN (SELECT source_request_id FROM content_matches)
                                OR p.request_id IN (SELECT affected_request_id FROM content_matches)))
)
SELECT format('{:,} request id(s) logged more than once with different values where a copy decides a finding (first '
              || '''{}'' at {} line {}, kept the record at {}): the record loaded first was kept, so a forged line in '
              || 'an earlier file would win over the genuine one; find which system wrote each copy and keep only the '
              || 'genuine one in the inputs', count(*), left(arg_min(request_id, (source_file, source_line)), 80),
              regexp_extract(arg_min(source_file, (source_file, source_line)), '[^/]+$'),
              arg_min(source_line, (source_file, source_line)),
              regexp_extract(arg_min(kept_at, (source_file, source_line)), '[^/]+$')) AS message,
       count(*) AS requests, list(request_id ORDER BY source_file, source_line)[1:20] AS request_ids
FROM deciding
HAVING count(*) > 0;
