"""The detection rules as data: ``mechanisms/<mechanism>/rules/<id>.sql`` and ``<id>.yml`` read into :class:`Rule`.

Each rule belongs to the exposure mechanism whose folder holds it (:mod:`kvforensics.mechanisms`).
A rule is two files: ``<id>.sql`` returns ``request_id, strength, evidence`` for the requests it
flags, using named parameters (``$name``) declared with defaults in ``<id>.yml``, which also holds
its metadata and its own positive and negative test cases. The SQL is portable
(``kvforensics.engines.portable``): ``Rule.template`` is the file, ``Rule.sql`` its DuckDB rendering.
``detect`` runs them; the incident file's ``[rules.<id>]`` tables are checked against them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cache
from html import escape
from pathlib import Path
from typing import Any, Mapping

import yaml

from kvforensics.core.db import sql
from kvforensics.core.declarations import load_yaml
from kvforensics.core.errors import ConfigError
from kvforensics.engines.portable import EngineError, render
from kvforensics.mechanisms import MECHANISMS_DIR, load_mechanisms

_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    severity: str
    description: str
    sql: str  # the template rendered for DuckDB
    version: str
    parameters: Mapping[str, Any]
    parameter_docs: Mapping[str, str]
    references: tuple[str, ...] = ()
    false_positives: tuple[str, ...] = ()
    tests: tuple[Mapping[str, Any], ...] = ()
    needs_latency_model: bool = False
    meta: Mapping[str, Any] = field(default_factory=dict)
    template: str = ""  # the portable text of <id>.sql (helpers not yet expanded)
    mechanism: str = ""  # the id of the mechanism whose folder holds the rule

    def used_parameters(self) -> set[str]:
        return set(_PARAM.findall(re.sub(r"--[^\n]*", "", self.sql)))

    def _repr_html_(self) -> str:
        params = "".join(f"<li><code>{escape(k)}</code> = {escape(str(v))}</li>" for k, v in self.parameters.items())
        return (
            f"<b>{escape(self.id)}</b> ({escape(self.severity)}, version {escape(self.version)}): "
            f"{escape(self.title)}<ul>{params}</ul>"
        )


@cache
def load_rules(directory: Path = MECHANISMS_DIR) -> tuple[Rule, ...]:
    """Every rule of every mechanism under *directory*, sorted by id. *directory* may also be one
    mechanism's folder or a folder of rule files (its rules then belong to the mechanism of the folder
    above, if that has a ``mechanism.yml``)."""
    if any(directory.glob("*.yml")) and not (directory / "mechanism.yml").is_file():
        owner = directory.parent.name if (directory.parent / "mechanism.yml").is_file() else ""
        folders = [(directory, owner)]
    elif (directory / "mechanism.yml").is_file():
        folders = [(directory / "rules", directory.name)]
    else:
        folders = [(m.rules_dir, m.id) for m in load_mechanisms(directory)]
    rules: dict[str, Rule] = {}
    for folder, mechanism in folders:
        for yml in sorted(folder.glob("*.yml")):
            rule = _read_rule(yml, mechanism)
            if rule.id in rules:
                raise ConfigError(
                    f"rule id {rule.id!r} is used by two mechanisms ({rules[rule.id].mechanism} and "
                    f"{mechanism}): rename one",
                    location=str(yml),
                )
            rules[rule.id] = rule
    return tuple(sorted(rules.values(), key=lambda r: r.id))


_FRAGMENT_CALL = re.compile(r"\{\{\s*fragment\(\s*'([a-z_][a-z0-9_]*)'\s*\)\s*\}\}")


def rule_version(yml: Path, sql_path: Path) -> str:
    """The hash of a rule's two files and of every SQL fragment its query includes (by name, sorted), so
    that a finding's rule_version changes whenever the text its query ran changes."""
    raw = yml.read_bytes() + b"\0" + sql_path.read_bytes()
    for name in sorted(set(_FRAGMENT_CALL.findall(sql_path.read_text(encoding="utf-8")))):
        raw += b"\0" + sql(name).encode("utf-8")
    return hashlib.sha256(raw).hexdigest()[:12]


def _read_rule(yml: Path, mechanism: str) -> Rule:
    sql_path = yml.with_suffix(".sql")
    try:
        meta = load_yaml(yml.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"rule {yml.stem}: not valid YAML ({' '.join(str(e).split())[:200]})", location=str(yml)
        ) from None
    if not isinstance(meta, Mapping):
        raise ConfigError(f"rule {yml.stem}: the file must be a mapping (id, title, severity ...)", location=str(yml))
    if meta.get("id") != yml.stem:
        raise ConfigError(
            f"rule {yml.stem}: id {meta.get('id')!r} must be the file's name {yml.stem!r}", location=str(yml)
        )
    if not sql_path.exists():
        raise ConfigError(f"rule {yml.stem} has no {sql_path.name}", location=str(yml))
    text = sql_path.read_text(encoding="utf-8")
    try:
        duckdb_sql = render(text, "duckdb")
    except EngineError as e:
        raise ConfigError(f"rule {yml.stem}: {e}", location=str(sql_path)) from None
    version = rule_version(yml, sql_path)
    params = meta.get("parameters") or {}
    return Rule(
        id=str(meta["id"]),
        title=str(meta.get("title", "")),
        severity=str(meta.get("severity", "")),
        description=str(meta.get("description", "")).strip(),
        sql=duckdb_sql,
        version=version,
        parameters={k: v.get("default") for k, v in params.items()},
        parameter_docs={k: str(v.get("description", "")) for k, v in params.items()},
        references=tuple(meta.get("references") or ()),
        false_positives=tuple(meta.get("false_positives") or ()),
        tests=tuple(meta.get("tests") or ()),
        needs_latency_model="latency_model" in text,
        meta=meta,
        template=text,
        mechanism=mechanism,
    )


def rule_parameters(rule: Rule, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    params = dict(rule.parameters)
    for k, v in (overrides or {}).items():
        if k not in params:
            raise ConfigError(
                f"rule '{rule.id}' has no parameter '{k}'; it has {sorted(params)}", location=f"[rules.{rule.id}]"
            )
        params[k] = v
    return params
