"""What the checks share: the shape of a judgement, reading a server arg, and the unknown role."""

from __future__ import annotations

from typing import Any

from kvforensics.audit.startups import Startup

ON = ("true", "1", "yes", "on")
OFF = ("false", "0", "no", "off", "none", "")
Judged = tuple[str, str, str | None, int | None]  # status, detail, evidence file, evidence line


def role_unknown(s: Startup, judged: Judged) -> Judged:
    """A fail that only matters on a disaggregated role is unknown when the role is unknown."""
    status, detail, file, line = judged
    if s.pd is None and status == "fail":
        return ("unknown", f"role unknown (no server_args line); if disaggregated: {detail}", file, line)
    return judged


def server_arg(s: Startup, test: Any) -> tuple[str, str, str | None, int | None] | None:
    """The first server arg whose name passes *test*: (name, value, file, line), log before server_info."""
    for key in sorted(s.flags):
        if test(key.lower()):
            file, line = s.where("server_args")
            return key, s.flags[key], file, line
    if s.server_info is not None:
        for key in sorted(s.server_info.args):
            if test(key.lower()):
                return key, s.server_info.args[key], s.server_info.file, s.server_info.line_of(key)
    return None


def no_args_note(s: Startup) -> str:
    return "" if "server_args" in s.evidence or s.server_info is not None else " (no server_args line in this start-up)"
