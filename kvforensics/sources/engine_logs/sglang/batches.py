"""SGLang prefill batch lines: what the scheduler put into one prefill step, read from the message.

The scheduler of each replica (TP rank 0 / attention-TP rank 0) logs one line per prefill batch; its
``#cached-token`` is how many prompt tokens of the batch the prefix cache served. The forms, by the
SGLang source that prints them:

* ``Prefill batch, #new-seq: N, #new-token: N, #cached-token: N, token usage: 0.00, #running-req: N,
  #queue-req: N, ...`` (0.4.10 and later: ``srt/managers/scheduler.py`` ``log_prefill_stats``, from
  0.5.x ``srt/managers/scheduler_metrics_mixin.py`` and ``scheduler_components/metrics_reporter.py``),
  with ``Prefill batch [iter],`` when ``SGLANG_LOG_FORWARD_ITERS`` is set, the PD prefill queue counts
  (``#bootstrap-req``, ``#inflight-req``, ``#prealloc-req``, ``#unbootstrapped-req``,
  ``#transferring-req``) and ``full token usage: .., swa token usage: ..`` or ``mamba usage: ..`` for
  hybrid pools;
* ``Prefill batch. #new-seq: N, ..., cache hit rate: X%, ...`` (0.3.x - 0.4.x ``srt/managers/scheduler.py``,
  a period instead of a comma) and ``Prefill batch(mixed #running-req: N). #new-seq: ...`` (mixed
  chunked prefill, the same files).

:func:`match_prefill_batch` is stateless. A line that starts as a prefill batch line but lacks a
readable ``#new-seq``, ``#new-token`` or ``#cached-token`` is a :class:`BatchRefusal` (the parser
quarantines it). The columnar reader (:mod:`kvforensics.sources.engine_logs.columnar`) reads the plainest
of these lines in SQL as this module reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The message of a prefill batch line starts so (after its envelope).
BATCH_NEEDLE = "Prefill batch"
_HEAD = re.compile(r"^Prefill batch(?: ?\[\d+\])?(?:\(mixed #running-req: (?P<mixed>[0-9]{1,18})\))?[.,] ")
_COUNT = re.compile(r"[0-9]{1,18}")
_USAGE = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,6})?")
REQUIRED = ("#new-seq", "#new-token", "#cached-token")
#: Fields of the PD prefill role (its bootstrap and transfer queues) and of the decode role.
PREFILL_FIELDS = ("#bootstrap-req", "#inflight-req", "#unbootstrapped-req", "#transferring-req")
DECODE_FIELDS = ("#transfer-req", "#retracted-req", "pre-allocated usage")


@dataclass(frozen=True)
class BatchMatch:
    """The counts one prefill batch line reports."""

    new_seq: int
    new_token: int
    cached_token: int
    running_req: int | None
    queue_req: int | None
    token_usage: float | None
    role: str | None


@dataclass(frozen=True)
class BatchRefusal:
    """A prefill batch line whose counts cannot be read."""

    reason: str


def batch_fields(rest: str) -> dict[str, str]:
    """The ``key: value`` parts of a batch line after its head, split at ``", "``; the first of a key wins."""
    fields: dict[str, str] = {}
    for part in rest.split(", "):
        key, sep, value = part.partition(": ")
        if sep:
            fields.setdefault(key, value)
    return fields


def _count(value: str | None) -> int | None:
    return int(value) if value is not None and _COUNT.fullmatch(value) else None


def match_prefill_batch(msg: str) -> BatchMatch | BatchRefusal | None:
    """The prefill batch *msg* (a line without its envelope) reports; None when it is not one."""
    if not msg.startswith(BATCH_NEEDLE):
        return None
    head = _HEAD.match(msg)
    if head is None:
        return None
    fields = batch_fields(msg[head.end() :])
    counts = [_count(fields.get(k)) for k in REQUIRED]
    if any(c is None for c in counts):
        return BatchRefusal(
            "prefill batch line without a readable "
            + ", ".join(k for k, c in zip(REQUIRED, counts, strict=True) if c is None)
        )
    new_seq, new_token, cached_token = (int(c) for c in counts)  # type: ignore[arg-type]
    usage = fields.get("token usage", fields.get("full token usage"))
    role = (
        "prefill"
        if any(k in fields for k in PREFILL_FIELDS)
        else "decode"
        if any(k in fields for k in DECODE_FIELDS)
        else None
    )
    running = _count(fields.get("#running-req"))
    return BatchMatch(
        new_seq=new_seq,
        new_token=new_token,
        cached_token=cached_token,
        running_req=running if running is not None else _count(head["mixed"]),
        queue_req=_count(fields.get("#queue-req")),
        token_usage=float(usage) if usage is not None and _USAGE.fullmatch(usage) else None,
        role=role,
    )
