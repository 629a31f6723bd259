"""`make lab` serves the notebooks, also as root in a container (where Jupyter refuses to start without
--allow-root): the Makefile's own command line is checked and run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def lab_command(*assignments: str) -> list[str]:
    """The jupyter lab command `make lab` runs (a dry run: nothing is installed or started)."""
    lines = subprocess.run(
        ["make", "-n", "-s", "lab", *assignments], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    commands = [shlex.split(line) for line in lines if "jupyter lab" in line]
    assert len(commands) == 1, lines
    return commands[0]


def test_make_lab_command_line():
    cmd = lab_command()
    assert cmd[0].endswith("/jupyter") and cmd[1] == "lab" and cmd[-1] == "notebooks/"
    assert "--ip=127.0.0.1" in cmd and "--port=8888" in cmd
    assert ("--allow-root" in cmd) == (os.getuid() == 0), "--allow-root exactly when running as root"
    cmd = lab_command("LAB_IP=0.0.0.0", "LAB_PORT=9999", "LAB_ARGS=--no-browser")
    assert "--ip=0.0.0.0" in cmd and "--port=9999" in cmd and "--no-browser" in cmd


@pytest.mark.slow
def test_make_lab_serves_the_notebooks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = lab_command(f"LAB_PORT={port}", "LAB_ARGS=--no-browser --ServerApp.token=kvf-test")
    cmd[0] = str(ROOT / cmd[0])
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")},
    )
    try:
        url = f"http://127.0.0.1:{port}/api/contents?token=kvf-test"
        for _ in range(240):
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}")
            try:
                listing = json.load(urllib.request.urlopen(url, timeout=2))
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("jupyter lab did not answer within 2 minutes")
        names = {item["name"] for item in listing["content"]}
        assert {"01-ingest.ipynb", "02-detect.ipynb", "03-scope.ipynb", "04-report.ipynb"} <= names
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token=kvf-test", timeout=10).read()
        assert b"JupyterLab" in page
    finally:
        proc.terminate()
        proc.wait(timeout=20)
