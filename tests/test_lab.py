"""`make lab` (jupyter lab notebooks/) really serves the notebooks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_jupyter_lab_serves_the_notebooks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--ServerApp.token=kvf-test", f"--ServerApp.root_dir={ROOT / 'notebooks'}", "--allow-root"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**__import__("os").environ, "JUPYTER_RUNTIME_DIR": str(tmp_path),
                                 "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")})
    try:
        url = f"http://127.0.0.1:{port}/api/contents?token=kvf-test"
        for _ in range(120):
            try:
                listing = json.load(urllib.request.urlopen(url, timeout=2))
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("jupyter lab did not answer within 60 s")
        names = {item["name"] for item in listing["content"]}
        assert {"01-ingest.ipynb", "02-detect.ipynb", "03-scope.ipynb", "04-report.ipynb"} <= names
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token=kvf-test", timeout=10).read()
        assert b"JupyterLab" in page
    finally:
        proc.terminate()
        proc.wait(timeout=20)
