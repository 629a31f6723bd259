"""KV-cache events (``kind = "kv_events"``): the blocks an engine's prefix cache stored and removed.

vLLM (``vllm/distributed/kv_events.py``) and SGLang (``python/sglang/srt/disaggregation/kv_events.py``)
publish ``KVEventBatch`` messages over ZMQ (topic, an 8-byte sequence number, msgpack encoded by
msgspec); a subscriber keeps them as JSONL, one message per line:

* array form: ``[ts, [event, ...]]`` or ``[ts, [event, ...], dp_rank]`` (msgspec ``array_like``);
* object form: ``{"ts": ..., "events": [...], "data_parallel_rank": ...}`` (SGLang: ``attn_dp_rank``);
* either inside the subscriber's own wrapper, e.g. ``{"recv_ts": ..., "instance": "sglang-1", "seq": 3898,
  "batch": [ts, [event, ...], dp_rank]}``: the source's ``columns`` say where each part is, dotted keys
  descending into objects and, by a number, into arrays (``ts = "batch.0"``, ``events = "batch.1"``), and
  ``seq`` names the publisher's sequence number (table ``kv_event_gaps``: lost messages and restarts).

Each event is an array ``[tag, field, ...]`` with its fields in declaration order, or a map
``{"type": tag, "<field>": ...}`` (newer vLLM; SGLang from sgl-project/sglang#37482, with ``cache_salt``
and ``session_id`` as fields of the event; an absent field of a map is its default, null).
``BlockStored`` fields in order: block_hashes, parent_block_hash, token_ids, block_size, lora_id (every
version); medium (later vLLM, SGLang from #18205); then vLLM's lora_name (vLLM PR 27577), extra_keys,
group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window (extra_keys: vLLM PR 33304), of which trailing
defaults may be omitted; salted SGLang stores (#30827) put a ``{"cache_salt": ..., "session_id": ...}`` map
where vLLM has lora_name, so one stream mixes 7- and 8-element arrays. ``BlockRemoved``: block_hashes, then
medium and group_idx. ``AllBlocksCleared``: no field. The load notes say which shapes a file held.

A block hash may be a JSON integer (kept as its decimal digits), a ``0x`` integer (the same), hex of
the hash's bytes without a prefix, or base64 of them (msgspec's JSON encoding of bytes); bytes are
kept as lower-case hex. Token ids are the prompt: each block's ids become a keyed fingerprint
(:func:`block_fingerprint`, the incident's HMAC key) and are never stored, nor shown in the
quarantine; a store naming several hashes (SGLang's merged stores, #31479) is one row per hash with its
share of the ids. A block's position in its chain, the cache salt of the chain (vLLM carries it in the
first block's ``extra_keys``) and the chain fingerprint of the prefix up to it (``chain_fp``,
:func:`kvforensics.sources.common.chain.chain_fingerprint`, equal for equal token ids whatever the salt did to
the hashes) follow the parent hashes across the files of an ingest (:class:`Chains`).

Two readers give the same rows: DuckDB reads the common shapes in bulk (:mod:`kvforensics.sources.kv_events.bulk`)
and hands every line it does not take, and every file it cannot number line for line, to the Python reference
(:mod:`kvforensics.sources.kv_events.reference`); the first load note of a file says which read it.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import duckdb

from kvforensics.config import Source
from kvforensics.sources.common.bulk_lines import CheckedLines
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.kv_events.bulk import BULK_MIN_LINES, read_bulk
from kvforensics.sources.kv_events.chains import Chains
from kvforensics.sources.kv_events.reference import FIELDS, block_fingerprint, canonical_hash, read_reference

__all__ = ["FIELDS", "Chains", "block_fingerprint", "canonical_hash", "load_kv_events"]


def load_kv_events(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    path: Path,
    key: bytes,
    chains: Chains | None = None,
    *,
    bulk_from: int = BULK_MIN_LINES,
    checked: Future[CheckedLines | str] | None = None,
) -> FileLoad:
    """Load one KV-event file into ``kv_events`` and its messages into ``kv_event_messages``: a record
    is an event (a line that cannot be read as a batch counts as one); every event loaded or quarantined
    with its reason, token ids never kept. In bulk when the file has *bulk_from* lines or more and DuckDB
    can read it, else by the reference. *checked*: the check of the file's lines begun before
    (:class:`~kvforensics.sources.common.bulk_lines.LineChecks`)."""
    chains = chains if chains is not None else Chains()
    load = read_bulk(con, source, path, key, chains, bulk_from, checked)
    if isinstance(load, FileLoad):
        return load
    reference = read_reference(con, source, path, key, chains)
    reference.notes.insert(0, f"read by the Python reference: {load}")
    return reference
