"""Deployment exposure audit: the checks operators were told to make, per instance and start-up.

For each start-up (configuration interval) of each engine instance the audit gives six verdicts,
each ``pass`` / ``fail`` / ``unknown`` / ``not_applicable`` with a sentence and the file and line it
rests on. **Missing evidence is never a pass**: a setting the log does not show is ``unknown``. Each
verdict also says how its start-up ended and on which line (``end_reason``, ``end_file``,
``end_line``).

The package is laid out by stage, in the order the work is done:

* :mod:`.inputs`: the optional ``/get_server_info`` dumps and deployment manifest (their schema;
  :mod:`.tenancy` reads the manifest's ``[prefix_cache]`` table);
* :mod:`.startups`: start-ups from parsed logs or the evidence database, how each ended, bare
  restarts linked to their predecessors, engine events and dumps placed in their start-up;
* :mod:`.checks`: one module per check (1 KV pool vs context length, 2 engine version, 3 deferred
  KV release and transfer batch, 4 corruption detection, 5 load balancer, 6 prefix-cache isolation);
* :mod:`.model` and :mod:`.report`: the verdicts and the :class:`AuditReport` that answers
  "exposed?" and "exposed now?";
* :mod:`.render`: the report as a text table, Markdown and HTML (:meth:`AuditReport.to_json` is the
  machine-readable form);
* :mod:`.api`: the entry points :func:`audit_paths` (engine logs), :func:`audit_incident` (the
  engine logs of an incident file), :func:`audit_database` (an evidence database's ``capacity`` and
  ``engine_events``), :func:`audit_parses` and :func:`audit_startups` (already parsed).

A check-1 ``fail`` is **exposed** on a prefill or decode role, or where the role is unknown: the
deploy gate fails closed. A check-6 ``fail`` (a prefix cache shared across tenants) is exposed too. **Exposed now** (:attr:`AuditReport.exposed_now`, :meth:`AuditReport.now`)
counts only exposed start-ups still in force; one that shut down, restarted or was retired is listed
with its window and how it ended. :attr:`AuditReport.exit_code` is 1 when anything is exposed in the
audited period (now or before), 0 when clean (unknowns alone do not fail; they are listed) and 2
when nothing could be audited; :attr:`AuditReport.exit_code_now` is 1 only while an exposed start-up
is in force (``kvforensics audit --now``, a deploy gate). Unreadable inputs raise
:class:`~kvforensics.core.errors.InputError`.
"""

from kvforensics.audit.api import audit_database, audit_incident, audit_parses, audit_paths, audit_startups
from kvforensics.audit.inputs import DeploymentManifest, ServerInfo, read_manifest, read_server_info
from kvforensics.audit.model import (
    AUDIT_EVENT_KINDS,
    CHECKS,
    PD_ROLES,
    SGLANG_FIXED_VERSION,
    STATUSES,
    ExposureWindow,
    Verdict,
)
from kvforensics.audit.report import AuditReport

__all__ = [
    "AUDIT_EVENT_KINDS",
    "CHECKS",
    "PD_ROLES",
    "SGLANG_FIXED_VERSION",
    "STATUSES",
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
