"""Exposure mechanisms as units: ``mechanisms/<id>/mechanism.yml`` and its rules in ``mechanisms/<id>/rules/``.

A mechanism is one way KV-cache contents cross tenants (``stale_pages``: pages read past an exceeded
pool; ``prefix_reuse``: prefix-cache blocks matched across tenants). Its folder holds what the toolkit
knows about it: ``mechanism.yml`` (title, the report's summary and explanation, the inputs it needs and
the ones that strengthen it, how its sources are attributed, the audit checks that bear on it, what
deliberate use looks like, what the per-account notices say) and its detection rules (``rules/<rule>.sql`` + ``rules/<rule>.yml``, read
by :mod:`kvforensics.stages.rulebook`). Adding a mechanism is adding a folder.

An input is one a source kind offers (``inputs`` of ``kvforensics/sources/<kind>/kind.yml``: ``requests``,
``engine_log``, ``content``, ``changes``, ``kv_events``) or a field of one whose kind offers its fields
(``requests.cache_salt``, ``kv_events.salt``); a mechanism naming any other is refused when it is loaded.
:func:`present_inputs` says which of them the evidence database holds; :func:`select` picks the mechanisms an investigation runs: the ones the
incident file names, else every mechanism whose inputs are present.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import duckdb

from kvforensics.core.db import one
from kvforensics.core.declarations import read_declaration
from kvforensics.core.errors import ConfigError
from kvforensics.sources import always_present, field_input_tables, input_tables

MECHANISMS_DIR = Path(__file__).parent
_INPUT = re.compile(r"^([a-z_]+)(?:\.([a-z_][a-z0-9_]*))?$")
_KEYS = {"id", "title", "summary", "explanation", "inputs", "attribution", "audit_checks", "exploitation", "notice"}
_TEXT_KEYS = ("id", "title", "summary", "explanation", "attribution", "exploitation")
_INPUT_KEYS = {"required", "any_of", "strengthens"}
_NOTICE_SECTION_KEYS = {"title", "text", "data", "consequence"}
_NOTICE_ROLES = ("received", "exposed", "possible")  # possible: only a mechanism whose attribution has possible sources
_BASIS = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class NoticeSection:
    """A notice's heading and paragraph for one role of an account."""

    title: str
    text: str
    # what the data concerned may hold, and the likely consequences for the account, where the notice's generic
    # sentences would not be true of this mechanism (None: the generic ones)
    data: str | None = None
    consequence: str | None = None


@dataclass(frozen=True)
class Notice:
    """What a mechanism's per-account notices say: to an account that received responses it flagged, to one
    whose data they confirmably carried (``exposed``) or possibly did (``possible``), and what each basis of
    its confirmed sources (``content_matches.basis``) means."""

    received: NoticeSection
    exposed: NoticeSection
    possible: NoticeSection | None
    bases: tuple[tuple[str, str], ...]  # (basis, what it means to the account told)

    def basis(self, name: str) -> str | None:
        return dict(self.bases).get(name)


@dataclass(frozen=True)
class Mechanism:
    """One exposure mechanism, as its ``mechanism.yml`` describes it."""

    id: str
    title: str
    summary: str
    explanation: str
    required: tuple[str, ...]  # every one must be present
    any_of: tuple[str, ...]  # at least one must be present (empty: no such need)
    strengthens: tuple[str, ...]  # inputs that make its findings stronger or its sources surer
    attribution: str
    audit_checks: tuple[int, ...]  # numbers of kvforensics.audit.model.CHECKS
    exploitation: str
    notice: Notice  # what the per-account notices say
    path: Path  # the mechanism's folder
    rule_ids: tuple[str, ...]  # the rules found in its rules/ folder

    @property
    def rules_dir(self) -> Path:
        return self.path / "rules"

    def missing(self, present: Iterable[str]) -> tuple[str, ...]:
        """The inputs it needs that are not in *present*: each required one, and its any_of group as
        one entry ("a or b") when none of them is there."""
        have = set(present)
        lacking = [i for i in self.required if i not in have]
        if self.any_of and not have & set(self.any_of):
            lacking.append(" or ".join(self.any_of))
        return tuple(lacking)

    def _repr_html_(self) -> str:
        from html import escape

        return (
            f"<b>{escape(self.id)}</b>: {escape(self.title)}<p>{escape(self.summary)}</p>"
            f"<p>rules: {escape(', '.join(self.rule_ids) or 'none')}</p>"
        )


def _text(meta: Mapping[str, Any], key: str, where: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"'{key}' must be a non-empty text", location=where)
    return " ".join(value.split())


def _inputs(meta: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = meta.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"inputs.{key} must be a list of inputs such as [requests, kv_events]", location=where)
    offered, fields = input_tables(), field_input_tables()
    for name in value:
        m = _INPUT.match(name)
        if not m or m.group(1) not in offered or (m.group(2) and m.group(1) not in fields):
            raise ConfigError(
                f"inputs.{key}: unknown input {name!r}; an input is one a source kind offers "
                f"({', '.join(offered)}) or a field of {' or '.join(fields)} "
                f"(e.g. requests.cached_tokens)",
                location=where,
            )
    return tuple(value)


def _notice_section(raw: Mapping[str, Any], role: str, where: str) -> NoticeSection:
    section = raw.get(role)
    if not isinstance(section, Mapping) or not {"title", "text"} <= set(section) <= _NOTICE_SECTION_KEYS:
        raise ConfigError(
            f"notice.{role} must be a mapping of title and text, optionally data and consequence", location=where
        )
    at = f"{where}: notice.{role}"
    return NoticeSection(
        _text(section, "title", at),
        _text(section, "text", at),
        _text(section, "data", at) if "data" in section else None,
        _text(section, "consequence", at) if "consequence" in section else None,
    )


def _notice(meta: Mapping[str, Any], where: str) -> Notice:
    raw = meta.get("notice")
    if (
        not isinstance(raw, Mapping)
        or not set(raw) <= {*_NOTICE_ROLES, "bases"}
        or not {"received", "exposed", "bases"} <= set(raw)
    ):
        raise ConfigError(
            "notice must be a mapping of received and exposed (each with title and text), optionally "
            "possible, and bases (each basis of its confirmed sources with what it means)",
            location=where,
        )
    bases = raw["bases"]
    if not isinstance(bases, Mapping) or not bases or not all(isinstance(b, str) and _BASIS.match(b) for b in bases):
        raise ConfigError(
            "notice.bases must map each basis (a lower-case name such as block_fingerprints) to what it means",
            location=where,
        )
    return Notice(
        received=_notice_section(raw, "received", where),
        exposed=_notice_section(raw, "exposed", where),
        possible=_notice_section(raw, "possible", where) if "possible" in raw else None,
        bases=tuple((b, _text(bases, b, f"{where}: notice.bases")) for b in bases),
    )


def read_mechanism(folder: Path) -> Mechanism:
    """The mechanism of *folder*, its ``mechanism.yml`` checked whole (a ConfigError names the file)."""
    path = folder / "mechanism.yml"
    where = str(path)
    meta = read_declaration(path, "mechanism", _KEYS)
    text = {k: _text(meta, k, where) for k in _TEXT_KEYS}
    if text["id"] != folder.name:
        raise ConfigError(f"id {text['id']!r} must be the folder's name {folder.name!r}", location=where)
    inputs = meta["inputs"]
    if not isinstance(inputs, Mapping) or not set(inputs) <= _INPUT_KEYS or "required" not in inputs:
        raise ConfigError(
            "inputs must be a mapping with required (and optionally any_of, strengthens), each a list of inputs",
            location=where,
        )
    checks = meta["audit_checks"]
    if not isinstance(checks, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in checks):
        raise ConfigError("audit_checks must be a list of audit check numbers, e.g. [6]", location=where)
    rules_dir = folder / "rules"
    rule_ids = tuple(sorted(p.stem for p in rules_dir.glob("*.yml"))) if rules_dir.is_dir() else ()
    return Mechanism(
        id=text["id"],
        title=text["title"],
        summary=text["summary"],
        explanation=text["explanation"],
        required=_inputs(inputs, "required", where),
        any_of=_inputs(inputs, "any_of", where),
        strengthens=_inputs(inputs, "strengthens", where),
        attribution=text["attribution"],
        audit_checks=tuple(checks),
        exploitation=text["exploitation"],
        notice=_notice(meta, where),
        path=folder,
        rule_ids=rule_ids,
    )


@cache
def load_mechanisms(directory: Path = MECHANISMS_DIR) -> tuple[Mechanism, ...]:
    """Every mechanism of *directory* (each sub-folder holding a ``mechanism.yml``), sorted by id."""
    return tuple(read_mechanism(p.parent) for p in sorted(directory.glob("*/mechanism.yml")))


def present_inputs(con: duckdb.DuckDBPyConnection, names: Iterable[str]) -> set[str]:
    """Which of the inputs *names* (validated by :func:`read_mechanism`) the evidence database holds.
    The inputs of a kind every incident needs (``requests``) are always present: an incident cannot be loaded
    without a source of it."""
    present = set()
    offered, fields, always = input_tables(), field_input_tables(), always_present()
    for name in set(names):
        kind, _, column = name.partition(".")
        if kind in always and not column:
            present.add(name)
            continue
        for table in (fields[kind],) if column else offered[kind]:
            has_column = (
                not column
                or one(
                    con,
                    "SELECT count(*) FROM information_schema.columns WHERE table_name = $t AND column_name = $c",
                    {"t": table, "c": column},
                )[0]
            )
            # identifiers: a table a source kind declares and a column that exists in it
            where = f'WHERE "{column}" IS NOT NULL' if column else ""
            if has_column and one(con, f'SELECT count(*) FROM (SELECT 1 FROM "{table}" {where} LIMIT 1)')[0]:
                present.add(name)
                break
    return present


@dataclass(frozen=True)
class Selection:
    """Whether an investigation runs a mechanism, and why."""

    mechanism: Mechanism
    named: bool  # the incident file names it
    selected: bool  # its rules run
    missing: tuple[str, ...]  # inputs it needs that the evidence lacks


def select(
    named: Sequence[str] | None, present: Iterable[str], mechanisms: Sequence[Mechanism] | None = None
) -> tuple[Selection, ...]:
    """Every mechanism with whether it runs: those *named* (missing inputs or not), or, when the incident
    file names none, every mechanism whose inputs are *present*."""
    have = set(present)
    out = []
    for m in mechanisms if mechanisms is not None else load_mechanisms():
        missing = m.missing(have)
        is_named = named is not None and m.id in named
        out.append(Selection(m, is_named, is_named if named is not None else not missing, missing))
    return tuple(out)
