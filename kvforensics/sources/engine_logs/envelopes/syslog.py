"""Engine lines in a syslog file, as rsyslog (or syslog-ng) writes them on a host that runs the engine
as a service (systemd's journal forwarded to ``/var/log/syslog``, ``/var/log/messages``, or a file of
its own).

rsyslog's file templates put a header before each message:

* ``RSYSLOG_FileFormat`` (Debian 12's default): ``<RFC 3339 time with fraction and offset> <host>
  <tag>: <message>``, e.g. ``2026-08-26T21:10:00.001123+00:00 gpu-node-7 sglang-decode[4242]: ...``;
* ``RSYSLOG_TraditionalFileFormat`` (and syslog-ng's default): ``<Mmm dd hh:mm:ss> <host> <tag>:
  <message>``, a BSD (RFC 3164) time with neither year nor zone.

The tag is the program (``SYSLOG_IDENTIFIER``) with its process id in brackets. Labels: ``host``,
``program``, ``pid``. The envelope's clock is the RFC 3339 time; a traditional header's time says
neither year nor zone, so those records have no envelope clock and keep the engine's own stamp.
rsyslog writes ``#ooo`` for control characters it received (``#011`` a tab); they are left as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from kvforensics.sources.engine_logs.contract import EngineLine, unreadable_reason
from kvforensics.sources.engine_logs.envelopes.records import (
    RFC3339,
    EnvelopeItem,
    EnvelopeRecord,
    match_ns,
    quarantine,
)

# a host name or address; the tag is always followed by a space (the templates' sp-if-no-1st-sp)
_TAG = r" (?P<host>[A-Za-z0-9][A-Za-z0-9._:%-]{0,254}) (?P<program>[^\s\[\]:]{1,128})(?:\[(?P<pid>[^\s\]]{1,32})\])?: "
FILE_FORMAT = re.compile(r"^(?P<ts>" + RFC3339.pattern + r")" + _TAG)
"""The header of ``RSYSLOG_FileFormat``."""
TRADITIONAL = re.compile(
    r"^(?P<bsd>(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d{2}:\d{2}:\d{2})" + _TAG
)
"""The header of ``RSYSLOG_TraditionalFileFormat`` (BSD time)."""


def header(text: str) -> re.Match[str] | None:
    """The syslog header a line starts with, or None."""
    return FILE_FORMAT.match(text) or TRADITIONAL.match(text)


def read_syslog(lines: Iterable[EngineLine]) -> Iterator[EnvelopeItem]:
    """One record per syslog line; a line without a header is quarantined."""
    origins: dict[tuple[str, str, str], dict[str, str]] = {}
    for number, text, raw in lines:
        if text is None:
            yield quarantine(number, unreadable_reason(raw, "not UTF-8 (a syslog file is text)"), raw)
            continue
        if not text.strip():
            continue
        m = header(text)
        if m is None:
            yield quarantine(number, "not a syslog line (<time> <host> <program>[<pid>]: <message>)", raw)
            continue
        try:
            ns = match_ns(m) if m.re is FILE_FORMAT else None
        except (ValueError, OverflowError):
            yield quarantine(number, f"bad syslog time '{m['ts']}'", raw)
            continue
        key = (m["host"], m["program"], m["pid"] or "")
        labels = origins.get(key)
        if labels is None:
            labels = origins[key] = {"host": key[0], "program": key[1], **({"pid": key[2]} if key[2] else {})}
        message = text[m.end() :]
        yield EnvelopeRecord(number, ns, labels, message[:-1] if message.endswith("\r") else message, b"")
