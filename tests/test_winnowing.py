"""Winnowing (kvforensics/core/fingerprint.py): the shingles kept, the guarantee the scope states, the setting.

The guarantee: two texts that share a run of ``m * w + SHINGLE_WORDS - 1`` words of distinct shingles share at
least ``m`` fingerprints under winnowing with window ``w``, whatever surrounds the run and whatever the key;
one word less and some texts share none (the bound is tight, so the property is tested at its edge).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.core.fingerprint import (
    SHINGLE_WORDS,
    WINNOW_WINDOW,
    fingerprint_key,
    fingerprints,
    guaranteed_words,
    shingle_fingerprint,
    shingles,
    winnow,
)
from kvforensics.stages.ingest import ingest

FEW_WORDS = [f"w{i}" for i in range(6)]  # surroundings that repeat, so their shingles tie and recur


def distinct_run(n: int) -> st.SearchStrategy[list[str]]:
    """*n* distinct words: a run whose shingles are all different."""
    return st.lists(st.integers(0, 10**9), min_size=n, max_size=n, unique=True).map(lambda xs: [f"r{x}" for x in xs])


@st.composite
def sharing(draw: st.DrawFn) -> tuple[int, int, str, str, bytes]:
    """Two texts sharing a run of exactly the guaranteed length for a window and a count, in any surroundings."""
    window = draw(st.integers(1, 9))
    shared = draw(st.integers(1, 3))
    run = draw(distinct_run(guaranteed_words(window, shared)))
    around = st.lists(st.sampled_from(FEW_WORDS) | distinct_run(1).map(lambda w: w[0]), max_size=40)
    a = draw(around) + run + draw(around)
    b = draw(around) + run + draw(around)
    return window, shared, " ".join(a), " ".join(b), draw(st.binary(min_size=1, max_size=80))


@settings(max_examples=300, deadline=None)
@given(sharing())
def test_a_run_of_the_guaranteed_length_shares_fingerprints(case):
    window, shared, a, b, key = case
    assert len(fingerprints(a, key, window=window) & fingerprints(b, key, window=window)) >= shared


@pytest.mark.parametrize("window", [2, 3, 4, 6])
def test_one_word_less_and_the_guarantee_no_longer_holds(window):
    """The bound is tight: some pair of texts sharing guaranteed_words(window) - 1 words shares no fingerprint."""
    rng = random.Random(window)
    key = b"tight"
    for attempt in range(5000):
        run = [f"r{attempt}x{i}" for i in range(guaranteed_words(window) - 1)]
        a = (
            [f"a{rng.randrange(10**6)}" for _ in range(window)]
            + run
            + [f"a{rng.randrange(10**6)}" for _ in range(window)]
        )
        b = (
            [f"b{rng.randrange(10**6)}" for _ in range(window)]
            + run
            + [f"b{rng.randrange(10**6)}" for _ in range(window)]
        )
        if not fingerprints(" ".join(a), key, window=window) & fingerprints(" ".join(b), key, window=window):
            return
    pytest.fail(f"every pair sharing {guaranteed_words(window) - 1} words shared a fingerprint")


def test_winnow_keeps_the_rightmost_least_of_each_window():
    assert winnow([5, 3, 3, 7, 1, 9, 4], 3) == [2, 4]  # windows: 5 3 3 -> 2; 3 3 7 -> 2; 3 7 1 -> 4; ...
    assert winnow([2, 2, 2, 2], 2) == [1, 2, 3]
    assert winnow([8, 6, 9], 5) == [1]  # fewer hashes than the window: one window of them all
    assert winnow([4], 3) == [0] and winnow([], 3) == []
    assert winnow([3, 1, 2], 1) == [0, 1, 2]


def test_what_winnowing_keeps_of_a_text():
    key = b"k" * 32
    text = " ".join(f"word{i}" for i in range(40))  # 33 distinct shingles
    every = fingerprints(text, key, window=1)
    assert len(every) == len(shingles(text)) == 33
    for window in (2, 3, 5, 9):
        kept = fingerprints(text, key, window=window)
        assert kept <= every
        # at least one in every window of consecutive shingles, so at least ceil(33 / window)
        assert -(-33 // window) <= len(kept) < 33
    keyed = fingerprint_key(key)
    hashes = [shingle_fingerprint(s, keyed) for s in shingles(text)]
    assert len(fingerprints(text, key, window=3)) == len(winnow(hashes, 3))
    # a text of fewer shingles than the window keeps one; one without words none
    assert len(fingerprints("only a few words here, eight or nine of them", key, window=5)) == 1
    assert fingerprints("...", key) == set()
    # the choice is keyed: another key keeps other shingles
    assert fingerprints(text, b"other", window=1) != every


def incident_file(tmp_path: Path, settings_lines: str = "") -> Path:
    """A gateway and a content source, and the given ``[settings]`` lines."""
    sources = "".join(
        f'[[sources]]\nname = "{kind}"\nkind = "{kind}"\npath = "{kind}.jsonl"\n\n' for kind in ("requests", "content")
    )
    path = tmp_path / "incident.toml"
    path.write_text(f'[incident]\nid = "winnow-test"\n\n{sources}{settings_lines}\n')
    return path


@pytest.mark.parametrize(
    ("value", "shown"), [("0", "0"), ("65", "65"), ("2.5", "2.5"), ('"3"', "'3'"), ("true", "True")]
)
def test_a_bad_winnow_window_is_refused(tmp_path, value, shown):
    with pytest.raises(ConfigError) as e:
        load_incident(incident_file(tmp_path, f"[settings]\nwinnow_window = {value}"))
    assert str(e.value) == (
        f"incident.toml: [settings]: winnow_window must be a whole number from 1 to 64 (of every "
        f"that many consecutive 8-word shingles one is fingerprinted; 1: every shingle), got {shown}"
    )


@pytest.mark.parametrize("window", [1, 5])
def test_the_ingest_fingerprints_with_the_incident_files_window(tmp_path, monkeypatch, window):
    key = "ef" * 32
    monkeypatch.setenv("KVFORENSICS_HMAC_KEY", key)
    text = " ".join(f"token{i}" for i in range(60))
    (tmp_path / "requests.jsonl").write_text(json.dumps({"request_id": "a", "ts": "2026-01-01T00:00:00Z"}) + "\n")
    (tmp_path / "content.jsonl").write_text(json.dumps({"request_id": "a", "prompt": text}) + "\n")
    incident = load_incident(incident_file(tmp_path, f"[settings]\nwinnow_window = {window}"))
    assert load_incident(incident_file(tmp_path)).winnow_window == WINNOW_WINDOW
    con = connect()
    result = ingest(con, incident)
    stored = {r[0] for r in con.execute("SELECT fp FROM content_fingerprints").fetchall()}
    assert stored == fingerprints(text, bytes.fromhex(key), window=window)
    if window == 1:
        assert len(stored) == 60 - SHINGLE_WORDS + 1
    assert con.execute("SELECT shingles FROM content_stats").fetchall() == [(len(stored),)]
    notes = [n for f in result.files if f.kind == "content" for n in f.notes]
    assert (
        f"text fingerprinted (keyed SHA-256 of the word shingles winnowing keeps, window {window}); no text stored"
        in notes
    )
