"""The exposure windows of the ``prefix_reuse`` mechanism: table ``prefix_windows``.

Cross-tenant reuse of prefix-cache blocks needs a path that ignores the tenant's namespace, and that
path is a configuration of an engine start-up: a store whose keys drop the salt (an SGLang HiCache
storage backend before sgl-project/sglang#38577, LMCache), no salt or a client-chosen one on a
multi-tenant deployment, an engine build that ignores the salt, a block hash that collides (audit check
6, :func:`kvforensics.audit.checks.prefix_cache.isolation_paths`). So exposure has windows per instance,
from the start-up that opened the path to the one that closed it, as a pool smaller than the context
has for the stale-pages mechanism. The facts no log holds (tenancy, who sets the salt, the engine build
when the log names none) come from the incident file's ``[prefix_cache]`` table, with the keys of the
audit manifest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvforensics.audit.api import declare_versions
from kvforensics.audit.checks.prefix_cache import PATH_REACH, isolation_paths
from kvforensics.audit.inputs import DeploymentManifest
from kvforensics.audit.startups import from_capacity_row

if TYPE_CHECKING:
    import duckdb

    from kvforensics.config import Incident

_COLUMNS = (
    "instance",
    "model",
    "engine",
    "engine_version",
    "valid_from",
    "valid_to",
    "end_reason",
    "path",
    "reach",
    "status",
    "sentence",
    "evidence_file",
    "evidence_line",
    "startup_file",
    "startup_line",
)


def incident_manifest(incident: Incident) -> DeploymentManifest | None:
    """The incident file's ``[prefix_cache]`` isolation facts as a deployment manifest (None: none stated)."""
    if incident.prefix_isolation is None:
        return None
    return DeploymentManifest(file=str(incident.path), name=None, default=None, prefix_cache=incident.prefix_isolation)


def write_prefix_windows(con: duckdb.DuckDBPyConnection, incident: Incident) -> int:
    """Rebuild ``prefix_windows`` from the ``capacity`` start-ups; the number of start-ups with a path."""
    from kvforensics.core.db import sql

    manifest = incident_manifest(incident)
    startups = [from_capacity_row(r) for r in con.execute(sql("audit_capacity")).fetchall()]
    declare_versions(startups, manifest)
    rows = []
    for s in startups:
        paths = isolation_paths(s, manifest)
        head = (s.instance, s.model, s.engine, s.version, s.ts, s.to, s.end_reason)
        for path, status, sentence, file, line in paths or [("isolated", "pass", "no path across tenants", None, None)]:
            reach = PATH_REACH.get(path, "none")
            rows.append((*head, path, reach, status, sentence, file, line, s.file, s.line))
    con.execute("DELETE FROM prefix_windows").fetchall()
    if rows:
        con.executemany(
            f"INSERT INTO prefix_windows ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", rows
        )
    return sum(1 for r in rows if r[7] != "isolated")
