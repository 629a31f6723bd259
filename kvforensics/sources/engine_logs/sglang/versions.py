"""SGLang versions: read from ``sglang version:`` lines and install paths, or inferred from format features.

SGLang never logs its version at start-up. Each format feature a start-up shows (its envelope, the
fields of its KV pool lines, the shape of its server_args dump ...) is a clue that bounds the
version (reference: /work/shared/reference/engine-log-formats.md §1.7); the clues' ranges are
intersected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

VERSION_LINES = (
    re.compile(r"\bsglang version:\s*v?(?P<v>\d+\.\d+(?:\.\d+)?(?:\.post\d+|rc\d+|\.dev\d+)?)", re.IGNORECASE),
    re.compile(r"^\s*sglang:\s*(?P<v>\d+\.\d+\.\d+(?:\.post\d+|rc\d+|\.dev\d+)?)\s*$"),  # check_env
    re.compile(r"\bsglang(?:==|-)v?(?P<v>\d+\.\d+\.\d+(?:\.post\d+|rc\d+|\.dev\d+)?)(?=[/\s.'\")]|$)"),
)

# ---------------------------------------------------------------------------------------------
# Version inference from format features (reference §1.7). Bounds are exclusive at the nearest
# release read that lacked (or still had) the feature, so the range never claims more than known.
# ---------------------------------------------------------------------------------------------

_Version = tuple[int, ...]


@dataclass(frozen=True)
class _Clue:
    label: str
    low: _Version | None = None
    low_inclusive: bool = False
    high: _Version | None = None
    high_inclusive: bool = False


_CLUES: dict[str, _Clue] = {
    "gpu_envelope": _Clue("[gpu=N] envelope", high=(0, 2, 15)),
    "time_only_envelope": _Clue("[HH:MM:SS TPn] envelope", high=(0, 3, 6)),
    "tp_tag_on_tp1": _Clue("TP0 suffix on a tp_size=1 server", high=(0, 4, 6), high_inclusive=True),
    "summary_no_chunked": _Clue("max_total_num_tokens line without chunked_prefill_size", high=(0, 4, 3)),
    "summary_no_avail": _Clue("max_total_num_tokens line without available_gpu_mem", low=(0, 3, 6), high=(0, 4, 10)),
    "summary_avail": _Clue("available_gpu_mem in the max_total_num_tokens line", low=(0, 4, 6)),
    "kv_no_tokens": _Clue("KV Cache line without #tokens", low=(0, 3, 6), high=(0, 4, 4)),
    "kv_tokens_no_dtype": _Clue("KV Cache line with #tokens but no dtype", low=(0, 4, 3), high=(0, 5, 15)),
    "kv_dtype": _Clue("dtype: in the KV Cache line", low=(0, 5, 9)),
    "req_time_stats_old": _Clue("'Req Time Stats(... input len=...)'", low=(0, 4, 6), high=(0, 5, 15)),
    "req_time_stats_new": _Clue("'ReqTimeStats(... input_len=...)'", low=(0, 5, 9)),
    "server_args_repr": _Clue("server_args=ServerArgs(...)", high=(0, 5, 20)),
    "server_args_dict": _Clue("server_args={...} dict", low=(0, 5, 15)),
}


def _vstr(v: _Version) -> str:
    return ".".join(str(x) for x in v)


def infer_version(clues: Iterable[str]) -> tuple[str | None, list[str]]:
    """Intersect the version ranges of the clues seen; (specifier, labels) or (None, labels)."""
    low: _Version | None = None
    low_inc = False
    high: _Version | None = None
    high_inc = False
    labels = []
    for key in clues:
        c = _CLUES[key]
        labels.append(c.label)
        if c.low is not None and (low is None or c.low > low or (c.low == low and not c.low_inclusive)):
            low, low_inc = c.low, c.low_inclusive
        if c.high is not None and (high is None or c.high < high or (c.high == high and not c.high_inclusive)):
            high, high_inc = c.high, c.high_inclusive
    if not labels:
        return None, labels
    if low is not None and high is not None and (low > high or (low == high and not (low_inc and high_inc))):
        return None, labels
    parts = []
    if low is not None:
        parts.append(f"{'>=' if low_inc else '>'}{_vstr(low)}")
    if high is not None:
        parts.append(f"{'<=' if high_inc else '<'}{_vstr(high)}")
    return ",".join(parts), labels


def satisfies(version: str, spec: str) -> bool:
    """True if *version* (e.g. ``0.5.21``) lies in *spec* (e.g. ``>0.5.9,<0.5.20``); True if unreadable."""
    nums = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if nums is None:
        return True
    v = tuple(int(x) for x in nums.groups(default="0"))
    for part in spec.split(","):
        m = re.match(r"(>=|<=|>|<)(.+)", part)
        if m is None:
            continue
        bound = tuple(int(x) for x in m[2].split("."))
        op = m[1]
        if (op == ">=" and not v >= bound) or (op == ">" and not v > bound):
            return False
        if (op == "<=" and not v <= bound) or (op == "<" and not v < bound):
            return False
    return True
