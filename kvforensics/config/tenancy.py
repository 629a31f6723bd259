"""The ``[prefix_cache]`` table of the deployment manifest: who shares the engines, and who sets the salt.

Check 6 (:mod:`kvforensics.audit.checks.prefix_cache`) needs facts no engine log holds::

    [prefix_cache]
    tenants = "multi"          # "multi": several customers share these engines | "single": one customer
    cache_salt = "gateway"     # who sets the request's cache_salt / extra_key:
                               #   "gateway": the gateway sets it per tenant, overwriting any client value
                               #   "client":  from the request body (a tenant can pick any salt)
                               #   "none":    no salt reaches the engine
    kv_store_keys_salt = true  # optional: you checked that the external KV store's keys include the salt
                               # (true) or not (false); without it the audit judges from the store and version
    engine_version = "0.5.18"  # optional: the engine build, for engines whose logs name none (SGLang often);
                               # a version the log states wins

    [prefix_cache.models."@cf/zai-org/glm-5.3"]      # optional, per gateway or engine model id
    cache_salt = "client"

    [prefix_cache.instances."glm53-prefill-0"]       # optional, per instance (wins over models)
    tenants = "single"

An override table only replaces the keys it names; the others come from the model table, then from
``[prefix_cache]``. Unknown keys and values raise :class:`~kvforensics.core.errors.InputError` naming the
key and what to write instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvforensics.core.errors import InputError

TENANTS = ("multi", "single")
CACHE_SALT = ("gateway", "client", "none")
KEYS = ("tenants", "cache_salt", "kv_store_keys_salt", "engine_version")
_VERSION = re.compile(r"v?\d+(\.\d+){0,3}([a-z0-9.+-]*)?")


@dataclass(frozen=True)
class Said:
    """One key of the table as it applies to a start-up: its value, the table it came from and its line."""

    value: str | bool
    scope: str  # "prefix_cache", "model X", "instance X"
    line: int | None


@dataclass(frozen=True)
class PrefixCachePolicy:
    """The ``[prefix_cache]`` table and its per-model and per-instance overrides."""

    default: dict[str, Said] = field(default_factory=dict)
    models: dict[str, dict[str, Said]] = field(default_factory=dict)
    instances: dict[str, dict[str, Said]] = field(default_factory=dict)

    def for_startup(self, instance: str, models: Iterable[str | None]) -> dict[str, Said]:
        """What the manifest says for one start-up, key by key: instance, then model, then default."""
        merged = dict(self.default)
        for m in models:
            if m is not None and m in self.models:
                merged.update(self.models[m])
                break
        merged.update(self.instances.get(instance, {}))
        return merged


def _value(key: str, raw: object, where: str, file: str) -> str | bool:
    if key == "engine_version":
        if not isinstance(raw, str) or not _VERSION.fullmatch(raw.strip()):
            raise InputError(
                f"{where}.{key} = {raw!r}; write the engine's version as text, e.g. \"0.5.18\"", location=file
            )
        return raw.strip().lstrip("v")
    if key == "kv_store_keys_salt":
        if not isinstance(raw, bool):
            raise InputError(f"{where}.{key} = {raw!r}; write true or false", location=file)
        return raw
    allowed = TENANTS if key == "tenants" else CACHE_SALT
    value = raw.strip().lower() if isinstance(raw, str) else None
    if value is None or value not in allowed:
        raise InputError(f"{where}.{key} = {raw!r}; use one of {', '.join(repr(v) for v in allowed)}", location=file)
    return value


def _key_line(lines: list[str], key: str, markers: tuple[str, ...], claimed: set[int]) -> int | None:
    """The line of *key* after each of *markers* in turn (a table header or a name), not already claimed."""
    start = 0
    for marker in markers:
        start = next((i for i in range(start, len(lines)) if marker in lines[i]), len(lines))
    pattern = re.compile(rf"\s*['\"]?{key}['\"]?\s*[:=]")
    found = (i + 1 for i in range(start, len(lines)) if i + 1 not in claimed and pattern.match(lines[i]))
    return next(found, None)


def _settings(
    table: Mapping[str, object],
    where: str,
    scope: str,
    markers: tuple[str, ...],
    ctx: tuple[list[str], str, set[int]],
) -> dict[str, Said]:
    lines, file, claimed = ctx
    out: dict[str, Said] = {}
    for key, raw in table.items():
        if key in ("models", "instances") and where == "prefix_cache":
            continue
        if key not in KEYS:
            raise InputError(f"{where} has an unknown key {key!r}; the keys are {', '.join(KEYS)}", location=file)
        line = _key_line(lines, key, markers, claimed)
        if line is not None:
            claimed.add(line)
        out[key] = Said(_value(key, raw, where, file), scope, line)
    return out


def read_prefix_cache(data: Mapping[str, object], text: str, file: str) -> PrefixCachePolicy | None:
    """The ``[prefix_cache]`` table of a parsed manifest (*text* gives the lines), None when absent."""
    table = data.get("prefix_cache")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise InputError("prefix_cache must be a table / mapping", location=file)
    lines = text.splitlines()
    claimed: set[int] = set()
    ctx = (lines, file, claimed)
    overrides: dict[str, dict[str, dict[str, Said]]] = {}
    for kind, label in (("instances", "instance"), ("models", "model")):  # overrides claim their lines first
        entries = table.get(kind, {}) or {}
        if not isinstance(entries, dict):
            raise InputError(f"prefix_cache.{kind} must map names to tables", location=file)
        overrides[kind] = {}
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                raise InputError(f"prefix_cache.{kind}.{name} must be a table", location=file)
            overrides[kind][str(name)] = _settings(
                entry, f"prefix_cache.{kind}.{name}", f"{label} {name}", ("prefix_cache", str(name)), ctx
            )
    default = _settings(table, "prefix_cache", "prefix_cache", ("prefix_cache",), ctx)
    return PrefixCachePolicy(default=default, models=overrides["models"], instances=overrides["instances"])
