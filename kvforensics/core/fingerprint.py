"""Keyed fingerprints of text: what lets us match leaked content without keeping the content.

Text is split into lower-cased word shingles (``SHINGLE_WORDS`` consecutive words). Each shingle is
reduced to a 63-bit integer under a per-investigation key: the first 64 bits, big-endian, shifted right
by one, of SHA-256 over a 64-byte fingerprint key (:func:`fingerprint_key`, derived from the
investigation's key: one whole SHA-256 block) followed by the shingle. Not every shingle is kept:
winnowing (Schleimer, Wilkerson and Aiken, "Winnowing: local algorithms for document fingerprinting",
SIGMOD 2003, the method behind MOSS) keeps, of every window of ``w`` consecutive shingles, the one of
least fingerprint (the rightmost of equal ones); a text of fewer than ``w`` shingles is one window.
As in MOSS, the fingerprint is also the order winnowing selects by, so each shingle is hashed once.
The guarantee: two texts that share a run of at least ``w + SHINGLE_WORDS - 1`` words share at least
one fingerprint, since the first window of ``w`` shingles inside that run is the same window in both
and keeps the same shingle; a run of ``m * w + SHINGLE_WORDS - 1`` words gives at least ``m``
(:func:`guaranteed_words`). A fingerprint is still one whole 8-word shingle, so ``m`` shared
fingerprints are ``m`` shared shingles. ``w = 1`` keeps every shingle.

Why a keyed SHA-256 and not HMAC: a secret-prefix hash is open to length extension only to someone
who sees the whole digest (the extension starts from SHA-256's full 256-bit state), and 63 of its 256
bits are all that is ever stored; so, as with HMAC, a fingerprint cannot be tested against guessed
text without the key, and the fingerprints cannot be brute-forced back to text by dictionary. No raw
text is ever stored. HMAC would cost two SHA-256 calls a shingle where DuckDB's per-call cost
dominates. The key comes from ``KVFORENSICS_HMAC_KEY`` (hex) or is generated once per investigation
and kept in ``$XDG_STATE_HOME/kvforensics/keys/<incident>.key`` (never in the outputs).

:func:`fingerprints` is the reference. The content loader (kvforensics/sources/content/load.py) computes
the same values in bulk with DuckDB (sql/content_fingerprints.sql, with DuckDB's ``sha256``), over the
words of an ASCII text tokenised in SQL (``[a-z0-9_]+`` of the lower-cased text, which is exactly
``\\w+`` on ASCII) or, for any other text, over the words :func:`shingle_words` gives.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Sequence

SHINGLE_WORDS = 8
#: The winnowing window: of every this many consecutive shingles, one is fingerprinted (``[settings]
#: winnow_window`` of the incident file). 3 keeps about 2 / (3 + 1) = half of the shingles, and any run of
#: 10 words two texts share gives them a fingerprint in common: the run of 10 words that 3 shingles in
#: common (the scope's threshold when every shingle was kept) needed.
WINNOW_WINDOW = 3
MAX_WINNOW_WINDOW = 64
_FINGERPRINT_LABEL = b"kvforensics shingle fingerprint v2"
_WORD = re.compile(r"\w+", re.UNICODE)
_SHA256_BLOCK = 64


def key_for(incident_id: str) -> bytes:
    """The HMAC key of an investigation: from the environment, else a stored per-incident key."""
    env = os.environ.get("KVFORENSICS_HMAC_KEY")
    if env:
        return bytes.fromhex(env)
    state = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    path = state / "kvforensics" / "keys" / f"{incident_id}.key"
    if path.exists():
        return bytes.fromhex(path.read_text().strip())
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex())
    return key


def shingles(text: str, width: int = SHINGLE_WORDS) -> list[str]:
    words = [w.lower() for w in _WORD.findall(text)]
    if len(words) < width:
        return [" ".join(words)] if words else []
    return [" ".join(words[i : i + width]) for i in range(len(words) - width + 1)]


def shingle_words(text: str) -> str:
    """The lower-cased words of a text, joined by single spaces, as :func:`shingles` splits them (a
    word never contains a space, so splitting this on spaces gives the words back)."""
    return " ".join(w.lower() for w in _WORD.findall(text))


def fingerprint_key(key: bytes) -> bytes:
    """The 64-byte key that prefixes every shingle: HMAC-SHA256 of a fixed label under the investigation's
    key, padded with zeros to SHA-256's block. As secret as the key: passed to DuckDB as a query
    parameter, never stored."""
    return hmac.new(key, _FINGERPRINT_LABEL, hashlib.sha256).digest().ljust(_SHA256_BLOCK, b"\0")


def shingle_fingerprint(shingle: str, keyed: bytes) -> int:
    """The 63-bit fingerprint of a shingle under a :func:`fingerprint_key`: the first 64 bits of
    SHA-256(keyed || shingle), big-endian, shifted right by one."""
    return int.from_bytes(hashlib.sha256(keyed + shingle.encode("utf-8")).digest()[:8], "big") >> 1


def winnow(hashes: Sequence[int], window: int) -> list[int]:
    """The positions winnowing keeps: of each run of *window* consecutive hashes the least, the rightmost
    of equal ones (robust winnowing's tie rule); of fewer hashes than *window*, the least of them all.
    Sorted and distinct."""
    if not hashes:
        return []
    span = min(window, len(hashes))
    kept = set()
    for start in range(len(hashes) - span + 1):
        least = min(hashes[start : start + span])
        kept.add(max(i for i in range(start, start + span) if hashes[i] == least))
    return sorted(kept)


def guaranteed_words(window: int, shared: int = 1, width: int = SHINGLE_WORDS) -> int:
    """The length of a run of words two texts share that guarantees them *shared* fingerprints in common
    under winnowing with *window* (when the run's shingles are distinct): every window of *window*
    shingles inside the run is the same in both texts and keeps the same shingle; a run of ``shared *
    window + width - 1`` words holds ``(shared - 1) * window + 1`` such windows, and one kept shingle is
    in at most *window* of them."""
    return shared * window + width - 1


def fingerprints(text: str, key: bytes, width: int = SHINGLE_WORDS, window: int = WINNOW_WINDOW) -> set[int]:
    """Distinct keyed 63-bit fingerprints of the text's word shingles that winnowing with *window* keeps
    (``window = 1``: every shingle)."""
    keyed = fingerprint_key(key)
    hashes = [shingle_fingerprint(s, keyed) for s in shingles(text, width)]
    return {hashes[i] for i in winnow(hashes, window)}


def rendered_text(value: Any) -> str | None:
    """The text of a content field as it is fingerprinted: a string as it is; a chat-messages array
    (``[{"role": "user", "content": "..."}]``, given as JSON or as a JSON string of it) as the texts of
    its messages in order, one paragraph each. A message's content may be a string or a list of
    content parts (``{"type": "text", "text": "..."}``), whose texts are taken in order; roles,
    names and non-text parts (images, audio, tool calls) are left out, as they are not text a
    response could quote. None when there is no text."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        texts = _message_texts(parsed)
        return "\n\n".join(texts) if texts else value
    if isinstance(value, str):
        return value or None
    texts = _message_texts(value)
    return "\n\n".join(texts) or None


def _message_texts(value: Any) -> list[str]:
    """The texts of a messages array or content-part list, in order (empty for anything else)."""
    if not isinstance(value, list):
        return []
    texts: list[str] = []
    for item in value:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("content"), str):
            texts.append(item["content"])
        elif isinstance(item, dict) and isinstance(item.get("content"), list):
            texts.extend(_message_texts(item["content"]))
        elif (
            isinstance(item, dict)
            and item.get("type") in (None, "text", "input_text", "output_text")
            and isinstance(item.get("text"), str)
        ):
            texts.append(item["text"])
    return [t for t in texts if t]
