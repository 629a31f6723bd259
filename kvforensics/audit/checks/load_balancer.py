"""Check 5: the load balancer does not abort before the first token on client disconnect.

From the deployment manifest only (``unknown`` without one; schema in :mod:`kvforensics.audit.inputs`).
``"never"`` and ``"after_first_token"`` pass, ``"always"`` fails, a missing key is ``unknown``.
Disaggregated roles only.
"""

from __future__ import annotations

from kvforensics.audit.checks.common import Judged, role_unknown
from kvforensics.audit.inputs import DeploymentManifest
from kvforensics.audit.startups import Startup


def check_load_balancer(s: Startup, manifest: DeploymentManifest | None) -> Judged:
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
        return role_unknown(
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
