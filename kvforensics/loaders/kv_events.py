"""KV-cache events (``kind = "kv_events"``): the blocks an engine's prefix cache stored and removed.

vLLM (``vllm/distributed/kv_events.py``) and SGLang (``python/sglang/srt/disaggregation/kv_events.py``)
publish ``KVEventBatch`` messages over ZMQ (msgpack, encoded by msgspec); a subscriber keeps them as
JSONL, one batch per line, in either of msgspec's encodings:

* array form: ``[ts, [event, ...]]`` or ``[ts, [event, ...], dp_rank]``, each event
  ``[tag, field, ...]`` with its fields in declaration order (msgspec ``array_like`` structs);
* object form: ``{"ts": ..., "events": [...], "data_parallel_rank": ...}`` (SGLang: ``attn_dp_rank``),
  each event ``{"type": tag, "<field>": ...}`` (newer vLLM structs are not ``array_like``).

``BlockStored`` fields in order: block_hashes, parent_block_hash, token_ids, block_size, lora_id (every
version); medium (later vLLM, SGLang); then vLLM's lora_name (vLLM PR 27577), extra_keys, group_idx,
kv_cache_spec_kind, kv_cache_spec_sliding_window (extra_keys: vLLM PR 33304), of which trailing defaults may be omitted; SGLang
0.5.18 and later put a ``{"cache_salt": ..., "session_id": ...}`` map where vLLM has lora_name.
``BlockRemoved``: block_hashes, then medium and group_idx. ``AllBlocksCleared``: no field.

A block hash may be a JSON integer (kept as its decimal digits), a ``0x`` integer (the same), hex of
the hash's bytes without a prefix, or base64 of them (msgspec's JSON encoding of bytes); bytes are
kept as lower-case hex. Token ids are the prompt: each block's ids become a keyed fingerprint
(:func:`block_fingerprint`, the incident's HMAC key) and are never stored, nor shown in the
quarantine. A block's position in its chain and the cache salt of the chain (vLLM carries it in the
first block's ``extra_keys``) follow the parent hashes across the files of an ingest (:class:`Chains`).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from hmac import digest as hmac_digest
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.loaders.changes import parse_ts
from kvforensics.loaders.records import QuarantineRows
from kvforensics.loaders.staging import FileLoad
from kvforensics.loaders.textio import INCOMPLETE_RECORD, LineStream, decode_line, printable_raw

KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
# each event's fields in wire order (after the tag), and how many every version carries
FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
REQUIRED = {"BlockStored": 5, "BlockRemoved": 1, "AllBlocksCleared": 0}
_LORA_NAME = FIELDS["BlockStored"].index("lora_name")
_INT32 = 2 ** 31  # dp_rank and group_idx are INTEGER columns
FLUSH_ROWS = 500_000  # block rows per insert
NOTE = "token ids fingerprinted per block (keyed HMAC); none stored"
_HEX = re.compile(r"[0-9a-fA-F]+")
# the columns of a block row, in the order _add_rows builds them
_COLUMNS = ("instance", "dp_rank", "ts", "batch", "seq", "kind", "block_hash", "parent_block_hash", "position",
            "num_tokens", "block_fp", "lora", "medium", "salt", "kv_group", "line")
_TYPES = {"dp_rank": pa.int32(), "ts": pa.timestamp("us", tz="UTC"), "batch": pa.int64(), "seq": pa.int32(),
          "position": pa.int64(), "num_tokens": pa.int64(), "block_fp": pa.int64(), "kv_group": pa.int32(),
          "line": pa.int64()}


class Refused(ValueError):
    """Why an event (or a whole batch) cannot be loaded."""


def block_fingerprint(token_ids: list[int], key: bytes) -> int:
    """The keyed 63-bit fingerprint of one block's token ids: HMAC-SHA256 under the incident key of
    ``b"kv-block:"`` and the ids as decimal numbers joined by commas. Equal ids give equal
    fingerprints within an investigation; without the key they cannot be tested against guesses."""
    message = b"kv-block:" + ",".join(map(str, token_ids)).encode("ascii")
    return int.from_bytes(hmac_digest(key, message, "sha256")[:8], "big") >> 1


def canonical_hash(value: Any) -> str:
    """A block hash as text: an integer as its decimal digits, bytes as lower-case hex."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        if value[:2] in ("0x", "0X") and _HEX.fullmatch(value[2:]):
            return str(int(value[2:], 16))
        if len(value) % 2 == 0 and _HEX.fullmatch(value):
            return value.lower()
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        if decoded:
            return decoded.hex()
    raise Refused(f"block hash {_shown(value)} is not an integer, hex or base64 string")


@dataclass
class Chains:
    """Position and cache salt of each stored block, by (instance, hash), kept across the files of one
    ingest so that a chain continued in a later batch or file knows its depth and salt."""

    known: dict[tuple[str, str], tuple[int | None, str | None]] = field(default_factory=dict)


@dataclass
class _Rows:
    """Block rows waiting for one insert, as tuples in ``_COLUMNS`` order."""

    data: list[tuple] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.data)

    def flush(self, con: duckdb.DuckDBPyConnection, source: Source, path: Path) -> None:
        if not self.data:
            return
        columns = zip(*self.data, strict=True)
        table = pa.table({c: pa.array(v, type=_TYPES.get(c, pa.string())) for c, v in zip(_COLUMNS, columns,
                                                                                           strict=True)})
        con.register("kv_events_batch", table)
        try:
            con.execute("INSERT INTO kv_events SELECT instance, dp_rank, ts, batch, seq, kind, block_hash, "
                        "parent_block_hash, position, num_tokens, block_fp, lora, medium, salt, kv_group, $s, $f, "
                        "line FROM kv_events_batch", {"s": source.name, "f": str(path)}).fetchall()
        finally:
            con.unregister("kv_events_batch")
        self.data = []


def load_kv_events(con: duckdb.DuckDBPyConnection, source: Source, path: Path, key: bytes,
                   chains: Chains | None = None) -> FileLoad:
    """Load one KV-event file into ``kv_events``: a record is an event (a line that cannot be read as a
    batch counts as one); every event loaded or quarantined with its reason, token ids never kept."""
    load = FileLoad(file=path)
    chains = chains if chains is not None else Chains()
    quarantine = QuarantineRows(con, source, path)
    rows = _Rows()
    default_instance = source.instance_for(path)
    stream = LineStream(path)
    for line, rawb in stream:
        if not rawb.strip():
            continue
        try:
            batch = _batch(rawb, source, default_instance)
        except Refused as e:  # the whole line: its text may hold token ids, so none of it is kept
            load.records_read += 1
            load.quarantined += 1
            quarantine.add(line, str(e), None)
            continue
        instance, dp_rank, ts, events, problem = batch
        for seq, event in enumerate(events):
            load.records_read += 1
            try:
                if problem:
                    raise Refused(problem)
                kind, values = _event(event)
                _add_rows(rows.data, chains, key, kind, values, (instance, dp_rank, ts, line, seq), line)
            except Refused as e:
                load.quarantined += 1
                quarantine.add(line, f"event {seq}: {e}", printable_raw(_shown(event)))
                continue
            load.loaded += 1
        if len(rows) >= FLUSH_ROWS:
            rows.flush(con, source, path)
    if stream.partial is not None:
        load.records_read += 1
        load.quarantined += 1
        quarantine.add(stream.partial[0], INCOMPLETE_RECORD, None)
    if stream.stopped:
        load.notes.append(stream.stopped)
    rows.flush(con, source, path)
    quarantine.flush()
    if load.records_read == 0:
        load.notes.append("empty file")
    load.notes.append(NOTE)
    return load


def _batch(rawb: bytes, source: Source, default_instance: str) -> tuple[str, int | None, Any, list, str | None]:
    """(instance, dp_rank, ts, events, the problem every event of the batch shares or None)."""
    text = decode_line(rawb)
    if text is None:
        raise Refused("not UTF-8")
    try:
        batch = json.loads(text)
    except ValueError:
        raise Refused("malformed JSON (text not kept: it may hold token ids)") from None
    instance_key = source.columns.get("instance")
    if isinstance(batch, list):
        if len(batch) not in (2, 3):
            raise Refused(f"a batch array has {len(batch)} items; expected [ts, events] or [ts, events, dp_rank]")
        if instance_key:
            raise Refused(f"the batch is an array, so it has no key '{instance_key}' naming the instance "
                          "(columns.instance)")
        ts_raw, events, rank = batch[0], batch[1], batch[2] if len(batch) == 3 else None
        instance = default_instance
    elif isinstance(batch, dict):
        ts_raw, events = _get(batch, source.column("ts")), _get(batch, source.column("events"))
        rank_key = source.columns.get("dp_rank")
        rank = _get(batch, rank_key) if rank_key else batch.get("data_parallel_rank", batch.get("attn_dp_rank"))
        if instance_key:
            instance = _get(batch, instance_key)
            if not isinstance(instance, str) or not instance:
                raise Refused(f"no instance: key '{instance_key}' (columns.instance) is missing or not a string")
        else:
            instance = default_instance
    else:
        raise Refused("a batch must be a JSON array [ts, events, ...] or object {\"ts\": ..., \"events\": [...]}")
    if not isinstance(events, list):
        raise Refused(f"the batch's events are {_type(events)}, not a list")
    problem = None
    ts = _batch_time(ts_raw, source)
    if ts is None:
        problem = f"the batch's timestamp {_shown(ts_raw)} is not epoch seconds or ISO 8601"
    elif rank is not None and (type(rank) is not int or not 0 <= rank < _INT32):
        problem = f"the batch's dp rank {_shown(rank)} is not a non-negative 32-bit integer"
    if not events and problem:
        raise Refused(problem)
    return instance, rank, ts, events, problem


def _batch_time(value: Any, source: Source) -> datetime | None:
    """A batch's ``ts`` in UTC: epoch seconds as published (a number, or its text; milli-, micro- and
    nanoseconds told apart by magnitude) or ISO 8601; the source's clock offset applied."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number: float | None = float(value)
    except ValueError:
        number = None
    return parse_ts(str(value) if number is None else repr(number), source)  # the offset applied there


def _get(record: dict, key: str) -> Any:
    """``record[key]``, a dotted key descending into nested objects."""
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _event(event: Any) -> tuple[str, list[Any]]:
    """The event's tag and its fields in ``FIELDS`` order (absent trailing ones None), shape checked
    (tag, arity); values are checked by :func:`_add_rows`."""
    if type(event) is list:
        tag = event[0] if event else None
        if not isinstance(tag, str):
            raise Refused("an event array must start with its tag (BlockStored, BlockRemoved, AllBlocksCleared)")
        names = FIELDS.get(tag)
        if names is None:
            raise Refused(f"unknown event tag {_shown(tag)}")
        given = len(event) - 1
        if not REQUIRED[tag] <= given <= len(names):
            expected = f"{REQUIRED[tag]} to {len(names)}" if len(names) > REQUIRED[tag] else str(len(names))
            raise Refused(f"{tag} with {given} fields; expected {expected} (wrong arity)")
        return tag, event[1:] + [None] * (len(names) - given)
    if isinstance(event, dict):
        tag = event.get("type")
        if tag not in FIELDS:
            raise Refused(f"unknown event tag {_shown(tag)}" if tag is not None
                          else "an event object needs its tag in \"type\"")
        missing = [n for n in FIELDS[tag][:REQUIRED[tag]] if n not in event]
        if missing:
            raise Refused(f"{tag} lacks field(s) {', '.join(missing)}")
        values = [event.get(n) for n in FIELDS[tag]]
        if tag == "BlockStored" and isinstance(event.get("metadata"), dict):  # SGLang's metadata as a key
            values[_LORA_NAME] = event["metadata"]
        return tag, values
    raise Refused(f"an event must be an array or object, not {_type(event)}")


def _add_rows(rows: list[tuple], chains: Chains, key: bytes, tag: str, v: list[Any],
              head: tuple[str, int | None, datetime, int, int], line: int) -> None:
    """The event's rows; ``v`` its fields in ``FIELDS`` order, ``head`` (instance, dp_rank, ts, batch, seq)."""
    kind = KINDS[tag]
    if tag == "AllBlocksCleared":
        rows.append((*head, kind, None, None, None, None, None, None, None, None, None, line))
        return
    hashes = v[0]
    if type(hashes) is not list or not hashes:
        raise Refused("block_hashes must be a non-empty list")
    hashes = [str(h) if type(h) is int else canonical_hash(h) for h in hashes]
    if tag == "BlockRemoved":
        medium, group = _optional(v[1], str, "medium"), _group(v[2])
        rows.extend((*head, kind, h, None, None, None, None, None, medium, None, group, line) for h in hashes)
        return
    parent_raw, tokens, size, lora_id, medium, lora_name, extra, group, spec_kind, window = v[1:]
    parent = None if parent_raw is None else str(parent_raw) if type(parent_raw) is int else \
        canonical_hash(parent_raw)
    if type(size) is not int:
        raise Refused(f"block_size {_shown(size)} is not an integer")
    if size <= 0:
        raise Refused(f"block_size {size} is not positive (negative size)" if size < 0 else "block_size is 0")
    if type(tokens) is not list or not set(map(type, tokens)) <= {int}:
        raise Refused("token_ids must be a list of integers")
    if tokens and min(tokens) < 0:
        raise Refused("token_ids holds a negative token id")
    n = len(hashes)
    if tokens and not (n - 1) * size < len(tokens) <= n * size:
        raise Refused(f"token_ids holds {len(tokens)} ids for {n} block(s) of block_size {size}")
    if lora_id is not None and (_optional(lora_id, int, "lora_id") < 0):
        raise Refused(f"negative lora_id {lora_id}")
    salt = None
    if type(lora_name) is dict:  # SGLang 0.5.18+: {"cache_salt": ..., "session_id": ...} in this slot
        salt = _optional(lora_name.get("cache_salt"), str, "metadata.cache_salt") or None
        lora_name = None
    medium, lora_name, group = _optional(medium, str, "medium"), _optional(lora_name, str, "lora_name"), _group(group)
    if extra is not None and (type(extra) is not list or len(extra) != n
                              or not all(e is None or type(e) is list for e in extra)):
        raise Refused(f"extra_keys must be a list of {n} lists or nulls, one per block")
    _optional(spec_kind, str, "kv_cache_spec_kind")
    _optional(window, int, "kv_cache_spec_sliding_window")
    lora = lora_name if lora_name is not None else None if lora_id is None else str(lora_id)
    instance = head[0]
    known = chains.known
    position, chain_salt = (0, None) if parent is None else known.get((instance, parent), (None, None))
    if parent is not None and position is not None:
        position += 1
    for i, h in enumerate(hashes):
        block = tokens if n == 1 else tokens[i * size:(i + 1) * size]
        if extra is not None and extra[i]:
            chain_salt = _vllm_salt(extra[i], lora_name) or chain_salt
        chain_salt = salt or chain_salt
        known[(instance, h)] = (position, chain_salt)
        rows.append((*head, kind, h, parent, position, len(block) or None,
                     block_fingerprint(block, key) if block else None, lora, medium, chain_salt, group, line))
        parent = h
        position = None if position is None else position + 1


def _vllm_salt(keys: list | None, lora_name: str | None) -> str | None:
    """The cache salt among a vLLM block's extra keys (LoRA name, then (mm id, offset) pairs, then the
    salt on the first block, then prompt-embedding hashes): a string that is not the LoRA name."""
    strings = [k for k in keys or () if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def _group(value: Any) -> int | None:
    if _optional(value, int, "group_idx") is not None and not 0 <= value < _INT32:
        raise Refused(f"negative group_idx {value}" if value < 0 else f"group_idx {value} is out of range")
    return value


def _optional(value: Any, kind: type, name: str) -> Any:
    """*value* if it is None or of type *kind* (a boolean is no integer), else refused."""
    if value is not None and type(value) is not kind:
        raise Refused(f"{name} {_shown(value)} is not {'an integer' if kind is int else 'a string'}")
    return value


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """A value as the quarantine may show it: lists (token ids, hashes) only by their length."""
    def redact(v: Any) -> Any:
        if isinstance(v, list):
            return f"<list of {len(v)}>" if not (v and isinstance(v[0], str) and v[0] in FIELDS) else \
                [v[0], *(redact(x) for x in v[1:])]
        if isinstance(v, dict):
            return {k: redact(x) for k, x in v.items()}
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return v
    return json.dumps(redact(value), ensure_ascii=False)[:200]
