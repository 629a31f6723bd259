"""``kvforensics simulate``: a thin shell over :func:`kvforensics.simulate.simulate`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rich.console import Console

from kvforensics.core.errors import ConfigError, KvForensicsError
from kvforensics.simulate.exports import EXPORT_STYLES, ExportResult, export_incident
from kvforensics.simulate.prefix import SCENARIO_NAMES as PREFIX_SCENARIOS
from kvforensics.simulate.prefix import PrefixResult, simulate_prefix
from kvforensics.simulate.run import SimulationResult, simulate
from kvforensics.simulate.scenario import (
    COLUMN_STYLES,
    GATEWAY_FORMATS,
    SGLANG_LOG_VERSIONS,
    TIMESTAMP_STYLES,
    Scenario,
    load_scenario_file,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="random seed (default 7, the sample)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="total gateway requests (default 20000); large values stream to disk",
    )
    parser.add_argument("--format", choices=GATEWAY_FORMATS, default=None, help="gateway log format")
    parser.add_argument("--affected", type=int, default=None, help="number of affected responses (default 155)")
    parser.add_argument("--exploiters", type=int, default=None, help="accounts that probe on purpose (default 0)")
    parser.add_argument("--engine-timezone", default=None, help="IANA zone of engine log timestamps")
    parser.add_argument("--timestamps", choices=TIMESTAMP_STYLES, default=None, help="gateway timestamp style")
    parser.add_argument("--columns", choices=COLUMN_STYLES, default=None, help="gateway column names")
    parser.add_argument("--sglang-version", choices=SGLANG_LOG_VERSIONS, default=None, help="engine log format")
    parser.add_argument(
        "--scenario-file",
        type=Path,
        default=None,
        help="TOML of Scenario overrides (top level or [scenario]); flags win",
    )
    parser.add_argument(
        "--export",
        choices=EXPORT_STYLES,
        default=None,
        help="write the incident as production exports instead: LiteLLM spend-log CSV, "
        "Grafana Loki and kubectl pod logs, pods replaced in rollouts (see simulate/exports.py)",
    )
    parser.add_argument(
        "--mechanism",
        choices=("stale_pages", "prefix_reuse"),
        default="stale_pages",
        help="exposure mechanism of the incident: stale KV pages (default, the sample) or prefix-cache "
        "reuse across tenants (with --prefix-scenario; only --seed and --requests apply)",
    )
    parser.add_argument(
        "--prefix-scenario",
        choices=tuple(PREFIX_SCENARIOS),
        default=None,
        help="with --mechanism prefix_reuse: which prefix-cache incident (see simulate/prefix)",
    )
    parser.add_argument(
        "--logcli-timezone",
        default="UTC",
        help="with --export: IANA zone logcli printed the Loki timestamps in (its --timezone)",
    )


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    base = load_scenario_file(args.scenario_file) if args.scenario_file else Scenario()
    flags = {
        "seed": args.seed,
        "requests": args.requests,
        "gateway_format": args.format,
        "affected": args.affected,
        "exploiters": args.exploiters,
        "engine_timezone": args.engine_timezone,
        "gateway_timestamps": args.timestamps,
        "gateway_columns": args.columns,
        "sglang_version": args.sglang_version,
    }
    return base.with_overrides({k: v for k, v in flags.items() if v is not None})


def summary(result: SimulationResult, console: Console) -> None:
    console.print(
        f"Wrote {result.out_dir}: {result.requests:,} requests ({result.gateway_lines:,} gateway lines), "
        f"{result.affected} affected responses from {result.affected_accounts} accounts, "
        f"{len(result.engine_logs)} engine logs."
    )
    for note in result.notes:
        console.print(f"Note: {note}")


def export_summary(result: ExportResult, console: Console) -> None:
    retired = sum(pod.successor_start is not None for pod in result.pods)
    console.print(
        f"Wrote {result.out_dir}: {result.requests:,} LiteLLM spend-log rows, {result.affected} affected "
        f"responses from {result.affected_accounts} accounts; {len(result.pods)} pods ({retired} replaced in "
        f"rollouts) in a Loki export ({result.loki_export.name}) and {len(result.kubectl_logs)} kubectl logs."
    )


def prefix_summary(result: PrefixResult, console: Console) -> None:
    console.print(
        f"Wrote {result.out_dir}: {result.scenario}, {result.requests:,} requests, {result.recipients} received "
        f"another tenant's prefix blocks ({result.recipient_accounts} accounts; {result.source_accounts} source "
        "accounts)."
    )


def run_prefix(args: argparse.Namespace, console: Console) -> None:
    if args.prefix_scenario is None:
        raise ConfigError(f"--mechanism prefix_reuse needs --prefix-scenario ({', '.join(PREFIX_SCENARIOS)})")
    if args.export or args.scenario_file:
        raise ConfigError("--export and --scenario-file apply to --mechanism stale_pages only")
    prefix_summary(simulate_prefix(args.prefix_scenario, args.out, args.seed, args.requests), console)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        if args.mechanism == "prefix_reuse":
            run_prefix(args, console)
            return 0
        if args.prefix_scenario is not None:
            raise ConfigError("--prefix-scenario needs --mechanism prefix_reuse")
        scenario = scenario_from_args(args)
        if args.export:
            export_summary(export_incident(scenario, args.out, args.logcli_timezone), console)
        else:
            summary(simulate(scenario, args.out), console)
    except KvForensicsError as exc:
        console.print(f"Error: {exc}", markup=False)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="kvforensics simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
