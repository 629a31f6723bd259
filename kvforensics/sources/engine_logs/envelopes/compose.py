"""Engine lines in ``docker compose logs`` output: the container's name before a bar, then the line.

``docker compose logs`` (and ``docker compose up`` in the foreground) prints every line of every
container of a project as ``<name padded> | <line>``: the formatter (``cmd/formatter/logs.go`` of
docker/compose) pads the name to the longest name plus one and puts `` | `` after it, the whole
prefix in the container's colour when the output is a terminal (or with ``--ansi always``). The
name is the container's name without the project, ``<service>-<n>`` by default (``<service>_<n>``
in Compose v1), or a service's ``container_name``. With ``--timestamps`` (``-t``) the Docker daemon
puts the time of each line after the bar, as ``docker logs --timestamps`` does:
``<name> | <RFC3339Nano, 9 fraction digits, UTC> <line>``. ``docker compose up --timestamps`` puts
the time compose received the line in the same place.

Labels: ``container`` (the name as printed) and ``service`` (the name without a trailing ``-<n>`` /
``_<n>`` replica number). The envelope's clock is the time after the bar; output without ``-t``
has none, and the engine's own stamp is the time.

Compose prefixes every line it prints, so a line without the prefix is either compose's own status
output (``Attaching to ...``, ``<name> exited with code 0``, printed after a terminal's line reset
``\r\x1b[K``), quarantined as such, or the rest of the line before it that a terminal wrapped when
the output was copied from it: read as a line of the same container at the same time (the engine
parsers join wrapped dumps). A line without the prefix before any prefixed one is quarantined.

References: https://docs.docker.com/reference/cli/docker/compose/logs/ (``--timestamps``,
``--no-log-prefix``, ``--no-color``), https://docs.docker.com/reference/cli/docker/container/logs/
(the timestamp format), docker/compose ``cmd/formatter/logs.go`` (``setPrefix``: ``%-<width>s | ``)
and ``pkg/compose/logs.go`` (``Timestamps`` passed to the daemon).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

from kvforensics.sources.engine_logs.contract import EngineLine, unreadable_reason
from kvforensics.sources.engine_logs.envelopes.records import (
    RFC3339,
    EnvelopeItem,
    EnvelopeRecord,
    match_ns,
    quarantine,
)

_COLOUR = r"(?:\x1b\[[0-9;]*m)*"
PREFIX = re.compile(r"^" + _COLOUR + r"(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,254}) +\|(?: |$)" + _COLOUR)
"""The prefix compose prints before a container's line (its colour, if any, included)."""
_STAMP = re.compile(RFC3339.pattern + r" ")
_REPLICA = re.compile(r"^(?P<service>.+?)[-_]\d+$")
# compose's own lines (pkg/compose/printer.go, the formatter's Status: "\r\x1b[K<name> <message>")
STATUS = re.compile(
    r"^(?:\r|\x1b\[[0-9;]*[A-Za-z])*(?:Attaching to |Aborting on container exit|Gracefully stopping"
    r"|[A-Za-z0-9][A-Za-z0-9_.-]* exited with code -?\d+)"
)
NOT_A_LINE = "not a docker compose log line (<container> | <line>) and no line before it to continue"
STATUS_LINE = "docker compose's own status line, not a container's output"


def labels_of(name: str) -> dict[str, str]:
    """The labels of a container compose names *name*: the name, and its service (without the replica number)."""
    m = _REPLICA.match(name)
    return {"container": name, "service": m["service"] if m else name}


def read_compose(lines: Iterable[EngineLine]) -> Iterator[EnvelopeItem]:
    """One record per prefixed line, its clock the time after the bar when ``-t`` printed one."""
    containers: dict[str, Mapping[str, str]] = {}
    last: EnvelopeRecord | None = None
    for number, text, raw in lines:
        if text is None:
            yield quarantine(number, unreadable_reason(raw, "not UTF-8 (docker compose prints text)"), raw)
            continue
        if not text.strip():
            continue
        m = PREFIX.match(text)
        if m is None:
            if STATUS.match(text):
                yield quarantine(number, STATUS_LINE, raw)
            elif last is None:
                yield quarantine(number, NOT_A_LINE, raw)
            else:  # a terminal wrapped the line before: its container's, at its time
                yield EnvelopeRecord(number, last.ts_ns, last.labels, text[:-1] if text.endswith("\r") else text, b"")
            continue
        name = m["name"]
        labels = containers.get(name)
        if labels is None:
            labels = containers[name] = labels_of(name)
        rest = text[m.end() :]
        ns = None
        stamp = _STAMP.match(rest)
        if stamp is not None:
            try:
                ns = match_ns(stamp)
                rest = rest[stamp.end() :]
            except (ValueError, OverflowError):  # not a time after all: the line keeps it
                ns = None
        last = EnvelopeRecord(number, ns, labels, rest[:-1] if rest.endswith("\r") else rest, b"")
        yield last
