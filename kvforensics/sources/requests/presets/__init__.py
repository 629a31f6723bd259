"""Presets: the mapping of an export format responders actually hold, named on a source.

``preset = "<name>"`` on a ``requests`` source reads ``kvforensics/sources/requests/presets/<name>.toml``, which
supplies ``format``, ``columns``, ``values``, ``null_tokens`` and ``timezone``; the source's own
keys override it key by key (a ``columns`` or ``values`` entry of the source replaces the preset's
entry for that one field only). Each preset file also carries a ``description`` and ``schema``,
the URL of the upstream project's documented schema it was written from.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from typing import Any, Mapping

from kvforensics.core.errors import ConfigError

PRESET_KEYS = ("description", "schema", "format", "columns", "values", "null_tokens", "timezone")
# source keys a preset supplies; the per-field tables merge entry by entry
SUPPLIED = ("format", "columns", "values", "null_tokens", "timezone")
_BY_FIELD = ("columns", "values")


def available() -> list[str]:
    """The names of the shipped presets."""
    return sorted(p.name[: -len(".toml")] for p in resources.files(__package__).iterdir() if p.name.endswith(".toml"))


def load_preset(name: str, where: str = "") -> dict[str, Any]:
    """The preset's keys; an unknown name is a ConfigError listing the presets."""
    names = available()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(names)}", location=where or None)
    text = resources.files(__package__).joinpath(f"{name}.toml").read_text(encoding="utf-8")
    preset = tomllib.loads(text)
    unknown = sorted(set(preset) - set(PRESET_KEYS))
    if unknown:  # a shipped file is checked by the tests; this guards a hand-edited installation
        raise ConfigError(f"preset {name!r} has unknown key(s) {unknown}", location=where or None)
    return preset


def with_preset(source: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """The source's keys with its preset's filled in (none when it names no preset)."""
    name = source.get("preset")
    if name is None:
        return dict(source)
    if not isinstance(name, str):
        raise ConfigError("preset must be the name of a preset, e.g. preset = \"litellm\"", location=where or None)
    preset = load_preset(name, where)
    merged = dict(source)
    for key in SUPPLIED:
        if key not in preset:
            continue
        if key in _BY_FIELD and isinstance(source.get(key, {}), Mapping):
            merged[key] = {**preset[key], **source.get(key, {})}
        else:
            merged.setdefault(key, preset[key])
    return merged


def describe(name: str) -> str:
    """One line for a load's notes: which preset mapped the source, what it assumes, where from."""
    preset = load_preset(name)
    return f"mapped by preset '{name}': {preset.get('description', '').strip()} (schema: {preset.get('schema', '?')})"
