"""Run one command in a child process and measure it: wall time and the child's own peak RSS.

``os.wait4`` returns the resource usage of exactly that child (``ru_maxrss``, KiB on Linux), so
each measured step gets its own peak RSS even though the harness starts many children. A /proc
poller would miss short peaks; the kernel's high-water mark does not. Linux keeps the high-water
mark of the memory a child starts with (the parent's, shared until ``exec``) across ``exec``, so a
child's peak is at least its parent's RSS at the start: the harness imports nothing heavy (about
20 MB), which is the most a step's figure can be above its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent


@dataclass
class Measured:
    """What one child process did: exit code, wall seconds, peak RSS and the JSON it reported."""

    argv: list[str]
    returncode: int
    wall_s: float
    peak_rss_mb: float
    cpu_s: float
    report: dict[str, Any] = field(default_factory=dict)
    stderr_tail: str = ""
    other_cpu_s: float | None = None  # CPU seconds other processes used meanwhile (noise)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_measured(
    argv: list[str],
    *,
    log_path: Path,
    report_path: Path | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> Measured:
    """Run ``argv`` with its output appended to ``log_path``; the child may write a JSON report
    (its own inner timings, counts) to ``report_path``."""
    if report_path is not None and report_path.exists():
        report_path.unlink()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(argv)}\n".encode())
        log.flush()
        offset = log.tell()
        busy_before = _busy_cpu_s()
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env={**os.environ, **(env or {})}, start_new_session=True)
        status, usage = _wait(proc, None if timeout_s is None else start + timeout_s)
        wall = time.perf_counter() - start
        busy_after = _busy_cpu_s()
    code = os.waitstatus_to_exitcode(status) if status is not None else -9
    stderr_tail = ""
    if code != 0:
        with open(log_path, "rb") as fh:
            fh.seek(offset)
            stderr_tail = fh.read().decode("utf-8", "replace")[-4000:]
    report: dict[str, Any] = {}
    if report_path is not None and report_path.exists():
        report = json.loads(report_path.read_text(encoding="utf-8"))
    return Measured(
        argv=argv,
        returncode=code,
        wall_s=wall,
        peak_rss_mb=(usage.ru_maxrss / 1024.0) if usage else float("nan"),
        cpu_s=(usage.ru_utime + usage.ru_stime) if usage else float("nan"),
        report=report,
        stderr_tail=stderr_tail,
        other_cpu_s=_other(busy_before, busy_after, usage),
    )


def _busy_cpu_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (/proc/stat), or None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _other(before: float | None, after: float | None, usage) -> float | None:
    if before is None or after is None or usage is None:
        return None
    return round(max(0.0, (after - before) - (usage.ru_utime + usage.ru_stime)), 1)


def _wait(proc: subprocess.Popen, deadline: float | None):
    """Block in ``wait4`` on the child; a timer kills its process group at the deadline."""
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = None
    if deadline is not None:
        timer = threading.Timer(max(0.0, deadline - time.perf_counter()), kill)
        timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if timer is not None:
            timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return (None if killed.is_set() else status), usage


def package_sha256() -> str:
    """A hash of the kvforensics sources (.py, .sql, .yml) as they are on disk now."""
    import hashlib

    root = BENCH_DIR.parent
    digest = hashlib.sha256()
    for p in sorted((root / "kvforensics").rglob("*")):
        if p.is_file() and p.suffix in (".py", ".sql", ".yml"):
            digest.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()[:16]


def python_argv(script: str, *args: str) -> list[str]:
    """``python benchmarks/<script> args...`` with the interpreter running the harness."""
    return [sys.executable, str(BENCH_DIR / script), *args]
