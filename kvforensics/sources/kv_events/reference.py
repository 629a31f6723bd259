"""The Python reference reader of KV-cache event files (the formats: :mod:`kvforensics.sources.kv_events.load`).

It reads a file line by line and event by event, follows each chain through the parent hashes in
read order (:class:`~kvforensics.sources.kv_events.chains.Chains`) and says of every refused record
why. It is the definition the bulk reader (:mod:`kvforensics.sources.kv_events.bulk`) is tested
against, and the reader of every line that one leaves out: :class:`LineReader` reads one line into
its message, the blocks of each event and the reasons of what it refuses, without following chains.

Size: the reference is the definition of every shape of every event the bulk reader is tested against; it
reads best whole, in the order a line is read.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvforensics.config import Source
from kvforensics.sources.common.chain import block_fingerprint, chain_fingerprint, ids_fingerprint
from kvforensics.sources.common.load_report import FileLoad
from kvforensics.sources.common.records import QuarantineRows, parse_ts
from kvforensics.sources.common.textio import INCOMPLETE_RECORD, LineStream, decode_line, printable_raw
from kvforensics.sources.kv_events.chains import Chains

KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
# each event's fields in wire order (after the tag), and how many every version carries
FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
REQUIRED = {"BlockStored": 5, "BlockRemoved": 1, "AllBlocksCleared": 0}
# the fields an event map must name: the others have defaults, which msgspec's omit_defaults leaves out
MAP_REQUIRED = {
    "BlockStored": ("block_hashes", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}
_LORA_NAME = FIELDS["BlockStored"].index("lora_name")
INT32 = 2**31  # dp_rank and group_idx are INTEGER columns
INT64 = 2**63  # msg_seq is a BIGINT column (the publisher's 8-byte sequence number)
FLUSH_ROWS = 500_000  # block rows per insert
NOTE = "token ids fingerprinted per block (keyed HMAC); none stored"
_HEX = re.compile(r"[0-9a-fA-F]+")
# the columns of a block row, in the order _chain_rows builds them, and of a message row
COLUMNS = (
    "instance",
    "dp_rank",
    "ts",
    "batch",
    "seq",
    "msg_seq",
    "kind",
    "block_hash",
    "parent_block_hash",
    "position",
    "num_tokens",
    "block_fp",
    "chain_fp",
    "lora",
    "medium",
    "salt",
    "kv_group",
    "line",
)
MESSAGE_COLUMNS = ("instance", "dp_rank", "msg_seq", "ts", "events", "loaded", "message", "line")
TYPES = {
    "dp_rank": pa.int32(),
    "ts": pa.timestamp("us", tz="UTC"),
    "batch": pa.int64(),
    "seq": pa.int32(),
    "msg_seq": pa.int64(),
    "position": pa.int64(),
    "num_tokens": pa.int64(),
    "block_fp": pa.int64(),
    "chain_fp": pa.int64(),
    "kv_group": pa.int32(),
    "line": pa.int64(),
    "events": pa.int64(),
    "loaded": pa.int64(),
    "message": pa.int64(),
}

_STRUCTS = {
    table: pa.struct([(c, TYPES.get(c, pa.string())) for c in columns])
    for table, columns in (("kv_events", COLUMNS), ("kv_event_messages", MESSAGE_COLUMNS))
}
Steps = tuple[tuple[str, int | None], ...]  # a dotted key: each step a key, and the index it is if a number
# a stored block before its chain is followed: hash, parent hash, token count, block_fp, the cache salt the
# event gives it (None: inherited from its parent), lora, medium, kv_group
StoredBlock = tuple[str, str | None, int | None, int | None, str | None, str | None, str | None, int | None]
RemovedBlock = tuple[str, str | None, int | None]  # hash, medium, kv_group


class Refused(ValueError):
    """Why an event (or a whole batch) cannot be loaded."""


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


@dataclass(frozen=True)
class Keys:
    """Where an object batch keeps each part, from the source's ``columns``."""

    ts: Steps
    events: Steps
    dp_rank: Steps | None  # None: data_parallel_rank (vLLM) or attn_dp_rank (SGLang)
    instance: Steps | None  # None: the source's instance template
    seq: Steps
    names: dict[str, str]  # canonical field -> the key as written, for the reasons
    seq_mapped: bool

    @classmethod
    def of(cls, source: Source) -> Keys:
        names = {f: source.column(f) for f in ("ts", "events", "dp_rank", "instance", "seq")}
        mapped = source.columns
        return cls(
            ts=steps(names["ts"]),
            events=steps(names["events"]),
            dp_rank=steps(names["dp_rank"]) if "dp_rank" in mapped else None,
            instance=steps(names["instance"]) if "instance" in mapped else None,
            seq=steps(names["seq"]),
            names=names,
            seq_mapped="seq" in mapped,
        )


@dataclass
class Rows:
    """Block rows and message rows waiting for one insert, as tuples in ``COLUMNS`` and
    ``MESSAGE_COLUMNS`` order."""

    data: list[tuple] = field(default_factory=list)
    messages: list[tuple] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.data)

    def flush(self, con: duckdb.DuckDBPyConnection, source: Source, path: Path) -> None:
        for table, rows in (("kv_events", self.data), ("kv_event_messages", self.messages)):
            if rows:
                insert_rows(
                    con, table, pa.Table.from_struct_array(pa.array(rows, type=_STRUCTS[table])), source, path
                )  # tuples converted in C++
        self.data, self.messages = [], []


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, arrow: pa.Table, source: Source, path: Path) -> None:
    """Rows of ``kv_events`` or ``kv_event_messages`` (their columns, ``line`` for ``source_line``) inserted."""
    name = f"{table}_batch"
    con.register(name, arrow)
    try:
        con.execute(
            f"INSERT INTO {table} BY NAME SELECT * EXCLUDE (line), line AS source_line, "
            f"$s AS source, $f AS source_file FROM {name}",
            {"s": source.name, "f": str(path)},
        ).fetchall()
    finally:
        con.unregister(name)


@dataclass
class LineRead:
    """What one line gave: the records it counts (its events; 1 for a line refused whole), its message
    ``(instance, dp_rank, msg_seq, ts, events, loaded)`` when it is one, ``(seq, kind, blocks)`` of each
    event loaded (blocks: :data:`StoredBlock` or :data:`RemovedBlock` tuples, none for a clear) and
    ``(reason, raw)`` of each record refused."""

    records: int = 0
    message: tuple[str, int | None, int | None, datetime | None, int | None, int] | None = None
    events: list[tuple[int, str, list[Any]]] = field(default_factory=list)
    refused: list[tuple[str, str | None]] = field(default_factory=list)


class LineReader:
    """Reads the lines of one file as the source's keys say, counting the event shapes and the messages
    with a sequence number it saw, for the file's notes."""

    def __init__(self, source: Source, path: Path, key: bytes) -> None:
        self.source = source
        self.key = key
        self.keys = Keys.of(source)
        self.default_instance = source.instance_for(path)
        self.shapes: dict[tuple[str, int], int] = {}
        self.sequenced = 0

    def read(self, line: int, rawb: bytes) -> LineRead | None:
        """One line read; None when it is blank."""
        if not rawb.strip():
            return None
        got = LineRead()
        try:
            instance, dp_rank, ts, msg_seq, events, problem = _batch(
                rawb, self.source, self.keys, self.default_instance
            )
        except Refused as e:  # the whole line: its text may hold token ids, so none of it is kept
            got.records = 1
            got.refused.append((str(e), None))
            return got
        self.sequenced += msg_seq is not None
        if events is None or (problem and not events):  # the line is one record
            got.records = 1
            got.refused.append((str(problem), None))
            got.message = (instance, dp_rank, msg_seq, ts, None if events is None else 0, 0)
            return got
        for seq, event in enumerate(events):
            try:
                if problem:
                    raise Refused(problem)
                tag, values, salt, salt_name = _event(event, self.shapes)
                got.events.append((seq, KINDS[tag], _blocks(tag, values, salt, salt_name, self.key)))
            except Refused as e:
                got.refused.append((f"event {seq}: {e}", printable_raw(_shown(event))))
        got.records = len(events)
        got.message = (instance, dp_rank, msg_seq, ts, len(events), len(got.events))
        return got

    def notes(self) -> list[str]:
        """The shapes of the events seen and the messages that carried a sequence number."""
        notes = []
        if self.shapes:
            notes.append(
                "event shapes seen: "
                + ", ".join(
                    _shape(tag, n, count)
                    for (tag, n), count in sorted(
                        self.shapes.items(), key=lambda s: (list(FIELDS).index(s[0][0]), s[0][1] == 0, s[0][1])
                    )
                )
            )
        if self.sequenced:
            notes.append(
                f"publisher sequence numbers (key '{self.keys.names['seq']}') read for "
                f"{self.sequenced:,} message(s): lost messages and restarts in kv_event_gaps"
            )
        return notes


def read_reference(con: duckdb.DuckDBPyConnection, source: Source, path: Path, key: bytes, chains: Chains) -> FileLoad:
    """Load one KV-event file line by line into ``kv_events`` and its messages into ``kv_event_messages``,
    each chain followed in read order: every event loaded or quarantined with its reason."""
    chains.settle(con)
    load = FileLoad(file=path, reader="python")
    quarantine = QuarantineRows(con, source, path)
    rows = Rows()
    reader = LineReader(source, path, key)
    stream = LineStream(path)
    for line, rawb in stream:
        got = reader.read(line, rawb)
        if got is None:
            continue
        count(load, got)
        for reason, raw in got.refused:
            quarantine.add(line, reason, raw)
        if got.message is None:
            continue
        chains.messages += 1
        instance, dp_rank, msg_seq, ts = got.message[:4]
        rows.messages.append((*got.message, chains.messages, line))
        for seq, kind, blocks in got.events:
            _chain_rows(rows.data, chains.known, key, kind, blocks, (instance, dp_rank, ts, line, seq, msg_seq))
        if len(rows) >= FLUSH_ROWS:
            rows.flush(con, source, path)
    rows.flush(con, source, path)
    finish(load, quarantine, stream, reader)
    return load


def count(load: FileLoad, got: LineRead) -> None:
    loaded = 0 if got.message is None else got.message[5]
    load.records_read += got.records
    load.loaded += loaded
    load.quarantined += got.records - loaded


def finish(load: FileLoad, quarantine: QuarantineRows, stream: LineStream | None, reader: LineReader) -> None:
    """The partial last record of a truncated stream quarantined, and the file's notes."""
    if stream is not None and stream.partial is not None:
        load.records_read += 1
        load.quarantined += 1
        quarantine.add(stream.partial[0], INCOMPLETE_RECORD, None)
    if stream is not None and stream.stopped:
        load.notes.append(stream.stopped)
    quarantine.flush()
    if load.records_read == 0:
        load.notes.append("empty file")
    load.notes.extend(reader.notes())
    load.notes.append(NOTE)


def _chain_rows(
    rows: list[tuple],
    known: dict[tuple[str, str], tuple[int | None, str | None, int | None]],
    key: bytes,
    kind: str,
    blocks: list[Any],
    head: tuple[str, int | None, datetime | None, int, int, int | None],
) -> None:
    """The event's rows, each stored block's position, cache salt and chain fingerprint followed from its
    parent's (in *known*, by instance and hash); ``head`` (instance, dp_rank, ts, batch, seq, msg_seq)."""
    line = head[3]
    if kind == "cleared":
        rows.append((*head, kind, None, None, None, None, None, None, None, None, None, None, line))
        return
    if kind == "removed":
        rows.extend(
            (*head, kind, h, None, None, None, None, None, None, medium, None, group, line)
            for h, medium, group in blocks
        )
        return
    instance, parent = head[0], blocks[0][1]
    position, chain_salt, chain = (
        (0, None, None) if parent is None else known.get((instance, parent), (None, None, None))
    )
    if parent is not None and position is not None:
        position += 1
    for h, parent, num_tokens, fp, salt, lora, medium, group in blocks:
        chain_salt = salt or chain_salt
        # the content of the prefix up to this block, whatever hashes (salted or not) the engine gave it
        chain = None if fp is None or (position != 0 and chain is None) else chain_fingerprint(chain, fp, key)
        known[(instance, h)] = (position, chain_salt, chain)
        rows.append((*head, kind, h, parent, position, num_tokens, fp, chain, lora, medium, chain_salt, group, line))
        position = None if position is None else position + 1


def _shape(tag: str, n: int, count: int) -> str:
    return f"{tag} {'map' if n == 0 else f'array of {n}'} ({count:,})"


def _batch(
    rawb: bytes, source: Source, keys: Keys, default_instance: str
) -> tuple[str, int | None, datetime | None, int | None, list | None, str | None]:
    """(instance, dp_rank, ts, msg_seq, events, the problem every event of the batch shares or None) of a
    message: dp_rank, ts and msg_seq None when absent or unreadable (the problem says which), events None
    when they are not a list (the problem says so). Refused when the line is no batch of a known instance."""
    text = decode_line(rawb)
    if text is None:
        raise Refused("not UTF-8")
    try:
        batch = json.loads(text)
    except ValueError:
        raise Refused("malformed JSON (text not kept: it may hold token ids)") from None
    if type(batch) is list:
        if len(batch) not in (2, 3):
            raise Refused(f"a batch array has {len(batch)} items; expected [ts, events] or [ts, events, dp_rank]")
        if keys.instance is not None:
            raise Refused(
                f"the batch is an array, so it has no key '{keys.names['instance']}' naming the instance "
                "(columns.instance)"
            )
        if keys.seq_mapped:
            raise Refused(
                f"the batch is an array, so it has no key '{keys.names['seq']}' holding the publisher's "
                "sequence number (columns.seq)"
            )
        ts_raw, events, rank = batch[0], batch[1], batch[2] if len(batch) == 3 else None
        instance, seq_raw = default_instance, None
        where = ""
    elif type(batch) is dict:
        ts_raw, events = get(batch, keys.ts), get(batch, keys.events)
        rank = (
            get(batch, keys.dp_rank)
            if keys.dp_rank is not None
            else batch.get("data_parallel_rank", batch.get("attn_dp_rank"))
        )
        if keys.instance is not None:
            instance = get(batch, keys.instance)
            if not isinstance(instance, str) or not instance:
                raise Refused(
                    f"no instance: key '{keys.names['instance']}' (columns.instance) is missing or not a string"
                )
        else:
            instance = default_instance
        seq_raw = get(batch, keys.seq)
        where = f" (key '{keys.names['events']}'; columns.events says where a message keeps them, e.g. \"batch.1\")"
    else:
        raise Refused("a batch must be a JSON array [ts, events, ...] or object {\"ts\": ..., \"events\": [...]}")
    problem = None
    ts = _batch_time(ts_raw, source)
    if ts is None:
        problem = f"the batch's timestamp {_shown(ts_raw)} is not epoch seconds or ISO 8601"
    if rank is not None and (type(rank) is not int or not 0 <= rank < INT32):
        problem = problem or f"the batch's dp rank {_shown(rank)} is not a non-negative 32-bit integer"
        rank = None
    msg_seq = None
    if seq_raw is None:
        if keys.seq_mapped:
            problem = problem or f"no sequence number: key '{keys.names['seq']}' (columns.seq) is missing"
    elif type(seq_raw) is int and 0 <= seq_raw < INT64:
        msg_seq = seq_raw
    elif type(seq_raw) is str and seq_raw.isascii() and seq_raw.isdigit() and int(seq_raw) < INT64:
        msg_seq = int(seq_raw)
    else:
        problem = problem or f"the publisher's sequence number {_shown(seq_raw)} is not a non-negative integer"
    if type(events) is not list:
        return instance, rank, ts, msg_seq, None, f"the batch's events are {_type(events)}, not a list{where}"
    return instance, rank, ts, msg_seq, events, problem


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


def steps(key: str) -> Steps:
    return tuple((part, int(part) if part.isascii() and part.isdigit() else None) for part in key.split("."))


def get(record: Any, steps: Steps) -> Any:
    """The value a dotted key names: each step a key of an object, or, where it is a number, an index
    of an array (``batch.1``: the second item of ``batch``); None when a step finds nothing."""
    value = record
    for name, index in steps:
        if type(value) is dict:
            value = value.get(name)
        elif type(value) is list and index is not None and index < len(value):
            value = value[index]
        else:
            return None
    return value


def _event(event: Any, shapes: dict[tuple[str, int], int]) -> tuple[str, list[Any], Any, str]:
    """The event's tag, its fields in ``FIELDS`` order (absent ones None), and its cache salt as published
    with the name of the field it was in; shape checked (tag, arity) and counted in *shapes* by tag and
    array length (0: a map). Values are checked by :func:`_blocks`."""
    if type(event) is list:
        tag = event[0] if event else None
        if type(tag) is not str:
            raise Refused("an event array must start with its tag (BlockStored, BlockRemoved, AllBlocksCleared)")
        names = FIELDS.get(tag)
        if names is None:
            raise Refused(f"unknown event tag {_shown(tag)}")
        shape = (tag, len(event))
        shapes[shape] = shapes.get(shape, 0) + 1
        given = len(event) - 1
        if not REQUIRED[tag] <= given <= len(names):
            expected = f"{REQUIRED[tag]} to {len(names)}" if len(names) > REQUIRED[tag] else str(len(names))
            raise Refused(f"{tag} with {given} fields; expected {expected} (wrong arity)")
        values = event[1:]
        if given < len(names):
            values.extend([None] * (len(names) - given))
        if given > _LORA_NAME and type(values[_LORA_NAME]) is dict and tag == "BlockStored":
            metadata = values[_LORA_NAME]  # SGLang #30827: {"cache_salt": ..., "session_id": ...} in this slot
            values[_LORA_NAME] = None
            return tag, values, metadata.get("cache_salt"), "metadata.cache_salt"
        return tag, values, None, ""
    if type(event) is dict:
        tag = event.get("type")
        if tag not in FIELDS:
            raise Refused(
                f"unknown event tag {_shown(tag)}" if tag is not None else "an event object needs its tag in \"type\""
            )
        shape = (tag, 0)
        shapes[shape] = shapes.get(shape, 0) + 1
        missing = [n for n in MAP_REQUIRED[tag] if n not in event]
        if missing:
            raise Refused(f"{tag} lacks field(s) {', '.join(missing)}")
        values = [event.get(n) for n in FIELDS[tag]]
        if tag == "BlockStored":
            metadata = event.get("metadata")
            if type(metadata) is dict:  # SGLang's metadata map as a key
                return tag, values, metadata.get("cache_salt"), "metadata.cache_salt"
            return tag, values, event.get("cache_salt"), "cache_salt"  # sgl-project/sglang#37482: a field
        return tag, values, None, ""
    raise Refused(f"an event must be an array or object, not {_type(event)}")


def _blocks(tag: str, v: list[Any], salt: Any, salt_name: str, key: bytes) -> list[Any]:
    """The event's blocks, its values checked; ``v`` its fields in ``FIELDS`` order, *salt* its cache salt as
    published (in field *salt_name*). A stored block's cache salt is the event's, else vLLM's in its extra
    keys, else None (its parent's, once the chain is followed)."""
    if tag == "AllBlocksCleared":
        return []
    hashes = v[0]
    if type(hashes) is not list or not hashes:
        raise Refused("block_hashes must be a non-empty list")
    hashes = [str(h) if type(h) is int else canonical_hash(h) for h in hashes]
    if tag == "BlockRemoved":
        medium, group = _optional(v[1], str, "medium"), _group(v[2])
        return [(h, medium, group) for h in hashes]
    parent_raw, tokens, size, lora_id, medium, lora_name, extra, group, spec_kind, window = v[1:]
    parent = None if parent_raw is None else str(parent_raw) if type(parent_raw) is int else canonical_hash(parent_raw)
    if type(size) is not int:
        raise Refused(f"block_size {_shown(size)} is not an integer")
    if size <= 0:
        raise Refused(f"block_size {size} is not positive (negative size)" if size < 0 else "block_size is 0")
    if type(tokens) is not list:
        raise Refused("token_ids must be a list of integers")
    ids = repr(tokens)[1:-1].replace(" ", "")  # "101,102,103": digits and commas only if every id is an int >= 0
    if tokens and not ids.replace(",", "").isdigit():
        if not set(map(type, tokens)) <= {int}:
            raise Refused("token_ids must be a list of integers")
        raise Refused("token_ids holds a negative token id")
    n = len(hashes)
    if tokens and not (n - 1) * size < len(tokens) <= n * size:
        raise Refused(f"token_ids holds {len(tokens)} ids for {n} block(s) of block_size {size}")
    if lora_id is not None and (_optional(lora_id, int, "lora_id") < 0):
        raise Refused(f"negative lora_id {lora_id}")
    if salt is not None and type(salt) is not str:
        raise Refused(f"{salt_name} {_shown(salt)} is not a string")
    salt = salt or None
    if medium is not None and type(medium) is not str:
        raise Refused(f"medium {_shown(medium)} is not a string")
    if (
        lora_name is not None or group is not None or extra is not None or spec_kind is not None or window is not None
    ):  # vLLM's later fields (SGLang has none of them)
        _optional(lora_name, str, "lora_name")
        group = _group(group)
        if extra is not None and (
            type(extra) is not list or len(extra) != n or not all(e is None or type(e) is list for e in extra)
        ):
            raise Refused(f"extra_keys must be a list of {n} lists or nulls, one per block")
        _optional(spec_kind, str, "kv_cache_spec_kind")
        _optional(window, int, "kv_cache_spec_sliding_window")
    lora = lora_name if lora_name is not None else None if lora_id is None else str(lora_id)
    blocks: list[StoredBlock] = []
    for i, h in enumerate(hashes):
        block = tokens if n == 1 else tokens[i * size : (i + 1) * size]
        own = salt or (_vllm_salt(extra[i], lora_name) if extra is not None and extra[i] else None) or None
        fp = None if not block else ids_fingerprint(ids, key) if n == 1 else block_fingerprint(block, key)
        blocks.append((h, parent, len(block) or None, fp, own, lora, medium, group))
        parent = h
    return blocks


def _vllm_salt(keys: list | None, lora_name: str | None) -> str | None:
    """The cache salt among a vLLM block's extra keys (LoRA name, then (mm id, offset) pairs, then the
    salt on the first block, then prompt-embedding hashes): a string that is not the LoRA name."""
    strings = [k for k in keys or () if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def _group(value: Any) -> int | None:
    if _optional(value, int, "group_idx") is not None and not 0 <= value < INT32:
        raise Refused(f"negative group_idx {value}" if value < 0 else f"group_idx {value} is out of range")
    return value


def _optional(value: Any, kind: type, name: str) -> Any:
    """*value* if it is None or of type *kind* (a boolean is no integer), else refused."""
    if value is not None and type(value) is not kind:
        raise Refused(f"{name} {_shown(value)} is not {'an integer' if kind is int else 'a string'}")
    return value


def _type(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """A value as the quarantine may show it: lists (token ids, hashes) only by their length."""

    def redact(v: Any) -> Any:
        if isinstance(v, list):
            return (
                f"<list of {len(v)}>"
                if not (v and isinstance(v[0], str) and v[0] in FIELDS)
                else [v[0], *(redact(x) for x in v[1:])]
            )
        if isinstance(v, dict):
            return {k: redact(x) for k, x in v.items()}
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return v

    return json.dumps(redact(value), ensure_ascii=False)[:200]
