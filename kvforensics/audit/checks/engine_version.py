"""Check 2: the engine version vs the first release with the complete PD reject-path fix (SGLang 0.5.22).

The version comes from the log, a ``/get_server_info`` dump, or the range inferred from the log's
format (the detail says which). A range whose upper bound is below 0.5.22 fails; one that straddles
it is ``unknown``. Only disaggregated roles need the fix (unified: ``not_applicable``, the version
is still reported). With the role unknown, a would-be ``fail`` is ``unknown``.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvforensics.audit.checks.common import Judged, role_unknown
from kvforensics.audit.model import SGLANG_FIXED_VERSION
from kvforensics.audit.phrases import loc, thousands
from kvforensics.audit.startups import Startup


def _version_of(text: str | None) -> Version | None:
    if text is None:
        return None
    try:
        return Version(text.strip().lstrip("v"))
    except InvalidVersion:
        return None


def is_fixed(v: Version) -> bool:
    return v >= SGLANG_FIXED_VERSION


def exact_version(s: Startup) -> Version | None:
    if s.version_source in ("log", "declared"):
        v = _version_of(s.version)
        if v is not None:
            return v
    if s.server_info is not None:
        return _version_of(s.server_info.version)
    return None


_SPEC_PART = re.compile(r"(>=|<=|>|<|==)\s*v?(\d+(?:\.\d+)*)")


def inferred_spec(s: Startup) -> str | None:
    spec = s.flags.get("engine_version_spec")
    if spec:
        return spec
    if s.version and s.version_source and s.version_source.startswith("inferred"):
        m = re.match(r"\s*([<>=][^ ]*)", s.version)
        return m.group(1) if m else None
    return None


def spec_side(spec: str, bound: Version = SGLANG_FIXED_VERSION) -> str:
    """'below' / 'above' *bound* (default: the fixed release) for every version in *spec*, else 'both'."""
    below = above = False
    for op, number in _SPEC_PART.findall(spec):
        v = Version(number)
        if (op == "<" and v <= bound) or (op == "<=" and v < bound):
            below = True
        if (op in (">=", ">") and v >= bound) or (op == "==" and v >= bound):
            above = True
        if op == "==" and v < bound:
            below = True
    return "below" if below else "above" if above else "both"


def _version_text(s: Startup) -> str:
    if s.version_source == "declared" and s.version:
        return f"{s.version} (declared in [prefix_cache] engine_version; the log names none)"
    if s.version_source == "log" and s.version:
        if "engine_version" not in s.evidence:
            return f"{s.version} (from the log)"
        return f"{s.version} (from the log, {loc(*s.where('engine_version'))})"
    if s.server_info is not None and s.server_info.version:
        return f"{s.server_info.version} (from {Path(s.server_info.file).name})"
    if s.version:
        return s.version.replace("(inferred:", "(inferred from format:")
    return "not logged"


def check_engine_version(s: Startup) -> Judged:
    file, line = s.where("engine_version")
    if s.engine != "sglang":
        return (
            "not_applicable",
            (
                f"{s.engine}: the SGLang disaggregated reject-path fix (>= "
                f"{SGLANG_FIXED_VERSION}) does not apply; engine version {_version_text(s)}"
            ),
            file,
            line,
        )
    if s.pd is False:
        return (
            "not_applicable",
            (
                f"unified (non-disaggregated) server: the PD reject-path fix (>= "
                f"{SGLANG_FIXED_VERSION}) does not apply; engine version {_version_text(s)}"
            ),
            file,
            line,
        )
    info = s.server_info
    if info is not None and info.version is not None:
        info_at = (info.file, info.line_of("version"))
        logged = _version_of(s.version) if s.version_source == "log" else None
        from_info = _version_of(info.version)
        if logged is not None and from_info is not None and logged != from_info:
            return (
                "unknown",
                (
                    f"the log says SGLang {s.version} ({loc(file, line)}) but "
                    f"{Path(info.file).name} says {info.version}: confirm which build runs"
                ),
                *info_at,
            )
        if logged is None:
            file, line = info_at
    exact = exact_version(s)
    if exact is not None:
        what = f"SGLang {_version_text(s)}"
        if exact.release[:3] == SGLANG_FIXED_VERSION.release[:3] and (exact.is_prerelease or exact.is_devrelease):
            return (
                "unknown",
                (
                    f"{what} is a pre-release of {SGLANG_FIXED_VERSION}: it may or may not carry the "
                    "complete fix; confirm or upgrade"
                ),
                file,
                line,
            )
        if is_fixed(exact):
            return (
                "pass",
                (
                    f"{what} >= {SGLANG_FIXED_VERSION}: a request with a pending abort is refused at the "
                    "disaggregation admission queue before any KV is sent"
                ),
                file,
                line,
            )
        return role_unknown(
            s,
            (
                "fail",
                (
                    f"{what} < {SGLANG_FIXED_VERSION}: a prompt the scheduler aborts is still "
                    "admitted, prefilled as a 1-token stub and handed to decode; upgrade to >= "
                    f"{SGLANG_FIXED_VERSION}{_aborts_handed_on(s)}"
                ),
                file,
                line,
            ),
        )
    spec = inferred_spec(s)
    if spec is not None:
        side = spec_side(spec)
        what = f"SGLang {_version_text(s)}"
        if side == "below":
            return role_unknown(
                s,
                (
                    "fail",
                    (
                        f"{what}: every release in that range is below "
                        f"{SGLANG_FIXED_VERSION}, which first refuses oversize requests before the "
                        f"hand-off; upgrade to >= {SGLANG_FIXED_VERSION}{_aborts_handed_on(s)}"
                    ),
                    file,
                    line,
                ),
            )
        if side == "above":
            return ("pass", f"{what}: every release in that range is >= {SGLANG_FIXED_VERSION}", file, line)
        return (
            "unknown",
            (
                f"{what}: the range includes releases before and after {SGLANG_FIXED_VERSION}; "
                "give a /get_server_info dump to confirm the build"
            ),
            file,
            line,
        )
    return (
        "unknown",
        (
            "no engine version: SGLang does not log it at start-up and the format gives no clue; "
            "give a /get_server_info dump"
        ),
        file,
        line,
    )


def _aborts_handed_on(s: Startup) -> str:
    """On a vulnerable prefill node, the scheduler aborts in the log are the leak path being taken."""
    aborts = s.events.get("scheduler_abort")
    if s.role != "prefill" or aborts is None:
        return ""
    return (
        f"; the log shows {thousands(aborts.count)} scheduler abort(s) on this prefill node (first at "
        f"{loc(aborts.first_file, aborts.first_line)}): with this build each was still handed to decode"
    )
