"""The detection rules as data: ``rules/<id>.sql`` and ``rules/<id>.yml`` read into :class:`Rule`.

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

from kvforensics.engines.portable import EngineError, render
from kvforensics.errors import ConfigError

RULES_DIR = Path(__file__).parent / "rules"
_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Rule:
    id: str
    title: str
    severity: str
    description: str
    sql: str                     # the template rendered for DuckDB
    version: str
    parameters: Mapping[str, Any]
    parameter_docs: Mapping[str, str]
    references: tuple[str, ...] = ()
    false_positives: tuple[str, ...] = ()
    tests: tuple[Mapping[str, Any], ...] = ()
    needs_latency_model: bool = False
    meta: Mapping[str, Any] = field(default_factory=dict)
    template: str = ""           # the portable text of <id>.sql (helpers not yet expanded)

    def used_parameters(self) -> set[str]:
        return set(_PARAM.findall(re.sub(r"--[^\n]*", "", self.sql)))

    def _repr_html_(self) -> str:
        params = "".join(f"<li><code>{escape(k)}</code> = {escape(str(v))}</li>" for k, v in self.parameters.items())
        return (f"<b>{escape(self.id)}</b> ({escape(self.severity)}, version {escape(self.version)}): "
                f"{escape(self.title)}<ul>{params}</ul>")


@cache
def load_rules(directory: Path = RULES_DIR) -> tuple[Rule, ...]:
    """Every rule in the directory, sorted by id."""
    rules = []
    for yml in sorted(directory.glob("*.yml")):
        sql_path = yml.with_suffix(".sql")
        meta = yaml.safe_load(yml.read_text(encoding="utf-8")) or {}
        if not sql_path.exists():
            raise ConfigError(f"rule {yml.stem} has no {sql_path.name}", location=str(yml))
        text = sql_path.read_text(encoding="utf-8")
        try:
            duckdb_sql = render(text, "duckdb")
        except EngineError as e:
            raise ConfigError(f"rule {yml.stem}: {e}", location=str(sql_path)) from None
        version = hashlib.sha256(yml.read_bytes() + b"\0" + sql_path.read_bytes()).hexdigest()[:12]
        params = meta.get("parameters") or {}
        rules.append(Rule(
            id=str(meta.get("id", "")), title=str(meta.get("title", "")), severity=str(meta.get("severity", "")),
            description=str(meta.get("description", "")).strip(), sql=duckdb_sql, version=version,
            parameters={k: v.get("default") for k, v in params.items()},
            parameter_docs={k: str(v.get("description", "")) for k, v in params.items()},
            references=tuple(meta.get("references") or ()), false_positives=tuple(meta.get("false_positives") or ()),
            tests=tuple(meta.get("tests") or ()), needs_latency_model="latency_model" in text, meta=meta,
            template=text,
        ))
    return tuple(sorted(rules, key=lambda r: r.id))


def rule_parameters(rule: Rule, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    params = dict(rule.parameters)
    for k, v in (overrides or {}).items():
        if k not in params:
            raise ConfigError(f"rule '{rule.id}' has no parameter '{k}'; it has {sorted(params)}",
                              location=f"[rules.{rule.id}]")
        params[k] = v
    return params
