-- Type and validate the staged records of one file, appending them to `kvf_batch.typed_all` (created by the
-- loader: one row per record of every file of the batch). The placeholder in FROM below is the file's staged relation
-- (line, raw, problem, <field>_raw ...; text, except that a number field may come as a DuckDB number, see
-- the Parquet stager): a temp table the Python readers filled, or the DuckDB
-- reader query itself, so the common case reads, parses and types in one streaming pass.
-- Parameters: $file_no, $tz (IANA zone for timestamps without an offset), $offset_s (clock offset in
-- seconds added to every timestamp of the source), $ambiguous (what a local time that the zone's
-- daylight-saving change makes ambiguous or nonexistent means: 'earlier' / 'later' of its two UTC
-- instants, or 'reject' to quarantine it), $dst_days (see `zoned`), plus those of the staged relation.
-- The first failing check names the record's quarantine reason. Nothing here may raise on any
-- input text: conversions are guarded (epoch range, TRY_CAST, finite and in-range checks), so a bad
-- value quarantines its record instead of stopping the load. The raw text is kept for refused
-- records only.
INSERT INTO kvf_batch.typed_all
SELECT $file_no, * FROM (
WITH trimmed AS (
    SELECT *, trim(ts_raw) AS t, nullif(trim(request_id_raw), '') AS request_id_t,
           nullif(trim(account_id_raw), '') AS account_id_t, nullif(trim(model_raw), '') AS model_t
    FROM {staging}
), s AS (
    SELECT *, regexp_full_match(coalesce(t, ''), '-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?') AS ts_epoch
    FROM trimmed
), parsed AS (
    SELECT *,
        regexp_matches(coalesce(t, ''), '[T ][0-9]{2}:[0-9]{2}.*([zZ]|[+-][0-9]{2}:?[0-9]{2}|UTC|GMT)$') AS ts_has_offset,
        -- only numbers are read as numbers (a failed cast costs more than the regex)
        CASE WHEN ts_epoch THEN TRY_CAST(t AS DOUBLE) END AS t_num,
        TRY_CAST(status_raw AS DOUBLE) AS status_num,
        TRY_CAST(prompt_tokens_raw AS DOUBLE) AS prompt_num,
        TRY_CAST(completion_tokens_raw AS DOUBLE) AS completion_num,
        TRY_CAST(cached_tokens_raw AS DOUBLE) AS cached_num,
        TRY_CAST(ttft_ms_raw AS DOUBLE) AS ttft_num,
        TRY_CAST(latency_ms_raw AS DOUBLE) AS latency_num
    FROM s
), scaled AS (
    SELECT *,
        -- epoch seconds from seconds / milliseconds / microseconds / nanoseconds by magnitude
        CASE WHEN NOT ts_epoch OR t_num IS NULL OR NOT isfinite(t_num) THEN NULL
             WHEN abs(t_num) >= 1e17 THEN t_num / 1e9
             WHEN abs(t_num) >= 1e14 THEN t_num / 1e6
             WHEN abs(t_num) >= 1e11 THEN t_num / 1e3
             ELSE t_num END AS epoch_s
    FROM parsed
), localized AS (
    SELECT *,
        CASE WHEN NOT ts_epoch AND NOT ts_has_offset THEN TRY_CAST(t AS TIMESTAMP) END AS ts_local,
        -- a numeric UTC offset beyond -14:00..+14:00 (or with minutes past 59) names no real zone
        CASE WHEN ts_has_offset THEN regexp_extract(t, '[+-]([0-9]{2}):?([0-9]{2})$', ['h', 'm']) END AS ts_offset
    FROM scaled
), zoned AS (
    -- $dst_days: the dates within a few days of one of the zone's offset changes (a cheap hash test
    -- that spares every other record the checks below)
    SELECT *, timezone($tz, ts_local) AS ts_zoned, CAST(ts_local AS DATE) IN (SELECT unnest($dst_days)) AS near_dst
    FROM localized
), offsets AS (
    SELECT *,
        -- the zone's UTC offset a day before and a day after: they differ only around a DST change
        CASE WHEN near_dst AND ts_local BETWEEN TIMESTAMP '1900-01-01' AND TIMESTAMP '2300-01-01' THEN
            timezone($tz, timezone('UTC', ts_local - INTERVAL 1 DAY)) - (ts_local - INTERVAL 1 DAY) END AS off_before,
        CASE WHEN near_dst AND ts_local BETWEEN TIMESTAMP '1900-01-01' AND TIMESTAMP '2300-01-01' THEN
            timezone($tz, timezone('UTC', ts_local + INTERVAL 1 DAY)) - (ts_local + INTERVAL 1 DAY) END AS off_after
    FROM zoned
), candidates AS (
    -- the two instants the wall-clock time may mean (with either offset), where the offsets differ
    SELECT *,
        CASE WHEN off_before <> off_after THEN timezone('UTC', ts_local - off_before) END AS cand_a,
        CASE WHEN off_before <> off_after THEN timezone('UTC', ts_local - off_after) END AS cand_b
    FROM offsets
), dst AS (
    -- both read back as the same wall-clock time: ambiguous (the repeated hour); neither: it does not exist
    SELECT *,
        CASE WHEN cand_a IS NULL THEN NULL
             WHEN timezone($tz, cand_a) = ts_local AND timezone($tz, cand_b) = ts_local THEN 'ambiguous'
             WHEN timezone($tz, cand_a) <> ts_local AND timezone($tz, cand_b) <> ts_local THEN 'nonexistent'
        END AS ts_dst
    FROM candidates
), stamped AS (
    SELECT *,
        CASE
            WHEN t IS NULL OR t = '' THEN NULL
            WHEN ts_epoch THEN CASE WHEN abs(epoch_s) < 1e11 THEN to_timestamp(epoch_s) END
            WHEN ts_has_offset THEN TRY_CAST(t AS TIMESTAMPTZ)
            WHEN ts_dst IS NOT NULL AND $ambiguous = 'earlier' THEN least(cand_a, cand_b)
            WHEN ts_dst IS NOT NULL AND $ambiguous = 'later' THEN greatest(cand_a, cand_b)
            ELSE ts_zoned
        END + to_microseconds(CAST(round($offset_s * 1e6) AS BIGINT)) AS ts_any,
        NOT ts_epoch AND NOT ts_has_offset AS ts_naive
    FROM dst
), bounded AS (
    -- a log of served requests cannot predate 1970 or lie centuries ahead; such values are garbage
    -- (and years past 9999 cannot be read back by most clients)
    SELECT *,
        CASE WHEN isfinite(ts_any) AND ts_any >= TIMESTAMPTZ '1970-01-01 00:00:00+00'
                  AND ts_any < TIMESTAMPTZ '2200-01-01 00:00:00+00' THEN ts_any END AS ts_utc
    FROM stamped
)
SELECT line, reason, CASE WHEN reason IS NOT NULL THEN left(raw, 2000) END AS raw,
    request_id, ts, ts_naive, ts_dst, account_id, model, status, prompt_tokens, completion_tokens, cached_tokens,
    ttft_ms, latency_ms, prefill_instance, decode_instance, cache_salt,
    -- what the merge groups and joins on to find repeated ids (8 bytes instead of the text; a
    -- collision only makes the merge compare two records by their ids, which tells them apart)
    hash(request_id) AS id_hash
FROM (SELECT
    line, raw,
    CASE
        WHEN problem IS NOT NULL THEN problem
        WHEN request_id_t IS NULL THEN 'missing required field ''request_id'''
        WHEN t IS NULL OR t = '' THEN 'missing required field ''ts'''
        WHEN ts_offset.h <> '' AND (CAST(ts_offset.h AS INTEGER) * 60 + CAST(ts_offset.m AS INTEGER) > 840
                                    OR CAST(ts_offset.m AS INTEGER) > 59)
            THEN 'timestamp offset is outside -14:00..+14:00: ''' || left(t, 60) || ''''
        WHEN ts_dst = 'ambiguous' AND $ambiguous = 'reject'
            THEN 'local time ''' || left(t, 60) || ''' is ambiguous in ' || $tz
                 || ' (the repeated hour when daylight saving time ends); set ambiguous = "earlier" or "later" on the source'
        WHEN ts_dst = 'nonexistent' AND $ambiguous = 'reject'
            THEN 'local time ''' || left(t, 60) || ''' does not exist in ' || $tz
                 || ' (the hour skipped when daylight saving time starts); set ambiguous = "earlier" or "later" on the source'
        WHEN ts_utc IS NULL THEN 'bad timestamp ''' || left(t, 60) || ''''
        WHEN account_id_t IS NULL THEN 'missing required field ''account_id'''
        WHEN model_t IS NULL THEN 'missing required field ''model'''
        WHEN status_raw IS NULL THEN 'missing required field ''status'''
        WHEN status_num IS NULL OR NOT isfinite(status_num) OR status_num <> floor(status_num)
             OR status_num < 100 OR status_num > 599
            THEN 'status is not an HTTP status code: ''' || left(CAST(status_raw AS VARCHAR), 40) || ''''
        WHEN prompt_tokens_raw IS NULL THEN 'missing required field ''prompt_tokens'''
        WHEN prompt_num IS NULL OR NOT isfinite(prompt_num) OR prompt_num <> floor(prompt_num) OR prompt_num < 0
            THEN 'prompt_tokens is not a non-negative integer: ''' || left(CAST(prompt_tokens_raw AS VARCHAR), 40) || ''''
        WHEN prompt_num > 9007199254740991
            THEN 'prompt_tokens is out of range: ''' || left(CAST(prompt_tokens_raw AS VARCHAR), 40) || ''''
        WHEN completion_tokens_raw IS NOT NULL AND (completion_num IS NULL OR NOT isfinite(completion_num)
             OR completion_num <> floor(completion_num) OR completion_num < 0)
            THEN 'completion_tokens is not a non-negative integer: ''' || left(CAST(completion_tokens_raw AS VARCHAR), 40) || ''''
        WHEN completion_num > 9007199254740991
            THEN 'completion_tokens is out of range: ''' || left(CAST(completion_tokens_raw AS VARCHAR), 40) || ''''
        WHEN cached_tokens_raw IS NOT NULL AND (cached_num IS NULL OR NOT isfinite(cached_num)
             OR cached_num <> floor(cached_num) OR cached_num < 0)
            THEN 'cached_tokens is not a non-negative integer: ''' || left(CAST(cached_tokens_raw AS VARCHAR), 40) || ''''
        WHEN cached_num > 9007199254740991
            THEN 'cached_tokens is out of range: ''' || left(CAST(cached_tokens_raw AS VARCHAR), 40) || ''''
        WHEN cached_num > prompt_num
            THEN 'cached_tokens (' || CAST(CAST(cached_num AS BIGINT) AS VARCHAR) || ') exceeds prompt_tokens ('
                 || CAST(CAST(prompt_num AS BIGINT) AS VARCHAR) || ')'
        WHEN ttft_ms_raw IS NOT NULL AND (ttft_num IS NULL OR ttft_num < 0 OR isnan(ttft_num) OR isinf(ttft_num))
            THEN 'ttft_ms is not a non-negative number: ''' || left(CAST(ttft_ms_raw AS VARCHAR), 40) || ''''
        WHEN latency_ms_raw IS NOT NULL AND (latency_num IS NULL OR latency_num < 0 OR isnan(latency_num) OR isinf(latency_num))
            THEN 'latency_ms is not a non-negative number: ''' || left(CAST(latency_ms_raw AS VARCHAR), 40) || ''''
        -- 1e12 ms is 31 years: beyond it a timing is a logging fault, and the time arithmetic that adds it to a
        -- timestamp would overflow
        WHEN ttft_num > 1e12
            THEN 'ttft_ms is out of range (over 1e12 ms): ''' || left(CAST(ttft_ms_raw AS VARCHAR), 40) || ''''
        WHEN latency_num > 1e12
            THEN 'latency_ms is out of range (over 1e12 ms): ''' || left(CAST(latency_ms_raw AS VARCHAR), 40) || ''''
    END AS reason,
    coalesce(request_id_t, trim(request_id_raw)) AS request_id,
    ts_utc AS ts,
    ts_naive,
    ts_dst,
    coalesce(account_id_t, trim(account_id_raw)) AS account_id,
    coalesce(model_t, trim(model_raw)) AS model,
    -- TRY_CAST: refused records are typed too, and their values may not fit
    TRY_CAST(status_num AS INTEGER) AS status,
    TRY_CAST(prompt_num AS BIGINT) AS prompt_tokens,
    TRY_CAST(completion_num AS BIGINT) AS completion_tokens,
    TRY_CAST(cached_num AS BIGINT) AS cached_tokens,
    ttft_num AS ttft_ms,
    latency_num AS latency_ms,
    nullif(trim(prefill_instance_raw), '') AS prefill_instance,
    nullif(trim(decode_instance_raw), '') AS decode_instance,
    nullif(trim(cache_salt_raw), '') AS cache_salt
FROM bounded));
