"""Verify an output folder by re-deriving it.

``kvforensics verify DIR`` trusts nothing the run wrote. It

* checks the manifest's SSH signature (``--allowed-signers``; ``ssh-keygen -Y verify``, namespace ``kvforensics``);
* re-hashes every output file (scope.json, CSVs, reports, notices) against the manifest's ``outputs``: a file it
  lists must be there unchanged, a file it does not list must not (a folder ``kvforensics scope`` wrote holds no
  report or notices, and its manifest lists none);
* re-hashes every input against the manifest's ``inputs``;
* hashes every table of the evidence database (its rows as a multiset, by the method the manifest's
  ``table_digest`` names: rows-v4 the sorted table hashed column-wise, rows-v2 sorted row hashes, rows-v3 row
  hashes summed as LtHash; not the file's bytes, which change on open)
  against the manifest's ``tables``;
* re-runs detection and scope on a scratch copy of the evidence database and compares every table they write,
  every figure of scope.json, every row of the CSVs and every notice with what the folder holds, and re-renders
  report.md and report.html from it (with the time they state they were generated) and compares them byte for
  byte (report.pdf, printed by a browser, is checked by its hash only);
* re-ingests the inputs into a scratch database, runs detection and scope there, and compares every table with the
  evidence database (an input changed together with its hash in the manifest is caught here).

The evidence database is only ever opened read-only. :func:`verify` returns the problems found, one line each.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import duckdb

from kvforensics import __version__
from kvforensics.config import Incident, load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError, InputError, KvForensicsError
from kvforensics.evidence.digests import (
    CSV_OUTPUTS,
    HASHED_OUTPUTS,
    TABLE_DIGEST,
    TABLE_DIGESTS,
    output_digests,
    output_files,
    report_written,
    table_digests,
)
from kvforensics.sources.common.textio import file_digest

SIGNATURE_NAMESPACE = "kvforensics"
EVIDENCE = "evidence.duckdb"
MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"


def seal_manifest(out_dir: Path, *, sign_key: Path | None = None) -> dict[str, Any]:
    """Re-take the manifest's output hashes once every output is written (the report comes after the manifest's
    first writing), then sign it with ``sign_key``. Returns the manifest."""
    path = out_dir / MANIFEST
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest["outputs"] = output_digests(out_dir)
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if sign_key is not None:
        sign_manifest(out_dir, sign_key)
    return manifest


# --- signing --------------------------------------------------------------------------------------------------------


def _ssh_keygen() -> str:
    found = shutil.which("ssh-keygen")
    if not found:
        raise ConfigError(
            "ssh-keygen is not installed: install OpenSSH (e.g. apt-get install openssh-client) "
            "to sign or check a manifest signature"
        )
    return found


def check_sign_key(key: Path) -> None:
    """Refuse a signing key that does not exist, or signing without ssh-keygen."""
    if not Path(key).is_file():
        raise ConfigError(f"signing key {key} does not exist: name an SSH private key file with --sign-key")
    _ssh_keygen()


def sign_manifest(out_dir: Path, key: Path) -> Path:
    """Sign manifest.json with an SSH private key (``ssh-keygen -Y sign``); writes and returns manifest.json.sig."""
    check_sign_key(key)
    sig = out_dir / SIGNATURE
    sig.unlink(missing_ok=True)
    done = subprocess.run(
        [_ssh_keygen(), "-Y", "sign", "-f", str(key), "-n", SIGNATURE_NAMESPACE, str(out_dir / MANIFEST)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0 or not sig.exists():
        raise ConfigError(
            f"ssh-keygen could not sign the manifest with {key} ({_last_line(done.stderr)}); "
            "use an SSH private key without a passphrase or one loaded in ssh-agent"
        )
    return sig


def check_signature(out_dir: Path, allowed_signers: Path, identity: str | None = None) -> list[str]:
    """Problems with manifest.json.sig against an allowed-signers file (empty when the signature holds)."""
    if not Path(allowed_signers).is_file():
        raise ConfigError(
            f"allowed signers file {allowed_signers} does not exist: name the file listing the "
            "public keys allowed to sign (ssh-keygen ALLOWED SIGNERS format)"
        )
    identity = identity or _first_principal(Path(allowed_signers))
    sig = out_dir / SIGNATURE
    if not sig.exists():
        return [f"{SIGNATURE} is missing: the manifest is not signed (run with --sign-key)"]
    with (out_dir / MANIFEST).open("rb") as manifest:
        done = subprocess.run(
            [
                _ssh_keygen(),
                "-Y",
                "verify",
                "-f",
                str(allowed_signers),
                "-I",
                identity,
                "-n",
                SIGNATURE_NAMESPACE,
                "-s",
                str(sig),
            ],
            stdin=manifest,
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        return [
            f"{MANIFEST}: the signature does not hold for {identity!r} "
            f"({_last_line(done.stderr or done.stdout)}): the manifest was changed after signing, "
            "or signed by another key"
        ]
    return []


def signature_unchecked(out_dir: Path, allowed_signers: Path | None) -> str | None:
    """What to say when a folder's manifest is signed but no allowed-signers file was given to check it (a hash
    in an unsigned manifest proves nothing: anyone who edits an output can fix its hash)."""
    if allowed_signers is None and (Path(out_dir) / SIGNATURE).exists():
        return (
            f"{SIGNATURE} was not checked: the folder is signed, but who signed it is only checked with "
            "--allowed-signers (and --identity)"
        )
    return None


def _first_principal(allowed_signers: Path) -> str:
    for line in allowed_signers.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.split()[0].split(",")[0]
    raise ConfigError(
        f"allowed signers file {allowed_signers} names no principal: give --identity or add a "
        "line '<principal> <key type> <public key>'"
    )


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


# --- verify ---------------------------------------------------------------------------------------------------------


def verify(
    out_dir: Path, *, allowed_signers: Path | None = None, identity: str | None = None, rederive: bool = True
) -> list[str]:
    """Problems found (empty when the folder checks out). ``rederive=False`` (``verify --hashes-only``) checks the
    signature, the inputs', outputs' and tables' hashes and the headline figures against the evidence, but neither
    re-derives the figures from the evidence nor ingests the inputs again (which a full verify does, taking longer
    than the run): enough to show nothing changed since a signed manifest was written."""
    out_dir = Path(out_dir)
    manifest, scope_json = _read_json(out_dir, MANIFEST), _read_json(out_dir, "scope.json")
    db = out_dir / EVIDENCE
    if not db.is_file():
        raise InputError(
            f"{EVIDENCE} is missing: verify re-derives every figure from it; name the whole output "
            "folder of a `kvforensics run`",
            location=str(out_dir),
        )
    problems: list[str] = []
    if allowed_signers is not None:
        problems += check_signature(out_dir, allowed_signers, identity)
    problems += _check_outputs(out_dir, manifest)
    problems += _check_inputs(out_dir, manifest)
    incident = _incident(out_dir, manifest)
    evidence = connect(db, read_only=True)
    try:
        stored = table_digests(evidence)
        # a manifest written before `table_digest` was recorded hashed its tables row by row in Python
        method = manifest.get("table_digest", "rows-v1")
        if method not in TABLE_DIGESTS:
            problems.append(
                f"the manifest's table_digest {str(method)[:40]!r} is not one this version knows "
                f"({', '.join(TABLE_DIGESTS)}): its tables cannot be checked"
            )
            recorded = stored
        else:
            recorded = stored if method == TABLE_DIGEST else table_digests(evidence, method)
        problems += _check_headlines(evidence, scope_json)
    finally:
        evidence.close()
    problems += _compare_tables(manifest.get("tables"), recorded, "the manifest records")
    if not rederive:
        return problems
    with tempfile.TemporaryDirectory(prefix="kvforensics-verify-") as tmp:
        problems += _rederive_from_evidence(db, Path(tmp), incident, manifest, scope_json, stored, out_dir)
        try:
            fresh = _reinvestigate(Path(tmp) / "fresh", incident)
        except KvForensicsError as e:
            problems.append(f"the inputs no longer ingest as they did: {e}")
        else:
            # tables the run keeps about itself (e.g. the evidence set it recorded) are not derived from inputs
            problems += _compare_tables(
                fresh, {k: v for k, v in stored.items() if k in fresh}, "a fresh ingest of the inputs gives"
            )
    return problems


def _check_outputs(out_dir: Path, manifest: dict) -> list[str]:
    recorded = manifest.get("outputs")
    if not isinstance(recorded, dict):
        return [f"{MANIFEST} lists no output hashes: it was written by an older kvforensics; run again"]
    problems = []
    for rel, digest in sorted(recorded.items()):
        path = out_dir / rel
        if Path(rel).parts[:1] not in [(name,) for name in HASHED_OUTPUTS] or ".." in Path(rel).parts:
            problems.append(f"{MANIFEST} lists {rel!r} among the outputs, which no run writes: the manifest was edited")
        elif not path.is_file():
            problems.append(f"output missing: {rel}")
        elif (actual := file_digest(path)[0]) != digest:
            problems.append(f"output changed since the run: {rel} (sha256 {actual} != {digest})")
    problems += [f"output not in the manifest: {rel}" for rel in output_files(out_dir) if rel not in recorded]
    return problems


def _check_inputs(out_dir: Path, manifest: dict) -> list[str]:
    problems = []
    base = _incident_dir(out_dir, manifest)
    for i, item in enumerate(manifest.get("inputs") or []):
        if not isinstance(item, dict) or not isinstance(item.get("file"), str) or "sha256" not in item:
            problems.append(f"{MANIFEST} inputs[{i}] is not an input entry (file, sha256): the manifest was edited")
            continue
        path = Path(item["file"])
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            problems.append(f"input missing: {path}")
            continue
        digest, _ = file_digest(path)
        if digest != item["sha256"]:
            problems.append(f"input changed since the run: {path} (sha256 {digest} != {item['sha256']})")
    return problems


def _incident(out_dir: Path, manifest: dict) -> Incident:
    recorded = manifest.get("incident")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("file"), str):
        raise InputError(
            f"{MANIFEST} names no incident file: it is not the manifest `kvforensics run` writes", location=str(out_dir)
        )
    path = _incident_dir(out_dir, manifest) / recorded["file"]
    if not path.is_file():
        raise InputError(
            f"the incident file {path} is missing: verify needs it (and the inputs it names) to "
            "re-derive the figures; restore it at that path",
            location=str(out_dir),
        )
    incident = load_incident(path)
    if manifest.get("outside_incident_folder"):  # the run was allowed to read them; their hashes are checked
        incident = replace(incident, allow_outside=True)
    return incident


def _check_headlines(con: duckdb.DuckDBPyConnection, scope: dict) -> list[str]:
    """Each headline query (``outputs.HEADLINE_QUERIES``, the ones the manifest names; never SQL read from the
    folder), run on the evidence database, against scope.json."""
    from kvforensics.evidence.outputs import HEADLINE_QUERIES

    problems = []
    for key, query in HEADLINE_QUERIES.items():
        value = con.execute(query).fetchall()[0][0]
        expected: Any = scope
        for part in key.split("."):
            expected = expected.get(part) if isinstance(expected, dict) else None
        if isinstance(expected, list):
            expected = len(expected)
        if value != expected:
            problems.append(f"scope.json {key} = {expected}, but the database gives {value} ({query})")
    if "conclusive" in scope and scope["conclusive"] != (not scope.get("inconclusive_reasons")):
        problems.append(
            f"scope.json conclusive = {scope['conclusive']} contradicts its "
            f"{len(scope.get('inconclusive_reasons') or [])} inconclusive reason(s)"
        )
    return problems


def _rederive_from_evidence(
    db: Path,
    tmp: Path,
    incident: Incident,
    manifest: dict,
    scope_json: dict,
    stored: dict[str, dict[str, Any]],
    out_dir: Path,
) -> list[str]:
    """Detection, scope, CSVs and notices re-run on a scratch copy of the evidence database, compared."""
    from kvforensics.evidence.outputs import write_manifest, write_tables
    from kvforensics.report.notices import write_notices
    from kvforensics.report.render import render_pages
    from kvforensics.stages.detect import detect
    from kvforensics.stages.scope import scope

    work = tmp / "rederived"
    work.mkdir()
    shutil.copyfile(db, work / EVIDENCE)
    if Path(f"{db}.wal").exists():
        shutil.copyfile(f"{db}.wal", work / f"{EVIDENCE}.wal")
    recorded = manifest.get("outputs")
    # without the report stage no notice was written: only those present are compared (and each is unlisted)
    complete = report_written(recorded) if isinstance(recorded, dict) else True
    pages = [name for name in REPORT_PAGES if (out_dir / name).is_file() or complete]
    con = connect(work / EVIDENCE, memory_limit=incident.memory_limit)
    try:
        detect(con, overrides=incident.rule_parameters, mechanisms=incident.mechanisms)
        result = scope(con, incident)
        summary = result.summary
        derived = table_digests(con)
        raw_csv = manifest.get("csv_cells") == "raw"
        write_tables(con, work, raw_csv=raw_csv)
        write_notices(con, incident, work)
        if pages:  # the report as the evidence gives it: its manifest (warnings, assumptions) derived too
            write_manifest(con, incident, result, work, datetime.now(timezone.utc), raw_csv=raw_csv)
            render_pages(con, incident, work, generated=_stated_time(out_dir, pages))
    finally:
        con.close()
    problems = _compare_tables(derived, stored, "detection and scope re-run on it give")
    problems += [f"scope.json {p}" for p in _json_diff(scope_json, json.loads(json.dumps(summary)))]
    for name in CSV_OUTPUTS:
        problems += _csv_diff(out_dir / name, work / name)
    problems += _notices_diff(out_dir / "notices", work / "notices", complete=complete)
    tool = manifest.get("tool") if isinstance(manifest.get("tool"), dict) else {}
    problems += [_page_diff(out_dir / name, work / name, tool.get("version")) for name in pages]
    return [p for p in problems if p]


# the report's pages, re-rendered from the evidence by verify (report.pdf is a browser's print of report.html)
REPORT_PAGES = ("report.md", "report.html")
_GENERATED = re.compile(r"Generated (\S+) by kvforensics")


def _stated_time(out_dir: Path, pages: list[str]) -> str | None:
    """The time the folder's report says it was generated (not a figure: the one value a re-rendering takes
    from the report itself), from the first page that states one."""
    for name in pages:
        try:
            found = _GENERATED.search((out_dir / name).read_text(encoding="utf-8", errors="replace")[:20000])
        except OSError:
            continue
        if found:
            return found[1]
    return None


def _page_diff(have_path: Path, want_path: Path, version: Any) -> str | None:
    """Where a report page differs from the one re-rendered from the evidence (None when they are the same)."""
    name = have_path.name
    if not have_path.is_file():
        return f"{name} is missing; the evidence gives it"
    have, want = have_path.read_bytes(), want_path.read_bytes()
    if have == want:
        return None
    have_lines, want_lines = have.decode("utf-8", "replace").splitlines(), want.decode("utf-8", "replace").splitlines()
    line = next(
        (i for i, (a, b) in enumerate(zip(have_lines, want_lines, strict=False), 1) if a != b),
        min(len(have_lines), len(want_lines)) + 1,
    )
    a = have_lines[line - 1] if line <= len(have_lines) else "(end of file)"
    b = want_lines[line - 1] if line <= len(want_lines) else "(end of file)"
    older = (
        f" (the run was kvforensics {str(version)[:20]}, this is {__version__}: run it again to compare)"
        if version != __version__
        else ""
    )
    return (
        f"{name} differs from the report the evidence gives, first at line {line}: {_short(a[:300])}, "
        f"re-rendered {_short(b[:300])}{older}"
    )


def _reinvestigate(work: Path, incident: Incident) -> dict[str, dict[str, Any]]:
    """Table digests of a fresh ingest, detection and scope of the incident's inputs in a scratch database."""
    from kvforensics.audit.exposure import write_exposure_windows
    from kvforensics.audit.isolation import write_prefix_windows
    from kvforensics.stages.detect import detect
    from kvforensics.stages.ingest import ingest
    from kvforensics.stages.scope import scope

    work.mkdir()
    con = connect(work / EVIDENCE, memory_limit=incident.memory_limit)
    try:
        ingest(con, incident)
        write_prefix_windows(con, incident)
        write_exposure_windows(con)
        detect(con, overrides=incident.rule_parameters, mechanisms=incident.mechanisms)
        scope(con, incident)
        return table_digests(con)
    finally:
        con.close()


def _compare_tables(expected: Any, stored: dict[str, dict[str, Any]], what: str) -> list[str]:
    """One line per table of the evidence database that differs from ``expected`` (``what`` names its origin)."""
    if not isinstance(expected, dict):
        return [f"{MANIFEST} records no table hashes: it was written by an older kvforensics; run again"]
    problems = []
    for name in sorted(set(expected) | set(stored)):
        want, have = expected.get(name), stored.get(name)
        if have is None:
            problems.append(f"{EVIDENCE}: table {name} is missing, but {what} it")
        elif want is None:
            problems.append(f"{EVIDENCE}: table {name} ({have['rows']} rows) is not one {what}")
        elif want.get("sha256") != have["sha256"]:
            problems.append(
                f"{EVIDENCE}: table {name} has {have['rows']} rows that differ from the {want.get('rows')} {what}"
            )
    return problems


def _json_diff(have: Any, want: Any, path: str = "") -> Iterator[str]:
    """Where a JSON value differs from the re-derived one, e.g. ``windows[0].last = X, re-derived Y``."""
    if isinstance(have, dict) and isinstance(want, dict):
        for key in list(want) + [k for k in have if k not in want]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in have:
                yield f"{sub} is missing; re-derived {json.dumps(want[key])}"
            elif key not in want:
                yield f"{sub} = {json.dumps(have[key])} is not a figure the evidence gives"
            else:
                yield from _json_diff(have[key], want[key], sub)
    elif isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
        for i, (a, b) in enumerate(zip(have, want, strict=True)):
            yield from _json_diff(a, b, f"{path}[{i}]")
    elif have != want or type(have) is not type(want):
        yield f"{path} = {_short(have)}, re-derived {_short(want)}"


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _csv_rows(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        return list(csv.reader(fh))


def _csv_diff(have_path: Path, want_path: Path) -> list[str]:
    """Each row of a CSV the folder holds that the re-derived one lacks, and the other way round."""
    name = have_path.name
    if not have_path.is_file():
        return [f"{name} is missing"]
    have, want = _csv_rows(have_path), _csv_rows(want_path)
    if have[:1] != want[:1]:
        return [f"{name}: header {have[:1]} differs from {want[:1]}"]
    problems = []
    for i, (a, b) in enumerate(zip(have[1:], want[1:], strict=False), start=2):
        if a != b:
            problems.append(f"{name} line {i}: {_short(a)}, re-derived {_short(b)}")
            break  # after a deleted or inserted row every later row shifts: the counts below say the rest
    if len(have) != len(want):
        missing = {tuple(r) for r in want[1:]} - {tuple(r) for r in have[1:]}
        extra = {tuple(r) for r in have[1:]} - {tuple(r) for r in want[1:]}
        problems.append(
            f"{name}: {len(have) - 1} rows, re-derived {len(want) - 1} "
            f"({len(missing)} missing, {len(extra)} not re-derived)"
        )
    return problems


def _notices_diff(have_dir: Path, want_dir: Path, *, complete: bool = True) -> list[str]:
    """Each notice that differs from the re-derived ones; those re-derived but absent only when the folder should
    hold every notice (``complete``: the report stage wrote it)."""
    have = (
        {p.relative_to(have_dir).as_posix() for p in have_dir.rglob("*") if p.is_file()} if have_dir.is_dir() else set()
    )
    want = (
        {p.relative_to(want_dir).as_posix() for p in want_dir.rglob("*") if p.is_file()} if want_dir.is_dir() else set()
    )
    problems = [f"notices/{rel} is missing; the evidence gives it" for rel in sorted(want - have) if complete]
    problems += [f"notices/{rel} is not a notice the evidence gives" for rel in sorted(have - want)]
    problems += [
        f"notices/{rel} differs from the notice the evidence gives"
        for rel in sorted(have & want)
        if (have_dir / rel).read_bytes() != (want_dir / rel).read_bytes()
    ]
    return problems


def _read_json(out_dir: Path, name: str) -> dict:
    path = out_dir / name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(
            f"{name} is missing: name the output folder of a `kvforensics run`", location=str(out_dir)
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(
            f"{name} is not the JSON `kvforensics run` writes ({e}); run the investigation again", location=str(path)
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"{name} is not the JSON object `kvforensics run` writes", location=str(path))
    return data


def _incident_dir(out_dir: Path, manifest: dict) -> Path:
    recorded = manifest.get("incident")
    folder = recorded.get("dir") if isinstance(recorded, dict) else None
    return Path(folder) if isinstance(folder, str) and folder else out_dir
