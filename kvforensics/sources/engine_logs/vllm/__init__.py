"""vLLM's engine logs: start-ups and events of V0, V1 and 0.33."""
