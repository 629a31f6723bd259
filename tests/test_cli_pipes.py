"""The command line in pipes and files: output on stdout, lines as long as their content, and a reader that
goes away (``| head``) ends a command quietly. Every test runs the installed console script."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvforensics.audit import audit_paths

KVF = shutil.which("kvforensics", path=str(Path(sys.executable).parent)) or "kvforensics"
AUDIT = Path(__file__).parent / "fixtures" / "audit"
LOGS = [AUDIT / "glm53-prefill-0.log", AUDIT / "glm53-decode-0.log"]
EVERY_LOG = sorted(AUDIT.glob("*.log")) + sorted((Path(__file__).parent / "fixtures" / "engine_logs").glob("*.log"))
PIPE_CLOSED = 141  # 128 + SIGPIPE, as a tool ended by the signal


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the variables that make Rich guess a terminal or a width."""
    drop = ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | extra


def run_to_file(args: list[str], out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    with out.open("w") as f:
        return subprocess.run(
            [KVF, *args], stdout=f, stderr=subprocess.PIPE, text=True, env=clean_env(**env), timeout=300
        )


def run_into_closed_pipe(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run with stdout on a pipe whose reader has already gone: the first write that reaches it fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [KVF, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=cwd, env=clean_env(), timeout=300
        )
    finally:
        os.close(write_end)


# --- audit > file ------------------------------------------------------------------------------


def test_audit_writes_its_table_to_stdout_one_line_per_verdict(tmp_path: Path) -> None:
    expected = audit_paths(LOGS)
    out = tmp_path / "audit.txt"
    # an exported COLUMNS (as many shells do) must not narrow a file either
    done = run_to_file(["audit", *map(str, LOGS)], out, COLUMNS="80")
    assert (done.returncode, done.stderr) == (expected.exit_code, "")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "Deployment exposure audit"
    assert expected.headline() in lines and expected.now() in lines
    rows = [ln for ln in lines if ln.startswith("│")]
    assert len(rows) == len(expected.verdicts)  # no row continues on a second line
    assert all(ln.count("│") == 10 for ln in rows)  # nine columns, each cell on its row
    for v in expected.verdicts:  # the longest cell, whole on one line
        assert any(v.detail in ln for ln in rows), v.detail
    assert max(len(ln) for ln in lines) > 80
    assert not any(ln.endswith(" ") for ln in lines)


def test_audit_markdown_and_json_go_to_stdout(tmp_path: Path) -> None:
    expected = audit_paths(LOGS)
    md, js = tmp_path / "audit.md", tmp_path / "audit.json"
    assert run_to_file(["audit", "--markdown", *map(str, LOGS)], md).stderr == ""
    assert md.read_text(encoding="utf-8") == expected.to_markdown() + "\n"
    assert run_to_file(["audit", "--json", *map(str, LOGS)], js).stderr == ""
    assert json.loads(js.read_text(encoding="utf-8"))["summary"] == expected.summary()


def read_terminal(args: list[str], columns: int) -> str:
    """What a terminal *columns* wide shows for the command (ANSI styles removed)."""
    import fcntl
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([KVF, *args], stdout=child, stderr=subprocess.PIPE, env=clean_env(TERM="xterm"))
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child side is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=300) in (0, 1) and proc.stderr is not None and proc.stderr.read() == b""
    text = b"".join(chunks).decode("utf-8").replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_in_a_terminal_the_table_fits_the_window() -> None:
    lines = read_terminal(["audit", *map(str, LOGS)], columns=120).splitlines()
    assert "Deployment exposure audit" in lines[0]
    assert max(len(ln) for ln in lines) <= 120
    rows = [ln for ln in lines if ln.startswith("│")]
    assert len(rows) > len(audit_paths(LOGS).verdicts)  # long details wrap inside their cell


# --- a reader that goes away -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["audit", "--json"],
        ["audit", "--markdown"],
        ["audit"],
    ],
    ids=["json", "markdown", "table"],
)
def test_audit_into_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    done = run_into_closed_pipe([*args, *map(str, LOGS)])
    assert (done.returncode, done.stderr) == (PIPE_CLOSED, "")


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["run", "--help"],
        ["verify", "--help"],
        ["simulate", "--help"],
    ],
    ids=" ".join,
)
def test_help_into_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    done = run_into_closed_pipe(args)
    assert done.returncode in (0, PIPE_CLOSED) and done.stderr == ""


def test_audit_json_piped_into_head() -> None:
    logs = " ".join(f"'{p}'" for p in EVERY_LOG)
    assert len(audit_paths(EVERY_LOG).to_json()) > 128 * 1024  # more than a pipe holds: head leaves first
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; '{KVF}' audit --json {logs} | head -c 10"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
    )
    assert (done.stdout, done.stderr, done.returncode) == ('{\n  "summa', "", PIPE_CLOSED)


def test_run_and_verify_into_a_closed_pipe_end_quietly(mini_incident: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_into_closed_pipe(["run", str(mini_incident), "--out", str(out), "--quiet", "--no-pdf"])
    assert (done.returncode, done.stderr) == (PIPE_CLOSED, "")
    assert (out / "scope.json").is_file()  # the work was done; only its summary had no reader
    done = run_into_closed_pipe(["verify", str(out)])
    assert (done.returncode, done.stderr) == (PIPE_CLOSED, "")
    summary = tmp_path / "verify.txt"
    assert run_to_file(["verify", str(out), "--hashes-only"], summary).returncode == 0
    assert "unchanged" in summary.read_text(encoding="utf-8")
