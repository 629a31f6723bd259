"""KV-cache events (``kind = "kv_events"``): the bulk and the reference reader, chains."""
