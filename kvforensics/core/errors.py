"""One error hierarchy for everything kvforensics refuses to do.

Every error carries, where known, the place that caused it (a file, a line, a config key) and a
message that says what to do next. The CLI prints ``Error: <message>`` and exits 2.
"""

from __future__ import annotations


class KvForensicsError(ValueError):
    """Base class: bad input or configuration that stops an investigation."""

    def __init__(self, message: str, *, location: str | None = None) -> None:
        self.location = location
        super().__init__(f"{location}: {message}" if location else message)


class ConfigError(KvForensicsError):
    """The incident file is invalid."""


class InputError(KvForensicsError):
    """An input file is missing, unreadable or unusable as a whole."""


class StrictModeError(KvForensicsError):
    """A record would have been quarantined while ``--strict`` was set."""
