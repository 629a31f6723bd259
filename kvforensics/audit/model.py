"""What an audit says: one :class:`Verdict` per check and start-up, and the exposure windows they imply.

The checks are numbered as operators were told to make them (:data:`CHECKS`); each verdict is one of
:data:`STATUSES`, with a sentence and the file and line it rests on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from packaging.version import Version

CHECKS: dict[int, str] = {
    1: "KV pool vs context length",
    2: "engine version (PD reject-path fix)",
    3: "deferred KV release and capped Mooncake transfer batch",
    4: "KV checksum / canary verification",
    5: "load balancer abort on client disconnect",
    6: "prefix-cache isolation between tenants",
}
STATUSES = ("pass", "fail", "unknown", "not_applicable")
SGLANG_FIXED_VERSION = Version("0.5.22")
PD_ROLES = ("prefill", "decode")
#: Engine event kinds the audit reads ("scheduler_abort" is an abort_input_too_long line carrying
#: the scheduler's "maximum allowed length").
AUDIT_EVENT_KINDS = (
    "abort_input_too_long",
    "input_truncated",
    "checksum_mismatch",
    "canary_violation",
    "context_corruption",
)


@dataclass(frozen=True)
class Verdict:
    """One check on one start-up (configuration interval) of one engine instance."""

    instance: str
    role: str  # prefill | decode | unified | unknown
    model: str | None
    startup_from: datetime | None  # UTC; None when the start-up carries no timestamp
    startup_to: datetime | None  # when it ended (see end_reason); None while still in force
    check: int  # 1..6, see CHECKS
    check_name: str
    status: str  # pass | fail | unknown | not_applicable
    exposed: bool  # a check-1 fail on a role that serves beyond its pool, or a check-6 fail (a shared prefix cache)
    detail: str
    evidence_file: str | None
    evidence_line: int | None
    engine: str | None = None
    engine_version: str | None = None
    startup_file: str | None = None  # where the start-up begins (identifies it when it has no timestamp)
    startup_line: int | None = None
    end_reason: str | None = None  # shutdown | next_startup | log_end | None (in force), as in capacity
    end_file: str | None = None  # the evidence of the end: shutdown line, next start-up, last line
    end_line: int | None = None
    successor: str | None = None  # log_end: the instance that took over

    @property
    def in_force(self) -> bool:
        """Still running when the evidence ends: the log shows no end."""
        return self.end_reason is None and self.startup_to is None


@dataclass(frozen=True)
class ExposureWindow:
    """A start-up whose check 1 failed on a role that serves beyond its pool."""

    instance: str
    role: str
    model: str | None
    start: datetime | None
    end: datetime | None
    detail: str
    evidence_file: str | None
    evidence_line: int | None
    end_reason: str | None = None
    end_file: str | None = None
    end_line: int | None = None
    successor: str | None = None
    in_force: bool = False
