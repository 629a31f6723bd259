"""The library facade: one investigation, stage by stage. The CLI and the notebooks call this."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
from rich.markup import escape

from kvforensics.config import Incident, load_incident
from kvforensics.db import connect
from kvforensics.errors import ConfigError
from kvforensics.ingest import IngestResult, ingest
from kvforensics.progress import record_progress, stage
from kvforensics.scope import ScopeResult, scope


@dataclass
class Investigation:
    """An incident file and the output folder its evidence and report go to."""

    incident: Incident
    out_dir: Path
    strict: bool = False
    memory_limit: str | None = None
    progress: bool = True
    pdf: bool = True
    engine: str = "duckdb"               # where detect and scope run: duckdb | spark
    spark_master: str | None = None      # Spark master URL (default local[2])
    spark_requests_table: str | None = None  # else [settings] spark_requests_table
    sign_key: Path | None = None         # SSH private key: manifest.json.sig (ssh-keygen -Y sign, kvforensics.verify)
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    ingest_result: IngestResult | None = None
    scope_result: ScopeResult | None = None
    _con: duckdb.DuckDBPyConnection | None = None
    _spark: Any = None

    def __post_init__(self) -> None:
        from kvforensics.engines import ENGINES

        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @classmethod
    def open(cls, incident: str | Path | Incident, out_dir: str | Path, **kwargs: Any) -> "Investigation":
        inc = incident if isinstance(incident, Incident) else load_incident(incident)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return cls(incident=inc, out_dir=out, **kwargs)

    @property
    def db_path(self) -> Path:
        return self.out_dir / "evidence.duckdb"

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
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

    # --- stages -----------------------------------------------------------------------------------
    def ingest(self) -> IngestResult:
        stage(f"ingest: {len(self.incident.sources)} source(s)", self.progress)
        with record_progress("loading", self.progress) as (tick, describe):
            self.ingest_result = ingest(self.con, self.incident, strict=self.strict, tick=tick, on_file=describe)
        for w in self.ingest_result.warnings:
            stage(f"[yellow]warning:[/] {escape(w)}", self.progress)  # "[instances]" is text, not markup
        return self.ingest_result

    def detect(self) -> pd.DataFrame:
        from kvforensics.detect import detect

        stage(f"detect: rules and latency model{' (rules on Spark)' if self.spark else ''}", self.progress)
        return detect(self.con, overrides=self.incident.rule_parameters, spark=self.spark)

    def scope(self) -> ScopeResult:
        stage(f"scope: affected responses, recipients, sources, windows{' (on Spark)' if self.spark else ''}",
              self.progress)
        self.scope_result = scope(self.con, self.incident, spark=self.spark)
        return self.scope_result

    def write_outputs(self) -> dict[str, Any]:
        from kvforensics import outputs

        if self.scope_result is None:
            self.scope()
        assert self.scope_result is not None
        outputs.write_scope_json(self.scope_result, self.out_dir)
        outputs.write_tables(self.con, self.out_dir)
        return outputs.write_manifest(self.con, self.incident, self.scope_result, self.out_dir, self.started)

    def report(self) -> Path:
        from kvforensics.report.render import render_pdf, render_report

        stage("report: report.html, report.md, report.pdf, notices", self.progress)
        path = render_report(self.con, self.incident, self.out_dir)
        problem = render_pdf(self.out_dir) if self.pdf else "report.pdf not requested"
        if problem:
            stage(f"[yellow]note:[/] {problem}", self.progress)
        return path

    def seal(self) -> None:
        """The manifest's output hashes taken again after the report, so they cover every output; signed with
        ``sign_key``."""
        from kvforensics.verify import seal_manifest

        seal_manifest(self.out_dir, sign_key=self.sign_key)

    def run(self) -> ScopeResult:
        """Every stage, in order; returns the headline numbers."""
        try:
            self.ingest()
            self.detect()
            self.scope()
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

    def _repr_html_(self) -> str:
        from html import escape

        return (f"<b>Investigation</b> {escape(self.incident.id)}: {escape(self.incident.title)}<br>"
                f"{len(self.incident.sources)} sources, output in <code>{escape(str(self.out_dir))}</code>")


def run(incident: str | Path, out_dir: str | Path, **kwargs: Any) -> ScopeResult:
    """Run a whole investigation: ``kvforensics run incident.toml --out DIR``."""
    out = Path(out_dir)
    if kwargs.pop("fresh", False) and out.exists():
        shutil.rmtree(out)
    return Investigation.open(incident, out, **kwargs).run()
