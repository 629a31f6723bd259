"""Issue 28, observation 3: notice file names collided. The sanitised id plus 8 hex digits of SHA-256 gave two ids
one name (found in 29,386 tries; these two in 52,573): both accounts wrote one file, 357 notices for 358 accounts.
Names now carry the whole SHA-256 of the id."""

from __future__ import annotations

import csv
import hashlib

from conftest import mini_requests, write_mini

from kvforensics.cli import main
from kvforensics.report.notices import safe_filename

# two ids whose sanitised form and first 8 hex digits of SHA-256 are the same: 'victim_co-1f072ae7.md'
TWINS = ("victim$($%$co", "victim%$&(%?co")


def test_the_twins_shared_a_name_under_the_old_scheme_and_do_not_now():
    old = {f"victim_co-{hashlib.sha256(a.encode()).hexdigest()[:8]}.md" for a in TWINS}
    assert old == {"victim_co-1f072ae7.md"}
    names = {safe_filename(a) for a in TWINS}
    assert len(names) == 2
    assert all(n.startswith("victim_co-1f072ae7") and len(n) == len("victim_co-") + 64 + 3 for n in names)
    assert len({n.casefold() for n in names}) == 2  # a case-insensitive file system keeps them apart too


def test_every_account_gets_its_own_notice(tmp_path):
    rows = mini_requests()
    for k, account in enumerate(TWINS):
        rows.append(
            {
                "rid": f"r-twin{k}",
                "received_at": f"2026-08-28T10:1{k}:00Z",
                "account_id": account,
                "model": "@cf/zai-org/glm-5.3",
                "http_status": 200,
                "prompt_tokens": 700000 + k,
                "completion_tokens": 50,
                "ttft_ms": 150.0,
                "latency_ms": 2000,
                "prefill_instance": "p0",
                "decode_instance": "d0",
            }
        )
    out = tmp_path / "out"
    assert main(["run", str(write_mini(tmp_path / "mini", rows)), "--out", str(out), "--quiet", "--no-pdf"]) == 0
    with (out / "notifications.csv").open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    accounts = {row["account_id"] for row in rows}
    assert set(TWINS) <= accounts
    notices = {p.relative_to(out).as_posix() for p in (out / "notices").rglob("*.md")}
    assert len(notices) == len(accounts)
    # notifications.csv maps each account to its own notice
    mapping = {row["account_id"]: row["notice"] for row in rows}
    assert set(mapping.values()) == notices
    assert all(mapping[a].endswith("/" + safe_filename(a)) for a in accounts)
