"""A simulated incident written the way production systems export it (``--export litellm-loki``).

The same seeded incident as :func:`kvforensics.simulate.simulate`, but in the files a responder is
handed, with no preprocessing:

* the gateway log is a LiteLLM proxy's ``LiteLLM_SpendLogs`` table exported from Postgres with
  ``\\copy "LiteLLM_SpendLogs" TO 'LiteLLM_SpendLogs.csv' CSV HEADER``: the columns of LiteLLM's
  ``schema.prisma`` model, timestamps as Postgres prints ``timestamp(3)`` without zone (UTC values,
  trailing zeros of the fraction dropped), JSON columns as ``jsonb`` prints them (keys shortest
  first, ``", "`` and ``": "``), NULL as an empty field and the empty string as ``""``; the team is
  the customer account (the provider's load tests use a service user's key outside any team:
  ``team_id`` "", the account in ``user``); rejected requests are logged as LiteLLM logs failures
  (``status`` = ``failure``, the HTTP code in ``metadata.error_information.error_code``, the request
  id the proxy's call id) and rows come in table order (written as requests complete);
* every engine instance is a Kubernetes pod of a Deployment, replaced in rollouts with
  ``maxSurge: 0`` (no spare GPUs): the old pod gets SIGTERM a few seconds before its successor, with
  a new name, prints its first line. A retired pod's log ends with SGLang's shutdown lines or simply
  stops (alternating, so both occur in every rollout);
* the PD fleet of the exposed model (prefill and decode pods of every generation) is one Grafana
  Loki export, ``logcli query --output=jsonl`` (newest first, pods interleaved, timestamps in the
  zone logcli ran in); the other models' pods are ``kubectl logs --timestamps <pod>`` files;
* the exposed model is first deployed "dark" with a safe KV pool (above its context length) days
  before the rollout that introduces the small pool and opens its route, so a retired pod that
  stayed in force would hide the exposure (only the smallest pool in force would be exceeded).

``ground_truth.json`` holds the affected request ids, every pod with how its log ends, the exposure
windows per pod and the trap request ids (under the ids the export gives them).

Formats, as documented upstream:

* LiteLLM ``LiteLLM_SpendLogs``: https://github.com/BerriAI/litellm/blob/main/schema.prisma (the
  model), ``litellm/proxy/spend_tracking/spend_tracking_utils.py`` ``get_logging_payload`` (what
  each column holds: ``cache_hit`` as ``str(bool)``, ``"Cache OFF"``, ``"{}"`` for messages and
  response unless prompts are stored, ``team_id`` "" when the key has no team) and
  ``litellm/proxy/_types.py`` ``SpendLogsMetadata`` / ``litellm/types/utils.py``
  ``StandardLoggingPayloadErrorInformation`` (the ``metadata`` keys).
* Postgres CSV and ``timestamp``/``jsonb`` output: https://www.postgresql.org/docs/current/sql-copy.html
  (File Formats, CSV), https://www.postgresql.org/docs/current/datatype-datetime.html,
  https://www.postgresql.org/docs/current/datatype-json.html.
* Kubernetes pods, Loki and kubectl exports: see :mod:`kvforensics.simulate.fleet.pods`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd

import kvforensics.simulate.sources.incident_files as files
from kvforensics.core.errors import ConfigError
from kvforensics.simulate.fleet.deployment import MODEL_KEYS, Deployment
from kvforensics.simulate.fleet.pods import (
    NAMESPACE,
    Pod,
    build_pods,
    random_uuid,
    with_dark_launch,
    write_kubectl_logs,
    write_loki_export,
)
from kvforensics.simulate.fleet.pods import (
    SIGTERM_LINE as SIGTERM_LINE,  # where tests and readers look for it
)
from kvforensics.simulate.run import affected_records, apply_pages, planned_incident, served_chunks, trap_ids
from kvforensics.simulate.scenario import Scenario
from kvforensics.simulate.sources.engine_log import build_engine_logs, request_lines
from kvforensics.simulate.traffic import STREAM_IDS

EXPORT_STYLES = ("litellm-loki",)
#: $ per million prompt / completion tokens, per model key (spend column).
PRICES = {"target": (0.60, 2.20), "control": (0.60, 2.20), "unified": (0.23, 0.40)}
#: LiteLLM exception class per HTTP status of a failed request.
ERROR_CLASSES = {
    400: "ContextWindowExceededError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
#: ``LiteLLM_SpendLogs`` columns in schema.prisma order.
SPEND_LOG_COLUMNS = (
    "request_id", "call_type", "api_key", "spend", "total_tokens", "prompt_tokens", "completion_tokens",
    "startTime", "endTime", "request_duration_ms", "completionStartTime", "model", "model_id",
    "model_group", "custom_llm_provider", "api_base", "user", "metadata", "cache_hit", "cache_key",
    "request_tags", "team_id", "organization_id", "end_user", "requester_ip_address", "messages",
    "response", "session_id", "status", "mcp_namespaced_tool_name", "agent_id", "proxy_server_request",
)  # fmt: skip


# --- Postgres text output -------------------------------------------------------------------------


def pg_timestamp(ms: int) -> str:
    """``timestamp(3)`` as Postgres prints it: ``2026-08-27 15:42:00.12`` (zeros of the fraction dropped)."""
    text = datetime.fromtimestamp(ms // 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    fraction = f"{ms % 1000:03d}".rstrip("0")
    return f"{text}.{fraction}" if fraction else text


def pg_float8(value: float) -> str:
    """``double precision`` output (shortest exact digits; integral values without ``.0``)."""
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def jsonb_text(value: Any) -> str:
    """JSON as ``jsonb`` prints it: object keys shortest first (then bytewise), ``", "`` and ``": "``."""
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (len(k.encode()), k.encode()))
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {jsonb_text(value[k])}" for k in keys) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(jsonb_text(v) for v in value) + "]"
    if isinstance(value, float):
        return format(Decimal(repr(value)), "f")  # numeric: never exponent notation
    return json.dumps(value, ensure_ascii=False)


def pg_csv_field(value: Any) -> str:
    """One field of ``COPY ... CSV``: NULL empty, the empty string and text with , " CR LF quoted."""
    if value is None:
        return ""
    if isinstance(value, dict | list):
        value = jsonb_text(value)
    elif isinstance(value, float):
        return pg_float8(value)
    elif not isinstance(value, str):
        return str(value)
    if value == "" or value.startswith("\\.") or any(c in value for c in ',"\n\r'):
        return '"' + value.replace('"', '""') + '"'
    return value


# --- The gateway as LiteLLM spend logs ------------------------------------------------------------


@dataclass(frozen=True)
class Keys:
    """Per-account virtual key (hashed, as the table stores it), alias and client address."""

    hashed: dict[str, str]
    alias: dict[str, str]
    ip: dict[str, str]


def account_keys(accounts: np.ndarray, seed: int) -> Keys:
    hashed, alias, ip = {}, {}, {}
    for account in sorted(set(accounts.tolist())):
        digest = hashlib.sha256(f"sk-{seed}-{account}".encode()).hexdigest()
        hashed[account] = digest
        alias[account] = f"{account}-prod"
        ip[account] = f"100.{64 + int(digest[:2], 16) % 64}.{int(digest[2:4], 16)}.{int(digest[4:6], 16)}"
    return Keys(hashed, alias, ip)


def spend_log_metadata(
    status: int,
    error: str | None,
    account: str,
    teamless: bool,
    keys: Keys,
    usage: dict[str, Any] | None,
    overhead_ms: float,
) -> dict[str, Any]:
    """The ``metadata`` column: SpendLogsMetadata keys; a key outside any team names its user instead."""
    team = None if teamless else account
    metadata: dict[str, Any] = {
        "status": "success" if status == 200 else "failure",
        "user_api_key": keys.hashed[account],
        "user_api_key_alias": keys.alias[account],
        "user_api_key_team_id": team,
        "user_api_key_org_id": None,
        "user_api_key_user_id": account if teamless else None,
        "user_api_key_team_alias": team,
        "spend_logs_metadata": None,
        "requester_ip_address": keys.ip[account],
        "applied_guardrails": [],
        "batch_models": None,
        "mcp_tool_call_metadata": None,
        "vector_store_request_metadata": None,
        "guardrail_information": None,
        "usage_object": usage,
        "model_map_information": None,
        "cold_storage_object_key": None,
        "litellm_overhead_time_ms": overhead_ms,
        "additional_usage_values": {k: v for k, v in (usage or {}).items() if not k.endswith("_tokens")},
        "proxy_server_request": None,
    }
    if status != 200:
        cls = ERROR_CLASSES.get(status, "APIError")
        metadata["error_information"] = {
            "error_code": str(status),
            "error_class": cls,
            "llm_provider": "openai",
            "traceback": "",
            "error_message": f"litellm.{cls}: OpenAIException - {error}",
        }
    return metadata


def spend_log_rows(
    served: pd.DataFrame, dep: Deployment, rng: np.random.Generator
) -> tuple[list[list[Any]], dict[str, str]]:
    """One row per request in table order (as written: by completion), and the ids failures get."""
    s = dep.scenario
    models = [dep.models[k] for k in MODEL_KEYS]
    model_ids = {k: hashlib.sha256(f"{s.seed}-{dep.models[k].gateway_model}".encode()).hexdigest() for k in MODEL_KEYS}
    keys = account_keys(served["account"].to_numpy(), s.seed)
    start = served["ts_ms"].to_numpy().astype(np.int64)
    latency = np.maximum(np.rint(served["latency_ms"].to_numpy()), 1).astype(np.int64)
    ttft = served["ttft_true_ms"].to_numpy()
    end = start + latency
    first = np.where(served["stream"].to_numpy() & ~np.isnan(ttft), start + np.rint(np.nan_to_num(ttft)), end)
    first = np.minimum(first.astype(np.int64), end)
    overhead = np.round(rng.lognormal(np.log(4.0), 0.5, len(served)), 3)
    rows: list[list[Any]] = []
    renamed: dict[str, str] = {}
    record: Any
    for i, record in enumerate(served.itertuples(index=False)):
        m = models[int(record.model_idx)]
        key = MODEL_KEYS[int(record.model_idx)]
        status = int(record.status)
        ok = status == 200
        prompt = int(record.prompt_tokens) if ok else 0
        completion = int(record.completion_tokens) if ok else 0
        usage = None
        if ok:  # the OpenAI usage object SGLang returns (--enable-cache-report)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": int(record.cached_tokens), "audio_tokens": None},
                "completion_tokens_details": None,
            }
        # the provider's own load tests run on a service user's key outside any team
        teamless = fnmatch.fnmatchcase(record.account, s.internal_account_glob)
        request_id = record.rid
        if not ok:  # no response object: LiteLLM keys the row by its own call id
            request_id = random_uuid(rng)
            renamed[record.rid] = request_id
        price_in, price_out = PRICES[key]
        spend = round((prompt * price_in + completion * price_out) / 1e6, 10)
        rows.append(
            [
                request_id,
                "acompletion",
                keys.hashed[record.account],
                spend,
                prompt + completion,
                prompt,
                completion,
                pg_timestamp(int(start[i])),
                pg_timestamp(int(end[i])),
                int(end[i] - start[i]),
                pg_timestamp(int(first[i])),
                m.engine_model,
                model_ids[key],
                m.gateway_model,
                "openai",
                f"http://{m.prefix}-router.{NAMESPACE}.svc.cluster.local:8000/v1",
                record.account if teamless else "",
                spend_log_metadata(status, record.error, record.account, teamless, keys, usage, float(overhead[i])),
                "False",
                "Cache OFF",
                [],
                "" if teamless else record.account,
                "",
                "",
                keys.ip[record.account],
                {},
                {},
                random_uuid(rng),
                "success" if ok else "failure",
                None,
                None,
                {},
            ]
        )
    order = np.argsort(end, kind="stable")
    return [rows[i] for i in order], renamed


def write_spend_logs(rows: list[list[Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as fh:
        fh.write(",".join(SPEND_LOG_COLUMNS) + "\n")
        for row in rows:
            fh.write(",".join(pg_csv_field(v) for v in row) + "\n")
    return path


# --- The incident file and ground truth -----------------------------------------------------------


def export_toml(dep: Deployment) -> str:
    """The incident file a responder writes for these exports: a preset and a few engine lines."""
    s = dep.scenario
    q = files.toml_string
    aliases = ", ".join(f"{q(m.engine_model)} = {q(m.gateway_model)}" for m in dep.models.values())
    engine = ['format = "sglang"', f"timezone = {q(s.engine_timezone)}"]
    return "\n".join(
        [
            "# Generated by `kvforensics simulate --export litellm-loki`; ground_truth.json is not referenced.",
            "[incident]",
            f"id = {q(s.incident_id)}",
            f"title = {q(dep.models['target'].gateway_model + ' KV-cache cross-tenant exposure')}",
            "",
            "[[sources]]",
            'name = "litellm"',
            'kind = "requests"',
            'path = "gateway/LiteLLM_SpendLogs.csv"',
            'preset = "litellm"',
            "",
            "[[sources]]",
            'name = "loki"',
            'kind = "engine_log"',
            'path = "engine/loki/*.jsonl"',
            *engine,
            'instance = "{label:pod}"',
            "",
            "[[sources]]",
            'name = "kubectl"',
            'kind = "engine_log"',
            'path = "engine/kubectl/*.log"',
            *engine,
            'instance = "{stem}"',
            "",
            "[scope]",
            f"internal_accounts = [{q(s.internal_account_glob)}]",
            f"reporter_accounts = [{q(s.reporter_account)}]",
            "",
            "[models]",
            f"aliases = {{ {aliases} }}",
            "",
        ]
    )


def iso_us(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def pod_json(pod: Pod) -> dict[str, Any]:
    return {
        "pod": pod.name,
        "instance": pod.instance,
        "model": pod.startup.model,
        "role": pod.startup.role,
        "pool_tokens": pod.startup.pool_tokens,
        "context_length": pod.startup.context_length,
        "start": files.iso(pod.startup.ts),
        "last_line": iso_us(pod.last_line),
        "stopped": iso_us(pod.stopped),
        "successor_start": files.iso(pod.successor_start),
        "end": pod.end,
        "collector": pod.collector,
    }


def exposure_windows(pods: list[Pod], dep: Deployment) -> list[dict[str, Any]]:
    """Per pod of the exposed model whose pool was below its context: from its first line until replaced."""
    model = dep.models["target"].gateway_model
    return [
        {
            "instance": pod.name,
            "role": pod.startup.role,
            "model": model,
            "start": files.iso(pod.startup.ts),
            "end": files.iso(pod.successor_start),
            "stopped": iso_us(pod.stopped),
            "pool_tokens": pod.startup.pool_tokens,
            "context_length": pod.startup.context_length,
        }
        for pod in pods
        if pod.startup.model == "target" and pod.startup.pool_tokens < pod.startup.context_length
    ]


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    incident_toml: Path
    ground_truth: Path
    spend_logs: Path
    loki_export: Path
    kubectl_logs: list[Path]
    pods: list[Pod]
    requests: int
    affected: int
    affected_accounts: int


def export_incident(scenario: Scenario, out_dir: Path, loki_timezone: str = "UTC") -> ExportResult:
    """Simulate ``scenario`` and write it as LiteLLM spend logs, a Loki export and kubectl pod logs."""
    s = scenario
    if not s.simulates_pages:
        raise ConfigError(
            f"--export writes every request row by row; use requests <= {s.page_simulation_max_requests}",
            location="scenario",
        )
    try:
        loki_zone = ZoneInfo(loki_timezone)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"unknown IANA time zone {loki_timezone!r}", location="export") from exc
    out_dir = Path(out_dir)
    dep, incident, _, background = planned_incident(s)
    served = pd.concat(list(served_chunks(s, dep, incident, background)), ignore_index=True)
    served, _, _ = apply_pages(served, dep)
    fleet = with_dark_launch(dep)
    logs = build_engine_logs(fleet, np.random.default_rng([s.seed, STREAM_IDS, 1]))
    request_lines(logs, served, dep, ZoneInfo(s.engine_timezone), True, np.random.default_rng([s.seed, STREAM_IDS, 3]))
    pods = build_pods(fleet, logs, np.random.default_rng([s.seed, STREAM_IDS, 5]))
    rows, renamed = spend_log_rows(served, dep, np.random.default_rng([s.seed, STREAM_IDS, 6]))
    spend_logs = write_spend_logs(rows, out_dir / "gateway" / "LiteLLM_SpendLogs.csv")
    loki = write_loki_export(
        [p for p in pods if p.collector == "loki"],
        out_dir / "engine" / "loki" / f"{dep.models['target'].prefix}.jsonl",
        loki_zone,
    )
    kubectl = write_kubectl_logs([p for p in pods if p.collector == "kubectl"], out_dir / "engine" / "kubectl")
    toml = files.write_text(out_dir / "incident.toml", export_toml(dep))
    model_ids = [dep.models[k].gateway_model for k in MODEL_KEYS]
    affected = affected_records(served, None, None, {}, model_ids)
    if len(affected) != s.affected:
        raise AssertionError(f"simulated {len(affected)} affected responses, scenario asked for {s.affected}")
    traps = {kind: sorted(renamed.get(rid, rid) for rid in ids) for kind, ids in trap_ids(served).items()}
    accounts = sorted({a["account_id"] for a in affected})
    truth = {
        "scenario": s.as_dict(),
        "export": {"style": "litellm-loki", "loki_timezone": loki_timezone},
        "counts": {
            "requests": len(served),
            "affected_responses": len(affected),
            "affected_accounts": len(accounts),
        },
        "affected_accounts": accounts,
        "pods": [pod_json(p) for p in pods],
        "exposure_windows": exposure_windows(pods, fleet),
        "traps": traps,
        "affected": affected,
    }
    truth_path = files.write_json(out_dir / "ground_truth.json", truth, records_key="affected")
    return ExportResult(
        out_dir=out_dir,
        incident_toml=toml,
        ground_truth=truth_path,
        spend_logs=spend_logs,
        loki_export=loki,
        kubectl_logs=kubectl,
        pods=pods,
        requests=len(served),
        affected=len(affected),
        affected_accounts=len(accounts),
    )
