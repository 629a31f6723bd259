"""The knobs of one simulated incident (defaults = the bundled sample) and their validation."""

from __future__ import annotations

import dataclasses
import fnmatch
import tomllib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, get_type_hints
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kvforensics.core.errors import ConfigError

TIMESTAMP_STYLES = ("iso_z", "iso_offset", "naive_local", "epoch_ms")
COLUMN_STYLES = ("sample", "canonical", "otel", "custom")
GATEWAY_FORMATS = ("jsonl", "parquet")
SGLANG_LOG_VERSIONS = ("0.5.15", "0.5.20")


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


@dataclass(frozen=True)
class Scenario:
    """Everything that shapes a simulated incident. Defaults reproduce ``data/sample``."""

    seed: int = 7
    #: Total gateway requests (background traffic + incident requests). Above
    #: ``page_simulation_max_requests`` every source is streamed and the KV page simulation skipped.
    requests: int = 20_000
    incident_id: str = "glm53-kv-exposure"

    # Period covered by the gateway log.
    start: datetime = datetime(2026, 8, 21, tzinfo=UTC)
    end: datetime = datetime(2026, 9, 12, tzinfo=UTC)

    # The exposed model (prefill/decode disaggregated, prefill pool < context).
    model: str = "@cf/zai-org/glm-5.3"
    engine_model: str = "zai-org/GLM-5.3-FP8"
    instance_prefix: str = "glm53"
    context_length: int = 1_048_576
    exposed_pool_tokens: int = 681_280
    fixed_pool_tokens: int = 2_042_880
    #: Decode pools: big enough to reserve any prompt below the context length.
    decode_pool_tokens: int = 1_310_720
    fixed_decode_pool_tokens: int = 2_621_440
    exposure_start: datetime = datetime(2026, 8, 27, 15, 42, tzinfo=UTC)
    fix_time: datetime = datetime(2026, 9, 9, 14, 5, tzinfo=UTC)
    #: Minutes between the restarts of successive prefill instances (per-instance windows).
    restart_stagger_minutes: int = 15
    prefill_instances: int = 2
    decode_instances: int = 2
    tp_size: int = 8
    page_size: int = 64

    # The PD control model (pool > context throughout) and the unified (non-PD) model.
    control_model: str = "@cf/zai-org/glm-5.2"
    control_engine_model: str = "zai-org/GLM-5.2-FP8"
    control_instance_prefix: str = "glm52"
    control_context_length: int = 1_048_576
    control_pool_tokens: int = 2_042_880
    unified_model: str = "@cf/meta/llama-3.3-70b-instruct"
    unified_engine_model: str = "meta-llama/Llama-3.3-70B-Instruct"
    unified_instance_prefix: str = "llama33"
    unified_context_length: int = 131_072
    unified_pool_tokens: int = 1_418_240

    # The incident.
    affected: int = 155
    affected_customer_accounts: int = 39
    internal_account: str = "loadtest-glm-01"
    internal_account_glob: str = "loadtest-*"
    internal_affected: int = 40
    reporter_account: str = "bounty-4471"
    reporter_affected: int = 4
    report_time: datetime = datetime(2026, 9, 8, 23, 11, tzinfo=UTC)
    upstream_issue_time: datetime = datetime(2026, 7, 6, 9, 30, tzinfo=UTC)
    #: Accounts that deliberately probe the bug (0 in the sample).
    exploiters: int = 0
    accounts: int = 600

    # Output shape.
    engine_timezone: str = "UTC"
    gateway_timezone: str = "UTC"
    gateway_timestamps: str = "iso_z"
    gateway_columns: str = "sample"
    gateway_format: str = "jsonl"
    gateway_has_instances: bool = True
    sglang_version: str = "0.5.15"
    duplicate_rate: float = 0.005
    write_content: bool = True
    page_simulation_max_requests: int = 2_000_000
    #: Column names for ``gateway_columns = "custom"`` (canonical name -> written name).
    custom_columns: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def scheduler_limit(self) -> int:
        """SGLang rejects (and, on a PD prefill node, leaks) prompts >= this many tokens."""
        return min(self.context_length, self.exposed_pool_tokens) - 6

    @property
    def simulates_pages(self) -> bool:
        return self.requests <= self.page_simulation_max_requests

    def with_overrides(self, overrides: dict[str, Any]) -> Scenario:
        return dataclasses.replace(self, **coerce_overrides(overrides))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.isoformat().replace("+00:00", "Z") if isinstance(value, datetime) else value
        return out


def validate(s: Scenario) -> None:
    """Refuse scenarios the simulator cannot honour, saying which knob to change."""
    checks: list[tuple[bool, str]] = [
        (s.start < s.exposure_start < s.fix_time < s.end, "need start < exposure_start < fix_time < end"),
        (s.fix_time - s.exposure_start >= timedelta(days=1), "the exposure must last at least one day"),
        (
            s.exposure_start + timedelta(hours=6) <= s.report_time < s.end,
            "report_time must be >= exposure_start + 6 h and before end",
        ),
        (s.end - s.fix_time >= timedelta(days=1), "leave at least one day after fix_time"),
        (
            s.exposed_pool_tokens + 64 < s.context_length or s.affected == 0,
            "exposed_pool_tokens must be below context_length when affected > 0",
        ),
        (s.fixed_pool_tokens >= s.context_length, "fixed_pool_tokens must be >= context_length"),
        (s.decode_pool_tokens >= s.context_length + 65_536, "decode_pool_tokens must exceed context_length"),
        (
            s.fixed_decode_pool_tokens >= s.context_length,
            "fixed_decode_pool_tokens must be >= context_length",
        ),
        (s.control_pool_tokens >= s.control_context_length, "control_pool_tokens must be >= its context"),
        (s.unified_pool_tokens >= s.unified_context_length, "unified_pool_tokens must be >= its context"),
        (s.prefill_instances >= 1 and s.decode_instances >= 1, "need at least one prefill and one decode"),
        (s.tp_size >= 1 and s.page_size >= 1, "tp_size and page_size must be positive"),
        (s.affected >= 0 and s.exploiters >= 0, "affected and exploiters must be >= 0"),
        (s.accounts >= s.affected_customer_accounts + 20, "accounts must exceed affected_customer_accounts"),
        (s.requests >= 2_000, "requests must be >= 2000"),
        (s.gateway_timestamps in TIMESTAMP_STYLES, f"gateway_timestamps must be one of {TIMESTAMP_STYLES}"),
        (s.gateway_columns in COLUMN_STYLES, f"gateway_columns must be one of {COLUMN_STYLES}"),
        (s.gateway_format in GATEWAY_FORMATS, f"gateway_format must be one of {GATEWAY_FORMATS}"),
        (s.sglang_version in SGLANG_LOG_VERSIONS, f"sglang_version must be one of {SGLANG_LOG_VERSIONS}"),
        (0.0 <= s.duplicate_rate < 0.5, "duplicate_rate must be in [0, 0.5)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message, location="scenario")
    if not fnmatch.fnmatchcase(s.internal_account, s.internal_account_glob):
        raise ConfigError("internal_account must match internal_account_glob", location="scenario")
    for zone in (s.engine_timezone, s.gateway_timezone):
        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ConfigError(f"unknown IANA time zone {zone!r}", location="scenario") from exc


def coerce_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Turn TOML/CLI values into field types (ISO strings into UTC datetimes)."""
    hints = get_type_hints(Scenario)
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in hints:
            raise ConfigError(f"unknown scenario field {key!r}", location="scenario")
        if hints[key] is datetime:
            value = _utc(value) if isinstance(value, str) else value
            if value.tzinfo is None:
                value = value.replace(tzinfo=UTC)
            value = value.astimezone(UTC)
        out[key] = value
    return out


def load_scenario_file(path: Path, base: Scenario | None = None) -> Scenario:
    """Read a TOML file of Scenario overrides (top level or under ``[scenario]``)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read scenario file: {exc}", location=str(path)) from exc
    overrides = data.get("scenario", data)
    return (base or Scenario()).with_overrides(overrides)
