"""Command line: thin shells over the library. Errors print ``Error: ...`` and exit 2; a run whose evidence
cannot support its answer prints why and exits 3."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import Callable

from kvforensics import __version__
from kvforensics.core.errors import KvForensicsError
from kvforensics.core.escaping import visible_controls

EXIT_INCONCLUSIVE = 3  # completed, but the evidence cannot support the answer (kvforensics.stages.conclusive)
EXIT_PIPE_CLOSED = 141  # the reader of stdout went away (| head): as a tool ended by SIGPIPE, 128 + 13

# --help, wrapped by hand (RawDescriptionHelpFormatter keeps the lines as written)
DESCRIPTION = """\
Investigate a suspected leak of KV-cache contents between the customers of an
LLM inference provider: ingest gateway request logs and SGLang/vLLM engine logs
into DuckDB, detect the affected responses, scope who is affected and write the
report. 'kvforensics run incident.toml --out DIR' does every step; ingest,
detect, scope and report each do one on the same folder."""
EPILOG = f"""\
Also: audit checks deployments for exposure (no incident needed), watch
follows the sources as they grow and alerts, verify re-derives an output
folder, simulate writes a synthetic incident. See
'kvforensics COMMAND -h' for each command's options.

Exit codes: 0 done; 1 audit found an exposure, or verify a difference; 2 could
not run (one line says what to fix; --debug shows the traceback); {EXIT_INCONCLUSIVE} done, but
the evidence cannot support the answer; {EXIT_PIPE_CLOSED} the reader of the output went away."""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("incident", type=Path, help="the incident file (incident.toml)")
    p.add_argument("--out", type=Path, required=True, help="output folder (evidence.duckdb, scope.json, report)")
    p.add_argument("--strict", action="store_true", help="fail on the first record that would be quarantined")
    p.add_argument(
        "--memory-limit",
        help="DuckDB memory limit, e.g. 2GB (spills to disk beyond it; default: "
        "[settings] memory_limit, else the smaller of 4GB and half the machine's memory)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--no-pdf", action="store_true", help="skip report.pdf (it needs a local Chromium)")
    p.add_argument(
        "--engine",
        choices=["duckdb", "spark"],
        default="duckdb",
        help="where detect and scope run (ingest is always DuckDB; spark needs the 'spark' extra)",
    )
    p.add_argument("--spark-master", help="Spark master URL for --engine spark (default local[2])")
    p.add_argument(
        "--allow-outside",
        action="store_true",
        help="read source files that resolve outside the incident folder ('..', symbolic links; "
        "[settings] allow_outside); the manifest lists them",
    )


def _investigation(args: argparse.Namespace):
    from dataclasses import replace

    from kvforensics.config import load_incident
    from kvforensics.core.errors import ConfigError
    from kvforensics.investigation import Investigation

    if args.spark_master and args.engine != "spark":
        raise ConfigError("--spark-master needs --engine spark")
    incident = load_incident(args.incident)
    if args.allow_outside:
        incident = replace(incident, allow_outside=True)
    return Investigation.open(
        incident,
        args.out,
        strict=args.strict,
        memory_limit=args.memory_limit,
        progress=not args.quiet,
        pdf=not args.no_pdf,
        engine=args.engine,
        spark_master=args.spark_master,
        raw_csv=getattr(args, "raw_csv", False),
        rebuild=not getattr(args, "no_rebuild", False),
        append=getattr(args, "append", False),
    )


def _verdict(summary: dict) -> int:
    """Print why the evidence cannot support the answer, loud and before the headline; the exit code."""
    reasons = summary.get("inconclusive_reasons") or []
    if not reasons:
        return 0
    print(
        f"INCONCLUSIVE: the evidence cannot support this answer ({len(reasons)} reason(s)); "
        "fix these and run again before relying on any figure below"
    )
    for r in reasons:
        print(visible_controls(f"  ! [{r['code']}] {r['message']}"))
    return EXIT_INCONCLUSIVE


def cmd_run(args: argparse.Namespace) -> int:
    if args.sign_key:
        from kvforensics.evidence.verify import check_sign_key

        check_sign_key(args.sign_key)  # before the run, not after it
    inv = _investigation(args)
    inv.sign_key = args.sign_key
    result = inv.run()
    s = result.summary
    code = _verdict(s)
    print(
        f"{s['affected_responses']} affected responses, {s['affected_accounts']} accounts received foreign data; "
        f"source accounts: {s['source_accounts']['confirmed']} confirmed, {s['source_accounts']['possible']} possible"
    )
    for w in s["windows"]:
        print(visible_controls(f"  {w['model']}: {w['responses']} from {w['first']} to {w['last']}"))
    print(f"report: {args.out / 'report.html'}")
    return code


def cmd_ingest(args: argparse.Namespace) -> int:
    inv = _investigation(args)
    try:
        r = inv.ingest()
    finally:
        inv.close()
    print(f"{r.records_read} records read, {r.quarantined} quarantined, from {len(r.files)} file(s) into {inv.db_path}")
    return 0


def cmd_detect(args: argparse.Namespace) -> int:
    inv = _investigation(args)
    try:
        inv.require("detect")
        found = inv.detect()
        tiers = inv.query("SELECT confidence, count(*) AS n FROM request_tiers GROUP BY 1 ORDER BY 1")
    finally:
        inv.close()
    print(f"{len(found)} findings; " + ", ".join(f"{r.confidence}: {r.n}" for r in tiers.itertuples()))
    return 0


def cmd_scope(args: argparse.Namespace) -> int:
    inv = _investigation(args)
    try:
        s = inv.scope_outputs(with_report=False).summary
    finally:
        inv.close()
    code = _verdict(s)
    print(
        f"{s['affected_responses']} affected responses, {s['affected_accounts']} accounts; "
        f"scope.json, CSVs and manifest.json in {args.out}"
    )
    return code


def cmd_report(args: argparse.Namespace) -> int:
    inv = _investigation(args)
    try:
        s = inv.scope_outputs(with_report=True).summary
        path = inv.out_dir / "report.html"
    finally:
        inv.close()
    code = _verdict(s)
    print(f"report: {path}")
    return code


def cmd_verify(args: argparse.Namespace) -> int:
    from kvforensics.evidence.verify import signature_unchecked, verify

    problems = verify(
        args.dir, allowed_signers=args.allowed_signers, identity=args.identity, rederive=not args.hashes_only
    )
    for p in problems:
        print(visible_controls(p))
    unchecked = signature_unchecked(args.dir, args.allowed_signers)
    if unchecked:
        print(f"note: {unchecked}")
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    signed = "manifest signature holds; " if args.allowed_signers else ""
    if args.hashes_only:
        print(
            f"{signed}inputs, outputs and evidence tables unchanged since the manifest was written, headline figures "
            "matching the evidence (nothing re-derived: run verify without --hashes-only for that)"
        )
        return 0
    print(
        f"{signed}inputs and outputs unchanged; every table, figure, CSV row and notice re-derived and matching, "
        "report.md and report.html re-rendered and matching"
    )
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from kvforensics import audit

    kwargs = {"server_info": list(args.server_info), "manifest": args.manifest}
    if args.incident and args.instance:
        print(
            "Error: --instance names the instances of engine logs given on the command line; with --incident, "
            "set `instance` in each engine_log source of the incident file",
            file=sys.stderr,
        )
        return 2
    if args.incident:
        from kvforensics.config import load_incident

        report = audit.audit_incident(load_incident(args.incident), **kwargs)
    else:
        if not args.sources:
            print("Error: name engine logs to audit, or --incident incident.toml", file=sys.stderr)
            return 2
        report = audit.audit_paths(
            list(args.sources),
            fmt=args.format,
            tz=args.timezone,
            year=args.year,
            envelope=args.envelope,
            instance_template=args.instance,
            **kwargs,
        )
    if args.json:
        print(report.to_json())
    elif args.markdown:
        print(report.to_markdown())
    else:
        report.render_terminal()  # stdout; as wide as the table when that is a file or a pipe
    return report.exit_code_now if args.now else report.exit_code


def cmd_watch(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvforensics.config import load_incident
    from kvforensics.core.errors import ConfigError
    from kvforensics.watch import Watch, WatchOptions

    if args.interval <= 0 or args.silence <= 0:
        raise ConfigError("--interval and --silence are seconds above 0")
    incident = load_incident(args.incident)
    if args.allow_outside:
        incident = replace(incident, allow_outside=True)
    options = WatchOptions(
        interval=args.interval,
        silence=args.silence,
        alert_command=args.alert_command,
        memory_limit=args.memory_limit,
        status=not args.quiet,
    )
    watch = Watch(incident, args.out, options)
    if not args.quiet:
        print(
            visible_controls(
                f"watching {len(incident.sources)} source(s) of {incident.path.name} every "
                f"{args.interval:g} s; alerts to {args.out / 'alerts.jsonl'} (Ctrl-C stops)"
            ),
            file=sys.stderr,
            flush=True,
        )
    done = watch.run(once=args.once)
    if not args.quiet:
        print(
            visible_controls(
                f"stopped: {done.requests} requests in {args.out / 'evidence.duckdb'}, {done.alerts} "
                "alert(s) in alerts.jsonl; `kvforensics scope` or `report` on the folder gives the "
                "answer"
            ),
            file=sys.stderr,
        )
        if done.alerted_not_in_answer:
            print(
                visible_controls(
                    f"note: {len(done.alerted_not_in_answer)} response(s) alerted while watching are "
                    "not affected in the answer of all the evidence (e.g. "
                    f"{done.alerted_not_in_answer[0]})"
                ),
                file=sys.stderr,
            )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from kvforensics.simulate.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from kvforensics.config import ENGINE_ENVELOPES

    parser = argparse.ArgumentParser(
        prog="kvforensics", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvforensics {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
        "run": (cmd_run, "the whole investigation: ingest, detect, scope, outputs, report"),
        "ingest": (cmd_ingest, "load every source into evidence.duckdb"),
        "detect": (cmd_detect, "run the detection rules on an ingested database"),
        "scope": (cmd_scope, "compute affected responses, recipients, sources and windows"),
        "report": (cmd_report, "render report.html, report.md and notices"),
    }
    for name, (func, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text)
        _add_common(p)
        if name == "run":
            p.add_argument(
                "--sign-key",
                type=Path,
                help="SSH private key to sign manifest.json with "
                "(ssh-keygen -Y sign, namespace kvforensics; writes manifest.json.sig)",
            )
        if name in ("run", "scope"):  # the commands that write the CSVs
            p.add_argument(
                "--raw-csv",
                action="store_true",
                help="write CSV cells as read, without the ' before =, +, -, @ (for machine consumers)",
            )
        if name in ("run", "ingest"):  # the commands that read the inputs
            changed = p.add_mutually_exclusive_group()
            changed.add_argument(
                "--no-rebuild",
                action="store_true",
                help="if the inputs changed since --out was built, stop (exit 2) instead of "
                "building the evidence afresh",
            )
            changed.add_argument(
                "--append",
                action="store_true",
                help="load only the input files added since --out was built into its evidence "
                "(refused if any was removed or modified)",
            )
        p.set_defaults(func=func)
    a = sub.add_parser(
        "audit",
        help="is any deployment exposed now? the six operator checks (exit 1 if anything "
        "was exposed in the logs, --now: if a start-up still in force is)",
    )
    a.add_argument("sources", nargs="*", type=Path, help="engine logs (plain, .gz or .zst)")
    a.add_argument("--incident", type=Path, help="audit the engine logs of an incident file instead")
    a.add_argument("--server-info", type=Path, action="append", default=[], help="a /get_server_info JSON dump")
    a.add_argument(
        "--manifest",
        type=Path,
        help="deployment manifest (TOML/YAML): load balancer and prefix-cache tenancy ([prefix_cache])",
    )
    a.add_argument("--format", default="auto", choices=["auto", "sglang", "vllm"])
    a.add_argument("--timezone", default="UTC", help="IANA zone of the log timestamps")
    a.add_argument("--year", type=int, help="year for vLLM timestamps, which carry none")
    a.add_argument(
        "--instance",
        metavar="TEMPLATE",
        help="the instance a log belongs to, from its path: {stem} (file name without extensions), {name}, "
        "{parent} (its folder), {label:NAME} (an envelope label); default {stem}, or {parent} "
        "(said in a note) when files in different folders share a stem (engines/*/sglang.log.gz)",
    )
    a.add_argument(
        "--envelope",
        default="auto",
        choices=list(ENGINE_ENVELOPES),
        help="the collection envelope of the engine logs (auto: recognised from the first lines; "
        "an incident file sets it per source)",
    )
    a.add_argument("--json", action="store_true", help="print JSON")
    a.add_argument("--markdown", action="store_true", help="print Markdown")
    a.add_argument(
        "--now",
        action="store_true",
        help="exit 1 only while an exposed start-up is still in force (a deploy gate); without it, 1 when "
        "any start-up in the logs was exposed, also one that has since shut down or restarted",
    )
    a.set_defaults(func=cmd_audit)
    v = sub.add_parser(
        "verify",
        help="re-hash inputs and outputs, re-derive every figure from the evidence (exit 1 if anything differs)",
    )
    v.add_argument("dir", type=Path, help="an output folder of 'kvforensics run'")
    v.add_argument(
        "--allowed-signers", type=Path, help="ssh-keygen allowed signers file: check manifest.json.sig against it"
    )
    v.add_argument("--identity", help="the signer's principal in --allowed-signers (default: its first one)")
    v.add_argument(
        "--hashes-only",
        action="store_true",
        help="check the hashes and headline figures only; re-derive nothing (a fraction of the time of a full "
        "verify, which runs the investigation again)",
    )
    v.set_defaults(func=cmd_verify)
    w = sub.add_parser(
        "watch",
        help="follow the sources as they grow; alert on exposed start-ups, affected responses "
        "and gaps in the evidence (alerts.jsonl, stdout)",
    )
    w.add_argument("incident", type=Path, help="the incident file (incident.toml)")
    w.add_argument(
        "--out",
        type=Path,
        required=True,
        help="output folder: evidence.duckdb and alerts.jsonl (a restart resumes where it stopped)",
    )
    w.add_argument("--interval", type=float, default=5.0, help="seconds between polls (default 5)")
    w.add_argument(
        "--silence",
        type=float,
        default=600.0,
        help="a source that has not grown for this many seconds is an evidence gap (default 600)",
    )
    w.add_argument(
        "--alert-command",
        metavar="CMD",
        help="run CMD (split as a shell splits it, not run by one) per batch of alerts, their JSON lines "
        "on its standard input",
    )
    w.add_argument("--once", action="store_true", help="one poll, then stop (and settle the folder)")
    w.add_argument("--memory-limit", help="DuckDB memory limit, e.g. 2GB")
    w.add_argument("--quiet", action="store_true", help="no status lines on stderr (alerts still go to stdout)")
    w.add_argument(
        "--allow-outside",
        action="store_true",
        help="read source files that resolve outside the incident folder ([settings] allow_outside)",
    )
    w.set_defaults(func=cmd_watch)
    try:
        from kvforensics.simulate.cli import add_arguments
    except ImportError:  # pragma: no cover - the simulator is part of the package
        add_arguments = None
    s = sub.add_parser("simulate", help="generate a synthetic incident (the bundled sample, or larger)")
    if add_arguments:
        add_arguments(s)
    s.set_defaults(func=cmd_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Output for a reader that went away (``| head``) ends the command quietly."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here rather than as a warning at interpreter exit
    except BrokenPipeError:
        # Python docs, signal module, "Note on SIGPIPE": send the rest of the output nowhere and stop
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        raise
    except Exception as e:  # noqa: BLE001 - every error ends in one line; the traceback only with --debug
        if args.debug:
            raise
        print(f"Error: {_describe(e)}", file=sys.stderr)
        return 2


def _describe(e: Exception) -> str:
    """What went wrong and what to do, in one line."""
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(
        e
    ):  # OSError or duckdb's IOException
        return (
            f"out of disk space ({_one_line(e)}): DuckDB spills beyond memory_limit into <out>/evidence.spill; "
            "free disk there, or run with --out on a larger disk"
        )
    if isinstance(e, (KvForensicsError, OSError)):  # bad input or configuration: the message says what to fix
        return str(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryException":  # duckdb's, without importing it
        return (
            f"out of memory ({_one_line(e)}): set a larger --memory-limit or [settings] memory_limit "
            "(DuckDB spills to disk beyond it), or free memory"
        )
    return (
        f"unexpected {type(e).__name__}{_origin(e)}: {_one_line(e)}. This is a kvforensics bug: run again with "
        "--debug for the traceback and report it with the input that caused it"
    )


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:300] + "..."


def _origin(e: BaseException) -> str:
    """`` in <file>:<line>`` of the innermost kvforensics frame of the exception."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__) if "kvforensics" in f.filename]
    return f" in {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


if __name__ == "__main__":
    sys.exit(main())
