-- Breaks in the KV-event publishers' sequence numbers (table kv_event_gaps), at the end of ingest. A publisher
-- numbers its messages 0, 1, 2, ... from its engine's start, one sequence per (instance, dp_rank): vLLM
-- vllm/distributed/kv_events.py and SGLang python/sglang/srt/disaggregation/kv_events.py (ZmqEventPublisher,
-- `_seq_gen = count()`, the number taken before the message is encoded and sent). In the order the messages
-- were read (files in path order, lines in order: kv_event_messages.message), a jump forward by more than one
-- is lost messages (a send that failed, the PUB socket's high-water mark, a subscriber that was down); a step
-- back is a restart, whose new sequence should start at 0. The same number twice is one message delivered
-- twice, no break.
DELETE FROM kv_event_gaps;

INSERT INTO kv_event_gaps BY NAME
WITH ordered AS (
    SELECT instance, dp_rank, source_file, msg_seq, ts,
           lag(msg_seq) OVER w AS seq_before, lag(ts) OVER w AS from_ts
    FROM kv_event_messages
    WHERE msg_seq IS NOT NULL
    WINDOW w AS (PARTITION BY instance, dp_rank ORDER BY message)
)
SELECT instance, dp_rank, source_file, seq_before, msg_seq AS seq_after,
       CASE WHEN msg_seq > seq_before THEN msg_seq - seq_before - 1 ELSE msg_seq END AS missing,
       from_ts, ts AS to_ts,
       CASE WHEN msg_seq > seq_before THEN 'gap' ELSE 'restart' END AS kind
FROM ordered
WHERE seq_before IS NOT NULL AND (msg_seq > seq_before + 1 OR msg_seq < seq_before);
