"""The whole pipeline never ends in a traceback, and says when its evidence is inconclusive.

Generated small incidents (gateway records with random NULLs and odd values, engine logs whose
start-ups lack a model, role, pool or time, empty sources, instance names no log knows) go through
``kvforensics run`` (ingest, detect, scope, outputs, report). Every run ends in exit 0, 2 or 3 with at
most a one-line message and never the last-resort "unexpected" error; 0 and 3 agree with
``scope.json``; and the run is inconclusive (exit 3) whenever its inputs make that certain.
``KVF_EXAMPLES`` sets the number of generated incidents. Every engine-log fixture of the test suite
also goes through a whole run as the engine source of a small incident.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import INCIDENT, write_mini
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.cli import main

EXAMPLES = int(os.environ.get("KVF_EXAMPLES", 8))
WHOLE_RUNS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {"m1": "org/M1", "m2": "org/M2"}  # gateway id -> the engine's served_model_name
LOGGED_INSTANCES = ("p0", "p1", "d0", "u0")
# gateway instance names: logged ones, names no log can know, and odd text
UNKNOWN_INSTANCE = "zz-unlogged-9"
INSTANCE_NAMES = st.sampled_from(
    [
        *LOGGED_INSTANCES,
        UNKNOWN_INSTANCE,
        "p0.pd.svc.cluster.local:30000",
        " ",
        "",
        "Ünï-çødé",
        "p0;DROP TABLE requests",
        "'\"",
        "a" * 300,
    ]
)

MINI_ALIASES = 'aliases = { "zai-org/GLM-5.3-FP8" = "@cf/zai-org/glm-5.3" }'
assert MINI_ALIASES in INCIDENT
# the small incident's file, serving the generated models
incident_text = INCIDENT.replace(
    MINI_ALIASES, "aliases = { " + ", ".join(f'"{e}" = "{g}"' for g, e in MODELS.items()) + " }"
)


@st.composite
def requests(draw: st.DrawFn, logged: list[str]) -> list[dict]:
    """Gateway records; whether some are broken (a text status, more cache hits than prompt tokens), name
    a model no log serves or an instance no log knows is decided once per incident."""
    flaws = draw(st.sets(st.sampled_from(["broken", "unserved", "unknown"])))
    broken, unserved, unknown = ("broken" in flaws), ("unserved" in flaws), ("unknown" in flaws)
    models = [*MODELS, "m-nolog"] if unserved else list(MODELS)
    names = INSTANCE_NAMES if unknown else st.sampled_from(logged)
    rows = []
    for i in range(draw(st.integers(0, 25))):
        prompt = draw(st.sampled_from([0, 10, 5000, 700000, 2_000_000]))
        row = {
            "rid": f"r{i}",
            "received_at": f"2026-08-{draw(st.integers(20, 30))}T{draw(st.integers(0, 23)):02d}:00:00Z",
            "account_id": draw(st.sampled_from(["a1", "a2", "loadtest-1", "Ω"])),
            "model": draw(st.sampled_from(models)),
            "http_status": draw(st.sampled_from([200, 200, 400, 500] + (["success"] if broken else []))),
            "prompt_tokens": prompt,
        }
        cached = st.integers(0, prompt + (10 if broken else 0))
        for field, values in (
            ("ttft_ms", st.floats(0, 1e5)),
            ("latency_ms", st.floats(0, 1e6)),
            ("completion_tokens", st.integers(0, 5000)),
            ("cached_tokens", cached),
            ("prefill_instance", names),
            ("decode_instance", names),
        ):
            choice = draw(st.integers(0, 2))  # absent, null, a value
            if choice == 1:
                row[field] = None
            elif choice == 2:
                row[field] = draw(values)
        rows.append(row)
    return rows


@st.composite
def startup(draw: st.DrawFn, day: int, complete: bool, model: str | None = None) -> list[str]:
    """One engine start-up; unless ``complete``, any of its model, role, pool, context and time may be missing."""
    stamp = f"2026-08-{day:02d} {draw(st.integers(0, 23)):02d}:00:00"
    timed = complete or draw(st.booleans())

    def line(text: str) -> str:
        return f"[{stamp}] {text}" if timed else text

    def part(strategy: st.SearchStrategy) -> object:
        return draw(strategy) if complete else draw(st.none() | strategy)

    args = []
    model = model or part(st.sampled_from(sorted(MODELS.values())))
    if model:
        args += [f"model_path='{model}'", f"served_model_name='{model}'"]
    context = part(st.sampled_from([32768, 1048576]))
    if context is not None:
        args.append(f"context_length={context}")
    role = draw(st.sampled_from([None, "prefill", "decode"]))
    if role:
        args.append(f"disaggregation_mode='{role}'")
    lines = [line(f"server_args=ServerArgs({', '.join(args)})")] if args or draw(st.booleans()) else []
    pool = part(st.sampled_from([5000, 681280, 2042880]))
    if pool is not None:
        lines.append(line(f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {pool}, KV size: 40.10 GB"))
        if context is not None:
            lines.append(
                line(
                    f"max_total_num_tokens={pool}, chunked_prefill_size=8192, max_prefill_tokens=16384, "
                    f"max_running_requests=64, context_len={context}, available_gpu_mem=12.34 GB"
                )
            )
    if draw(st.booleans()):
        rid = f"r{draw(st.integers(0, 25))}"
        lines.append(
            line(
                f"Input length (700000 tokens) exceeds the maximum allowed length (681274 tokens). Use a "
                f"shorter input or enable --allow-auto-truncate., self.rid='{rid}'"
            )
        )
    return lines


@st.composite
def engine_logs(draw: st.DrawFn) -> dict[str, str]:
    """Either tidy logs (a complete start-up of each model before the traffic, maybe a restart) or
    arbitrary ones (start-ups at any time, any part missing)."""
    if draw(st.booleans()):
        logs = {}
        for name, model in zip(("p0", "u0"), MODELS.values(), strict=True):
            lines = draw(startup(1, True, model))
            if draw(st.booleans()):
                lines += draw(startup(draw(st.integers(20, 30)), True, model))
            logs[name] = "".join(line + "\n" for line in lines)
        return logs
    logs = {}
    for name in draw(st.lists(st.sampled_from(LOGGED_INSTANCES), min_size=1, max_size=3, unique=True)):
        days = sorted(draw(st.lists(st.integers(20, 30), max_size=2)))
        logs[name] = "".join(line + "\n" for day in days for line in draw(startup(day, False)))
    return logs


def write_incident(root: Path, rows: list[dict], logs: dict[str, str], gateway_text: str | None = None) -> Path:
    (root / "gateway").mkdir(parents=True)
    (root / "engine").mkdir()
    (root / "gateway" / "day1.jsonl").write_text(
        gateway_text if gateway_text is not None else "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8"
    )
    for name, text in logs.items():
        (root / "engine" / f"{name}.log").write_text(text, encoding="utf-8")
    (root / "incident.toml").write_text(incident_text, encoding="utf-8")
    return root / "incident.toml"


def run_quietly(incident: Path, out: Path) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf"])
    return code, stdout.getvalue(), stderr.getvalue()


def check_outcome(code: int, stdout: str, stderr: str, out: Path, *, rederive: bool = True) -> dict | None:
    """The properties every run has; the scope of a completed run. ``rederive``: a full verify of the folder (else
    its hashes and headline figures only)."""
    assert code in (0, 2, 3), (code, stderr)
    assert "Traceback" not in stderr and "unexpected" not in stderr, stderr
    if code == 2:
        assert stderr.startswith("Error: ") and stderr.count("\n") == 1, stderr
        return None
    scope = json.loads((out / "scope.json").read_text())
    assert scope["conclusive"] is (code == 0)
    assert bool(scope["inconclusive_reasons"]) is (code == 3)
    assert (code == 3) is stdout.startswith("INCONCLUSIVE")
    first = (out / "report.md").read_text().splitlines()[0]
    assert first.startswith("**INCONCLUSIVE") is (code == 3)
    # readable; inputs are unchanged (and, in full, every figure re-derived without a traceback)
    assert main(["verify", str(out), *([] if rederive else ["--hashes-only"])]) in (0, 1)
    return scope


def predicted_reasons(rows: list[dict], logs: dict[str, str]) -> set[str]:
    """Reasons certain from the inputs alone (each implies at least one reason of that code)."""
    valid = [
        r for r in rows if isinstance(r["http_status"], int) and (r.get("cached_tokens") or 0) <= r["prompt_tokens"]
    ]
    reasons = set()
    if len(valid) < len(rows):  # any quarantined record is above 1% of at most 25
        reasons.add("quarantine_share")
    if not valid:
        reasons.add("no_requests")
    if any(r["model"] == "m-nolog" for r in valid):
        reasons.add("model_without_capacity")
    if any(UNKNOWN_INSTANCE in (r.get("prefill_instance"), r.get("decode_instance")) for r in valid):
        reasons.add("unknown_instances")
    return reasons


@WHOLE_RUNS
@given(data=st.data(), empty_gateway=st.booleans() | st.none())
def test_any_generated_incident_ends_in_0_2_or_3(data, empty_gateway):
    logs = data.draw(engine_logs(), label="engine logs")
    rows = data.draw(requests(sorted(logs)), label="gateway records")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if empty_gateway:
            rows = []
        incident = write_incident(root / "in", rows, logs, "" if empty_gateway else None)
        code, stdout, stderr = run_quietly(incident, root / "out")
        scope = check_outcome(code, stdout, stderr, root / "out")
        if scope is not None:
            got = {r["code"] for r in scope["inconclusive_reasons"]}
            assert predicted_reasons(rows, logs) <= got, (got, stdout)


# real start-up logs, and engine logs in their collection envelopes (Loki, CloudWatch, journald, ...)
ENGINE_FIXTURES = (
    sorted((FIXTURES / "engine_logs").glob("*.log"))
    + sorted((FIXTURES / "audit").glob("*.log"))
    + sorted(f for f in (FIXTURES / "envelopes").glob("*") if f.suffix in (".log", ".json", ".jsonl"))
)


@pytest.mark.slow
@pytest.mark.parametrize("log", ENGINE_FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_engine_log_fixture_runs_to_the_end(log, tmp_path):
    """Observation 5 of issue 12: real start-up logs (some without model, role, pool or time) and
    exported ones (a Loki export among them) as the engine source of the small incident: outputs and
    report are written, and no traceback."""
    root = tmp_path / "in"
    write_mini(root, incident=INCIDENT.replace('format = "sglang"', 'format = "auto"'))
    for old in (root / "engine").glob("*.log"):
        old.unlink()
    shutil.copy(log, root / "engine" / f"{log.stem}.log")
    code, stdout, stderr = run_quietly(root / "incident.toml", tmp_path / "out")
    # the engine logs change only the capacity the rules read: the generated incidents verify in full
    scope = check_outcome(code, stdout, stderr, tmp_path / "out", rederive=False)
    if scope is not None:
        assert (tmp_path / "out" / "report.html").exists() and (tmp_path / "out" / "manifest.json").exists()
        if not _serves_the_gateway_model(tmp_path / "out"):
            # no start-up of the gateway's model: its responses cannot be judged, never an all-clear
            assert code == 3 and "model_without_capacity" in {r["code"] for r in scope["inconclusive_reasons"]}


def _serves_the_gateway_model(out: Path) -> bool:
    import duckdb

    con = duckdb.connect(str(out / "evidence.duckdb"), read_only=True)
    try:
        return bool(con.execute("SELECT count(*) FROM capacity WHERE model = '@cf/zai-org/glm-5.3'").fetchall()[0][0])
    finally:
        con.close()
