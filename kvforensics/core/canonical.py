"""The canonical fields each kind of source is mapped onto.

A ``columns`` entry of the incident file maps one of these names to where the source holds it
(``sources/requests/mapping.py``); the loaders fill the tables of ``sql/schema.sql`` with them.
"""

from __future__ import annotations

CANONICAL_REQUEST_FIELDS = (
    "request_id",
    "ts",
    "account_id",
    "model",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "latency_ms",
    "prefill_instance",
    "decode_instance",
    "cache_salt",  # the prefix-cache salt / namespace the gateway or engine saw (optional)
)
REQUIRED_REQUEST_FIELDS = ("request_id", "ts", "account_id", "model", "status", "prompt_tokens")
CANONICAL_CHANGE_FIELDS = ("ts", "model", "instance", "description", "details")
# prompt_token_ids (optional): the prompt as the engine's token ids, cut into prefix blocks (sources/content/prefix_blocks.py)
CANONICAL_CONTENT_FIELDS = ("request_id", "prompt", "output", "prompt_token_ids")
# kv_events: the keys of a message written as an object (dotted for a nested key, a number indexing an array:
# "batch.1"); `instance` read from a field only when mapped, else from the source's instance template; `seq`
# the publisher's sequence number (kv_event_gaps)
CANONICAL_KV_EVENT_FIELDS = ("instance", "ts", "events", "dp_rank", "seq")
