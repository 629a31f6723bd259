-- The canonical tables of evidence.duckdb: the single source of truth for their shape.
-- All timestamps are TIMESTAMPTZ in UTC (the session time zone is UTC).

CREATE TABLE IF NOT EXISTS requests (
    request_id        VARCHAR NOT NULL,
    ts                TIMESTAMPTZ NOT NULL,   -- when the gateway received the request
    account_id        VARCHAR NOT NULL,
    model             VARCHAR NOT NULL,
    status            INTEGER NOT NULL,       -- HTTP status the client got
    prompt_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT,
    cached_tokens     BIGINT,                 -- prefix-cache hits
    ttft_ms           DOUBLE,
    latency_ms        DOUBLE,                 -- end to end
    prefill_instance  VARCHAR,
    decode_instance   VARCHAR,
    source            VARCHAR NOT NULL,       -- input name from the incident file
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL
);
-- evidence databases written before duplicates were compared by value carry a hash column
ALTER TABLE requests DROP COLUMN IF EXISTS row_hash;
-- the prefix-cache salt / namespace the gateway or engine saw (optional; after source_line in every database)
ALTER TABLE requests ADD COLUMN IF NOT EXISTS cache_salt VARCHAR;
-- where cached_tokens came from (sql/cached_tokens.sql): gateway | engine_request (the engine's per-request
-- count) | engine_batch (a prefill batch of that request alone); NULL when no source gives it
ALTER TABLE requests ADD COLUMN IF NOT EXISTS cached_tokens_source VARCHAR;

CREATE TABLE IF NOT EXISTS capacity (
    instance          VARCHAR NOT NULL,
    role              VARCHAR NOT NULL,       -- prefill | decode | unified | unknown (no line of its log says)
    model             VARCHAR,                -- gateway model id (after aliases)
    engine_model      VARCHAR,                -- as the engine named it
    valid_from        TIMESTAMPTZ,
    valid_to          TIMESTAMPTZ,            -- NULL while still running
    kv_pool_tokens    BIGINT,
    context_length    BIGINT,
    page_size         BIGINT,
    engine            VARCHAR NOT NULL,
    engine_version    VARCHAR,
    version_source    VARCHAR,
    tp_size           INTEGER,
    dp_size           INTEGER,
    flags             JSON,
    startup_refused   BOOLEAN,
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT,
    pool_source_line  BIGINT,
    -- how the start-up ended (kvforensics/stages/instances.py): next_startup | shutdown | log_end (retired: a
    -- successor took over) | NULL (its log merely stops: still running when collected, valid_to NULL)
    end_reason        VARCHAR,
    end_ts            TIMESTAMPTZ,            -- the evidence of the end: shutdown line, next start-up, last line
    end_file          VARCHAR,
    end_line          BIGINT,
    successor         VARCHAR,                -- log_end: the instance that took over
    last_ts           TIMESTAMPTZ,            -- its last stamped line: how far its log goes
    last_line         BIGINT
);
-- evidence databases written before start-ups had ends
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS end_reason VARCHAR;
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS end_ts TIMESTAMPTZ;
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS end_file VARCHAR;
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS end_line BIGINT;
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS successor VARCHAR;
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS last_ts TIMESTAMPTZ;
ALTER TABLE capacity ADD COLUMN IF NOT EXISTS last_line BIGINT;

-- Instance names the gateway used, and the engine instance each was matched to (kvforensics/stages/instances.py).
-- requests.prefill_instance / decode_instance hold the engine instance where one matched.
CREATE TABLE IF NOT EXISTS instance_names (
    gateway_name      VARCHAR NOT NULL,
    engine_instance   VARCHAR,                -- NULL: unmatched or ambiguous
    matched_by        VARCHAR NOT NULL,       -- map | exact | match | host | first_label | ambiguous | unmatched
    candidates        VARCHAR,                -- ambiguous: the engine instances it fits
    requests          BIGINT NOT NULL         -- requests naming it (prefill or decode)
);

-- The gateway's own values of renamed requests whose engine instance several gateway names map to (the
-- others are mapped back by name): restored before the next ingest (sql/instance_restore.sql), so that
-- re-delivered records compare equal with what was loaded.
CREATE TABLE IF NOT EXISTS instance_renames (
    request_id        VARCHAR NOT NULL,
    prefill_instance  VARCHAR,
    decode_instance   VARCHAR
);

CREATE TABLE IF NOT EXISTS engine_events (
    instance          VARCHAR NOT NULL,
    ts                TIMESTAMPTZ,
    kind              VARCHAR NOT NULL,       -- abort_input_too_long | req_time_stats | transfer_failure | ...
    request_id        VARCHAR,
    prompt_tokens     BIGINT,
    limit_tokens      BIGINT,
    detail            VARCHAR,
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL
);
-- req_time_stats: the prompt tokens the engine's prefix cache served (SGLang cached_input_len=, >= 0.5.15)
ALTER TABLE engine_events ADD COLUMN IF NOT EXISTS cached_tokens BIGINT;

-- The engines' prefill batch lines (SGLang "Prefill batch, #new-seq: N, #new-token: N, #cached-token: N, ...",
-- kvforensics/sources/engine_logs/sglang/batches.py): one row per prefill step of one replica.
CREATE TABLE IF NOT EXISTS prefill_batches (
    instance          VARCHAR NOT NULL,
    ts                TIMESTAMPTZ,
    new_seq           BIGINT NOT NULL,        -- requests (or chunks of one) the step prefilled
    new_token         BIGINT NOT NULL,        -- prompt tokens computed
    cached_token      BIGINT NOT NULL,        -- prompt tokens served from the prefix cache
    running_req       BIGINT,
    queue_req         BIGINT,
    token_usage       DOUBLE,                 -- share of the KV pool in use (hybrid: full-attention layers)
    role              VARCHAR,                -- prefill | decode | unified: the line's PD counts, else its start-up's
    ranks             VARCHAR,                -- the rank prefix ("DP1 TP0"); each DP replica batches on its own
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL
);

-- Requests whose engine logged its own count of cached prompt tokens for the same prompt (SGLang ReqTimeStats
-- on the request's prefill instance, input_len = the gateway's prompt_tokens), with the gateway's count beside it
-- (sql/cached_tokens.sql): where the two sources can be compared.
CREATE TABLE IF NOT EXISTS engine_cached_tokens (
    request_id        VARCHAR NOT NULL,
    instance          VARCHAR NOT NULL,
    engine_cached     BIGINT NOT NULL,
    gateway_cached    BIGINT,                 -- NULL: the gateway gives none (requests.cached_tokens is the engine's)
    source_file       VARCHAR NOT NULL,       -- the engine line
    source_line       BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS changes (
    ts                TIMESTAMPTZ NOT NULL,
    model             VARCHAR,
    instance          VARCHAR,
    description       VARCHAR NOT NULL,
    details           VARCHAR,
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS content_fingerprints (
    request_id        VARCHAR NOT NULL,
    part              VARCHAR NOT NULL,       -- prompt | output
    fp                BIGINT NOT NULL         -- keyed HMAC of a word shingle, never the text
);

-- Prompts cut into prefix-cache blocks (kind "content", kvforensics/sources/content/prefix_blocks.py): one row per full
-- block of the engine's block size; fingerprints only, never token ids or words.
CREATE TABLE IF NOT EXISTS request_blocks (
    request_id        VARCHAR NOT NULL,
    position          BIGINT NOT NULL,        -- the block's index in the prompt (0 = first)
    num_tokens        BIGINT NOT NULL,        -- tokens (words, without token ids) the block holds
    block_fp          BIGINT NOT NULL,        -- keyed HMAC of the block's token ids (= kv_events.block_fp)
    chain_fp          BIGINT NOT NULL         -- keyed hash of the parent's chain_fp and block_fp: the prefix
);

-- The incident file's account globs ([scope] internal_accounts, reporter_accounts), written by ingest: rules
-- read them to set the provider's own accounts apart (their shared prefixes expose nothing).
CREATE TABLE IF NOT EXISTS account_patterns (
    pattern           VARCHAR,
    account_class     VARCHAR,                -- reporter | internal
    priority          INTEGER
);

CREATE TABLE IF NOT EXISTS content_stats (
    request_id        VARCHAR NOT NULL,
    part              VARCHAR NOT NULL,
    shingles          BIGINT NOT NULL
);

-- KV-cache events the engines published (kind "kv_events", kvforensics/sources/kv_events/load.py): one row per
-- block a BlockStored or BlockRemoved event names, one per AllBlocksCleared. Token ids are never stored.
CREATE TABLE IF NOT EXISTS kv_events (
    instance          VARCHAR NOT NULL,       -- the engine instance (source template or a field of the batch)
    dp_rank           INTEGER,                -- data_parallel_rank (vLLM) / attn_dp_rank (SGLang): its own cache
    ts                TIMESTAMPTZ NOT NULL,   -- the batch's time (epoch seconds as published), UTC
    batch             BIGINT NOT NULL,        -- the line the batch was read from
    seq               INTEGER NOT NULL,       -- the event's index in its batch (0-based)
    kind              VARCHAR NOT NULL,       -- stored | removed | cleared
    block_hash        VARCHAR,                -- an int as its decimal digits, bytes as lower-case hex; NULL: cleared
    parent_block_hash VARCHAR,                -- stored: the block before it in the chain (NULL: first block)
    position          BIGINT,                 -- stored: the block's index in its chain (0 = first), when known
    num_tokens        BIGINT,                 -- stored: token ids the block holds
    block_fp          BIGINT,                 -- stored: keyed HMAC of the block's token ids, never the ids
    lora              VARCHAR,                -- lora_name, else lora_id
    medium            VARCHAR,                -- GPU | CPU_PINNED | DISK | EXTERNAL ... as published
    salt              VARCHAR,                -- the cache salt the block's chain was stored under, when published
    kv_group          INTEGER,                -- vLLM group_idx (hybrid models hash each group apart)
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL
);
-- stored: the keyed fingerprint of the chain's token ids up to this block (kvforensics/sources/common/chain.py), the
-- same value as request_blocks.chain_fp for the same prefix: content matched across salted hashes
ALTER TABLE kv_events ADD COLUMN IF NOT EXISTS chain_fp BIGINT;
-- the publisher's sequence number of the message the event came in (columns.seq of an archive's wrapper),
-- per (instance, dp_rank): 0 from each engine start; NULL when the archive keeps none
ALTER TABLE kv_events ADD COLUMN IF NOT EXISTS msg_seq BIGINT;

-- Every KV-event message read (a line that parsed as a batch of a known instance), whether its events
-- loaded or not: what kv_event_gaps follows, so that a message whose events were quarantined is not lost.
CREATE TABLE IF NOT EXISTS kv_event_messages (
    instance          VARCHAR NOT NULL,
    dp_rank           INTEGER,                -- the publisher's rank (NULL: none, or not readable)
    msg_seq           BIGINT,                 -- the publisher's sequence number (NULL: none kept, or not readable)
    ts                TIMESTAMPTZ,            -- the batch's time (NULL: not readable)
    events            BIGINT,                 -- events in the batch (NULL: its events are not a list)
    loaded            BIGINT NOT NULL,        -- of them loaded into kv_events (the rest quarantined)
    message           BIGINT NOT NULL,        -- its place in the order the ingest read the messages (1, 2, ...)
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL
);

-- Breaks in a publisher's sequence numbers (sql/kv_event_gaps.sql), per (instance, dp_rank) in the order
-- the messages were read: kind 'gap', a jump forward by more than one, `missing` messages lost between
-- seq_before and seq_after; kind 'restart', a step back (the engine restarted: its sequence starts again
-- at 0), `missing` = seq_after, the first messages of the new sequence the archive lacks.
CREATE TABLE IF NOT EXISTS kv_event_gaps (
    instance          VARCHAR NOT NULL,
    dp_rank           INTEGER,
    source_file       VARCHAR NOT NULL,       -- the file of the message after the break
    seq_before        BIGINT NOT NULL,
    seq_after         BIGINT NOT NULL,
    missing           BIGINT NOT NULL,
    from_ts           TIMESTAMPTZ,            -- the batch time of the message before the break
    to_ts             TIMESTAMPTZ,            -- ... and after it
    kind              VARCHAR NOT NULL        -- gap | restart
);

CREATE TABLE IF NOT EXISTS quarantine (
    source            VARCHAR NOT NULL,
    file              VARCHAR NOT NULL,
    line              BIGINT,
    reason            VARCHAR NOT NULL,
    raw               VARCHAR                 -- truncated; never text from a content source
);

-- the typed values of each request record quarantined as a conflicting duplicate (a request id logged before with
-- other values: sql/requests_merge.sql), beside the copy kept in `requests`: the gate's reason
-- conflicting_duplicate asks whether either copy decides a finding
CREATE TABLE IF NOT EXISTS request_conflicts (
    request_id        VARCHAR NOT NULL,
    ts                TIMESTAMPTZ NOT NULL,
    account_id        VARCHAR NOT NULL,
    model             VARCHAR NOT NULL,
    status            INTEGER NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    ttft_ms           DOUBLE,
    latency_ms        DOUBLE,
    source            VARCHAR NOT NULL,
    source_file       VARCHAR NOT NULL,
    source_line       BIGINT NOT NULL,
    kept_at           VARCHAR NOT NULL        -- file:line of the copy kept in `requests`
);

CREATE TABLE IF NOT EXISTS load_report (
    source            VARCHAR NOT NULL,
    kind              VARCHAR NOT NULL,
    file              VARCHAR NOT NULL,
    sha256            VARCHAR NOT NULL,
    bytes             BIGINT NOT NULL,
    records_read      BIGINT NOT NULL,
    loaded            BIGINT NOT NULL,
    quarantined       BIGINT NOT NULL,
    duplicates        BIGINT NOT NULL,
    notes             VARCHAR
);

CREATE TABLE IF NOT EXISTS findings (
    request_id        VARCHAR NOT NULL,
    rule_id           VARCHAR NOT NULL,
    rule_version      VARCHAR NOT NULL,       -- content hash of the rule's .sql and .yml
    confidence        VARCHAR NOT NULL,       -- the request's tier: confirmed | probable | possible
    strength          VARCHAR,                -- this rule's signal: strong | weak
    parameters        JSON,
    evidence          JSON,
    mechanism         VARCHAR                 -- the exposure mechanism the rule belongs to (kvforensics/mechanisms)
);
ALTER TABLE findings ADD COLUMN IF NOT EXISTS mechanism VARCHAR;  -- databases built before mechanisms

-- The exposure mechanisms an investigation ran (detect): every known one, named in the incident file or
-- chosen because its inputs are present, with the inputs the evidence lacks.
CREATE TABLE IF NOT EXISTS mechanisms (
    id                VARCHAR NOT NULL,
    title             VARCHAR NOT NULL,
    named             BOOLEAN NOT NULL,       -- the incident file's `mechanisms` names it
    selected          BOOLEAN NOT NULL,       -- its rules ran
    missing_inputs    VARCHAR[] NOT NULL      -- inputs it needs that the evidence lacks ("a or b": one of them)
);

CREATE TABLE IF NOT EXISTS latency_model (
    model             VARCHAR NOT NULL,
    usable            BOOLEAN NOT NULL,
    reason            VARCHAR,
    a_ms              DOUBLE,
    b_ms_per_token    DOUBLE,
    c_ms_per_token2   DOUBLE,
    quantile          DOUBLE,
    n_points          BIGINT,
    n_bins            BIGINT,
    min_tokens        BIGINT,
    max_tokens        BIGINT,
    r2                DOUBLE,
    mean_rel_err      DOUBLE,
    method            VARCHAR
);

CREATE TABLE IF NOT EXISTS ingest_notes (
    kind              VARCHAR NOT NULL,       -- warning | assumption
    note              VARCHAR NOT NULL
);

-- Why the evidence cannot support this run's answer (kvforensics/stages/conclusive.py): empty = conclusive.
CREATE TABLE IF NOT EXISTS inconclusive_reasons (
    n                 INTEGER NOT NULL,       -- order of report
    code              VARCHAR NOT NULL,       -- stable: the check in sql/conclusive.sql
    message           VARCHAR NOT NULL,       -- one line: what was seen and what to do
    evidence          JSON                    -- the numbers behind it
);

-- The prefix_reuse mechanism's exposure windows (kvforensics/audit/isolation.py): per engine start-up, each
-- way KV could cross tenants while it ran (audit check 6 on its server args and the incident file's
-- [prefix_cache] isolation facts), or one row path = 'isolated' when none. reach: local (the instance's
-- own cache) | shared_store (a store several instances read) | collision | any (undetermined) | none.
CREATE TABLE IF NOT EXISTS prefix_windows (
    instance          VARCHAR NOT NULL,
    model             VARCHAR,
    engine            VARCHAR,
    engine_version    VARCHAR,
    valid_from        TIMESTAMPTZ,            -- NULL: the start-up has no timestamp (from the beginning)
    valid_to          TIMESTAMPTZ,            -- NULL: still in force
    end_reason        VARCHAR,
    path              VARCHAR NOT NULL,       -- salt_blind_store | no_salt | client_salt | engine_ignores_salt
                                              -- | weak_hash | undetermined | isolated
    reach             VARCHAR NOT NULL,
    status            VARCHAR NOT NULL,       -- fail | unknown | pass
    sentence          VARCHAR NOT NULL,
    evidence_file     VARCHAR,
    evidence_line     BIGINT,
    startup_file      VARCHAR,
    startup_line      BIGINT
);

-- [prefix_cache] shared_namespaces: cache salts (globs) the provider documents as shared by every tenant.
CREATE TABLE IF NOT EXISTS prefix_shared_namespaces (
    pattern           VARCHAR NOT NULL
);

-- The stale_pages mechanism's exposure windows (kvforensics/audit/exposure.py): the engine start-ups whose audit
-- check 1 FAILs, exposed (a KV pool below the context on a role that hands a prompt beyond the pool to pages it
-- did not write: prefill, decode, or a role the log does not show). Written from the audit's own verdicts at the
-- end of ingest, so the audit, scope.json's exposure_windows, the gate and the report name the same start-ups.
CREATE TABLE IF NOT EXISTS exposure_windows (
    instance          VARCHAR NOT NULL,
    role              VARCHAR NOT NULL,       -- prefill | decode | unknown (no line says)
    model             VARCHAR,
    engine            VARCHAR,
    engine_version    VARCHAR,
    valid_from        TIMESTAMPTZ,            -- NULL: the start-up has no timestamp
    valid_to          TIMESTAMPTZ,            -- NULL: still in force
    end_reason        VARCHAR,
    kv_pool_tokens    BIGINT,
    context_length    BIGINT,
    sentence          VARCHAR NOT NULL,       -- the audit's check-1 verdict
    source_file       VARCHAR,
    source_line       BIGINT
);

-- The accounts suspected of deliberate exploitation (sql/suspects.sql, written by scope): per account and mechanism,
-- why. Their notices go to the provider's trust-and-safety team (kvforensics/report/notices.py).
CREATE TABLE IF NOT EXISTS suspected_exploiters (
    account_id        VARCHAR NOT NULL,
    mechanism         VARCHAR NOT NULL,       -- stale_pages | prefix_reuse
    why               VARCHAR NOT NULL
);
