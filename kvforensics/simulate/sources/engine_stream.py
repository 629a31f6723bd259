"""Engine logs written while the traffic is generated: bounded memory at any number of requests.

The per-request lines of the target model's prefill instances (the abort line of every affected
request, one ``ReqTimeStats(...)`` per served request) are built column-wise for a whole chunk
with Arrow string kernels, in the same text as :mod:`kvforensics.simulate.sources.engine_log` writes them
one by one. :class:`EngineLogStream` merges them, in time order, with each instance's start-up and
batch lines and appends to the instance's file everything older than the next chunk's first
request (a line is never earlier than its request's arrival), keeping only later lines pending.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvforensics.simulate.fleet.deployment import Deployment
from kvforensics.simulate.sources.engine_log import EngineLog

ABORT_MIDDLE = " tokens) exceeds the maximum allowed length ("
ABORT_TAIL = " tokens). Use a shorter input or enable --allow-auto-truncate., self.rid='"


def text_bytes(lines: pa.Array) -> tuple[bytes, np.ndarray]:
    """The UTF-8 payload of a string array and each value's start offset in it (plus the end)."""
    lines = lines.combine_chunks() if isinstance(lines, pa.ChunkedArray) else lines
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32, count=len(lines) + 1, offset=lines.offset * 4)
    data = lines.buffers()[2]
    payload = data.to_pybytes()[offsets[0] : offsets[-1]] if data is not None else b""
    return payload, (offsets - offsets[0]).astype(np.int64)


def fixed(values: np.ndarray, digits: int) -> pa.Array:
    """Non-negative numbers as text with exactly ``digits`` decimals (``f"{v:.2f}"``), column-wise."""
    scale = 10**digits
    scaled = np.round(np.asarray(values, dtype=float) * scale).astype(np.int64)
    whole = pa.array(scaled // scale).cast(pa.string())
    fraction = pc.utf8_lpad(pa.array(scaled % scale).cast(pa.string()), digits, "0")
    return pc.binary_join_element_wise(whole, fraction, ".")


def integers(values: np.ndarray) -> pa.Array:
    return pa.array(np.asarray(values, dtype=np.int64)).cast(pa.string())


def envelopes(ts_ms: np.ndarray, zone: str, rank: int | None, tp: int) -> pa.Array:
    """``[YYYY-MM-DD HH:MM:SS TPn] `` in the engine's local time, as ``engine_log.envelope``."""
    seconds = pd.to_datetime(np.asarray(ts_ms, dtype=np.int64) // 1000, unit="s", utc=True)
    local = seconds.tz_convert(zone).tz_localize(None).to_numpy().astype("datetime64[s]")
    text = pc.replace_substring(pa.array(np.datetime_as_string(local, unit="s")), "T", " ")
    suffix = f" TP{rank}] " if rank is not None and tp > 1 else "] "
    return pc.binary_join_element_wise("[", text, suffix, "")


def request_line_columns(
    served: pd.DataFrame, dep: Deployment, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """Instance name, time (epoch ms) and text of every abort and ``ReqTimeStats`` line of a chunk.

    The same lines, values and rounding as ``engine_log.request_lines(..., with_time_stats=True)``;
    the random bootstrap room and transfer speed are drawn per chunk, column-wise.
    """
    s = dep.scenario
    m = dep.models["target"]
    tp = m.tp_size
    rows = served[(served["model_idx"].to_numpy() == 0) & (served["status"].to_numpy() == 200)]
    n = len(rows)
    affected = rows["affected"].to_numpy().astype(bool)
    received = rows["ts_ms"].to_numpy().astype(np.int64)
    queue = rows["queue_ms"].to_numpy().astype(float)
    start = received + queue.astype(np.int64)
    prompt = rows["prompt_tokens"].to_numpy().astype(np.int64)
    rid = pa.array(rows["rid"].to_numpy(dtype=object), type=pa.string())
    instance = rows["prefill_instance"].to_numpy(dtype=object)

    input_len = np.where(affected, 1, prompt)
    cached = np.where(affected, 0, rows["cached_tokens"].to_numpy().astype(np.int64))
    forward = np.asarray(m.latency.prefill_ms((input_len - cached).astype(float))) * rows["noise"].to_numpy()
    bootstrap = 3.0 + 25.0 * rows["u_bootstrap"].to_numpy()
    transfer_mb = input_len * m.latency.kv_bytes_per_token / 1e6
    done = start + (bootstrap + forward).astype(np.int64)
    room = rng.integers(1, 2**62, size=n)
    transfer_s = transfer_mb / (1000 * rng.uniform(22, 46, size=n))
    speed = transfer_mb / 1000 / np.maximum(transfer_s, 1e-4)
    stats = pc.binary_join_element_wise(
        envelopes(done, s.engine_timezone, 0, tp),
        "ReqTimeStats(rid=", rid,
        ", bootstrap_room=", integers(room),
        ", input_len=", integers(input_len),
        ", cached_input_len=", integers(cached),
        ", output_len=1, attempts=1, type=prefill): bootstrap_duration=", fixed(bootstrap, 2),
        "ms, queue_duration=", fixed(queue, 2),
        "ms, forward_duration=", fixed(forward, 2),
        "ms, entry_time=", fixed(received / 1000, 3),
        ", transfer_speed=", fixed(speed, 2),
        " GB/s, transfer_total=", fixed(transfer_mb, 2),
        " MB\n",
        "",
    )  # fmt: skip
    hit = np.flatnonzero(affected)
    limit = np.minimum(s.context_length, rows["pool_tokens"].to_numpy()[hit].astype(np.int64)) - 6
    aborts = pc.binary_join_element_wise(
        envelopes(start[hit], s.engine_timezone, 0, tp),
        "Input length (", integers(prompt[hit]), ABORT_MIDDLE, integers(limit), ABORT_TAIL,
        rid.take(pa.array(hit)), "'\n",
        "",
    )  # fmt: skip
    # Generation order (what breaks ties at the same millisecond): a request's abort, then its stats.
    order = np.argsort(np.concatenate([2 * hit, 2 * np.arange(n) + 1]), kind="stable")
    names = np.concatenate([instance[hit], instance])[order]
    times = np.concatenate([start[hit], done])[order]
    return names, times, pa.concat_arrays([aborts, stats]).take(pa.array(order))


class EngineLogStream:
    """One open file per engine instance; per-request lines merged with its start-up and batch lines."""

    def __init__(self, logs: dict[str, EngineLog], out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.names = sorted(logs)
        self.paths = [out_dir / f"{name}.log" for name in self.names]
        self.static = [sorted(logs[name].lines) for name in self.names]
        self.static_ms = [np.array([line.ts_ms for line in lines], dtype=np.int64) for lines in self.static]
        self.written = [0] * len(self.names)  # static lines already written, per instance
        self.files: list[IO[bytes]] = [path.open("wb") for path in self.paths]
        self.pending_instance = np.zeros(0, dtype=np.int64)
        self.pending_ms = np.zeros(0, dtype=np.int64)
        self.pending_text = pa.array([], type=pa.string())
        self.lines = 0

    def add(self, names: np.ndarray, ts_ms: np.ndarray, text: pa.Array) -> None:
        """Queue lines (texts end in a newline) in generation order; later calls sort after on ties."""
        instance = pd.Index(self.names).get_indexer(names).astype(np.int64)
        if (instance < 0).any():
            raise ValueError(f"no engine log for instance {names[instance < 0][0]!r}")
        self.pending_instance = np.concatenate([self.pending_instance, instance])
        self.pending_ms = np.concatenate([self.pending_ms, np.asarray(ts_ms, dtype=np.int64)])
        self.pending_text = pa.concat_arrays([self.pending_text, text])

    def flush_before(self, watermark_ms: int | None) -> None:
        """Write every queued and start-up/batch line earlier than ``watermark_ms`` (all when None)."""
        order = np.lexsort((self.pending_ms, self.pending_instance))  # stable: generation order on ties
        instance, ts = self.pending_instance[order], self.pending_ms[order]
        due = np.ones(len(ts), dtype=bool) if watermark_ms is None else ts < watermark_ms
        payload, offsets = text_bytes(self.pending_text.take(pa.array(order[due])))
        due_instance, due_ms = instance[due], ts[due]
        bounds = np.searchsorted(due_instance, np.arange(len(self.names) + 1))
        for i, out in enumerate(self.files):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            self._write_merged(i, out, payload, offsets, lo, hi, due_ms[lo:hi], watermark_ms)
        keep = order[~due]
        self.pending_instance = self.pending_instance[keep]
        self.pending_ms = self.pending_ms[keep]
        self.pending_text = self.pending_text.take(pa.array(keep, type=pa.int64()))

    def _write_merged(
        self,
        i: int,
        out: IO[bytes],
        payload: bytes,
        offsets: np.ndarray,
        lo: int,
        hi: int,
        ts: np.ndarray,
        watermark_ms: int | None,
    ) -> None:
        first = self.written[i]
        last = (
            len(self.static[i])
            if watermark_ms is None
            else int(np.searchsorted(self.static_ms[i], watermark_ms, side="left"))
        )
        cursor = lo
        for line in self.static[i][first:last]:  # a start-up or batch line goes before requests' at its ms
            at = lo + int(np.searchsorted(ts, line.ts_ms, side="left"))
            out.write(payload[offsets[cursor] : offsets[at]])
            out.write((line.text + "\n").encode("utf-8"))
            cursor = at
        out.write(payload[offsets[cursor] : offsets[hi]])
        self.lines += (hi - lo) + (last - first)
        self.written[i] = last

    def close(self) -> list[Path]:
        self.flush_before(None)
        for out in self.files:
            out.close()
        return self.paths
