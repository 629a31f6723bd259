"""Optional inputs of the audit: ``/get_server_info`` dumps and the deployment manifest.

* A ``/get_server_info`` JSON dump (:func:`read_server_info`): the raw dump, or
  ``{"instance": ..., "captured_at": "<ISO-8601>", "server_info": {...}}``. The instance is the
  ``instance`` key, else the file name through the instance template (with ``.json`` and a
  ``.server_info`` / ``_server_info`` / ``-server_info`` suffix removed). A dump applies to the
  start-up running at ``captured_at``, else to the instance's latest start-up
  (:func:`kvforensics.audit.startups.attach_server_info`).
* A deployment manifest, TOML or YAML (:func:`read_manifest`)::

      [load_balancer]
      name = "sgl-model-gateway"                          # optional, quoted in the verdicts
      abort_on_client_disconnect = "after_first_token"    # "never" | "after_first_token" | "always"

      [load_balancer.models."@cf/zai-org/glm-5.3"]        # optional, per gateway or engine model id
      abort_on_client_disconnect = "always"

      [load_balancer.instances."glm53-prefill-0"]         # optional, per instance (wins over models)
      abort_on_client_disconnect = "never"

  ``true`` / ``"before_first_token"`` mean ``"always"``; ``false`` means ``"never"``. The
  ``[prefix_cache]`` table (tenancy and who sets the cache salt, for check 6) is described in
  :mod:`kvforensics.config.tenancy`.

Unreadable or malformed inputs raise :class:`~kvforensics.core.errors.InputError` naming the file.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvforensics.config import Source
from kvforensics.config.tenancy import PrefixCachePolicy, read_prefix_cache
from kvforensics.core.errors import InputError
from kvforensics.sources.engine_logs.fields import flag_value

_LB_VALUES = ("never", "after_first_token", "always")


@dataclass(frozen=True)
class ServerInfo:
    """One SGLang ``/get_server_info`` dump: server args, version and scheduler limits."""

    file: str
    instance: str
    captured_at: datetime | None
    version: str | None
    args: dict[str, str]  # server args as flag strings (flag_value)
    max_total_num_tokens: int | None
    context_length: int | None
    lines: dict[str, int]  # key -> line of the key in the file (for evidence)

    def line_of(self, key: str) -> int | None:
        return self.lines.get(key)


def _json_key_lines(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        for key in re.findall(r'"([^"\\]+)"\s*:', line):
            out.setdefault(key, number)
    return out


def _server_info_instance(path: Path, template: str) -> str:
    name = re.sub(r"(?i)[._-]server_info(?=\.json$)", "", path.name)
    source = Source(
        name="server_info",
        kind="engine_log",
        path="",
        format="auto",
        timezone="UTC",
        base_dir=path.parent,
        instance=template,
    )
    return source.instance_for(path.with_name(name))


def read_server_info(path: str | Path, *, instance_template: str = "{stem}") -> ServerInfo:
    """Read a ``/get_server_info`` JSON dump (raw, or wrapped with ``instance`` / ``captured_at``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except OSError as e:
        raise InputError(f"cannot read server_info dump: {e.strerror or e}", location=str(path)) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(
            f"server_info dump is not JSON: {e}; save the body of GET /get_server_info", location=str(path)
        ) from e
    if not isinstance(data, dict):
        raise InputError("server_info dump must be a JSON object", location=str(path))
    instance = data.get("instance") if isinstance(data.get("instance"), str) else None
    captured = None
    if "captured_at" in data:
        try:
            captured = datetime.fromisoformat(str(data["captured_at"]))
        except ValueError as e:
            raise InputError(
                f"captured_at {data['captured_at']!r} is not an ISO-8601 timestamp", location=str(path)
            ) from e
        if captured.tzinfo is None:
            raise InputError("captured_at has no time zone; add 'Z' or an offset", location=str(path))
        captured = captured.astimezone(UTC)
    wrapped = data.get("server_info")
    body: dict[str, Any] = wrapped if isinstance(wrapped, dict) else data
    states = body.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}

    def number(key: str) -> int | None:
        for src in (body, state):
            value = src.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    args = {
        str(k): flag_value(v)
        for k, v in body.items()
        if not isinstance(v, dict | list) and k not in ("version", "instance", "captured_at")
    }
    version = body.get("version")
    return ServerInfo(
        file=str(path),
        instance=instance or _server_info_instance(path, instance_template),
        captured_at=captured,
        version=str(version) if version else None,
        args=args,
        max_total_num_tokens=number("max_total_num_tokens"),
        context_length=number("context_length") or number("context_len"),
        lines=_json_key_lines(text),
    )


@dataclass(frozen=True)
class LoadBalancerSetting:
    value: str | None  # never | after_first_token | always | None (not said)
    scope: str  # "load balancer", "model X", "instance X"
    line: int | None


@dataclass(frozen=True)
class DeploymentManifest:
    """A deployment manifest: the load balancer (schema in the module docstring) and the prefix cache."""

    file: str
    name: str | None
    default: LoadBalancerSetting | None  # None: no [load_balancer] table at all
    models: dict[str, LoadBalancerSetting] = field(default_factory=dict)
    instances: dict[str, LoadBalancerSetting] = field(default_factory=dict)
    prefix_cache: PrefixCachePolicy | None = None  # None: no [prefix_cache] table

    def setting_for(self, instance: str, models: Iterable[str | None]) -> LoadBalancerSetting | None:
        if instance in self.instances:
            return self.instances[instance]
        for m in models:
            if m is not None and m in self.models:
                return self.models[m]
        return self.default


def _lb_value(raw: object, where: str, file: str) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        return "always" if raw else "never"
    value = str(raw).strip().lower().replace("-", "_").replace(" ", "_")
    value = {"before_first_token": "always", "true": "always", "false": "never"}.get(value, value)
    if value not in _LB_VALUES:
        raise InputError(
            f"{where}.abort_on_client_disconnect = {raw!r}; use one of {', '.join(repr(v) for v in _LB_VALUES)}",
            location=file,
        )
    return value


def read_manifest(path: str | Path) -> DeploymentManifest:
    """Read a deployment manifest (TOML, or YAML for ``.yaml`` / ``.yml``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read deployment manifest: {e}", location=str(path)) from e
    data: object
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise InputError(f"manifest is not valid YAML: {e}", location=str(path)) from e
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise InputError(
                f"manifest is not valid TOML: {e} (YAML manifests need a .yaml name)", location=str(path)
            ) from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError("manifest must be a table / mapping at the top level", location=str(path))
    prefix_cache = read_prefix_cache(data, text, str(path))
    lb = data.get("load_balancer")
    if lb is None:
        return DeploymentManifest(file=str(path), name=None, default=None, prefix_cache=prefix_cache)
    if not isinstance(lb, dict):
        raise InputError("load_balancer must be a table / mapping", location=str(path))
    lines = text.splitlines()
    key = "abort_on_client_disconnect"

    def key_line(after: str | None) -> int | None:
        start = 0
        if after is not None:
            start = next((i for i, ln in enumerate(lines) if after in ln), len(lines))
        for i in range(start, len(lines)):
            if re.match(rf"\s*['\"]?{key}['\"]?\s*[:=]", lines[i]):
                return i + 1
        return None

    def overrides(kind: str) -> dict[str, LoadBalancerSetting]:
        table = lb.get(kind, {}) or {}
        if not isinstance(table, dict):
            raise InputError(f"load_balancer.{kind} must map names to tables", location=str(path))
        out = {}
        for name, entry in table.items():
            if not isinstance(entry, dict):
                raise InputError(f"load_balancer.{kind}.{name} must be a table", location=str(path))
            label = "model" if kind == "models" else "instance"
            out[str(name)] = LoadBalancerSetting(
                _lb_value(entry.get(key), f"load_balancer.{kind}.{name}", str(path)),
                f"{label} {name}",
                key_line(str(name)) if key in entry else None,
            )
        return out

    models, instances = overrides("models"), overrides("instances")
    claimed = {s.line for s in (*models.values(), *instances.values())}
    default_line = None
    if key in lb:
        default_line = next(
            (
                i + 1
                for i, ln in enumerate(lines)
                if i + 1 not in claimed and re.match(rf"\s*['\"]?{key}['\"]?\s*[:=]", ln)
            ),
            None,
        )
    name = lb.get("name")
    return DeploymentManifest(
        file=str(path),
        name=str(name) if name else None,
        default=LoadBalancerSetting(_lb_value(lb.get(key), "load_balancer", str(path)), "load balancer", default_line),
        models=models,
        instances=instances,
        prefix_cache=prefix_cache,
    )
