"""Stored KV blocks followed through their parent hashes, for a whole file at once.

Each stored block continues the chain of its parent: its position is the parent's plus one (0 with no
parent), its cache salt is the one its event gives it or else its parent's, and its chain fingerprint
is the keyed hash of the parent's and its own block fingerprint (:func:`~kvforensics.sources.common.chain.
chain_fingerprint`). The parent of a block is the previous block of its event or, for an event's first
block, the block last stored under that hash on the same instance before it, in this file or in an
earlier one of the ingest (:class:`Chains`); a parent stored nowhere before leaves position and chain
unknown.

The Python reference (:mod:`kvforensics.sources.kv_events.reference`) follows the chains block by block.
Here they are followed for all the stored blocks of a file together: each first block's parent found
by DuckDB (an ``ASOF`` join, the latest earlier store of the hash), then the blocks taken in rounds,
one depth of the chains at a time (breadth first from the blocks whose parent is known or absent), each
round's chain fingerprints computed together: by DuckDB's SHA-256 when the round is large, in Python
when it is small. Equal (parent, block) pairs of a round are hashed once. A round per depth: a file of
chains as deep as ``d`` blocks takes ``d`` rounds, whatever its size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# rounds of fewer chain fingerprints than this are computed in Python (a DuckDB query costs ~1 ms to start)
DUCKDB_ROUND = 2_000
State = tuple[int | None, str | None, int | None]  # a stored block's position, cache salt, chain fingerprint


@dataclass
class Chains:
    """What an event stream carries across the files of one ingest: the position, cache salt and chain
    fingerprint of each stored block by (instance, hash), so that a chain continued in a later batch or
    file knows its depth, salt and content up to it; and how many messages were read, each message's
    place in the read order (``kv_event_messages.message``, the order ``kv_event_gaps`` follows).

    The reference reader keeps the states in ``known``; the bulk reader keeps those of the files it
    read in a temporary table of the ingest's connection (``table``: newer than ``known``; ``stored``
    blocks so far, each block's place among them in column ``ord``), moved into ``known`` by
    :meth:`settle` before the reference reads a file."""

    known: dict[tuple[str, str], State] = field(default_factory=dict)
    messages: int = 0
    table: str | None = None
    stored: int = 0
    con: duckdb.DuckDBPyConnection | None = field(default=None, repr=False)

    def settle(self, con: duckdb.DuckDBPyConnection) -> None:
        """The states the bulk reader left in its table moved into ``known``, the table dropped."""
        if self.table is None or self.con is None:
            return
        for instance, block_hash, position, salt, chain in self.con.execute(
            f"SELECT instance, block_hash, position, salt, chain_fp FROM {self.table} "
            "QUALIFY row_number() OVER (PARTITION BY instance, block_hash ORDER BY ord DESC) = 1"
        ).fetchall():
            self.known[(instance, block_hash)] = (position, salt, chain)
        self.con.execute(f"DROP TABLE {self.table}").fetchall()
        self.table, self.con = None, None

    def table_on(self, con: duckdb.DuckDBPyConnection) -> str:
        """The state table on *con* (created when there is none; a table on another connection settled first)."""
        if self.con is not None and self.con is not con:
            self.settle(self.con)
        if self.table is None:
            self.table, self.con = f"kv_chain_state_{id(self):x}", con
            con.execute(
                f"CREATE TEMP TABLE {self.table} (instance VARCHAR, block_hash VARCHAR, ord BIGINT, "
                "position BIGINT, salt VARCHAR, chain_fp BIGINT)"
            ).fetchall()
        return self.table


class Fingerprints:
    """Keyed 63-bit HMAC-SHA256 fingerprints as :mod:`kvforensics.sources.common.chain` and the block fingerprints
    compute them one at a time: here as a DuckDB expression over a column of messages (``expression``,
    with the parameters ``params``), or in Python for a few."""

    def __init__(self, key: bytes) -> None:
        block = key if len(key) <= 64 else hashlib.sha256(key).digest()
        block = block.ljust(64, b"\0")
        self.params = {"ipad": bytes(b ^ 0x36 for b in block), "opad": bytes(b ^ 0x5C for b in block)}
        self._inner = hashlib.sha256(self.params["ipad"])
        self._outer = hashlib.sha256(self.params["opad"])

    @staticmethod
    def expression(message: str) -> str:
        """SQL of the fingerprint of the text *message* (an SQL expression of ASCII text)."""
        return f"(('0x' || left(sha256($opad || unhex(sha256($ipad || encode({message})))), 16))::UBIGINT >> 1)::BIGINT"

    def one(self, message: bytes) -> int:
        inner = self._inner.copy()
        inner.update(message)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return int.from_bytes(outer.digest()[:8], "big") >> 1


def follow(con: duckdb.DuckDBPyConnection, chains: Chains, blocks: str, key: bytes) -> pa.Table:
    """The position, cache salt and chain fingerprint of every stored block of the temporary table *blocks*
    (``kind``, ``line``, ``seq``, ``i``: the block's place in its event, ``instance``, ``block_hash``, ``parent``,
    ``block_fp``, ``own_salt``), as a table ``row`` (the block's rowid), ``position``, ``salt``, ``chain_fp``;
    their states added to *chains*."""
    table = chains.table_on(con)
    rows = con.sql(
        f"SELECT rowid AS row, line, seq, i, instance, block_hash, parent, block_fp, own_salt FROM {blocks} "
        "WHERE kind = 'stored'"
    ).to_arrow_table()
    n = rows.num_rows
    if n == 0:
        return pa.table(
            {
                "row": pa.array([], pa.int64()),
                "position": pa.array([], pa.int64()),
                "salt": pa.array([], pa.string()),
                "chain_fp": pa.array([], pa.int64()),
            }
        )
    rows = rows.take(np.lexsort([rows.column(c).to_numpy() for c in ("i", "seq", "line")]))  # read order
    first = rows.column("i").to_numpy() == 0
    fp_valid = rows.column("block_fp").is_valid().to_numpy(zero_copy_only=False)
    fp = rows.column("block_fp").fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    salts = rows.column("own_salt").combine_chunks().dictionary_encode()
    salt_values: list[str] = salts.dictionary.to_pylist()
    codes = {s: i for i, s in enumerate(salt_values)}
    own = salts.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)

    # each block's (instance, hash) as a number, and its first block's parent's; a first block's parent is the
    # latest earlier store of that number in this file, else its last state in the files before (the bulk
    # reader's table, else the reference's dictionary)
    instances = rows.column("instance").combine_chunks().dictionary_encode()
    hashes = rows.column("block_hash").combine_chunks().dictionary_encode()
    width = len(hashes.dictionary) + 1
    place = instances.indices.to_numpy().astype(np.int64) * width
    stored = place + hashes.indices.to_numpy().astype(np.int64)
    parent_index = pc.index_in(rows.column("parent"), value_set=hashes.dictionary)
    has_parent = rows.column("parent").is_valid().to_numpy(zero_copy_only=False)
    parent = place + parent_index.fill_null(width - 1).to_numpy(zero_copy_only=False).astype(np.int64)
    ords = np.arange(n, dtype=np.int64)
    if int(place.max()) + width >= (2**62) // (n + 1):
        raise ValueError("too many blocks in one file to follow their chains at once")
    sorted_keys = np.sort(stored * (n + 1) + ords)  # (instance, hash) then read order
    asked = np.nonzero(first & has_parent)[0]
    at = np.searchsorted(sorted_keys, parent[asked] * (n + 1) + asked) - 1
    before = sorted_keys[np.maximum(at, 0)]
    hit = (at >= 0) & (before // (n + 1) == parent[asked])
    pred = ords - 1  # the block before in its event
    pred[first] = -1
    pred[asked[hit]] = before[hit] % (n + 1)
    outside = asked[~hit]

    position = np.zeros(n, dtype=np.int64)
    pos_valid = np.zeros(n, dtype=bool)
    chain = np.zeros(n, dtype=np.int64)
    chain_valid = np.zeros(n, dtype=bool)
    salt = np.full(n, -1, dtype=np.int64)
    hasher = Fingerprints(key)
    # the roots: blocks without a parent (position 0, the chain of their own fingerprint), and first blocks whose
    # parent is in an earlier file or nowhere
    root = first & ~has_parent
    position[root], pos_valid[root], salt[root] = 0, True, own[root]
    starts = np.nonzero(root & fp_valid)[0].tolist()
    parents: list[int | None] = [None] * len(starts)
    for ord_, p_position, p_salt, p_chain in _states(con, chains, table, rows, outside):
        if p_position is not None:
            position[ord_], pos_valid[ord_] = p_position + 1, True
        if own[ord_] >= 0:
            salt[ord_] = own[ord_]
        elif p_salt is not None:
            if p_salt not in codes:
                codes[p_salt] = len(salt_values)
                salt_values.append(p_salt)
            salt[ord_] = codes[p_salt]
        if p_chain is not None and fp_valid[ord_]:
            starts.append(ord_)
            parents.append(p_chain)
    chain[starts] = _chain_fps(con, hasher, parents, fp[starts])
    chain_valid[starts] = True

    # breadth first from the roots: each round the children of the round before
    has_pred = pred >= 0
    children = np.nonzero(has_pred)[0]
    children = children[np.argsort(pred[children], kind="stable")]
    counts = np.bincount(pred[has_pred], minlength=n)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    frontier = np.nonzero(~has_pred)[0]
    while frontier.size:
        lens = counts[frontier]
        total = int(lens.sum())
        if total == 0:
            break
        kids = children[np.repeat(offsets[frontier] - np.cumsum(lens) + lens, lens) + np.arange(total)]
        up = pred[kids]
        pos_valid[kids] = pos_valid[up]
        position[kids] = position[up] + 1
        salt[kids] = np.where(own[kids] >= 0, own[kids], salt[up])
        need = chain_valid[up] & fp_valid[kids]
        chain_valid[kids] = need
        hashed = kids[need]
        chain[hashed] = _chain_fps(con, hasher, chain[up[need]], fp[hashed])
        frontier = kids

    salt_array = pa.DictionaryArray.from_arrays(
        pa.array(salt, mask=salt < 0, type=pa.int32()), pa.array(salt_values, pa.string())
    ).cast(pa.string())
    result = pa.table(
        {
            "row": rows.column("row"),
            "position": pa.array(position, mask=~pos_valid),
            "salt": salt_array,
            "chain_fp": pa.array(chain, mask=~chain_valid),
        }
    )
    # each (instance, hash)'s last state in this file, for the files after it
    last = n - 1 - np.unique(stored[::-1], return_index=True)[1]
    states = pa.table(
        {
            "instance": rows.column("instance").take(last),
            "block_hash": rows.column("block_hash").take(last),
            "ord": pa.array(last + chains.stored),
            "position": result.column("position").take(last),
            "salt": result.column("salt").take(last),
            "chain_fp": result.column("chain_fp").take(last),
        }
    )
    con.register("kv_states", states)
    try:
        con.execute(f"INSERT INTO {table} SELECT * FROM kv_states").fetchall()
    finally:
        con.unregister("kv_states")
    chains.stored += n
    return result


def _states(
    con: duckdb.DuckDBPyConnection, chains: Chains, table: str, rows: pa.Table, asked: np.ndarray
) -> list[tuple[int, int | None, str | None, int | None]]:
    """(block, its parent's position, cache salt and chain fingerprint) of each first block *asked* (by its place in
    *rows*), whose parent no earlier block of this file stored: its last state in the files before (the bulk reader's
    table, else the reference's dictionary), or unknown."""
    if not len(asked):
        return []
    wanted = pa.table(
        {
            "ord": pa.array(asked),
            "instance": rows.column("instance").take(asked),
            "parent": rows.column("parent").take(asked),
        }
    )
    con.register("kv_wanted", wanted)
    try:
        found = con.execute(f"""
            SELECT w.ord, w.instance, w.parent, s.ord IS NOT NULL AS seen, s.position, s.salt, s.chain_fp
            FROM kv_wanted w LEFT JOIN {table} s ON s.instance = w.instance AND s.block_hash = w.parent
            QUALIFY row_number() OVER (PARTITION BY w.ord ORDER BY s.ord DESC NULLS LAST) = 1""").fetchall()
    finally:
        con.unregister("kv_wanted")
    return [
        (ord_, position, salt, chain) if seen else (ord_, *chains.known.get((instance, parent), (None, None, None)))
        for ord_, instance, parent, seen, position, salt, chain in found
    ]


def _chain_fps(con: duckdb.DuckDBPyConnection, hasher: Fingerprints, parents: Any, fps: np.ndarray) -> np.ndarray:
    """The chain fingerprints of blocks with fingerprints *fps* after parents of chain fingerprints *parents*
    (None: no parent); each distinct pair hashed once."""
    if len(fps) == 0:
        return np.zeros(0, dtype=np.int64)
    parent_list = parents if isinstance(parents, list) else parents.tolist()
    if len(fps) < DUCKDB_ROUND:
        done: dict[tuple[int | None, int], int] = {}
        out = np.empty(len(fps), dtype=np.int64)
        for i, (parent, fp) in enumerate(zip(parent_list, fps.tolist(), strict=True)):
            value = done.get((parent, fp))
            if value is None:
                value = done[(parent, fp)] = hasher.one(f"kv-chain:{'' if parent is None else parent}:{fp}".encode())
            out[i] = value
        return out
    pairs = pa.table(
        {"i": pa.array(np.arange(len(fps), dtype=np.int64)), "p": pa.array(parent_list, pa.int64()), "f": pa.array(fps)}
    )
    con.register("kv_chain_pairs", pairs)
    try:
        message = "'kv-chain:' || coalesce(p::VARCHAR, '') || ':' || f::VARCHAR"
        got = con.execute(
            f"""
            WITH distinct_pairs AS (SELECT DISTINCT p, f FROM kv_chain_pairs),
                 hashed AS (SELECT p, f, {Fingerprints.expression(message)} AS c FROM distinct_pairs)
            SELECT k.i, h.c FROM kv_chain_pairs k JOIN hashed h ON k.f = h.f AND k.p IS NOT DISTINCT FROM h.p
            """,
            hasher.params,
        ).fetchnumpy()
    finally:
        con.unregister("kv_chain_pairs")
    out = np.empty(len(fps), dtype=np.int64)
    out[got["i"]] = got["c"]
    return out
