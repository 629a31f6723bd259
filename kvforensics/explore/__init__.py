"""Exploring an investigation in a notebook: what each stage found, and drill-downs into one account, one
engine instance or one affected response. Every function takes the investigation's connection
(``inv.con``), reads the evidence database (names go to DuckDB as parameters) and returns a
:class:`~kvforensics.explore.view.View` (a table, a sentence on how to read it, sometimes a chart).

``stages``: one function per stage question; ``drill``: the drill-downs; ``outputs``: the money charts of
every model, the report and the output folder; ``offline``: charts without network (``offline_charts()`` in a
notebook's first cell) and :func:`export_html`.
"""

from __future__ import annotations

from kvforensics.explore.drill import (
    Examples,
    account_exposure,
    account_timeline,
    examples,
    instance_history,
    response_evidence,
    response_sources,
)
from kvforensics.explore.offline import export_html, offline_charts
from kvforensics.explore.outputs import model_charts, output_files, report_preview
from kvforensics.explore.stages import (
    NOTIFICATION_ROLES,
    conclusiveness,
    exploitation,
    exposure_windows,
    flagged,
    ingest_notes,
    instance_names,
    latency_model,
    loaded,
    loaded_files,
    notification_list,
    quarantine,
    quarantined_records,
    recipients,
    rules,
    sources_per_response,
    startups,
    tiers,
)
from kvforensics.explore.view import View

__all__ = [
    "NOTIFICATION_ROLES",
    "Examples",
    "View",
    "account_exposure",
    "account_timeline",
    "conclusiveness",
    "examples",
    "exploitation",
    "export_html",
    "exposure_windows",
    "flagged",
    "ingest_notes",
    "instance_history",
    "instance_names",
    "latency_model",
    "loaded",
    "loaded_files",
    "model_charts",
    "notification_list",
    "offline_charts",
    "output_files",
    "quarantine",
    "quarantined_records",
    "recipients",
    "report_preview",
    "response_evidence",
    "response_sources",
    "rules",
    "sources_per_response",
    "startups",
    "tiers",
]
