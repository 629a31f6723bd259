"""Deployment exposure audit: the five checks operators were told to make, per instance and start-up.

Every start-up of every engine instance is one configuration interval, from its first line until it
ended by the ingest's rule (:func:`kvforensics.instances.lifetimes`, so the audit and the evidence
database's ``capacity`` table agree): its own shutdown lines (``shutdown``), the next start-up of the
same instance (``next_startup``), or the end of its log when a successor of the same model and role
took over on another instance (``log_end``: a pod replaced in a rollout). A log that merely stops,
with no successor, leaves the start-up **in force**. Each verdict says how its start-up ended and on
which line (``end_reason``, ``end_file``, ``end_line``).

For each interval the audit gives five verdicts, each ``pass`` / ``fail`` / ``unknown`` /
``not_applicable`` with a sentence and the file and line it rests on. **Missing evidence is never a
pass**: a setting the log does not show is ``unknown``.

1. **KV pool vs context length** (every role). SGLang's scheduler refuses a prompt of ``n`` tokens
   when ``n >= max_req_input_len = min(context_len - 1, max_total_num_tokens - 1) - 5``; the
   tokenizer's context check refuses ``n >= context_len`` (HTTP 400). With a pool smaller than the
   context, prompts of ``pool - 6 .. context - 1`` tokens pass the context check and are aborted by
   the scheduler, which on the disaggregated path (before 0.5.22) still hands them to decode: the
   response is served from stale KV pages. ``fail`` when ``pool < context``; the largest safe
   context length is the pool itself (``--context-length <= pool``): from there down the pool no
   longer lowers the limit and the engine behaves as with an unlimited pool. (Any SGLang build
   leaves prompts within 6 tokens of the context length to the scheduler rather than the context
   check; only the engine fix, check 2, makes that refusal safe on the PD path.) vLLM refuses to
   start when the pool cannot hold ``max_model_len``: such a start-up served nothing
   (``not_applicable``); ``pool >= max_model_len`` passes. Scheduler aborts in the log whose limit
   contradicts the pool and context read turn a pass into ``unknown`` (the readings are in doubt).
2. **Engine version** vs the first release with the complete PD reject-path fix (SGLang 0.5.22),
   from the log, a ``/get_server_info`` dump, or the format-inferred range (the detail says which).
   A range whose upper bound is below 0.5.22 fails; one that straddles it is ``unknown``. Only
   disaggregated roles need the fix (unified: ``not_applicable``, the version is still reported).
3. **Deferred KV release and a capped Mooncake transfer batch** (disaggregated SGLang), from the
   server args: a flag whose name holds ``defer`` and ``release``
   (``disaggregation_defer_kv_release``) must be on; one holding ``mooncake``/``transfer`` and
   ``batch``/``max`` (``disaggregation_mooncake_transfer_batch_size``) must be a positive number.
   An absent or ``None`` setting is ``unknown`` (the engine default is not in the log).
4. **KV checksum / canary** (``disaggregation_enable_kv_checksum``, ``kv_canary`` not ``none``)
   and evidence that requests are verified. Checksum mismatches, canary violations or context
   corruption in the interval fail (any role). Detection off fails when the logged options are
   all off (an option missing from a ``server_args`` dump does not exist in that build); neither
   option logged is ``unknown``. Detection on but no verification in the log is ``unknown``:
   SGLang logs failures only, so a quiet log does not show that anything is checked.
5. **Load balancer does not abort before the first token on client disconnect**, from the
   deployment manifest only (``unknown`` without one). Disaggregated roles only.

A check-1 ``fail`` is **exposed** on a prefill or decode role, or where the role is unknown (no
``server_args`` line and nothing else to tell): the deploy gate fails closed. A unified server
answers those prompts with an error, so its check-1 fail is listed but not exposed. **Exposed now**
(:attr:`AuditReport.exposed_now`, :meth:`AuditReport.now`) counts only exposed start-ups still in
force; one that shut down, restarted or was retired is listed with its window and how it ended.
A restart that logs no ``server_args`` takes the role (and model) of the instance's previous
start-up, or the ``disaggregation_mode`` of a ``server_info`` dump, and the verdict says so; with
neither, checks 2-5 turn a would-be ``fail`` into ``unknown`` (it only matters if the instance is
disaggregated). :attr:`AuditReport.exit_code` is 1 when anything is exposed in the audited period
(now or before), 0 when clean (unknowns alone do not fail; they are listed) and 2 when nothing
could be audited; unreadable inputs raise :class:`~kvforensics.errors.InputError` (the CLI exits 2).

Inputs
------
* engine logs (SGLang or vLLM, any version the loaders read), or an evidence database's
  ``capacity`` and ``engine_events`` tables (:func:`audit_database`; evidence lines there are the
  start-up's first line where the database does not keep the exact line). An event belongs to
  the last start-up before it in its file, else (a rotated file) to the start-up running at its
  time;
* optional ``/get_server_info`` JSON dumps (:func:`read_server_info`): the raw dump, or
  ``{"instance": ..., "captured_at": "<ISO-8601>", "server_info": {...}}``. The instance is the
  ``instance`` key, else the file name through the instance template (with ``.json`` and a
  ``.server_info`` / ``_server_info`` / ``-server_info`` suffix removed). A dump applies to the
  start-up running at ``captured_at``, else to the instance's latest start-up;
* an optional deployment manifest, TOML or YAML (:func:`read_manifest`)::

      [load_balancer]
      name = "sgl-model-gateway"                          # optional, quoted in the verdicts
      abort_on_client_disconnect = "after_first_token"    # "never" | "after_first_token" | "always"

      [load_balancer.models."@cf/zai-org/glm-5.3"]        # optional, per gateway or engine model id
      abort_on_client_disconnect = "always"

      [load_balancer.instances."glm53-prefill-0"]         # optional, per instance (wins over models)
      abort_on_client_disconnect = "never"

  ``true`` / ``"before_first_token"`` mean ``"always"``; ``false`` means ``"never"``. ``"never"``
  and ``"after_first_token"`` pass, ``"always"`` fails, a missing key is ``unknown``.
"""

from __future__ import annotations

import html
import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from packaging.version import InvalidVersion, Version

from kvforensics.errors import InputError
from kvforensics.instances import DEFAULT_HANDOVER_S, PlacedStartup, lifetimes
from kvforensics.loaders.engine_common import EngineEvent, EngineLogParse, StartupRecord, flag_value

if TYPE_CHECKING:
    import duckdb
    import pandas as pd
    from rich.console import Console

    from kvforensics.config import Incident

__all__ = [
    "CHECKS",
    "SGLANG_FIXED_VERSION",
    "AuditReport",
    "DeploymentManifest",
    "ExposureWindow",
    "ServerInfo",
    "Verdict",
    "audit_database",
    "audit_incident",
    "audit_parses",
    "audit_paths",
    "audit_startups",
    "read_manifest",
    "read_server_info",
]

CHECKS: dict[int, str] = {
    1: "KV pool vs context length",
    2: "engine version (PD reject-path fix)",
    3: "deferred KV release and capped Mooncake transfer batch",
    4: "KV checksum / canary verification",
    5: "load balancer abort on client disconnect",
}
STATUSES = ("pass", "fail", "unknown", "not_applicable")
SGLANG_FIXED_VERSION = Version("0.5.22")
PD_ROLES = ("prefill", "decode")
#: Engine event kinds the audit reads ("scheduler_abort" is an abort_input_too_long line carrying
#: the scheduler's "maximum allowed length").
AUDIT_EVENT_KINDS = (
    "abort_input_too_long",
    "input_truncated",
    "checksum_mismatch",
    "canary_violation",
    "context_corruption",
)
_CORRUPTION_KINDS = ("checksum_mismatch", "canary_violation", "context_corruption")
_LB_VALUES = ("never", "after_first_token", "always")
_ON = ("true", "1", "yes", "on")
_OFF = ("false", "0", "no", "off", "none", "")


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """One check on one start-up (configuration interval) of one engine instance."""

    instance: str
    role: str  # prefill | decode | unified | unknown
    model: str | None
    startup_from: datetime | None  # UTC; None when the start-up carries no timestamp
    startup_to: datetime | None  # when it ended (see end_reason); None while still in force
    check: int  # 1..5, see CHECKS
    check_name: str
    status: str  # pass | fail | unknown | not_applicable
    exposed: bool
    detail: str
    evidence_file: str | None
    evidence_line: int | None
    engine: str | None = None
    engine_version: str | None = None
    startup_file: str | None = None  # where the start-up begins (identifies it when it has no timestamp)
    startup_line: int | None = None
    end_reason: str | None = None  # shutdown | next_startup | log_end | None (in force), as in capacity
    end_file: str | None = None  # the evidence of the end: shutdown line, next start-up, last line
    end_line: int | None = None
    successor: str | None = None  # log_end: the instance that took over

    @property
    def in_force(self) -> bool:
        """Still running when the evidence ends: the log shows no end."""
        return self.end_reason is None and self.startup_to is None


@dataclass(frozen=True)
class ExposureWindow:
    """A start-up whose check 1 failed on a role that serves beyond its pool."""

    instance: str
    role: str
    model: str | None
    start: datetime | None
    end: datetime | None
    detail: str
    evidence_file: str | None
    evidence_line: int | None
    end_reason: str | None = None
    end_file: str | None = None
    end_line: int | None = None
    successor: str | None = None
    in_force: bool = False


_STATUS_LABEL = {"pass": "pass", "fail": "FAIL", "unknown": "unknown", "not_applicable": "n/a"}
_COLUMNS = (
    "instance",
    "role",
    "model",
    "startup_from",
    "startup_to",
    "check",
    "check_name",
    "status",
    "exposed",
    "detail",
    "evidence_file",
    "evidence_line",
    "engine",
    "engine_version",
    "startup_file",
    "startup_line",
    "end_reason",
    "end_file",
    "end_line",
    "successor",
)
_TABLE_HEAD = (
    "Instance", "Role", "Model", "Start-up (UTC)", "Check", "Status", "Detail", "Evidence", "Ended"
)
_END_SUMMARY = {"shutdown": "shut down", "next_startup": "restarted", "log_end": "replaced by a successor"}


@dataclass
class AuditReport:
    """All verdicts of one audit, with the notes a reader needs (parser warnings, assumptions)."""

    verdicts: list[Verdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)

    @property
    def exposed(self) -> bool:
        return any(v.exposed for v in self.verdicts)

    @property
    def exposed_now(self) -> bool:
        """Exposed by a start-up still in force (not shut down, restarted or retired)."""
        return any(w.in_force for w in self.exposure_windows)

    @property
    def exit_code(self) -> int:
        """1 exposed, 0 clean (unknowns alone do not fail), 2 nothing could be audited."""
        if not self.verdicts:
            return 2
        return 1 if self.exposed else 0

    @property
    def startups(self) -> int:
        return len({(v.instance, v.startup_file, v.startup_line, v.startup_from) for v in self.verdicts})

    def by_status(self, status: str) -> list[Verdict]:
        return [v for v in self.verdicts if v.status == status]

    @property
    def exposure_windows(self) -> list[ExposureWindow]:
        return [
            ExposureWindow(
                v.instance,
                v.role,
                v.model,
                v.startup_from,
                v.startup_to,
                v.detail,
                v.evidence_file,
                v.evidence_line,
                v.end_reason,
                v.end_file,
                v.end_line,
                v.successor,
                v.in_force,
            )
            for v in self.verdicts
            if v.exposed
        ]

    def summary(self) -> dict[str, Any]:
        counts = {s: len(self.by_status(s)) for s in STATUSES}
        return {
            "exposed": self.exposed,
            "exit_code": self.exit_code,
            "startups": self.startups,
            "instances": len({v.instance for v in self.verdicts}),
            "exposed_startups": len(self.exposure_windows),
            "verdicts": counts,
        }

    # -- presenters -------------------------------------------------------------------------

    def to_records(self) -> list[dict[str, Any]]:
        return [asdict(v) for v in self.verdicts]

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd

        frame = pd.DataFrame(self.to_records(), columns=list(_COLUMNS))
        for col in ("startup_from", "startup_to"):
            frame[col] = pd.to_datetime(frame[col], utc=True)
        frame["evidence_line"] = frame["evidence_line"].astype("Int64")
        return frame

    def to_json(self, indent: int | None = 2) -> str:
        doc = {
            "summary": self.summary(),
            "checks": {str(k): v for k, v in CHECKS.items()},
            "verdicts": [
                {k: _iso(v) if isinstance(v, datetime) else v for k, v in r.items()}
                for r in self.to_records()
            ],
            "exposure_windows": [
                {k: _iso(v) if isinstance(v, datetime) else v for k, v in asdict(w).items()}
                for w in self.exposure_windows
            ],
            "now": {
                "exposed": self.exposed_now,
                "exposed_startups": sum(w.in_force for w in self.exposure_windows),
                "answer": self.now(),
            },
            "notes": self.notes,
            "inputs": self.inputs,
        }
        return json.dumps(doc, indent=indent, ensure_ascii=False)

    def headline(self) -> str:
        s = self.summary()
        if self.exit_code == 2:
            return "Nothing audited: no engine start-up found in the inputs."
        c = s["verdicts"]
        state = (
            f"EXPOSED: {s['exposed_startups']} start-up(s) serve prompts beyond their KV pool"
            if self.exposed
            else "Not exposed"
        )
        return (
            f"{state}. {s['startups']} start-up(s) of {s['instances']} instance(s): {c['pass']} pass, "
            f"{c['fail']} fail, {c['unknown']} unknown, {c['not_applicable']} not applicable."
        )

    def now(self) -> str:
        """Is any deployment exposed now? Only exposed start-ups still in force count."""
        windows = self.exposure_windows
        live = sorted({w.instance for w in windows if w.in_force})
        if live:
            return (
                f"EXPOSED NOW: {sum(w.in_force for w in windows)} start-up(s) still in force serve prompts "
                f"beyond their KV pool ({', '.join(live)})."
            )
        if not windows:
            return "Not exposed now: no start-up serves prompts beyond its KV pool."
        ended: dict[str, int] = {}
        for w in windows:
            how = _END_SUMMARY.get(w.end_reason or "", "ended")
            ended[how] = ended.get(how, 0) + 1
        how_ended = ", ".join(f"{n} {how}" for how, n in ended.items())
        return f"Not exposed now: every exposed start-up has ended ({how_ended})."

    def to_markdown(self) -> str:
        lines = [
            f"**{_md(self.headline())}**",
            "",
            *([f"**{_md(self.now())}**", ""] if self.verdicts else []),
            "| " + " | ".join(_TABLE_HEAD) + " |",
            "|---" * len(_TABLE_HEAD) + "|",
        ]
        for v in self.verdicts:
            status = _STATUS_LABEL[v.status] + (" (exposed)" if v.exposed else "")
            lines.append(
                "| "
                + " | ".join(
                    _md(x)
                    for x in (
                        v.instance,
                        v.role,
                        v.model or "",
                        _interval(v),
                        f"{v.check}. {v.check_name}",
                        status,
                        v.detail,
                        _evidence(v),
                        _ended(v),
                    )
                )
                + " |"
            )
        if self.notes:
            lines += ["", "Notes:", ""] + [f"- {_md(n)}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def _repr_html_(self) -> str:
        e = html.escape
        colour = {"pass": "#1a7f37", "fail": "#cf222e", "unknown": "#9a6700", "not_applicable": "#57606a"}
        rows = []
        for v in self.verdicts:
            status = _STATUS_LABEL[v.status] + (" (exposed)" if v.exposed else "")
            weight = "font-weight:bold;" if v.status == "fail" else ""
            rows.append(
                "<tr>"
                + "".join(f"<td>{e(x)}</td>" for x in (v.instance, v.role, v.model or "", _interval(v)))
                + f"<td>{v.check}. {e(v.check_name)}</td>"
                + f'<td style="color:{colour[v.status]};{weight}">{e(status)}</td>'
                + f"<td>{e(v.detail)}</td><td><code>{e(_evidence(v))}</code></td><td>{e(_ended(v))}</td></tr>"
            )
        notes = (
            (
                "<details><summary>Notes</summary><ul>"
                + "".join(f"<li>{e(n)}</li>" for n in self.notes)
                + "</ul></details>"
            )
            if self.notes
            else ""
        )
        head = "".join(f"<th>{h}</th>" for h in _TABLE_HEAD)
        now = f"<p><strong>{e(self.now())}</strong></p>" if self.verdicts else ""
        return (
            f'<div class="kvf-audit"><p><strong>{e(self.headline())}</strong></p>{now}'
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{notes}</div>"
        )

    def render_terminal(self, console: Console) -> None:
        from rich.table import Table
        from rich.text import Text

        style = {"pass": "green", "fail": "bold red", "unknown": "yellow", "not_applicable": "dim"}
        table = Table(title="Deployment exposure audit", show_lines=False, expand=False)
        for name in _TABLE_HEAD:
            table.add_column(name, overflow="fold")
        for v in self.verdicts:
            status = _STATUS_LABEL[v.status] + (" (exposed)" if v.exposed else "")
            table.add_row(
                Text(v.instance),
                Text(v.role),
                Text(v.model or ""),
                Text(_interval(v)),
                Text(f"{v.check}. {v.check_name}"),
                Text(status, style=style[v.status]),
                Text(v.detail),
                Text(_evidence(v)),
                Text(_ended(v)),
            )
        console.print(table)
        console.print(Text(self.headline(), style="bold red" if self.exposed else "bold"))
        if self.verdicts:
            console.print(Text(self.now(), style="bold red" if self.exposed_now else "bold"))
        for n in self.notes:
            console.print(Text(f"note: {n}", style="dim"))


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _short_ts(ts: datetime | None) -> str:
    return "?" if ts is None else ts.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def _interval(v: Verdict) -> str:
    end = "running" if v.in_force else _short_ts(v.startup_to)
    return f"{_short_ts(v.startup_from)} \u2192 {end}"


def _ended(v: Verdict) -> str:
    """How the start-up ended, with the line that shows it."""
    if v.in_force:
        return "in force: the log shows no end"
    at = f" ({_loc(v.end_file, v.end_line)})" if v.end_file is not None else ""
    if v.end_reason == "next_startup":
        return f"next start-up{at}"
    if v.end_reason == "shutdown":
        return f"shut down{at}"
    if v.end_reason == "log_end":
        return f"retired: its log ends{at} and '{v.successor}' took over"
    return "ended (the evidence database does not say how)"


def _evidence(v: Verdict) -> str:
    if v.evidence_file is None:
        return ""
    name = Path(v.evidence_file).name
    return f"{name}:{v.evidence_line}" if v.evidence_line is not None else name


def _md(text: str) -> str:
    from kvforensics.escaping import markdown_text

    return markdown_text(text)


# ---------------------------------------------------------------------------------------------
# Optional inputs: /get_server_info dumps and the deployment manifest
# ---------------------------------------------------------------------------------------------


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
    from kvforensics.config import Source

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
    """The load-balancer part of a deployment manifest (schema in the module docstring)."""

    file: str
    name: str | None
    default: LoadBalancerSetting | None  # None: no [load_balancer] table at all
    models: dict[str, LoadBalancerSetting] = field(default_factory=dict)
    instances: dict[str, LoadBalancerSetting] = field(default_factory=dict)

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
            f"{where}.abort_on_client_disconnect = {raw!r}; use one of "
            f"{', '.join(repr(v) for v in _LB_VALUES)}",
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
    lb = data.get("load_balancer")
    if lb is None:
        return DeploymentManifest(file=str(path), name=None, default=None)
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
        default=LoadBalancerSetting(
            _lb_value(lb.get(key), "load_balancer", str(path)), "load balancer", default_line
        ),
        models=models,
        instances=instances,
    )


# ---------------------------------------------------------------------------------------------
# The normalised start-up the checks judge (from parsed logs or from the evidence database)
# ---------------------------------------------------------------------------------------------


@dataclass
class _EventStat:
    count: int
    first_file: str | None
    first_line: int | None
    min_limit: int | None
    max_limit: int | None


@dataclass
class _Startup:
    instance: str
    file: str | None
    line: int | None
    ts: datetime | None
    engine: str
    version: str | None
    version_source: str | None
    role: str
    model: str | None
    engine_model: str | None
    pool: int | None
    pool_line: int | None
    context: int | None
    dp_size: int | None
    flags: dict[str, str]
    evidence: dict[str, int]
    refused: bool = False
    pool_file: str | None = None  # where the pool comes from when not this start-up's log
    to: datetime | None = None  # valid_to: when it ended (kvforensics/instances.py)
    end_reason: str | None = None
    end_file: str | None = None
    end_line: int | None = None
    successor: str | None = None
    last_ts: datetime | None = None  # how far its log goes, and its own shutdown line (parsed logs only)
    last_line: int | None = None
    shutdown_ts: datetime | None = None
    shutdown_line: int | None = None
    role_certain: bool = True
    role_note: str | None = None
    server_info: ServerInfo | None = None
    events: dict[str, _EventStat] = field(default_factory=dict)

    def where(self, key: str | None = None) -> tuple[str | None, int | None]:
        """(file, line) of the evidence for *key*, else of the start-up itself."""
        if key is not None and key in self.evidence:
            return self.file, self.evidence[key]
        return self.file, self.line

    @property
    def pd(self) -> bool | None:
        """True for prefill/decode, False for a unified server, None when the role is unknown."""
        if not self.role_certain:
            return None
        return self.role in PD_ROLES


def _from_record(r: StartupRecord, file: str | None, aliases: Mapping[str, str]) -> _Startup:
    flags = dict(r.flags)
    role_source = flags.get("role_source", "")
    return _Startup(
        instance=r.instance,
        file=file,
        line=r.line,
        ts=r.ts,
        engine=r.engine,
        version=r.engine_version,
        version_source=r.version_source,
        role=r.role,
        model=_alias(r.model, aliases),
        engine_model=r.model,
        pool=r.kv_pool_tokens,
        pool_line=r.pool_source_line,
        context=r.context_length,
        dp_size=r.dp_size,
        flags=flags,
        evidence=dict(r.evidence),
        refused=flags.get("startup_refused", "").lower() == "true",
        last_ts=r.last_ts,
        last_line=r.last_line,
        shutdown_ts=r.shutdown_ts,
        shutdown_line=r.shutdown_line,
        role_certain=not role_source.startswith("default"),
    )


def _alias(model: str | None, aliases: Mapping[str, str]) -> str | None:
    if model is None:
        return None
    if model in aliases:
        return aliases[model]
    lowered = {k.lower(): v for k, v in aliases.items()}
    return lowered.get(model.lower(), model)


def _event_kind(kind: str, detail: str) -> str:
    if kind == "abort_input_too_long" and "maximum allowed length" in detail:
        return "scheduler_abort"
    return kind


def _add_event(s: _Startup, kind: str, file: str | None, line: int | None, limit: int | None) -> None:
    stat = s.events.get(kind)
    if stat is None:
        s.events[kind] = _EventStat(1, file, line, limit, limit)
        return
    stat.count += 1
    if limit is not None:
        stat.min_limit = limit if stat.min_limit is None else min(stat.min_limit, limit)
        stat.max_limit = limit if stat.max_limit is None else max(stat.max_limit, limit)


def _sort_key(s: _Startup) -> tuple[Any, ...]:
    return (s.instance, s.ts is None, s.ts or datetime.min.replace(tzinfo=UTC), s.file or "", s.line or 0)


def _end_lifetimes(startups: list[_Startup], handover_s: float) -> None:
    """End each start-up as the ingest does (shutdown, next start-up, or retired when a successor took
    over), with the role and model the parse gave, so that the audit agrees with ``capacity``."""
    placed = [
        PlacedStartup(
            instance=s.instance,
            role=s.role,
            model=s.model,
            ts=s.ts,
            file=s.file or "",
            line=s.line or 0,
            last_ts=s.last_ts,
            last_line=s.last_line,
            shutdown_ts=s.shutdown_ts,
            shutdown_line=s.shutdown_line,
        )
        for s in startups
    ]
    for s, end in zip(startups, lifetimes(placed, handover_s), strict=True):
        s.to, s.end_reason, s.end_file, s.end_line, s.successor = (
            end.valid_to,
            end.end_reason,
            end.end_file or None,
            end.end_line,
            end.successor,
        )


def _link(startups: list[_Startup]) -> None:
    """Order start-ups per instance and carry a role over a bare restart."""
    startups.sort(key=_sort_key)
    for i, s in enumerate(startups):
        if not s.role_certain:
            prev = next(
                (p for p in reversed(startups[:i]) if p.instance == s.instance and p.role_certain), None
            )
            if prev is not None:
                s.role, s.role_certain = prev.role, True
                what = "role"
                if s.model is None and prev.model is not None:
                    s.model, s.engine_model = prev.model, prev.engine_model
                    what = "role and model"
                s.role_note = (
                    f"{what} assumed from the previous start-up ({_loc(prev.file, prev.line)}): this "
                    "one logged no server_args"
                )


def _assign_events(startups: list[_Startup], events: Iterable[tuple[str | None, EngineEvent]]) -> int:
    """Give each event to its start-up: same file and after its first line, else by time."""
    by_file: dict[tuple[str, str | None], list[_Startup]] = {}
    by_instance: dict[str, list[_Startup]] = {}
    for s in startups:
        by_file.setdefault((s.instance, s.file), []).append(s)
        by_instance.setdefault(s.instance, []).append(s)
    for group in by_file.values():
        group.sort(key=lambda x: x.line or 0)
    lost = 0
    for file, e in events:
        kind = _event_kind(e.kind, e.detail)
        if e.kind not in AUDIT_EVENT_KINDS:
            continue
        target = None
        for s in by_file.get((e.instance, file), []):
            if (s.line or 0) <= e.line:
                target = s
        if target is None and e.ts is not None:
            for s in by_instance.get(e.instance, []):
                if s.ts is not None and s.ts <= e.ts and (s.to is None or e.ts < s.to):
                    target = s
        if target is None:
            lost += 1
            continue
        _add_event(target, kind, file, e.line, e.limit_tokens)
    return lost


def _attach_server_info(startups: list[_Startup], infos: Sequence[ServerInfo], notes: list[str]) -> None:
    for info in infos:
        mine = [s for s in startups if s.instance == info.instance]
        if not mine:
            notes.append(
                f"{info.file}: server_info for instance '{info.instance}', which has no start-up in "
                "the engine logs; not used"
            )
            continue
        target = mine[-1]
        if info.captured_at is not None:
            hits = [
                s
                for s in mine
                if s.ts is not None and s.ts <= info.captured_at and (s.to is None or info.captured_at < s.to)
            ]
            if not hits:
                notes.append(
                    f"{info.file}: captured at {_iso(info.captured_at)}, when no logged start-up of "
                    f"'{info.instance}' was running; not used"
                )
                continue
            target = hits[-1]
        target.server_info = info
        if not target.role_certain and "disaggregation_mode" in info.args:
            mode = info.args["disaggregation_mode"]
            target.role = mode if mode in PD_ROLES else "unified"
            target.role_certain = True
            target.role_note = f"role from {Path(info.file).name} (disaggregation_mode={mode})"
        reported = info.max_total_num_tokens
        if reported is not None and (target.pool is None or reported < target.pool):
            if target.pool is not None:
                target.flags["kv_pool_log_tokens"] = str(target.pool)
            target.pool, target.pool_file, target.pool_line = (
                reported,
                info.file,
                info.line_of("max_total_num_tokens"),
            )
            target.flags["kv_pool_source"] = f"server_info {Path(info.file).name}" + (
                f", smaller than the {_n(int(target.flags['kv_pool_log_tokens']))} in the log"
                if "kv_pool_log_tokens" in target.flags
                else ""
            )


# ---------------------------------------------------------------------------------------------
# The five checks
# ---------------------------------------------------------------------------------------------

_Judged = tuple[str, str, str | None, int | None]  # status, detail, evidence file, evidence line


def _n(x: int) -> str:
    return f"{x:,}"


def _loc(file: str | None, line: int | None) -> str:
    name = Path(file).name if file else "?"
    return f"{name}:{line}" if line is not None else name


def _pool_notes(s: _Startup) -> str:
    parts = []
    if s.dp_size is not None and s.dp_size > 1:
        parts.append(f"per DP replica, dp_size={s.dp_size}")
    kind = s.flags.get("kv_pool_kind", "")
    full = _int(s.flags.get("swa_full_layer_tokens"))
    if kind.startswith("hybrid"):
        if full is not None and s.pool is not None and full != s.pool:
            parts.append(
                f"hybrid SWA pool: full-attention layers {_n(full)} tokens, the smallest KV "
                f"allocation logged ({_n(s.pool)}) is used"
            )
        else:
            parts.append("hybrid SWA pool; the full-attention layers bound one request")
    elif kind:
        parts.append(kind)
    if s.flags.get("kv_pool_resized_after_capture") == "true":
        parts.append("after the post-capture resize")
    source = s.flags.get("kv_pool_source", "")
    if source.startswith(("implied", "server_info", "estimated")):
        parts.append(source)
    return f" ({'; '.join(parts)})" if parts else ""


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(str(value).replace(",", ""))
    except ValueError:
        return None


def _check_pool(s: _Startup) -> tuple[str, str, str | None, int | None, bool]:
    """Check 1; returns (status, detail, file, line, exposed)."""
    pool_at = (s.pool_file or s.file, s.pool_line) if s.pool_line is not None else s.where("kv_pool_tokens")
    note = f" [{s.role_note}]" if s.role_note else ""
    if s.engine == "vllm" and s.refused:
        est = s.flags.get("estimated_max_model_len")
        why = (
            f" (estimated maximum model length {_n(int(est))})"
            if est and est.isdigit()
            else f" (it holds {_n(s.pool)} tokens)"
            if s.pool is not None
            else ""
        )
        file, line = s.where("startup_refused")
        held = f"max_model_len {_n(s.context)}" if s.context is not None else "max_model_len"
        return (
            "not_applicable",
            (f"vLLM refused to start: the KV cache cannot hold {held}{why}; this start-up served nothing"),
            file,
            line,
            False,
        )
    if s.pool is None or s.context is None:
        missing = " and ".join(
            x for x, v in (("KV pool size", s.pool), ("context length", s.context)) if v is None
        )
        file, line = s.where()
        return (
            "unknown",
            f"no {missing} in this start-up's log: pool vs context cannot be checked{note}",
            file,
            line,
            False,
        )
    pool, ctx = s.pool, s.context
    scope = _pool_notes(s)
    if s.engine == "vllm":
        if s.flags.get("kv_pool_source", "").startswith("approximate"):
            ratio = pool / ctx  # the pool is max_model_len x a concurrency printed with 2 decimals
            if ratio - 0.005 < 1 <= ratio + 0.005:
                return (
                    "unknown",
                    (
                        f"KV cache ~{_n(pool)} tokens (max_model_len x a concurrency rounded to 2 "
                        f"decimals) is too close to max_model_len {_n(ctx)} to tell{note}"
                    ),
                    *pool_at,
                    False,
                )
        if pool >= ctx:
            derived = (
                (
                    " (vLLM V1 token counts are derived; hybrid / sliding-window models may hold fewer "
                    "physical slots)"
                )
                if s.flags.get("kv_pool_note")
                else ""
            )
            return (
                "pass",
                (
                    f"KV cache {_n(pool)} tokens >= max_model_len {_n(ctx)}: vLLM admits no prompt longer "
                    f"than max_model_len, so every admitted prompt fits{derived}{note}"
                ),
                *pool_at,
                False,
            )
        exposed = s.pd is not False
        return (
            "fail",
            (
                f"KV cache {_n(pool)} tokens < max_model_len {_n(ctx)}{scope} and the engine did not "
                f"refuse to start: prompts longer than the pool are admitted; set --max-model-len <= "
                f"{_n(pool)}{note}"
            ),
            *pool_at,
            exposed,
        )
    # SGLang
    limit = min(ctx - 1, pool - 1) - 5
    aborts = s.events.get("scheduler_abort")
    seen = ""
    conflict = False
    if aborts is not None:
        seen = (
            f"; the log shows {_n(aborts.count)} scheduler abort(s) in this start-up (first at "
            f"{_loc(aborts.first_file, aborts.first_line)})"
        )
        if aborts.min_limit is not None and (aborts.min_limit != limit or aborts.max_limit != limit):
            conflict = True
            shown = (
                _n(aborts.min_limit)
                if aborts.min_limit == aborts.max_limit
                else f"{_n(aborts.min_limit)}-{_n(aborts.max_limit or 0)}"
            )
            seen += (
                f" reporting a limit of {shown}, not the {_n(limit)} these numbers give: the pool or context "
                "reading is inconsistent (a /get_server_info dump shows max_req_input_len)"
            )
    if pool >= ctx:
        return (
            "unknown" if conflict else "pass",
            (
                f"KV pool {_n(pool)} >= context {_n(ctx)}{scope}: the pool never lowers the scheduler limit "
                f"(context - 6 = {_n(limit)}){seen}{note}"
            ),
            *pool_at,
            False,
        )
    head = (
        f"KV pool {_n(pool)} < context {_n(ctx)}{scope}: the scheduler limit is "
        f"min({_n(ctx - 1)}, {_n(pool - 1)}) - 5 = {_n(limit)}, so prompts of {_n(limit)}-{_n(ctx - 1)} "
        "tokens pass the context check and are aborted by the scheduler"
    )
    fix = f"set --context-length <= {_n(pool)} (the pool)"
    if s.pd is None:
        role = (
            "; the role is unknown (no server_args line): if this instance is disaggregated, builds before "
            "0.5.22 still hand those requests to decode, which answers them from stale KV pages"
        )
        return "fail", f"{head}{role}; {fix}{seen}{note}", *pool_at, True
    if s.role == "prefill":
        version = _exact_version(s)
        fixed = (
            f"; this build ({version}) refuses them at the admission queue, but the checklist says not to "
            "rely on the engine"
            if version is not None and _is_fixed(version)
            else ""
        )
        body = (
            "; on the disaggregated path, builds before 0.5.22 still hand them to decode, which answers "
            f"them from stale KV pages (HTTP 200){fixed}; {fix} on both roles"
        )
        return "fail", f"{head}{body}{seen}{note}", *pool_at, True
    if s.role == "decode":
        body = (
            f"; this decode node cannot hold every request its prefill peers admit; {fix} on both roles "
            "of the pair"
        )
        return "fail", f"{head}{body}{seen}{note}", *pool_at, True
    truncate = s.flags.get("allow_auto_truncate", "").lower() in _ON or "input_truncated" in s.events
    body = (
        f"; with --allow-auto-truncate they are cut to {_n(limit)} tokens and served"
        if truncate
        else "; a unified server answers them with an error, so nothing is served from stale KV"
    )
    return (
        "fail",
        f"{head}{body}; {fix} so the context check refuses them up front{seen}{note}",
        *pool_at,
        False,
    )


def _version_of(text: str | None) -> Version | None:
    if text is None:
        return None
    try:
        return Version(text.strip().lstrip("v"))
    except InvalidVersion:
        return None


def _is_fixed(v: Version) -> bool:
    return v >= SGLANG_FIXED_VERSION


def _exact_version(s: _Startup) -> Version | None:
    if s.version_source == "log":
        v = _version_of(s.version)
        if v is not None:
            return v
    if s.server_info is not None:
        return _version_of(s.server_info.version)
    return None


_SPEC_PART = re.compile(r"(>=|<=|>|<|==)\s*v?(\d+(?:\.\d+)*)")


def _inferred_spec(s: _Startup) -> str | None:
    spec = s.flags.get("engine_version_spec")
    if spec:
        return spec
    if s.version and s.version_source and s.version_source.startswith("inferred"):
        m = re.match(r"\s*([<>=][^ ]*)", s.version)
        return m.group(1) if m else None
    return None


def _spec_side(spec: str) -> str:
    """'below' / 'above' the fixed release for every version in *spec*, else 'both'."""
    below = above = False
    for op, number in _SPEC_PART.findall(spec):
        v = Version(number)
        if (op == "<" and v <= SGLANG_FIXED_VERSION) or (op == "<=" and v < SGLANG_FIXED_VERSION):
            below = True
        if (op in (">=", ">") and v >= SGLANG_FIXED_VERSION) or (op == "==" and v >= SGLANG_FIXED_VERSION):
            above = True
        if op == "==" and v < SGLANG_FIXED_VERSION:
            below = True
    return "below" if below else "above" if above else "both"


def _version_text(s: _Startup) -> str:
    if s.version_source == "log" and s.version:
        if "engine_version" not in s.evidence:
            return f"{s.version} (from the log)"
        return f"{s.version} (from the log, {_loc(*s.where('engine_version'))})"
    if s.server_info is not None and s.server_info.version:
        return f"{s.server_info.version} (from {Path(s.server_info.file).name})"
    if s.version:
        return s.version.replace("(inferred:", "(inferred from format:")
    return "not logged"


def _check_version(s: _Startup) -> _Judged:
    file, line = s.where("engine_version")
    if s.engine != "sglang":
        return (
            "not_applicable",
            (
                f"{s.engine}: the SGLang disaggregated reject-path fix (>= "
                f"{SGLANG_FIXED_VERSION}) does not apply; engine version {_version_text(s)}"
            ),
            file,
            line,
        )
    if s.pd is False:
        return (
            "not_applicable",
            (
                f"unified (non-disaggregated) server: the PD reject-path fix (>= "
                f"{SGLANG_FIXED_VERSION}) does not apply; engine version {_version_text(s)}"
            ),
            file,
            line,
        )
    info = s.server_info
    if info is not None and info.version is not None:
        info_at = (info.file, info.line_of("version"))
        logged = _version_of(s.version) if s.version_source == "log" else None
        from_info = _version_of(info.version)
        if logged is not None and from_info is not None and logged != from_info:
            return (
                "unknown",
                (
                    f"the log says SGLang {s.version} ({_loc(file, line)}) but "
                    f"{Path(info.file).name} says {info.version}: confirm which build runs"
                ),
                *info_at,
            )
        if logged is None:
            file, line = info_at
    exact = _exact_version(s)
    if exact is not None:
        what = f"SGLang {_version_text(s)}"
        if exact.release[:3] == SGLANG_FIXED_VERSION.release[:3] and (
            exact.is_prerelease or exact.is_devrelease
        ):
            return (
                "unknown",
                (
                    f"{what} is a pre-release of {SGLANG_FIXED_VERSION}: it may or may not carry the "
                    "complete fix; confirm or upgrade"
                ),
                file,
                line,
            )
        if _is_fixed(exact):
            return (
                "pass",
                (
                    f"{what} >= {SGLANG_FIXED_VERSION}: a request with a pending abort is refused at the "
                    "disaggregation admission queue before any KV is sent"
                ),
                file,
                line,
            )
        return _role_unknown(
            s,
            (
                "fail",
                (
                    f"{what} < {SGLANG_FIXED_VERSION}: a prompt the scheduler aborts is still "
                    "admitted, prefilled as a 1-token stub and handed to decode; upgrade to >= "
                    f"{SGLANG_FIXED_VERSION}{_aborts_handed_on(s)}"
                ),
                file,
                line,
            ),
        )
    spec = _inferred_spec(s)
    if spec is not None:
        side = _spec_side(spec)
        what = f"SGLang {_version_text(s)}"
        if side == "below":
            return _role_unknown(
                s,
                (
                    "fail",
                    (
                        f"{what}: every release in that range is below "
                        f"{SGLANG_FIXED_VERSION}, which first refuses oversize requests before the "
                        f"hand-off; upgrade to >= {SGLANG_FIXED_VERSION}{_aborts_handed_on(s)}"
                    ),
                    file,
                    line,
                ),
            )
        if side == "above":
            return ("pass", f"{what}: every release in that range is >= {SGLANG_FIXED_VERSION}", file, line)
        return (
            "unknown",
            (
                f"{what}: the range includes releases before and after {SGLANG_FIXED_VERSION}; "
                "give a /get_server_info dump to confirm the build"
            ),
            file,
            line,
        )
    return (
        "unknown",
        (
            "no engine version: SGLang does not log it at start-up and the format gives no clue; "
            "give a /get_server_info dump"
        ),
        file,
        line,
    )


def _aborts_handed_on(s: _Startup) -> str:
    """On a vulnerable prefill node, the scheduler aborts in the log are the leak path being taken."""
    aborts = s.events.get("scheduler_abort")
    if s.role != "prefill" or aborts is None:
        return ""
    return (
        f"; the log shows {_n(aborts.count)} scheduler abort(s) on this prefill node (first at "
        f"{_loc(aborts.first_file, aborts.first_line)}): with this build each was still handed to decode"
    )


def _role_unknown(s: _Startup, judged: _Judged) -> _Judged:
    """A fail that only matters on a disaggregated role is unknown when the role is unknown."""
    status, detail, file, line = judged
    if s.pd is None and status == "fail":
        return ("unknown", f"role unknown (no server_args line); if disaggregated: {detail}", file, line)
    return judged


def _flag(s: _Startup, test: Any) -> tuple[str, str, str | None, int | None] | None:
    """The first server arg whose name passes *test*: (name, value, file, line), log before server_info."""
    for key in sorted(s.flags):
        if test(key.lower()):
            file, line = s.where("server_args")
            return key, s.flags[key], file, line
    if s.server_info is not None:
        for key in sorted(s.server_info.args):
            if test(key.lower()):
                return key, s.server_info.args[key], s.server_info.file, s.server_info.line_of(key)
    return None


def _is_defer_release(k: str) -> bool:
    return "defer" in k and "release" in k


def _is_batch_cap(k: str) -> bool:
    return ("mooncake" in k or "transfer" in k) and ("batch" in k or "max" in k) and "backend" not in k


def _no_args_note(s: _Startup) -> str:
    return (
        ""
        if "server_args" in s.evidence or s.server_info is not None
        else " (no server_args line in this start-up)"
    )


def _check_release_and_batch(s: _Startup) -> _Judged:
    file, line = s.where("server_args")
    if s.engine != "sglang":
        connector = s.flags.get("kv_connector")
        via = f" (KV moves via {connector})" if connector else ""
        return (
            "not_applicable",
            (f"{s.engine}{via}: deferred KV release and the Mooncake transfer batch are SGLang settings"),
            file,
            line,
        )
    if s.pd is False:
        return "not_applicable", "unified server: no KV hand-off between nodes", file, line
    parts: list[str] = []
    statuses: list[str] = []
    at: tuple[str | None, int | None] | None = None
    defer = _flag(s, _is_defer_release)
    if defer is None:
        parts.append(
            "deferred KV release: not in the server args"
            + _no_args_note(s)
            + " (newer builds default it on, but a default is not evidence)"
        )
        statuses.append("unknown")
    else:
        key, value, f, ln = defer
        on = value.lower() in _ON
        off = value.lower() in ("false", "0", "no", "off")
        statuses.append("pass" if on else "fail" if off else "unknown")
        state = (
            "on"
            if on
            else "off"
            if off
            else "not set, the engine default applies"
            if value.lower() in ("none", "null", "")
            else "unreadable"
        )
        parts.append(f"deferred KV release {state} ({key}={value})")
        at = at or (f, ln)
    backend = s.flags.get("disaggregation_transfer_backend") or (
        s.server_info.args.get("disaggregation_transfer_backend") if s.server_info else None
    )
    if backend is not None and backend.lower() not in ("mooncake", "none"):
        parts.append(f"transfer backend {backend}: the Mooncake batch cap does not apply")
    else:
        cap = _flag(s, _is_batch_cap)
        if cap is None:
            parts.append("Mooncake transfer batch cap: not in the server args" + _no_args_note(s))
            statuses.append("unknown")
        else:
            key, value, f, ln = cap
            number = _int(value)
            if number is not None and number > 0:
                statuses.append("pass")
                parts.append(f"Mooncake transfer batch capped at {_n(number)} ({key}={value})")
            elif number is not None or value.lower() in ("false", "off", "no"):
                statuses.append("fail")
                parts.append(f"Mooncake transfer batch uncapped ({key}={value})")
            elif value.lower() in ("none", "null", ""):
                statuses.append("unknown")
                parts.append(
                    f"Mooncake transfer batch cap not set ({key}={value}): the engine default applies, "
                    "which the log does not show"
                )
            else:
                statuses.append("unknown")
                parts.append(f"Mooncake transfer batch cap unreadable ({key}={value})")
            at = at or (f, ln)
    status = "fail" if "fail" in statuses else "unknown" if "unknown" in statuses else "pass"
    if status == "fail":
        parts.append(
            "turn on deferred KV release on both roles and cap the transfer batch, so a timeout "
            "cannot leave an unbounded tail write"
        )
    file, line = at or (file, line)
    return _role_unknown(s, (status, "; ".join(parts), file, line))


def _check_corruption_detection(s: _Startup) -> _Judged:
    file, line = s.where("server_args")
    hits = [(k, s.events[k]) for k in _CORRUPTION_KINDS if k in s.events]
    if hits:
        names = {
            "checksum_mismatch": "KV checksum mismatch(es)",
            "canary_violation": "KV canary violation(s)",
            "context_corruption": "context corruption(s) (metadata buffer collision)",
        }
        first = min((st for _, st in hits), key=lambda st: (st.first_file or "", st.first_line or 0))
        listed = ", ".join(
            f"{_n(st.count)} {names[k]} (first at {_loc(st.first_file, st.first_line)})" for k, st in hits
        )
        return (
            "fail",
            (
                f"corruption detected in this start-up: {listed}; the responses involved may carry "
                "another request's KV"
            ),
            first.first_file,
            first.first_line,
        )
    if s.engine != "sglang":
        return "not_applicable", f"{s.engine}: no KV checksum or canary to enable", file, line
    checksum = _flag(s, lambda k: "checksum" in k)
    canary = _flag(s, lambda k: "canary" in k)
    if s.pd is False:
        state = ", ".join(f"{f[0]}={f[1]}" for f in (checksum, canary) if f is not None) or "not logged"
        return (
            "not_applicable",
            (
                f"unified server: hand-off checksums do not apply ({state}); no corruption "
                "reported in this start-up"
            ),
            file,
            line,
        )
    if checksum is None and canary is None:
        return (
            "unknown",
            "neither --disaggregation-enable-kv-checksum nor --kv-canary is in the server args"
            + _no_args_note(s),
            file,
            line,
        )
    described = []
    enabled = []
    for f in (checksum, canary):
        if f is None:
            continue
        key, value, ff, fl = f
        on = value.lower() not in _OFF
        described.append(f"{key}={value}")
        if on:
            enabled.append((ff, fl))
    state = ", ".join(described)
    if not enabled:
        missing = (
            " (--kv-canary is not among the logged server args)"
            if canary is None
            else " (--disaggregation-enable-kv-checksum is not among the logged server args)"
            if checksum is None
            else ""
        )
        return _role_unknown(
            s,
            (
                "fail",
                (
                    f"corruption detection is off ({state}){missing}: turn on "
                    "--disaggregation-enable-kv-checksum or --kv-canary where the model supports it"
                ),
                file,
                line,
            ),
        )
    ff, fl = enabled[0]
    return (
        "unknown",
        (
            f"detection on ({state}) but nothing in the log shows a request being verified: SGLang "
            "logs only mismatches, so a quiet log is no proof; check the engine's checksum / canary counters"
        ),
        ff,
        fl,
    )


def _check_load_balancer(s: _Startup, manifest: DeploymentManifest | None) -> _Judged:
    file, line = s.where()
    if s.engine == "vllm" and s.refused:
        return "not_applicable", "vLLM refused to start: nothing served", file, line
    if s.pd is False:
        return (
            "not_applicable",
            ("unified server: an abort on client disconnect needs no cross-node coordination"),
            file,
            line,
        )
    if manifest is None:
        return (
            "unknown",
            ("no deployment manifest given: the load balancer's abort-on-disconnect behaviour is unknown"),
            file,
            line,
        )
    setting = manifest.setting_for(s.instance, (s.model, s.engine_model))
    lb = f"load balancer {manifest.name!r}" if manifest.name else "the load balancer"
    if setting is None:
        return "unknown", "the manifest has no [load_balancer] table", manifest.file, None
    at = (manifest.file, setting.line)
    where = "" if setting.scope == "load balancer" else f" (setting for {setting.scope})"
    if setting.value is None:
        return "unknown", f"the manifest does not say when {lb} aborts on client disconnect{where}", *at
    if setting.value == "always":
        return _role_unknown(
            s,
            (
                "fail",
                (
                    f"{lb} aborts a request on client disconnect even before its first "
                    f"token{where}: that abort needs prefill/decode coordination; set "
                    'abort_on_client_disconnect = "after_first_token" or "never"'
                ),
                *at,
            ),
        )
    said = "never aborts" if setting.value == "never" else "aborts only after the first token"
    return "pass", f"{lb} {said} on client disconnect{where}", *at


def _verdict(
    s: _Startup,
    check: int,
    status: str,
    detail: str,
    file: str | None,
    line: int | None,
    exposed: bool = False,
) -> Verdict:
    return Verdict(
        instance=s.instance,
        role=s.role if s.role_certain else "unknown",
        model=s.model,
        startup_from=s.ts,
        startup_to=s.to,
        check=check,
        check_name=CHECKS[check],
        status=status,
        exposed=exposed,
        detail=detail,
        evidence_file=file,
        evidence_line=line,
        engine=s.engine,
        engine_version=s.version,
        startup_file=s.file,
        startup_line=s.line,
        end_reason=s.end_reason,
        end_file=s.end_file,
        end_line=s.end_line,
        successor=s.successor,
    )


def _judge(startups: list[_Startup], manifest: DeploymentManifest | None) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for s in startups:
        status, detail, file, line, exposed = _check_pool(s)
        verdicts.append(_verdict(s, 1, status, detail, file, line, exposed))
        if s.engine == "vllm" and s.refused:
            others: list[_Judged] = [
                ("not_applicable", "vLLM refused to start: nothing served", *s.where())
            ] * 4
        else:
            others = [
                _check_version(s),
                _check_release_and_batch(s),
                _check_corruption_detection(s),
                _check_load_balancer(s, manifest),
            ]
        verdicts += [_verdict(s, check, *judged) for check, judged in enumerate(others, start=2)]
    return verdicts


def _report(
    startups: list[_Startup],
    *,
    server_info: Sequence[ServerInfo | str | Path],
    manifest: DeploymentManifest | str | Path | None,
    notes: list[str],
    inputs: list[str],
    events: Iterable[tuple[str | None, EngineEvent]] | None = None,
    handover_s: float | None = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """*handover_s* None: the start-ups already carry their ends (the ``capacity`` table)."""
    infos = [i if isinstance(i, ServerInfo) else read_server_info(i) for i in server_info]
    lb = manifest if manifest is None or isinstance(manifest, DeploymentManifest) else read_manifest(manifest)
    if handover_s is not None:
        _end_lifetimes(startups, handover_s)
    _link(startups)
    if events is not None:
        lost = _assign_events(startups, events)
        if lost:
            notes.append(
                f"{lost} engine event(s) could not be placed in any start-up (no start-up before them "
                "in their file and no timestamp inside a logged interval); not audited"
            )
    _attach_server_info(startups, infos, notes)
    if not startups:
        notes.append("no engine start-up found in the inputs: nothing to audit")
    inputs = inputs + [i.file for i in infos] + ([lb.file] if lb is not None else [])
    return AuditReport(verdicts=_judge(startups, lb), notes=notes, inputs=inputs)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def audit_startups(
    startups: Iterable[StartupRecord | tuple[str | Path, StartupRecord]],
    events: Iterable[EngineEvent | tuple[str | Path, EngineEvent]] = (),
    *,
    source_file: str | Path | None = None,
    server_info: Sequence[ServerInfo | str | Path] = (),
    manifest: DeploymentManifest | str | Path | None = None,
    model_aliases: Mapping[str, str] | None = None,
    handover_s: float = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """Audit parsed start-ups (pure when given parsed :class:`ServerInfo` / :class:`DeploymentManifest`).

    Items may be bare records (their file is *source_file*) or ``(file, record)`` pairs.
    *model_aliases* maps engine model names to gateway model ids, as in the incident file;
    *handover_s* is the ``[instances] handover_s`` of the lifetime rule.
    """
    aliases = dict(model_aliases or {})
    default = str(source_file) if source_file is not None else None
    norm = []
    for item in startups:
        file, rec = (str(item[0]), item[1]) if isinstance(item, tuple) else (default, item)
        norm.append(_from_record(rec, file, aliases))
    evs = [(str(e[0]), e[1]) if isinstance(e, tuple) else (default, e) for e in events]
    files = sorted({s.file for s in norm if s.file})
    return _report(
        norm,
        server_info=server_info,
        manifest=manifest,
        notes=[],
        inputs=files,
        events=evs,
        handover_s=handover_s,
    )


def audit_parses(
    parses: Mapping[str | Path, EngineLogParse],
    *,
    server_info: Sequence[ServerInfo | str | Path] = (),
    manifest: DeploymentManifest | str | Path | None = None,
    model_aliases: Mapping[str, str] | None = None,
    handover_s: float = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """Audit engine logs already parsed by :func:`~kvforensics.loaders.engine_common.parse_engine_log`."""
    aliases = dict(model_aliases or {})
    norm: list[_Startup] = []
    events: list[tuple[str | None, EngineEvent]] = []
    notes: list[str] = []
    for path, parse in parses.items():
        file = str(path)
        norm += [_from_record(r, file, aliases) for r in parse.startups]
        events += [(file, e) for e in parse.events if e.kind in AUDIT_EVENT_KINDS]
        name = Path(file).name
        notes += [f"{name}: {n}" for n in parse.notes]
        if parse.quarantined:
            notes.append(
                f"{name}: {len(parse.quarantined)} line(s) could not be read and were skipped "
                f"(first at line {parse.quarantined[0].line}: {parse.quarantined[0].reason})"
            )
        if not parse.startups:
            notes.append(f"{name}: no engine start-up found; this file gives no KV pool size")
    return _report(
        norm,
        server_info=server_info,
        manifest=manifest,
        notes=notes,
        inputs=[str(p) for p in parses],
        events=events,
        handover_s=handover_s,
    )


def _zone(tz: str | ZoneInfo) -> ZoneInfo:
    if isinstance(tz, ZoneInfo):
        return tz
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise InputError(
            f"unknown time zone {tz!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'"
        ) from e


def audit_paths(
    paths: Sequence[str | Path],
    *,
    fmt: str = "auto",
    tz: str | ZoneInfo = "UTC",
    year: int | None = None,
    instance_template: str = "{stem}",
    clock_offset_s: float = 0.0,
    server_info: Sequence[str | Path | ServerInfo] = (),
    manifest: str | Path | DeploymentManifest | None = None,
    model_aliases: Mapping[str, str] | None = None,
    envelope: str = "auto",
    handover_s: float = DEFAULT_HANDOVER_S,
) -> AuditReport:
    """Parse engine logs (plain, .gz, .zst; SGLang or vLLM) and audit every start-up in them.

    ``tz`` is the zone of the engines' naive timestamps, ``year`` the year of vLLM's year-less
    stamps, ``instance_template`` names the instance from the file (``{stem}``, ``{name}``,
    ``{parent}``, or an envelope label ``{label:NAME}``), ``envelope`` the collection envelope
    (``auto``: recognised; a file of several instances gives several), ``handover_s`` how long a
    successor may start before a replaced pod's log ends (``[instances] handover_s``). Raises
    :class:`~kvforensics.errors.InputError` for an unreadable input.
    """
    from kvforensics.config import Source
    from kvforensics.loaders.engine_common import parse_engine_log

    if not paths:
        raise InputError("no engine logs given: name at least one SGLang or vLLM log file")
    zone = _zone(tz)
    try:
        template = Source(
            name="audit",
            kind="engine_log",
            path="",
            format=fmt,
            timezone=zone.key,
            base_dir=Path("."),
            instance=instance_template,
        )
        template.instance_for(Path("x.log"))
    except (KeyError, IndexError, ValueError) as e:
        raise InputError(
            f"instance template {instance_template!r} may only use {{stem}}, {{name}}, {{parent}}"
        ) from e
    parses: dict[str | Path, EngineLogParse] = {}
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise InputError("engine log not found", location=str(path))
        parses[str(path)] = parse_engine_log(
            path,
            fmt=fmt,
            instance=lambda labels, path=path: template.instance_for(path, labels),
            tz=zone,
            year=year,
            clock_offset_s=clock_offset_s,
            envelope=envelope,
        )
    infos = [
        i if isinstance(i, ServerInfo) else read_server_info(i, instance_template=instance_template)
        for i in server_info
    ]
    return audit_parses(
        parses, server_info=infos, manifest=manifest, model_aliases=model_aliases, handover_s=handover_s
    )


def audit_incident(
    incident: Incident,
    *,
    server_info: Sequence[str | Path | ServerInfo] = (),
    manifest: str | Path | DeploymentManifest | None = None,
) -> AuditReport:
    """Audit the engine logs an incident file names, with each source's zone, format and year."""
    from kvforensics.loaders.engine_common import parse_engine_log

    parses: dict[str | Path, EngineLogParse] = {}
    sources = incident.sources_of("engine_log")
    if not sources:
        raise InputError(
            "the incident file names no engine_log source: nothing to audit", location=str(incident.path)
        )
    for source in sources:
        files = source.files()
        if not files:
            raise InputError(
                f"engine_log source '{source.name}' matches no file ({source.path})",
                location=str(incident.path),
            )
        for path in files:
            parses[str(path)] = parse_engine_log(
                path,
                fmt=source.format,
                instance=lambda labels, source=source, path=path: source.instance_for(path, labels),
                tz=source.tz,
                year=source.year or incident.year,
                clock_offset_s=source.clock_offset_s,
                envelope=source.envelope,
            )
    return audit_parses(
        parses,
        server_info=server_info,
        manifest=manifest,
        model_aliases=incident.model_aliases,
        handover_s=incident.instances.handover_s,
    )


def audit_database(
    con: duckdb.DuckDBPyConnection,
    *,
    server_info: Sequence[str | Path | ServerInfo] = (),
    manifest: str | Path | DeploymentManifest | None = None,
) -> AuditReport:
    """Audit the start-ups in an evidence database's ``capacity`` table (with ``engine_events``).

    The database keeps the start-up's first line and its pool line; other evidence (server args,
    version) points at the start-up's first line, and a refused vLLM start-up at its pool line.
    ``model`` is the gateway id the ingest resolved; each start-up ends where the ingest ended it.
    """
    import duckdb

    from kvforensics.db import sql

    norm: list[_Startup] = []
    try:
        rows = con.execute(sql("audit_capacity")).fetchall()
    except (duckdb.CatalogException, duckdb.BinderException) as e:
        raise InputError(
            f"the evidence database has no capacity table with start-up ends ({str(e).splitlines()[0]}): "
            "open it writable (its schema is then brought up to date) or run 'kvforensics ingest' again"
        ) from e
    for (
        instance,
        role,
        model,
        engine_model,
        valid_from,
        valid_to,
        pool,
        context,
        _page,
        engine,
        version,
        version_source,
        _tp,
        dp,
        flags_json,
        refused,
        _source,
        source_file,
        source_line,
        pool_line,
        end_reason,
        end_file,
        end_line,
        successor,
    ) in rows:
        try:
            flags = {str(k): str(v) for k, v in json.loads(flags_json or "{}").items()}
        except (json.JSONDecodeError, AttributeError):
            flags = {}
        line = int(source_line) if source_line is not None else None
        evidence = {"server_args": line} if line is not None and "role_source" not in flags else {}
        is_refused = bool(refused) or flags.get("startup_refused", "").lower() == "true"
        if is_refused and pool_line is not None:  # vLLM: the pool of a refused start comes from the refusal
            evidence["startup_refused"] = int(pool_line)
        s = _Startup(
            instance=instance,
            file=source_file,
            line=line,
            ts=_utc(valid_from),
            engine=engine,
            version=version,
            version_source=version_source,
            role=role,
            model=model or engine_model,
            engine_model=engine_model,
            pool=pool,
            pool_line=pool_line,
            context=context,
            dp_size=dp,
            flags=flags,
            evidence=evidence,
            refused=is_refused,
            to=_utc(valid_to),
            end_reason=end_reason,
            end_file=end_file,
            end_line=end_line,
            successor=successor,
            role_certain=not flags.get("role_source", "").startswith("default"),
        )
        norm.append(s)
    index = {(s.instance, s.file, s.line): s for s in norm}
    for (
        instance,
        startup_file,
        startup_line,
        kind,
        count,
        first_file,
        first_line,
        min_limit,
        max_limit,
    ) in con.execute(sql("audit_events")).fetchall():
        found = index.get((instance, startup_file, startup_line))
        if found is not None:
            found.events[kind] = _EventStat(int(count), first_file, first_line, min_limit, max_limit)
    files = sorted({s.file for s in norm if s.file})
    return _report(norm, server_info=server_info, manifest=manifest, notes=[], inputs=files, handover_s=None)


def _utc(ts: datetime | None) -> datetime | None:
    if ts is None:
        return None
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)
