"""Source kinds as units: ``sources/<kind>/kind.yml`` and the readers beside it.

A source kind is one sort of input an incident file's ``[[sources]]`` entry names with ``kind`` (gateway
request logs, engine logs, the change log, content, KV-cache events). Its folder holds everything about it:
``kind.yml`` declares the formats it reads and its default one, the canonical fields its ``columns`` may map,
the keys only it accepts (each with one line saying what it is, and what a source of another kind that sets
them is told), the tables it fills, the inputs it offers the mechanisms (``mechanism.yml`` names them), the
conclusiveness checks it owns (``-- reason:`` of ``sql/conclusive.sql``) with what to fix when its records are
quarantined, and when ingest reads it; ``entry`` names the module ingest calls (its ``load``). The config checks
a source against its kind's declaration, ingest reads the kinds in their order, and the mechanisms' inputs
are checked against what the kinds offer: adding a kind is adding a folder.

This module reads the declarations only (the incident file is checked with them); a kind's readers are
imported when ingest loads them (:meth:`SourceKind.entry_module`).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from kvforensics.core import canonical as canonical_fields
from kvforensics.core.declarations import read_declaration
from kvforensics.core.errors import ConfigError

SOURCES_DIR = Path(__file__).parent
INGEST_PHASES = ("first", "files", "last")  # requests before all, the per-file kinds, content after capacity
_REQUIRED = {
    "name",
    "title",
    "order",
    "ingest",
    "entry",
    "formats",
    "default_format",
    "canonical",
    "tables",
    "inputs",
    "quarantine_fix",
    "conclusive",
}
_OPTIONAL = {
    "keys",
    "refused_elsewhere",
    "maps_columns",
    "required",
    "shares_files",
    "envelopes",
    "field_inputs",
    "no_labels",
}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class SourceKind:
    """One kind of source, as its ``kind.yml`` declares it."""

    name: str  # the value of ``kind`` in the incident file
    title: str
    order: int  # its place in lists of kinds (messages, limits)
    ingest: str  # one of INGEST_PHASES
    entry: str  # the module ingest calls: ``load(run, source, files)``
    formats: tuple[str, ...]
    default_format: str | None  # None: told from the path's extension
    canonical: tuple[str, ...]  # the canonical fields its ``columns`` may map
    keys: tuple[tuple[str, str], ...]  # (key, what it says): the keys only this kind accepts
    refused_elsewhere: tuple[tuple[tuple[str, ...], str], ...]  # (keys, what another kind's source is told)
    maps_columns: bool  # columns may be paths or expressions, with value maps, null tokens
    required: str | None  # why an incident needs a source of this kind (None: it does not)
    shares_files: tuple[tuple[str, tuple[str, ...]], ...]  # (its format, kinds whose files it may read too)
    envelopes: tuple[str, ...]  # collection envelopes its files may come in
    tables: tuple[str, ...]  # the evidence tables it fills
    inputs: tuple[tuple[str, tuple[str, ...]], ...]  # (input, the tables holding it) offered to the mechanisms
    field_inputs: str | None  # the table whose columns are inputs too (``<kind>.<column>``)
    no_labels: str | None  # why its instance template may not name an envelope label
    quarantine_fix: str  # what to fix when its records are quarantined beyond the limit
    conclusive: tuple[str, ...]  # the conclusiveness reasons it owns
    path: Path  # its folder

    def entry_module(self) -> ModuleType:
        """The module ingest calls for this kind (its readers are imported only then)."""
        return importlib.import_module(self.entry)

    def may_share_files(self, fmt: str, other: str) -> bool:
        """Whether a source of this kind and format may read the files a source of kind *other* reads."""
        return other in dict(self.shares_files).get(fmt, ())


def _strings(value: Any, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"'{key}' must be a list of names", location=where)
    return tuple(value)


def _text(meta: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> str | None:
    value = meta.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"'{key}' must be a non-empty text", location=where)
    return " ".join(value.split())


def _canonical(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    fields = (
        getattr(canonical_fields, value, None) if isinstance(value, str) and value.startswith("CANONICAL_") else None
    )
    if not isinstance(fields, tuple):
        raise ConfigError(
            f"canonical {value!r} must name a CANONICAL_..._FIELDS tuple of kvforensics/core/canonical.py, or be null",
            location=where,
        )
    return fields


def _keys(meta: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    keys = meta.get("keys", {})
    if not isinstance(keys, Mapping) or not all(
        isinstance(k, str) and isinstance(d, str) and d.strip() for k, d in keys.items()
    ):
        raise ConfigError(
            "'keys' must map each key only this kind accepts to one line saying what it is", location=where
        )
    return tuple((k, " ".join(d.split())) for k, d in keys.items())


def _refused(
    meta: Mapping[str, Any], keys: tuple[tuple[str, str], ...], where: str
) -> tuple[tuple[tuple[str, ...], str], ...]:
    groups = meta.get("refused_elsewhere", [])
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and set(g) == {"keys", "message"} for g in groups
    ):
        raise ConfigError("'refused_elsewhere' must be a list of {keys, message}", location=where)
    out = tuple(
        (_strings(g["keys"], "refused_elsewhere.keys", where), _text(g, "message", where) or "") for g in groups
    )
    own = {k for k, _ in keys}
    covered = [k for group, _ in out for k in group]
    if sorted(covered) != sorted(own):
        raise ConfigError(f"'refused_elsewhere' must name each of its own keys {sorted(own)} once", location=where)
    return out


def _inputs(meta: Mapping[str, Any], tables: tuple[str, ...], where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    inputs = meta["inputs"]
    if not isinstance(inputs, Mapping) or not all(isinstance(k, str) and _NAME.match(k) for k in inputs):
        raise ConfigError(
            "'inputs' must map each input it offers the mechanisms to the tables holding it", location=where
        )
    out = tuple((name, _strings(held, f"inputs.{name}", where)) for name, held in inputs.items())
    foreign = sorted({t for _, held in out for t in held} - set(tables))
    if foreign:
        raise ConfigError(f"inputs name tables the kind does not fill: {foreign}", location=where)
    return out


def read_kind(folder: Path) -> SourceKind:
    """The source kind of *folder*, its ``kind.yml`` checked whole (a ConfigError names the file and the field)."""
    path = folder / "kind.yml"
    where = str(path)
    meta = read_declaration(path, "source kind", _REQUIRED, _OPTIONAL, word="field")
    name = _text(meta, "name", where) or ""
    if not _NAME.match(name):
        raise ConfigError(f"name {name!r} must be a lower-case name", location=where)
    if not isinstance(meta["order"], int) or isinstance(meta["order"], bool):
        raise ConfigError("'order' must be an integer", location=where)
    if meta["ingest"] not in INGEST_PHASES:
        raise ConfigError(f"'ingest' must be one of {list(INGEST_PHASES)}", location=where)
    if not isinstance(meta["entry"], str) or not meta["entry"].startswith("kvforensics.sources."):
        raise ConfigError("'entry' must name a module of kvforensics.sources", location=where)
    formats = _strings(meta["formats"], "formats", where)
    default = meta["default_format"]
    if default is not None and default not in formats:
        raise ConfigError(f"default_format {default!r} must be one of its formats or null", location=where)
    keys = _keys(meta, where)
    tables = _strings(meta["tables"], "tables", where)
    field_inputs = meta.get("field_inputs")
    if field_inputs is not None and field_inputs not in tables:
        raise ConfigError(f"field_inputs {field_inputs!r} must be one of the tables it fills", location=where)
    shares = meta.get("shares_files", {})
    if not isinstance(shares, Mapping) or not set(shares) <= set(formats):
        raise ConfigError("'shares_files' must map formats of the kind to lists of kinds", location=where)
    return SourceKind(
        name=name,
        title=_text(meta, "title", where) or "",
        order=meta["order"],
        ingest=meta["ingest"],
        entry=meta["entry"],
        formats=formats,
        default_format=default,
        canonical=_canonical(meta["canonical"], where),
        keys=keys,
        refused_elsewhere=_refused(meta, keys, where),
        maps_columns=meta.get("maps_columns") is True,
        required=_text(meta, "required", where, optional=True),
        shares_files=tuple((f, _strings(k, f"shares_files.{f}", where)) for f, k in shares.items()),
        envelopes=_strings(meta.get("envelopes", []), "envelopes", where),
        tables=tables,
        inputs=_inputs(meta, tables, where),
        field_inputs=field_inputs,
        no_labels=_text(meta, "no_labels", where, optional=True),
        quarantine_fix=_text(meta, "quarantine_fix", where) or "",
        conclusive=_strings(meta["conclusive"], "conclusive", where),
        path=folder,
    )


@cache
def load_kinds(directory: Path = SOURCES_DIR) -> tuple[SourceKind, ...]:
    """Every source kind of *directory* (each sub-folder holding a ``kind.yml``), in their order; two kinds
    with one name, order, input or reason, or a kind sharing files with a kind that does not exist, are refused."""
    kinds = tuple(sorted((read_kind(p.parent) for p in sorted(directory.glob("*/kind.yml"))), key=lambda k: k.order))
    for what, values in (
        ("name", [k.name for k in kinds]),
        ("order", [k.order for k in kinds]),
        ("input", [i for k in kinds for i, _ in k.inputs]),
        ("conclusiveness reason", [r for k in kinds for r in k.conclusive]),
    ):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            raise ConfigError(f"source kinds declare the same {what} twice: {twice}", location=str(directory))
    names = {k.name for k in kinds}
    for k in kinds:
        unknown = sorted({o for _, others in k.shares_files for o in others} - names)
        if unknown:
            raise ConfigError(f"shares_files names unknown kind(s) {unknown}", location=str(k.path / "kind.yml"))
    return kinds


def kinds_by_name(directory: Path = SOURCES_DIR) -> dict[str, SourceKind]:
    return {k.name: k for k in load_kinds(directory)}


def input_tables(directory: Path = SOURCES_DIR) -> dict[str, tuple[str, ...]]:
    """Every input the kinds offer the mechanisms, with the evidence tables that hold it."""
    return {name: tables for k in load_kinds(directory) for name, tables in k.inputs}


def field_input_tables(directory: Path = SOURCES_DIR) -> dict[str, str]:
    """The inputs whose fields are inputs too (``<input>.<column>``), with the table whose columns they are."""
    return {name: k.field_inputs for k in load_kinds(directory) if k.field_inputs for name, _ in k.inputs}


def always_present(directory: Path = SOURCES_DIR) -> set[str]:
    """The inputs of the kinds every incident has a source of (an incident without one is refused)."""
    return {name for k in load_kinds(directory) if k.required for name, _ in k.inputs}


def envelope_names(directory: Path = SOURCES_DIR) -> tuple[str, ...]:
    """Every collection envelope a kind's files may come in, in the order the kinds declare them."""
    return tuple(e for k in load_kinds(directory) for e in k.envelopes)
