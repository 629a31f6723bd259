"""The YAML files that declare a unit of the toolkit (``mechanisms/<id>/mechanism.yml``,
``sources/<kind>/kind.yml``): read whole, a mapping, every key known and every required one present, or a
ConfigError naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from kvforensics.core.errors import ConfigError

# libyaml's safe loader where PyYAML was built with it (the wheels are): the same documents, about ten times faster
# than the pure-Python one, which every run paid for its rules and mechanisms
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """A YAML document of the toolkit's own files, read safely (no Python objects)."""
    return yaml.load(text, Loader=_SAFE_LOADER)  # noqa: S506 - a safe loader


def read_declaration(
    path: Path, what: str, required: set[str], optional: set[str] | None = None, *, word: str = "key"
) -> Mapping[str, Any]:
    """The mapping *path* holds, its keys checked against *required* and *optional* (*what*: the unit it
    declares, for the message; *word*: what its keys are called there)."""
    where = str(path)
    try:
        meta = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the {what}: {' '.join(str(e).split())[:200]}", location=where) from None
    if not isinstance(meta, Mapping):
        raise ConfigError(f"a {path.name} is a mapping of " + ", ".join(sorted(required)), location=where)
    unknown = sorted(set(meta) - required - (optional or set()))
    missing = sorted(required - set(meta))
    if unknown or missing:
        raise ConfigError(
            "; ".join(
                filter(None, [unknown and f"unknown {word}(s) {unknown}", missing and f"missing {word}(s) {missing}"])
            ),
            location=where,
        )
    return meta
