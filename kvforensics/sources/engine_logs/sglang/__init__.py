"""SGLang's engine logs: start-ups, per-request lines, prefill batches, versions."""
