"""The content file written while the traffic is generated, for runs above the page simulation.

Every served request of the target model gets a prompt and an output of random vocabulary words,
built column-wise per chunk (Arrow list and join kernels). Without the page simulation nobody
knows which pages an affected response read, so its output quotes 2-6 of the requests that last
finished on its decode instance before its decode started (the writers of the pages a FIFO free
list hands out first): runs of >= ``RUN_WORDS`` words of their prompts or outputs, as
:meth:`ContentWriter.leaked_output` stitches them on the page-simulated path. The latest finished
requests of each decode instance are carried from chunk to chunk, so memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from isal import igzip

from kvforensics.simulate.sources.content import ContentWriter, Text
from kvforensics.simulate.sources.engine_stream import text_bytes
from kvforensics.simulate.traffic import STREAM_CONTENT

RECENT_PER_INSTANCE = 64  # finished requests kept per decode instance as candidate leak sources


@dataclass(frozen=True)
class Finished:
    """A request that finished decoding: a candidate leak source."""

    end_ms: float
    request_id: str
    account: str
    text: Text


class ContentStream:
    """``content.jsonl.gz``: one record per served target-model request, in arrival order."""

    def __init__(self, seed: int, path: Path) -> None:
        self.seed = seed
        self.path = path
        self.writer = ContentWriter(seed)
        self.words = pa.array(self.writer.words.tolist(), type=pa.string())
        self.recent: dict[str, list[Finished]] = {}
        self.repeated: dict[tuple[str, int], str] = {}  # an exploiter re-sends the same prompt
        path.parent.mkdir(parents=True, exist_ok=True)
        self._raw = path.open("wb")
        self._gz = igzip.IGzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0, compresslevel=1)
        self.records = 0

    def phrases(self, rng: np.random.Generator, n: int, lo: int, hi: int) -> pa.Array:
        """``n`` texts of ``lo``-``hi`` random vocabulary words each."""
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(rng.integers(lo, hi + 1, size=n), out=offsets[1:])
        words = self.words.take(pa.array(rng.integers(0, len(self.words), size=int(offsets[-1]))))
        return pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), words), " ")

    def write(self, served: pd.DataFrame, chunk: int) -> dict[str, list[tuple[str, str]]]:
        """Write a chunk's records; the (request id, account) each affected output quotes, by its id."""
        rows = served[(served["model_idx"].to_numpy() == 0) & (served["status"].to_numpy() == 200)]
        rng = np.random.default_rng([self.seed, STREAM_CONTENT, 2, chunk])
        self.writer.rng = rng
        n = len(rows)
        prompts = self.phrases(rng, n, 18, 40)
        outputs = self.phrases(rng, n, 14, 24)
        rid = rows["rid"].to_numpy(dtype=object)
        account = rows["account"].to_numpy(dtype=object)
        tokens = rows["prompt_tokens"].to_numpy()
        exploit = np.flatnonzero(rows["kind"].to_numpy() == "affected_exploiter")
        if len(exploit):
            own = prompts.take(pa.array(exploit)).to_pylist()
            again = [
                self.repeated.setdefault((account[i], int(tokens[i])), p) for i, p in zip(exploit, own, strict=True)
            ]
            prompts = pc.replace_with_mask(prompts, self._mask(n, exploit), pa.array(again, type=pa.string()))
        affected = rows["affected"].to_numpy().astype(bool)
        decode = rows["decode_instance"].to_numpy(dtype=object)
        start = rows["ts_ms"].to_numpy() + rows["ttft_true_ms"].to_numpy()
        end = rows["ts_ms"].to_numpy() + rows["latency_ms"].to_numpy()
        leaked: dict[str, list[tuple[str, str]]] = {}
        hits = np.flatnonzero(affected)
        stitched: list[str] = []
        for a in hits[np.argsort(start[hits], kind="stable")]:
            near = np.flatnonzero((decode == decode[a]) & ~affected & (end <= start[a]))
            near = near[np.argsort(end[near], kind="stable")][-RECENT_PER_INSTANCE:]
            own = [Finished(float(end[j]), rid[j], account[j], self._text(prompts, outputs, j)) for j in near]
            earlier = [f for f in self.recent.get(decode[a], []) if f.end_ms <= start[a]]
            candidates = sorted(earlier + own, key=lambda f: f.end_ms)
            sources = candidates[len(candidates) - int(rng.integers(2, 7)) :] if candidates else []
            stitched.append(self.writer.leaked_output([f.text for f in sources]))
            leaked[rid[a]] = [(f.request_id, f.account) for f in sources]
        if len(hits):
            order = hits[np.argsort(start[hits], kind="stable")]
            outputs = pc.replace_with_mask(
                outputs, self._mask(n, np.sort(order)), pa.array([stitched[k] for k in np.argsort(order)])
            )
        self._remember(decode, affected, end, rid, account, prompts, outputs)
        lines = pc.binary_join_element_wise(
            '{"output": "', outputs, '", "prompt": "', prompts, '", "request_id": "',
            pa.array(rid, type=pa.string()), '"}\n', "",
        )  # fmt: skip
        self._gz.write(text_bytes(lines)[0])
        self.records += n
        return leaked

    @staticmethod
    def _mask(n: int, positions: np.ndarray) -> pa.Array:
        mask = np.zeros(n, dtype=bool)
        mask[positions] = True
        return pa.array(mask)

    @staticmethod
    def _text(prompts: pa.Array, outputs: pa.Array, j: int) -> Text:
        return Text(prompts[int(j)].as_py(), outputs[int(j)].as_py())

    def _remember(
        self,
        decode: np.ndarray,
        affected: np.ndarray,
        end: np.ndarray,
        rid: np.ndarray,
        account: np.ndarray,
        prompts: pa.Array,
        outputs: pa.Array,
    ) -> None:
        """Carry each decode instance's latest finished requests into the next chunk."""
        for instance in sorted(set(decode[~affected].tolist())):
            mine = np.flatnonzero((decode == instance) & ~affected)
            latest = mine[np.argsort(end[mine], kind="stable")][-RECENT_PER_INSTANCE:]
            fresh = [Finished(float(end[j]), rid[j], account[j], self._text(prompts, outputs, j)) for j in latest]
            merged = sorted(self.recent.get(instance, []) + fresh, key=lambda f: f.end_ms)
            self.recent[instance] = merged[-RECENT_PER_INSTANCE:]

    def close(self) -> Path:
        self._gz.close()
        self._raw.close()
        return self.path
