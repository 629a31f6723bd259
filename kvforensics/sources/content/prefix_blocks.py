"""Prompts cut into prefix-cache blocks: table ``request_blocks``, what ties a reused block to the
request that first stored it.

A prefix cache keys the KV of a prompt's leading tokens in blocks of the engine's block size: block
``p`` holds tokens ``p * size .. (p + 1) * size - 1``, and only full blocks are cached. Each block of
a content record becomes a row ``request_id, position, num_tokens, block_fp, chain_fp``:

* ``block_fp``: the keyed fingerprint of the block's tokens, :func:`kvforensics.sources.common.chain.block_fingerprint`
  when the record carries the engine's ``prompt_token_ids`` (so it joins with ``kv_events.block_fp``),
  else the same HMAC over the block's words (:func:`fingerprint.shingle_words`): a documented
  approximation in which a word stands for a token, blocks of words line up between two prompts only
  where their words do, and ``num_tokens`` counts words;
* ``chain_fp``: a keyed hash of the parent block's ``chain_fp`` and this ``block_fp``, so two equal
  ``chain_fp`` mean two equal prompts up to the end of that block, which is when an engine's cache
  can serve the one from the other.

The block size is the incident file's ``[prefix_cache] block_size``, else the block size the loaded
KV-cache events show, else the engines' page size (``capacity.page_size``), else 16. Neither token ids
nor words are stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from hmac import digest as hmac_digest

import duckdb
import pyarrow as pa

from kvforensics.core.db import one
from kvforensics.sources.common.chain import block_fingerprint, chain_fingerprint

DEFAULT_BLOCK_SIZE = 16
MAX_BLOCKS = 100_000  # per prompt: a cache keyed on longer prefixes than this is not one we model
TOKEN_IDS_NOTE = "prompt token ids cut into prefix blocks of {size} (keyed fingerprints; no ids stored)"
WORDS_NOTE = "prompts without token ids cut into prefix blocks of {size} words (an approximation of token blocks)"
_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("position", pa.int64()),
        ("num_tokens", pa.int64()),
        ("block_fp", pa.int64()),
        ("chain_fp", pa.int64()),
    ]
)


def word_fingerprint(words: Sequence[str], key: bytes) -> int:
    """The keyed fingerprint of a block of words, the message :func:`block_fingerprint` builds from
    token ids with the words in their place."""
    message = b"kv-block:" + ",".join(words).encode("utf-8")
    return int.from_bytes(hmac_digest(key, message, "sha256")[:8], "big") >> 1


def prefix_blocks(units: Sequence[int] | Sequence[str], block_size: int, key: bytes) -> list[tuple[int, int, int, int]]:
    """``(position, num_tokens, block_fp, chain_fp)`` of every full block of a prompt given as token ids
    (ints) or words (strings)."""
    out: list[tuple[int, int, int, int]] = []
    parent: int | None = None
    for position in range(min(len(units) // block_size, MAX_BLOCKS)):
        block = units[position * block_size : (position + 1) * block_size]
        if isinstance(block[0], str):
            fp = word_fingerprint(block, key)  # type: ignore[arg-type]
        else:
            fp = block_fingerprint(block, key)  # type: ignore[arg-type]
        parent = chain_fingerprint(parent, fp, key)
        out.append((position, block_size, fp, parent))
    return out


def token_ids(value: object) -> list[int] | None:
    """A record's ``prompt_token_ids`` as a list of non-negative ints, ``[]`` when absent, None when it
    is not such a list (the record is quarantined for it)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):  # a CSV cell holding the JSON list
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return value


def block_size(con: duckdb.DuckDBPyConnection, configured: int | None) -> int:
    """The block size prompts are cut at: configured, else the most common block size of the loaded
    KV-cache events, else the smallest page size of the engines' start-ups, else 16."""
    if configured:
        return configured
    events, pages = one(
        con,
        """SELECT (SELECT num_tokens FROM kv_events WHERE kind = 'stored' AND num_tokens > 0
                                        GROUP BY num_tokens ORDER BY count(*) DESC, num_tokens LIMIT 1),
                                       (SELECT min(page_size) FROM capacity WHERE page_size > 0)""",
    )
    return int(events or pages or DEFAULT_BLOCK_SIZE)


class BlockRows:
    """Rows of ``request_blocks`` waiting to be inserted."""

    def __init__(self) -> None:
        self.columns: dict[str, list[object]] = {name: [] for name in _SCHEMA.names}

    def add(self, request_id: str, blocks: Iterable[tuple[int, int, int, int]]) -> None:
        for position, num_tokens, fp, chain in blocks:
            for name, value in zip(_SCHEMA.names, (request_id, position, num_tokens, fp, chain), strict=True):
                self.columns[name].append(value)

    def __len__(self) -> int:
        return len(self.columns["request_id"])

    def flush(self, con: duckdb.DuckDBPyConnection) -> None:
        if not len(self):
            return
        con.register("request_blocks_batch", pa.table(self.columns, schema=_SCHEMA))
        try:
            con.execute("INSERT INTO request_blocks SELECT * FROM request_blocks_batch").fetchall()
        finally:
            con.unregister("request_blocks_batch")
        self.columns = {name: [] for name in _SCHEMA.names}
