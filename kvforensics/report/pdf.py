"""report.pdf: the HTML report printed by a local headless Chromium (no network)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Flags that keep a headless browser off the network and quiet (it must not fetch anything).
OFFLINE_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
]


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def html_to_pdf(html: Path, pdf: Path, *, timeout_s: float = 120) -> str | None:
    """Print ``html`` to ``pdf``; returns None on success or the reason it could not."""
    browser = find_chromium()
    if browser is None:
        return "no Chromium found (install Debian's chromium): report.pdf not written"
    with tempfile.TemporaryDirectory(prefix="kvf-chromium-") as profile:
        cmd = [
            browser,
            *OFFLINE_FLAGS,
            f"--user-data-dir={profile}",
            "--no-pdf-header-footer",
            f"--print-to-pdf={pdf}",
            html.resolve().as_uri(),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"Chromium did not finish within {timeout_s:.0f} s: report.pdf not written"
    if done.returncode != 0 or not pdf.exists():
        return f"Chromium failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    return None
