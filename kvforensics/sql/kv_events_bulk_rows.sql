-- The rows of a KV-event file read in bulk (kvforensics/sources/kv_events/bulk.py, sql/kv_events_bulk.sql): its
-- blocks (kv_bulk_blocks), each stored one with the position, cache salt and chain fingerprint its chain gave it
-- (temp table kv_bulk_followed, by the block's rowid), and its messages in line order, numbered on from the
-- files read before ($before). Parameters: $s (the source), $f (the file), $before.

INSERT INTO kv_events BY NAME
SELECT b.instance, b.dp_rank, b.ts, b.line AS batch, b.seq, b.msg_seq, b.kind, b.block_hash,
       b.parent AS parent_block_hash, f.position, b.num_tokens, b.block_fp, f.chain_fp, b.lora, b.medium, f.salt,
       b.kv_group, $s AS source, $f AS source_file, b.line AS source_line
FROM kv_bulk_blocks b LEFT JOIN kv_bulk_followed f ON f.row = b.rowid;

INSERT INTO kv_event_messages BY NAME
SELECT instance, dp_rank, msg_seq, ts, events, loaded, $before + row_number() OVER (ORDER BY line) AS message,
       $s AS source, $f AS source_file, line AS source_line
FROM kv_bulk_events WHERE seq = 0;
