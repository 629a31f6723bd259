"""The gateway request log: column and timestamp styles, at-least-once duplicates, day files.

Lines are assembled column-wise with Arrow compute (no per-row Python), so the same writer serves
the 25k-request sample and 100M-request benchmarks. Files are one per UTC day, gzip with mtime 0
(JSONL) or Parquet; the same seed gives byte-identical files.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from isal import igzip

from kvforensics.simulate.scenario import Scenario

#: Canonical field -> written name, per column style. Order = column order in the file.
SAMPLE_COLUMNS: dict[str, str] = {
    "request_id": "rid",
    "ts": "received_at",
    "account_id": "account_id",
    "model": "model",
    "status": "http_status",
    "prompt_tokens": "prompt_tokens",
    "completion_tokens": "completion_tokens",
    "cached_tokens": "cached_tokens",
    "ttft_ms": "ttft_ms",
    "latency_ms": "latency_ms",
    "stream": "stream",
    "prefill_instance": "prefill_instance",
    "decode_instance": "decode_instance",
    "error": "error",
}
CANONICAL_COLUMNS: dict[str, str] = {k: k for k in SAMPLE_COLUMNS}
OTEL_COLUMNS: dict[str, str] = {
    "request_id": "gen_ai.response.id",
    "ts": "timestamp",
    "account_id": "enduser.id",
    "model": "gen_ai.request.model",
    "status": "http.response.status_code",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "completion_tokens": "gen_ai.usage.output_tokens",
    "cached_tokens": "gen_ai.usage.cache_read.input_tokens",
    "ttft_ms": "gen_ai.server.time_to_first_token_ms",
    "latency_ms": "gen_ai.server.request.duration_ms",
    "stream": "gen_ai.request.stream",
    "prefill_instance": "sglang.prefill_instance",
    "decode_instance": "sglang.decode_instance",
    "error": "error.type",
}
CUSTOM_COLUMNS: dict[str, str] = {
    "request_id": "reqId",
    "ts": "@t",
    "account_id": "tenant",
    "model": "llm",
    "status": "code",
    "prompt_tokens": "tokIn",
    "completion_tokens": "tokOut",
    "cached_tokens": "tokCached",
    "ttft_ms": "firstByteMs",
    "latency_ms": "totalMs",
    "stream": "sse",
    "prefill_instance": "pNode",
    "decode_instance": "dNode",
    "error": "err",
}
#: Fields the incident contract calls canonical (mapped in incident.toml when renamed).
CANONICAL_FIELDS = (
    "request_id",
    "ts",
    "account_id",
    "model",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_ms",
    "latency_ms",
    "prefill_instance",
    "decode_instance",
)
INSTANCE_FIELDS = ("prefill_instance", "decode_instance")


def column_names(s: Scenario) -> dict[str, str]:
    base = {
        "sample": SAMPLE_COLUMNS,
        "canonical": CANONICAL_COLUMNS,
        "otel": OTEL_COLUMNS,
        "custom": CUSTOM_COLUMNS,
    }[s.gateway_columns]
    names = dict(base)
    if s.gateway_columns == "custom":
        names.update(s.custom_columns)
    if not s.gateway_has_instances:
        for key in INSTANCE_FIELDS:
            names.pop(key)
    return names


def format_timestamps(ts_ms: np.ndarray, s: Scenario) -> pa.Array:
    if s.gateway_timestamps == "epoch_ms":
        return pa.array(ts_ms, type=pa.int64())
    utc = pd.to_datetime(ts_ms, unit="ms", utc=True)
    if s.gateway_timestamps == "iso_z":
        text = np.datetime_as_string(ts_ms.astype("datetime64[ms]"), unit="ms")
        return pc.binary_join_element_wise(pa.array(text), "Z", "")
    local = utc.tz_convert(s.gateway_timezone).tz_localize(None)
    text = np.datetime_as_string(local.to_numpy().astype("datetime64[ms]"), unit="ms")
    if s.gateway_timestamps == "naive_local":
        return pa.array(np.char.replace(text.astype(str), "T", " "))
    minutes = ((local.to_numpy() - utc.tz_localize(None).to_numpy()) // np.timedelta64(1, "m")).astype(np.int64)
    sign = np.where(minutes < 0, "-", "+")
    offset = np.char.add(
        np.char.add(sign, np.char.zfill((np.abs(minutes) // 60).astype(str), 2)),
        np.char.add(":", np.char.zfill((np.abs(minutes) % 60).astype(str), 2)),
    )
    return pc.binary_join_element_wise(pa.array(text), pa.array(offset), "")


def _strings(column: pd.Series) -> pa.Array:
    return pa.array(column.to_numpy(dtype=object), type=pa.string(), from_pandas=True)


def gateway_table(served: pd.DataFrame, s: Scenario, model_ids: list[str]) -> pa.Table:
    """The written columns (in file order) for already-ordered rows."""
    names = column_names(s)
    ttft = served["ttft_ms"].to_numpy()
    values: dict[str, pa.Array] = {
        "request_id": _strings(served["rid"]),
        "ts": format_timestamps(served["ts_ms"].to_numpy(), s),
        "account_id": _strings(served["account"]),
        "model": pa.array(np.asarray(model_ids, dtype=object)[served["model_idx"].to_numpy()], type=pa.string()),
        "status": pa.array(served["status"].to_numpy().astype(np.int64)),
        "prompt_tokens": pa.array(served["prompt_tokens"].to_numpy().astype(np.int64)),
        "completion_tokens": pa.array(served["completion_tokens"].to_numpy().astype(np.int64)),
        "cached_tokens": pa.array(served["cached_tokens"].to_numpy().astype(np.int64)),
        "ttft_ms": pa.array(ttft, mask=np.isnan(ttft), type=pa.float64()),
        "latency_ms": pa.array(served["latency_ms"].to_numpy(), type=pa.float64()),
        "stream": pa.array(served["stream"].to_numpy(), type=pa.bool_()),
        "prefill_instance": _strings(served["prefill_instance"]),
        "decode_instance": _strings(served["decode_instance"]),
        "error": _strings(served["error"]),
    }
    return pa.table({written: values[key] for key, written in names.items()})


def json_value(column: pa.Array) -> pa.Array:
    """JSON text of each value (strings are quoted; our strings never need escaping)."""
    if pa.types.is_string(column.type):
        text = pc.binary_join_element_wise('"', column, '"', "")
    elif pa.types.is_boolean(column.type):
        text = pc.if_else(column, "true", "false")
    else:
        text = pc.cast(column, pa.string())
    return pc.fill_null(text, "null")


def jsonl_bytes(table: pa.Table) -> bytes:
    """One JSON object per line, keys in column order."""
    if table.num_rows == 0:
        return b""
    parts: list[pa.Array | str] = []
    for i, name in enumerate(table.column_names):
        parts.append(("{" if i == 0 else ",") + f'"{name}":')
        parts.append(json_value(table.column(i).combine_chunks()))
    parts.append("}\n")
    lines = pc.binary_join_element_wise(*parts, "")
    return b"".join(buf for buf in _string_payloads(lines))


def _string_payloads(lines: pa.ChunkedArray | pa.Array) -> list[bytes]:
    chunks = lines.chunks if isinstance(lines, pa.ChunkedArray) else [lines]
    out = []
    for chunk in chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32, count=len(chunk) + 1, offset=chunk.offset * 4)
        out.append(chunk.buffers()[2].to_pybytes()[offsets[0] : offsets[-1]])
    return out


def with_duplicates(served: pd.DataFrame, rate: float, rng: np.random.Generator) -> pd.DataFrame:
    """At-least-once shipping: ~``rate`` of lines repeated verbatim a few lines later."""
    n = len(served)
    dup = np.flatnonzero(rng.random(n) < rate)
    position = np.concatenate([np.arange(n, dtype=float), dup + rng.integers(1, 25, size=len(dup)) + 0.5])
    rows = np.concatenate([np.arange(n), dup])
    order = np.argsort(position, kind="stable")
    return served.iloc[rows[order]].reset_index(drop=True)


class GatewayWriter:
    """Streams ordered rows into one file per UTC day."""

    def __init__(
        self, s: Scenario, out_dir: Path, model_ids: list[str], compresslevel: int = 6, isal: bool = False
    ) -> None:
        """``isal``: gzip with ISA-L (its level 1, several times faster than zlib's) for large runs."""
        self.s = s
        self.out_dir = out_dir
        self.model_ids = model_ids
        self.compresslevel = compresslevel
        self.isal = isal
        self._open: dict[str, tuple[IO[bytes], object]] = {}
        self.paths: list[Path] = []
        self.lines = 0
        out_dir.mkdir(parents=True, exist_ok=True)

    def write(self, served: pd.DataFrame) -> None:
        day = pd.to_datetime(served["ts_ms"].to_numpy(), unit="ms").strftime("%Y-%m-%d").to_numpy()
        for d in sorted(set(day)):
            part = served[day == d]
            table = gateway_table(part, self.s, self.model_ids)
            self.lines += table.num_rows
            if self.s.gateway_format == "parquet":
                self._parquet(d, table)
            else:
                self._jsonl(d, table)

    def _jsonl(self, day: str, table: pa.Table) -> None:
        if day not in self._open:
            path = self.out_dir / f"requests-{day}.jsonl.gz"
            raw = path.open("wb")
            gz: IO[bytes]
            if self.isal:
                gz = igzip.IGzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1)
            else:
                gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=self.compresslevel)
            self._open[day] = (raw, gz)
            self.paths.append(path)
        self._open[day][1].write(jsonl_bytes(table))  # type: ignore[attr-defined]

    def _parquet(self, day: str, table: pa.Table) -> None:
        if day not in self._open:
            path = self.out_dir / f"requests-{day}.parquet"
            raw = path.open("wb")
            self._open[day] = (raw, pq.ParquetWriter(raw, table.schema, compression="zstd"))
            self.paths.append(path)
        self._open[day][1].write_table(table)  # type: ignore[attr-defined]

    def close(self) -> list[Path]:
        for raw, inner in self._open.values():
            inner.close()  # type: ignore[attr-defined]
            raw.close()
        self._open.clear()
        return sorted(self.paths)
