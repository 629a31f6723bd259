"""The six checks, one module each, numbered as in :data:`kvforensics.audit.model.CHECKS`.

1. :mod:`.pool_vs_context`: KV pool vs context length (every role).
2. :mod:`.engine_version`: engine version vs the first release with the PD reject-path fix.
3. :mod:`.release_and_batch`: deferred KV release and a capped Mooncake transfer batch.
4. :mod:`.corruption_detection`: KV checksum / canary on, and corruption seen in the log.
5. :mod:`.load_balancer`: the load balancer's abort on client disconnect (deployment manifest).
6. :mod:`.prefix_cache`: prefix-cache isolation between tenants (caching on, block hash, salts and who
   sets them, external KV stores); a fail here is listed, it does not make the start-up "exposed"
   (that word is check 1's: prompts served beyond the KV pool).

Each takes one :class:`~kvforensics.audit.startups.Startup` and returns its status, a sentence and
the file and line the sentence rests on (:data:`.common.Judged`). **Missing evidence is never a
pass**: a setting the log does not show is ``unknown``.
"""
