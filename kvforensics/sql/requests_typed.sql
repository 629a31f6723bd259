-- Type and validate staged request records. Parameters: $tz (IANA zone for timestamps without an
-- offset), $offset_s (clock offset in seconds added to every timestamp of the source).
-- The first failing check names the record's quarantine reason.
CREATE OR REPLACE TEMP TABLE typed_requests AS
WITH s AS (
    SELECT *, trim(ts_raw) AS t FROM staging_requests
), parsed AS (
    SELECT *,
        regexp_full_match(coalesce(t, ''), '-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?') AS ts_epoch,
        regexp_matches(coalesce(t, ''), '[T ][0-9]{2}:[0-9]{2}.*([zZ]|[+-][0-9]{2}:?[0-9]{2}|UTC|GMT)$') AS ts_has_offset,
        TRY_CAST(t AS DOUBLE) AS t_num,
        TRY_CAST(status_raw AS DOUBLE) AS status_num,
        TRY_CAST(prompt_tokens_raw AS DOUBLE) AS prompt_num,
        TRY_CAST(completion_tokens_raw AS DOUBLE) AS completion_num,
        TRY_CAST(cached_tokens_raw AS DOUBLE) AS cached_num,
        TRY_CAST(ttft_ms_raw AS DOUBLE) AS ttft_num,
        TRY_CAST(latency_ms_raw AS DOUBLE) AS latency_num
    FROM s
), stamped AS (
    SELECT *,
        CASE
            WHEN t IS NULL OR t = '' THEN NULL
            WHEN ts_epoch THEN
                CASE WHEN abs(t_num) >= 1e17 THEN to_timestamp(t_num / 1e9)
                     WHEN abs(t_num) >= 1e14 THEN to_timestamp(t_num / 1e6)
                     WHEN abs(t_num) >= 1e11 THEN to_timestamp(t_num / 1e3)
                     ELSE to_timestamp(t_num) END
            WHEN ts_has_offset THEN TRY_CAST(t AS TIMESTAMPTZ)
            ELSE timezone($tz, TRY_CAST(t AS TIMESTAMP))
        END + to_microseconds(CAST(round($offset_s * 1e6) AS BIGINT)) AS ts_utc,
        NOT ts_epoch AND NOT ts_has_offset AS ts_naive
    FROM parsed
)
SELECT
    line, raw,
    CASE
        WHEN problem IS NOT NULL THEN problem
        WHEN nullif(trim(request_id_raw), '') IS NULL THEN 'missing required field ''request_id'''
        WHEN t IS NULL OR t = '' THEN 'missing required field ''ts'''
        WHEN ts_utc IS NULL THEN 'bad timestamp ''' || left(t, 60) || ''''
        WHEN nullif(trim(account_id_raw), '') IS NULL THEN 'missing required field ''account_id'''
        WHEN nullif(trim(model_raw), '') IS NULL THEN 'missing required field ''model'''
        WHEN status_raw IS NULL THEN 'missing required field ''status'''
        WHEN status_num IS NULL OR status_num <> floor(status_num) OR status_num < 100 OR status_num > 599
            THEN 'status is not an HTTP status code: ''' || left(status_raw, 40) || ''''
        WHEN prompt_tokens_raw IS NULL THEN 'missing required field ''prompt_tokens'''
        WHEN prompt_num IS NULL OR prompt_num <> floor(prompt_num) OR prompt_num < 0
            THEN 'prompt_tokens is not a non-negative integer: ''' || left(prompt_tokens_raw, 40) || ''''
        WHEN completion_tokens_raw IS NOT NULL AND (completion_num IS NULL OR completion_num <> floor(completion_num) OR completion_num < 0)
            THEN 'completion_tokens is not a non-negative integer: ''' || left(completion_tokens_raw, 40) || ''''
        WHEN cached_tokens_raw IS NOT NULL AND (cached_num IS NULL OR cached_num <> floor(cached_num) OR cached_num < 0)
            THEN 'cached_tokens is not a non-negative integer: ''' || left(cached_tokens_raw, 40) || ''''
        WHEN cached_num > prompt_num
            THEN 'cached_tokens (' || CAST(CAST(cached_num AS BIGINT) AS VARCHAR) || ') exceeds prompt_tokens ('
                 || CAST(CAST(prompt_num AS BIGINT) AS VARCHAR) || ')'
        WHEN ttft_ms_raw IS NOT NULL AND (ttft_num IS NULL OR ttft_num < 0 OR isnan(ttft_num) OR isinf(ttft_num))
            THEN 'ttft_ms is not a non-negative number: ''' || left(ttft_ms_raw, 40) || ''''
        WHEN latency_ms_raw IS NOT NULL AND (latency_num IS NULL OR latency_num < 0 OR isnan(latency_num) OR isinf(latency_num))
            THEN 'latency_ms is not a non-negative number: ''' || left(latency_ms_raw, 40) || ''''
    END AS reason,
    trim(request_id_raw) AS request_id,
    ts_utc AS ts,
    ts_naive,
    trim(account_id_raw) AS account_id,
    trim(model_raw) AS model,
    CAST(status_num AS INTEGER) AS status,
    CAST(prompt_num AS BIGINT) AS prompt_tokens,
    CAST(completion_num AS BIGINT) AS completion_tokens,
    CAST(cached_num AS BIGINT) AS cached_tokens,
    ttft_num AS ttft_ms,
    latency_num AS latency_ms,
    nullif(trim(prefill_instance_raw), '') AS prefill_instance,
    nullif(trim(decode_instance_raw), '') AS decode_instance
FROM stamped;
