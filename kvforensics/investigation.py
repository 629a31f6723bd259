"""The library facade: one investigation, stage by stage. The CLI and the notebooks call this."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import duckdb
import pandas as pd
from rich.markup import escape

from kvforensics.audit.exposure import write_exposure_windows
from kvforensics.audit.isolation import write_prefix_windows
from kvforensics.config import Incident, load_incident
from kvforensics.core.db import connect, has_table
from kvforensics.core.errors import ConfigError, InputError
from kvforensics.core.progress import record_progress, stage
from kvforensics.evidence.digests import CSV_OUTPUTS
from kvforensics.evidence.evidence_set import changes, current_inputs, record, recorded_inputs, scope_key
from kvforensics.evidence.output_folder import FolderLock, check_out_dir, clear_evidence, new_staging, publish
from kvforensics.stages.ingest import IngestResult, ingest
from kvforensics.stages.scope import ScopeResult, scope


@dataclass
class Investigation:
    """An incident file and the output folder its evidence and report go to."""

    incident: Incident
    out_dir: Path
    strict: bool = False
    memory_limit: str | None = None
    progress: bool = True
    pdf: bool = True
    raw_csv: bool = False  # CSV cells as read, formula starts not neutralised (machine consumers)
    engine: str = "duckdb"  # where detect and scope run: duckdb | spark
    spark_master: str | None = None  # Spark master URL (default local[2])
    spark_requests_table: str | None = None  # else [settings] spark_requests_table
    sign_key: Path | None = None  # SSH private key: manifest.json.sig (ssh-keygen -Y sign, kvforensics.evidence.verify)
    rebuild: bool = True  # inputs changed since the folder was built: build afresh
    append: bool = False  # ... or load only the added files (refused if any other change)
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    evidence_built: str | None = None  # how this run came to its evidence set (manifest run.evidence)
    ingest_result: IngestResult | None = None
    scope_result: ScopeResult | None = None
    scope_reused: bool = False  # the report reused the folder's scope of the same inputs (not run again)
    _con: duckdb.DuckDBPyConnection | None = None
    _spark: Any = None
    _lock: FolderLock | None = None
    _staging: Path | None = None
    _digests: dict[str, tuple[str, int]] = field(default_factory=dict)  # input files hashed by _prepare_evidence
    _scope_key: str | None = None  # evidence_set.scope_key when scope() ran: the manifest's run.scope_key

    def __post_init__(self) -> None:
        from kvforensics.engines import ENGINES

        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @classmethod
    def open(cls, incident: str | Path | Incident, out_dir: str | Path, **kwargs: Any) -> "Investigation":
        inc = incident if isinstance(incident, Incident) else load_incident(incident)
        out = Path(out_dir)
        check_out_dir(out, inc)
        out.mkdir(parents=True, exist_ok=True)
        investigation = cls(incident=inc, out_dir=out, **kwargs)
        investigation.lock()
        return investigation

    @classmethod
    def open_or_build(
        cls, incident: str | Path | Incident, out_dir: str | Path, through: str = "scope", **kwargs: Any
    ) -> "Investigation":
        """Open an output folder to read it, first building, in order, the stages up to *through* (ingest,
        detect, scope or report) whose output it lacks: a notebook runs on its own on a fresh folder. A stage
        whose output is there is not run again (``kvforensics run`` rebuilds a folder whose inputs changed)."""
        if through not in cls.STAGES:
            raise ConfigError(f"through must be one of {', '.join(cls.STAGES)}, got {through!r}")
        investigation = cls.open(incident, out_dir, **kwargs)
        try:
            for name in cls.STAGES[: cls.STAGES.index(through) + 1]:
                if not investigation.has(name):
                    investigation._build(name)
        except BaseException:
            investigation.close()
            raise
        return investigation

    def _build(self, stage_name: str) -> None:
        if stage_name == "ingest":
            self.ingest()
        elif stage_name == "detect":
            self.detect()
        else:  # scope writes scope.json, the CSVs and the manifest; the report adds report and notices
            self.scope_outputs(with_report=stage_name == "report")

    def lock(self) -> None:
        """Take the output folder's lock (a second run into the same folder stops with an error)."""
        if self._lock is None:
            self._lock = FolderLock(self.out_dir)
        self._lock.acquire()

    @property
    def db_path(self) -> Path:
        return self.out_dir / "evidence.duckdb"

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self.lock()
            self._con = connect(self.db_path, memory_limit=self.memory_limit or self.incident.memory_limit)
        return self._con

    @property
    def spark(self) -> Any:
        """The Spark engine of a ``--engine spark`` investigation (None on DuckDB)."""
        if self.engine != "spark":
            return None
        if self._spark is None:
            from kvforensics.engines.spark import SparkEngine, requests_table_setting

            table = self.spark_requests_table or requests_table_setting(self.incident)
            self._spark = SparkEngine.start(self.spark_master, table)
        return self._spark

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None
        if self._lock is not None:
            self._lock.release()

    @property
    def write_dir(self) -> Path:
        """Where outputs are written now: the staging folder while one is open, else the output folder."""
        return self._staging or self.out_dir

    @contextmanager
    def writing(self, stale: tuple[str, ...] = ()) -> Iterator[Path]:
        """A staging folder the outputs are written into, moved into the output folder when the block
        ends without error (files renamed, folders swapped whole; *stale* names it lacks removed); an
        error leaves the outputs already in place untouched. Nested blocks share the outer one."""
        if self._staging is not None:
            yield self._staging
            return
        self._staging = new_staging(self.out_dir)
        try:
            yield self._staging
            publish(self._staging, self.out_dir, remove=stale)
        finally:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def _prepare_evidence(self) -> None:
        """Compare the inputs with the evidence set the folder holds: the same set resumes; a changed
        one is built afresh (or refused with --no-rebuild, or appended to with --append when files were
        only added). Records the set in the database before anything is read."""
        if any(not s.files() for s in self.incident.sources):
            return  # the ingest names the path that matches nothing, before anything changes
        self.close()
        inputs = current_inputs(self.incident)
        try:
            old, loaded = recorded_inputs(self.db_path)
        except duckdb.Error as e:
            raise InputError(
                f"{self.db_path} cannot be read ({' '.join(str(e).split())[:200]}): delete it or "
                f"use another --out folder"
            ) from None
        self.lock()
        if old is None:
            diff = "the evidence database records no input set (an older kvforensics built it)" if loaded else ""
            can_append = False
        else:
            found = changes(old, inputs)
            diff, can_append = found.describe(), found.only_adds
        if not diff:
            built = "new" if old is None else "same inputs: files already loaded are not read again"
        elif self.append and can_append:
            built = f"appended: {diff}"
        elif self.append:
            raise InputError(
                f"--append only adds files, but the inputs changed since {self.out_dir} was built "
                f"({diff}): run without --append to build the evidence afresh"
            )
        elif not self.rebuild:
            raise InputError(
                f"the inputs changed since {self.out_dir} was built ({diff}): run without "
                f"--no-rebuild to build the evidence afresh, or use another --out folder"
            )
        else:
            clear_evidence(self.out_dir)
            built = f"rebuilt: the inputs changed ({diff})"
            stage(f"[yellow]evidence built afresh:[/] {escape(diff)}", self.progress)
        self.evidence_built = built
        self._digests = dict(inputs.digests)
        record(self.con, inputs)

    # --- stages -----------------------------------------------------------------------------------
    STAGES = ("ingest", "detect", "scope", "report")
    # the table each stage leaves in the evidence database (the report: report.html in the folder)
    _STAGE_TABLES = {"ingest": "load_report", "detect": "request_tiers", "scope": "log_gaps"}

    def has(self, stage_name: str) -> bool:
        """Whether the folder holds the output of *stage_name* (one of ``STAGES``)."""
        if stage_name == "report":
            return (self.out_dir / "report.html").is_file()
        table = self._STAGE_TABLES[stage_name]
        present = self.db_path.is_file() and has_table(self.con, table)
        if present and table == "load_report":
            present = bool(self.con.execute("SELECT count(*) FROM load_report").fetchone()[0])
        return present

    def require(self, stage_name: str) -> None:
        """Refuse a stage whose inputs an earlier stage has not written yet, naming the command to run first
        (``detect`` on an empty folder must not say "0 findings")."""
        before = self.STAGES[self.STAGES.index(stage_name) - 1]
        if not self.has(before):
            raise InputError(
                f"{self.out_dir} holds no output of '{before}' yet: run `kvforensics {before} "
                f"{self.incident.path.name} --out {self.out_dir}` first (or `kvforensics run`)"
            )

    def ingest(self) -> IngestResult:
        stage(f"ingest: {len(self.incident.sources)} source(s)", self.progress)
        self._prepare_evidence()
        with record_progress("loading", self.progress) as (tick, describe):
            self.ingest_result = ingest(
                self.con, self.incident, strict=self.strict, tick=tick, on_file=describe, digests=self._digests
            )
        write_prefix_windows(self.con, self.incident)  # the prefix_reuse exposure windows of the start-ups
        write_exposure_windows(self.con)  # the stale_pages ones: the start-ups audit check 1 fails
        for w in self.ingest_result.warnings:
            stage(f"[yellow]warning:[/] {escape(w)}", self.progress)  # "[instances]" is text, not markup
        return self.ingest_result

    def detect(self) -> pd.DataFrame:
        from kvforensics.stages.detect import detect

        stage(f"detect: rules and latency model{' (rules on Spark)' if self.spark else ''}", self.progress)
        return detect(
            self.con, overrides=self.incident.rule_parameters, spark=self.spark, mechanisms=self.incident.mechanisms
        )

    def scope(self) -> ScopeResult:
        stage(
            f"scope: affected responses, recipients, sources, windows{' (on Spark)' if self.spark else ''}",
            self.progress,
        )
        key = scope_key(self.con, self.incident)  # before: what this scope follows from
        self.scope_result = scope(self.con, self.incident, spark=self.spark)
        self._scope_key = key
        return self.scope_result

    def completed_scope(self) -> ScopeResult | None:
        """The scope the output folder already holds, if it was computed from the same incident file, the same
        evidence set and the same kvforensics version (its manifest's ``run.scope_key``) and its outputs are in
        place; else None. Detect, run again on the same inputs, gives the same tables."""
        scope_json, manifest_json = self.out_dir / "scope.json", self.out_dir / "manifest.json"
        if not (
            self.has("scope")
            and scope_json.is_file()
            and manifest_json.is_file()
            and all((self.out_dir / name).is_file() for name in CSV_OUTPUTS)
        ):
            return None
        try:
            manifest = json.loads(manifest_json.read_text(encoding="utf-8"))
            summary = json.loads(scope_json.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        recorded = (manifest.get("run") or {}).get("scope_key") if isinstance(manifest, dict) else None
        if recorded is None or recorded != scope_key(self.con, self.incident):
            return None
        return ScopeResult(summary=summary, parameters=manifest.get("scope_parameters") or {})

    def write_outputs(self) -> dict[str, Any]:
        from kvforensics.evidence import outputs

        if self.scope_result is None:
            self.scope()
        assert self.scope_result is not None
        with self.writing() as out:
            outputs.write_scope_json(self.scope_result, out)
            outputs.write_tables(self.con, out, raw_csv=self.raw_csv)
            manifest = outputs.write_manifest(
                self.con, self.incident, self.scope_result, out, self.started, raw_csv=self.raw_csv
            )
            run = {
                "evidence": self.evidence_built,  # how this run came to its evidence set, beside its times
                "scope_key": self._scope_key,
            }  # what the scope followed from: a report may reuse it
            if any(run.values()):
                manifest["run"].update({k: v for k, v in run.items() if v})
                (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        return manifest

    def report(self) -> Path:
        from kvforensics.report.render import render_pdf, render_report, report_files

        stage("report: " + ", ".join(report_files(pdf=self.pdf)), self.progress)
        with self.writing(stale=("report.pdf", "notices")) as out:
            if not (out / "manifest.json").exists() and (self.out_dir / "manifest.json").exists():
                shutil.copy2(self.out_dir / "manifest.json", out / "manifest.json")  # the report cites it
            render_report(self.con, self.incident, out)
            problem = render_pdf(out) if self.pdf else None  # --no-pdf: none asked for, nothing to say
        if problem:
            stage(f"[yellow]note:[/] {problem}", self.progress)
        if self.incident.notice.missing:
            stage(
                f"[yellow]note:[/] the notices are drafts: the incident file's \\[notice] gives no "
                f"{', '.join(self.incident.notice.missing)}",
                self.progress,
            )
        return self.out_dir / "report.html"

    def seal(self) -> None:
        """The manifest's output hashes taken again after the report, so they cover every output; signed with
        ``sign_key``."""
        from kvforensics.evidence.verify import seal_manifest

        seal_manifest(self.write_dir, sign_key=self.sign_key)

    def scope_outputs(self, with_report: bool) -> ScopeResult:
        """``kvforensics scope`` / ``report`` on an ingested and detected folder: scope, then its outputs
        (scope.json, CSVs, manifest) and, with the report, the report and notices, put in place together. A
        report of an earlier scope is removed by ``scope`` alone (it would no longer match scope.json). The report
        of a folder that holds a completed scope of the same inputs (:meth:`completed_scope`) reuses it: its
        scope.json, CSVs and manifest stay as they are, and only the report and notices are written."""
        self.require("scope")
        if with_report and (done := self.completed_scope()) is not None:
            return self._report_of(done)
        result = self.scope()
        report_files = ("report.html", "report.md", "report.pdf", "notices")
        stale = ("manifest.json.sig",) + (("report.pdf", "notices") if with_report else report_files)
        with self.writing(stale=stale):
            self.write_outputs()
            if with_report:
                self.report()
            self.seal()
        return result

    def _report_of(self, done: ScopeResult) -> ScopeResult:
        """The report and notices of the folder's completed scope *done*, its outputs left as they are."""
        stage("scope: reused (the folder's scope is of the same incident file and evidence)", self.progress)
        self.scope_result, self.scope_reused = done, True
        with self.writing(stale=("report.pdf", "notices", "manifest.json.sig")) as out:
            for name in ("scope.json", *CSV_OUTPUTS):  # beside the report, so that the seal hashes every output
                _link_or_copy(self.out_dir / name, out / name)
            self.report()
            self.seal()
        return done

    def run(self) -> ScopeResult:
        """Every stage, in order; returns the headline numbers."""
        try:
            self.ingest()
            self.detect()
            self.scope()
            with self.writing(
                stale=("report.pdf", "notices", "manifest.json.sig")
            ):  # every output put in place together
                self.write_outputs()
                self.report()
                self.seal()
            self.con.execute("CHECKPOINT").fetchall()
        finally:
            self.close()
        assert self.scope_result is not None
        return self.scope_result

    # --- notebook helpers -------------------------------------------------------------------------
    def query(self, sql_text: str, params: dict | None = None) -> pd.DataFrame:
        """A read-only query on the evidence database as a DataFrame."""
        return self.con.execute(sql_text, params).df() if params else self.con.execute(sql_text).df()

    def _stages_present(self) -> list[str]:
        try:
            return [name for name in self.STAGES if self.has(name)]
        except Exception:  # noqa: BLE001 - a closed folder: its repr still says what it is
            return []

    def __repr__(self) -> str:
        """One line (the dataclass repr printed the whole incident, ~18,000 characters, in a notebook)."""
        stages = ", ".join(self._stages_present()) or "none yet"
        return (
            f"Investigation({self.incident.id!r}: {len(self.incident.sources)} sources, output in "
            f"{str(self.out_dir)!r}, stages in the folder: {stages})"
        )

    def _repr_html_(self) -> str:
        from html import escape

        stages = ", ".join(self._stages_present()) or "none yet"
        return (
            f"<b>Investigation</b> {escape(self.incident.id)}: {escape(self.incident.title)}<br>"
            f"{len(self.incident.sources)} sources, output in <code>{escape(str(self.out_dir))}</code>; "
            f"stages in the folder: {escape(stages)}"
        )


def _link_or_copy(src: Path, dst: Path) -> None:
    """*dst* as a hard link to *src* (renaming it over *src* later does nothing), else a copy."""
    try:
        dst.hardlink_to(src)
    except OSError:
        shutil.copy2(src, dst)


def run(incident: str | Path, out_dir: str | Path, **kwargs: Any) -> ScopeResult:
    """Run a whole investigation: ``kvforensics run incident.toml --out DIR``."""
    fresh = kwargs.pop("fresh", False)
    investigation = Investigation.open(incident, out_dir, **kwargs)
    if fresh:  # the folder's earlier evidence and outputs, once its lock is held
        clear_evidence(investigation.out_dir)
    return investigation.run()
