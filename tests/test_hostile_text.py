"""Issue 28, observation 1: one customer's id must never stop everyone's notices. Control characters, surrogates and
non-characters in the text fields of affected accounts reach no renderer as they are (vl-convert aborts the
process on a character XML forbids), and every output is still written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from conftest import mini_requests, write_mini
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvforensics.cli import main
from kvforensics.core.escaping import UNSAFE, markdown_text, visible_controls, visible_controls_in

OUTPUTS = (
    "scope.json",
    "affected_requests.csv",
    "notifications.csv",
    "quarantine.csv",
    "manifest.json",
    "report.html",
    "report.md",
)
# the text fields of a request each hostile account carries its text in (besides its account id)
FIELD_SETS = ((), ("rid",), ("model",), ("prefill_instance", "decode_instance"))


def test_visible_controls_escapes_what_xml_forbids():
    assert visible_controls("nul\x00byte") == "nul\\x00byte"
    assert visible_controls("\x01\x1b[31m\x7f\x85") == "\\x01\\x1b[31m\\x7f\\x85"
    assert visible_controls("a\uffff\ufffe\ufdd0") == "a\\uffff\\ufffe\\ufdd0"
    assert visible_controls("\ud800") == "\\ud800"
    assert visible_controls("\U0010ffff\U0001fffe") == "\\U0010ffff\\U0001fffe"
    # text, tabs and line ends, and characters beyond ASCII stay as they are
    assert visible_controls("tab\there\nline é 中 😀 \ufffd") == "tab\there\nline é 中 😀 \ufffd"
    assert markdown_text("a\x00b") == "a\\\\x00b"
    spec = {"datasets": {"d\x00": [{"account_id": "nul\x00", "n": 1}]}, "title": ("\uffff",)}
    assert visible_controls_in(spec) == {
        "datasets": {"d\\x00": [{"account_id": "nul\\x00", "n": 1}]},
        "title": ["\\uffff"],
    }


def _hostile_incident(root: Path, texts: list[str], escaped: bool) -> Path:
    """The mini incident with one more affected response per text: its account id is the text, and so is one set
    of its other text fields. ``escaped``: the JSON holds ``\\uXXXX`` escapes, else the characters themselves (a
    lone surrogate as the bytes Python's surrogatepass writes, which are not UTF-8)."""
    rows = mini_requests()
    for k, text in enumerate(texts):
        row = {
            "rid": f"r-hostile{k}",
            "received_at": f"2026-08-28T10:{10 + k:02d}:00Z",
            "account_id": text,
            "model": "@cf/zai-org/glm-5.3",
            "http_status": 200,
            "prompt_tokens": 700000 + k,
            "completion_tokens": 50,
            "ttft_ms": 150.0,
            "latency_ms": 2000,
            "prefill_instance": "p0",
            "decode_instance": "d0",
        }
        row.update({field: f"{row[field]}{text}" for field in FIELD_SETS[k % len(FIELD_SETS)]})
        rows.append(row)
    path = write_mini(root, rows)
    (root / "gateway" / "day1.jsonl").write_bytes(
        b"".join((json.dumps(r, ensure_ascii=escaped) + "\n").encode("utf-8", "surrogatepass") for r in rows)
    )
    return path


def _run_and_check(root: Path, texts: list[str], escaped: bool) -> None:
    path = _hostile_incident(root, texts, escaped)
    out = root / "out"
    # in this process (a child would double the time): a renderer that aborts, as vl-convert's panic did, ends the
    # test worker, which pytest reports as a failure
    assert main(["run", str(path), "--out", str(out), "--no-pdf", "--quiet"]) in (0, 3)
    for name in OUTPUTS:
        assert (out / name).is_file(), name
    assert not (out / ".kvforensics-staging").exists()
    with (out / "notifications.csv").open(encoding="utf-8", newline="") as fh:
        accounts = {row["account_id"] for row in csv.DictReader(fh)}
    notices = sorted((out / "notices").rglob("*.md"))
    assert len(notices) == len(accounts)
    for file in [*(out / name for name in OUTPUTS), *notices]:
        text = file.read_text(encoding="utf-8")
        assert not UNSAFE.search(text), (file.name, UNSAFE.search(text))
    assert all(n.name.isascii() and n.name.isprintable() for n in notices)


# a character of any category, surrogates (Cs) and unassigned code points (Cn: the non-characters) included
HOSTILE = st.text(
    st.one_of(st.characters(exclude_categories=()), st.sampled_from("\x00\x01\x1b\x7f\x85\ud800\ufffe\uffff")),
    min_size=1,
    max_size=12,
)


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(HOSTILE, min_size=len(FIELD_SETS), max_size=len(FIELD_SETS), unique=True), escaped=st.booleans())
@example(texts=["nul\x00byte", "ctl\x01", "non\uffff", "esc\x1b[2J\x85"], escaped=False)
@example(texts=["sur\ud800", "\x00", "\U0010ffff\ufdd0", "tab\there"], escaped=True)
def test_hostile_text_in_every_field_of_affected_accounts(tmp_path_factory, texts, escaped):
    _run_and_check(tmp_path_factory.mktemp("hostile"), texts, escaped)
