"""The keyed fingerprints of a block's token ids and of a prompt prefix up to a block, shared by the KV-cache
events (each stored block's chain, followed through its parent hashes) and the prompts cut into blocks
(``request_blocks``): equal values mean equal token ids from the first block to this one, whatever hash (salted
or not) an engine published for them."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from functools import lru_cache
from typing import Any


def chain_fingerprint(parent: int | None, block_fp: int, key: bytes) -> int:
    """The keyed fingerprint of a prefix up to a block: its parent's chain fingerprint and its own."""
    mac = keyed_sha256(key)()
    mac.update(f"kv-chain:{'' if parent is None else parent}:{block_fp}".encode("ascii"))
    return int.from_bytes(mac.digest()[:8], "big") >> 1


@lru_cache(maxsize=8)
def keyed_sha256(key: bytes) -> Callable[[], Any]:
    """A fresh HMAC-SHA256 under *key* (``update``, ``digest``): a copy of one keyed once, cheaper than
    keying one for each block, of the C object inside ``hmac.HMAC`` where CPython has one (OpenSSL's)."""
    keyed = hmac.new(key, digestmod="sha256")
    return getattr(keyed, "_hmac", keyed).copy


def block_fingerprint(token_ids: list[int], key: bytes) -> int:
    """The keyed 63-bit fingerprint of one block's token ids: HMAC-SHA256 under the incident key of
    ``b"kv-block:"`` and the ids as decimal numbers joined by commas. Equal ids give equal
    fingerprints within an investigation; without the key they cannot be tested against guesses. (A
    list of ints' ``repr`` is that text with spaces, and faster to make.)"""
    text = repr(token_ids)[1:-1].replace(" ", "") if type(token_ids) is list else ",".join(map(str, token_ids))
    return ids_fingerprint(text, key)


def ids_fingerprint(ids: str, key: bytes) -> int:
    """:func:`block_fingerprint` of the ids written as it writes them (``"101,102,103"``)."""
    mac = keyed_sha256(key)()
    mac.update(b"kv-block:" + ids.encode("ascii"))
    return int.from_bytes(mac.digest()[:8], "big") >> 1
