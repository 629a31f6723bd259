"""The keyed fingerprint of a prompt prefix up to a block, shared by the KV-cache events (each stored
block's chain, followed through its parent hashes) and the prompts cut into blocks (``request_blocks``):
equal values mean equal token ids from the first block to this one, whatever hash (salted or not) an
engine published for them."""

from __future__ import annotations

from hmac import digest as hmac_digest


def chain_fingerprint(parent: int | None, block_fp: int, key: bytes) -> int:
    """The keyed fingerprint of a prefix up to a block: its parent's chain fingerprint and its own."""
    message = f"kv-chain:{'' if parent is None else parent}:{block_fp}".encode("ascii")
    return int.from_bytes(hmac_digest(key, message, "sha256")[:8], "big") >> 1
