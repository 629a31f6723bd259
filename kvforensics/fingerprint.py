"""Keyed fingerprints of text: what lets us match leaked content without keeping the content.

Text is split into lower-cased word shingles (``SHINGLE_WORDS`` consecutive words); each shingle is
reduced to a 63-bit integer with HMAC-SHA256 under a per-investigation key. Without the key the
fingerprints cannot be brute-forced back to text by dictionary, and no raw text is ever stored.
The key comes from ``KVFORENSICS_HMAC_KEY`` (hex) or is generated once per investigation and kept
in ``$XDG_STATE_HOME/kvforensics/keys/<incident>.key`` (never in the outputs).

:func:`fingerprints` is the reference. The content loader (kvforensics/loaders/content.py) computes
the same values in bulk with DuckDB (sql/content_fingerprints.sql): HMAC-SHA256 composed from
DuckDB's ``sha256`` and the key blocks of :func:`hmac_blocks`, over the words of an ASCII text
tokenised in SQL (``[a-z0-9_]+`` of the lower-cased text, which is exactly ``\\w+`` on ASCII) or,
for any other text, over the words :func:`shingle_words` gives.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

SHINGLE_WORDS = 8
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
    return [" ".join(words[i:i + width]) for i in range(len(words) - width + 1)]


def shingle_words(text: str) -> str:
    """The lower-cased words of a text, joined by single spaces, as :func:`shingles` splits them (a
    word never contains a space, so splitting this on spaces gives the words back)."""
    return " ".join(w.lower() for w in _WORD.findall(text))


def hmac_blocks(key: bytes) -> tuple[bytes, bytes]:
    """The inner and outer key blocks of HMAC-SHA256 (RFC 2104): the key (hashed first when longer
    than SHA-256's 64-byte block) padded with zeros to 64 bytes, XOR 0x36 and XOR 0x5c. An HMAC is
    SHA256(outer || SHA256(inner || message)). As secret as the key: passed to DuckDB as query
    parameters, never stored."""
    block = (hashlib.sha256(key).digest() if len(key) > _SHA256_BLOCK else key).ljust(_SHA256_BLOCK, b"\0")
    return bytes(b ^ 0x36 for b in block), bytes(b ^ 0x5C for b in block)


def fingerprints(text: str, key: bytes, width: int = SHINGLE_WORDS) -> set[int]:
    """Distinct keyed 63-bit fingerprints of the text's word shingles."""
    out = set()
    for s in shingles(text, width):
        digest = hmac.new(key, s.encode("utf-8"), hashlib.sha256).digest()
        out.add(int.from_bytes(digest[:8], "big") >> 1)
    return out


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
        elif isinstance(item, dict) and item.get("type") in (None, "text", "input_text", "output_text") \
                and isinstance(item.get("text"), str):
            texts.append(item["text"])
    return [t for t in texts if t]
