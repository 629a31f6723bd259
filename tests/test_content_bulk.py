"""The content file read in bulk by DuckDB (kvforensics/sources/content/bulk.py) gives the rows and counts the Python
reader gives (the reference): every line shape the reference judges, generated lines, files the bulk reader must
leave whole, and the fingerprint script's written-out windows against the reference fingerprints."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.core.fingerprint import fingerprints
from kvforensics.sources.content import load as content_loader
from kvforensics.sources.content.load import load_content

KEY = bytes.fromhex("a7" * 32)
TABLES = {
    "content_fingerprints": "SELECT request_id, part, fp FROM content_fingerprints ORDER BY ALL",
    "content_stats": "SELECT * FROM content_stats ORDER BY ALL",
    "quarantine": "SELECT source, line, reason, raw FROM quarantine ORDER BY ALL",
    "request_blocks": "SELECT * FROM request_blocks ORDER BY ALL",
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def source(tmp_path: Path, columns: str = "", name: str = "content.jsonl", fmt: str = "jsonl"):
    (tmp_path / "incident.toml").write_text(f"""[incident]
id = "content-bulk-test"
title = "content bulk reader"

[[sources]]
name = "content"
kind = "content"
path = "{name}"
format = "{fmt}"
{columns}

[[sources]]
name = "gateway"
kind = "requests"
path = "gateway.jsonl"
format = "jsonl"
""")
    inc = load_incident(tmp_path / "incident.toml")
    ((src, _),) = [(s, f) for s, f in inc.source_files() if s.kind == "content"]
    return src


def read(src, path: Path, bulk_from: int, window: int = 3, block_size: int | None = 16):
    con = connect()
    load = load_content(con, src, path, KEY, block_size, window=window, bulk_from=bulk_from)
    return load, {table: con.execute(query).fetchall() for table, query in TABLES.items()}


def assert_agree(tmp_path: Path, path: Path, columns: str = "", window: int = 3):
    """Bulk (from any number of lines) and reference (never bulk) read *path* alike; the bulk load."""
    src = source(tmp_path, columns, path.name)
    ref, ref_rows = read(src, path, 10**9, window)
    bulk, bulk_rows = read(src, path, 0, window)
    assert ref.reader == "python" and ref.notes[0].startswith("read by the Python reader")
    for table in TABLES:
        assert bulk_rows[table] == ref_rows[table], table
    assert (bulk.records_read, bulk.loaded, bulk.quarantined) == (ref.records_read, ref.loaded, ref.quarantined)
    assert bulk.notes[1:] == ref.notes[1:]
    return bulk, bulk_rows


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def lines_of_every_shape(rng: random.Random) -> list[str]:
    """What a content file holds in the wild and what the reference judges, line by line."""
    t = lambda n=30: text(rng, n)  # noqa: E731
    out = [
        json.dumps({"request_id": "plain-1", "prompt": t(), "output": t(12)}),
        json.dumps({"request_id": "only-prompt", "prompt": t()}),
        json.dumps({"request_id": "null-output", "prompt": t(), "output": None}),
        json.dumps({"request_id": "empty-texts", "prompt": "", "output": ""}),
        json.dumps({"request_id": "short", "prompt": "three words only", "output": "x"}),
        json.dumps({"request_id": "escapes", "prompt": 'a "quoted"\nline\twith \\ back/slash ' + t()}),
        json.dumps({"request_id": "non-ascii", "prompt": "Größe ÉTÉ naïve " + t(), "output": "日本語 テキスト"}),
        json.dumps({"request_id": "non-ascii-raw", "prompt": "Straße café " + t()}, ensure_ascii=False),
        json.dumps({"request_id": "unicode-digits", "prompt": "x²³ ①② ٣٤ " + t()}, ensure_ascii=False),
        json.dumps({"request_id": "chat", "prompt": [{"role": "user", "content": t()}], "output": t(9)}),
        json.dumps({"request_id": "chat-string", "prompt": json.dumps([{"role": "user", "content": t()}])}),
        json.dumps({"request_id": "bracket-text", "prompt": "  [not json at all " + t()}),
        json.dumps({"request_id": "bracket-later", "prompt": t(5) + " [see above] " + t()}),
        json.dumps({"request_id": "lone", "prompt": "\ud800 " + t()}),
        json.dumps({"request_id": "\ud83d", "prompt": t()}),
        json.dumps({"request_id": 12345, "prompt": t()}),
        json.dumps({"request_id": 1.5, "prompt": t()}),
        json.dumps({"request_id": "", "prompt": t()}),
        json.dumps({"prompt": t()}),
        json.dumps({"request_id": None, "prompt": t()}),
        json.dumps({"request_id": True, "prompt": t()}),
        json.dumps({"request_id": "num-prompt", "prompt": 42, "output": t()}),
        json.dumps({"request_id": "obj-prompt", "prompt": {"text": t()}}),
        json.dumps({"request_id": "ids", "prompt": t(), "prompt_token_ids": list(range(40))}),
        json.dumps({"request_id": "bad-ids", "prompt": t(), "prompt_token_ids": [1, -2]}),
        json.dumps({"request_id": "extra", "prompt": t(), "model": "m", "usage": {"prompt": "nested"}}),
        '{"request_id": "dup-id", "request_id": "dup-id-2", "prompt": "%s"}' % t(),
        '{"request_id": "dup-prompt", "prompt": "%s", "prompt": "%s"}' % (t(), t()),
        '{"request_id": "key-in-text", "prompt": "the \\"prompt\\" key in %s"}' % t(),
        '{"request_id": "esc-key", "\\u0070rompt": "%s"}' % t(),
        '{"request_id": "dup-esc-key", "prompt": "%s", "\\u0070rompt": "%s"}' % (t(), t()),
        '{"request_id": "trailing", "prompt": "%s",}' % t(),
        '{"request_id": "nan", "prompt": "%s", "score": NaN}' % t(),
        '{"request_id": "inf", "prompt": "%s", "score": -Infinity}' % t(),
        '{"request_id": "big", "prompt": "%s", "n": %s}' % (t(), "9" * 500),
        '{"request_id": "single", \'prompt\': "x"}',
        '["request_id", "not an object"]',
        '"a string"',
        "42",
        "null",
        "{not json",
        "   ",
        "\t",
        '  {"request_id": "spaced", "prompt": "%s"}  ' % t(),
        '{"request_id": "ctl", "prompt": "raw\x02control %s"}' % t(),
        '{"request_id": "nbsp-only"}\u00a0',
        "\u00a0",
    ]
    for i in range(40):  # ordinary records between the odd ones, one request twice
        out.append(json.dumps({"request_id": f"r{i % 37}", "prompt": t(rng.randint(0, 60)), "output": t(20)}))
    rng.shuffle(out)
    return out


def write(path: Path, lines: list[str], compress: bool = False) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8", "surrogatepass")
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


@pytest.mark.parametrize("compress", [False, True])
def test_every_shape_the_reference_judges_is_read_alike(tmp_path, compress):
    path = write(
        tmp_path / ("content.jsonl.gz" if compress else "content.jsonl"),
        lines_of_every_shape(random.Random(3)),
        compress,
    )
    load, rows = assert_agree(tmp_path, path)
    assert load.reader == "duckdb-bulk" and load.notes[0].startswith("read in bulk by DuckDB; ")
    # the plain records were the bulk reader's, the odd ones the reference's
    fallback = int(load.notes[0].split("; ")[1].split()[0])
    assert 0 < fallback < load.records_read / 2
    assert rows["quarantine"] and all(raw is None for *_, raw in rows["quarantine"])  # never the text
    assert rows["request_blocks"]  # the prompt with token ids, cut by the reference


def test_prompts_cut_into_word_blocks_are_the_references(tmp_path):
    path = write(tmp_path / "content.jsonl", lines_of_every_shape(random.Random(4)))
    src = source(tmp_path)
    con = connect()
    load = load_content(con, src, path, KEY, 4, word_blocks=True, bulk_from=0)
    assert load.reader == "python" and "word_blocks" in load.notes[0]


def test_mapped_keys_and_windows_agree(tmp_path):
    rng = random.Random(5)
    lines = [
        json.dumps({"id": f"q{i}", "input": text(rng, rng.randint(1, 80)), "completion": text(rng, 30), "prompt": "x"})
        for i in range(300)
    ]
    path = write(tmp_path / "content.jsonl", lines)
    columns = 'columns = { request_id = "id", prompt = "input", output = "completion" }'
    for window in (1, 2, 3, 5, 8, 9, 20):
        load, _ = assert_agree(tmp_path, path, columns, window)
        assert load.notes[0] == "read in bulk by DuckDB"


def test_the_bulk_fingerprints_are_the_reference_fingerprints(tmp_path):
    """The written-out window (comparisons) and the shingle (concat_ws) give fingerprint.fingerprints' values."""
    rng = random.Random(9)
    texts = [text(rng, n) for n in (0, 1, 7, 8, 9, 10, 11, 30, 200)] + ["the the the the the the the the the the"]
    path = write(
        tmp_path / "content.jsonl", [json.dumps({"request_id": f"t{i}", "prompt": s}) for i, s in enumerate(texts)]
    )
    src = source(tmp_path)
    for window in (1, 2, 3, 4, 8, 9):
        con = connect()
        load_content(con, src, path, KEY, window=window, bulk_from=0)
        got = {
            rid: set(fps)
            for rid, fps in con.execute(
                "SELECT request_id, list(fp) FROM content_fingerprints GROUP BY request_id"
            ).fetchall()
        }
        for i, s in enumerate(texts):
            assert got.get(f"t{i}", set()) == set(fingerprints(s, KEY, window=window)), (window, i)


def test_files_the_bulk_reader_leaves_whole(tmp_path):
    rng = random.Random(1)
    good = [json.dumps({"request_id": f"r{i}", "prompt": text(rng, 20)}) for i in range(50)]
    cases = {
        "bom.jsonl": ("\ufeff" + good[0], "byte-order mark"),
        "cr.jsonl": (good[0] + "\r", "cannot number its lines"),
    }
    for name, (first, why) in cases.items():
        path = write(tmp_path / name, [first, *good[1:]])
        src = source(tmp_path, name=name)
        bulk, bulk_rows = read(src, path, 0)
        ref, ref_rows = read(src, path, 10**9)
        assert bulk.reader == "python" and why in bulk.notes[0], bulk.notes[0]
        assert bulk_rows == ref_rows
    small = write(tmp_path / "small.jsonl", good)
    load, _ = read(source(tmp_path, name="small.jsonl"), small, content_loader.BULK_MIN_LINES)
    assert load.reader == "python" and "fewer than the 2,000" in load.notes[0]
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress("".join(g + "\n" for g in good).encode())[:-30])
    load, _ = read(source(tmp_path, name="cut.jsonl.gz"), truncated, 0)
    assert load.reader == "python" and load.quarantined == 1  # the partial last record, as the reference says
    csv = tmp_path / "content.csv"
    csv.write_text("request_id,prompt\nr1,some words here\n")
    load, _ = read(source(tmp_path, name="content.csv", fmt="csv"), csv, 0)
    assert load.reader == "python" and "format 'csv'" in load.notes[0]


def test_a_file_read_in_chunks_gives_the_same_rows(tmp_path, monkeypatch):
    import kvforensics.sources.common.bulk_lines as bulk_lines

    monkeypatch.setattr(bulk_lines, "CHUNK_LINES", 7)
    monkeypatch.setattr(bulk_lines, "SLICE_LINES", 3)
    path = write(tmp_path / "content.jsonl", lines_of_every_shape(random.Random(11)))
    assert_agree(tmp_path, path)


_line = st.one_of(
    st.builds(
        lambda rid, prompt, output: json.dumps({"request_id": rid, "prompt": prompt, "output": output}),
        st.one_of(st.text(max_size=6), st.integers(), st.none()),
        st.one_of(st.text(max_size=80), st.none(), st.lists(st.text(max_size=10), max_size=2)),
        st.one_of(st.text(alphabet="ab cd[]\"\\é", max_size=40), st.none()),
    ),
    st.text(max_size=40),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_line, min_size=1, max_size=25))
def test_any_lines_are_read_alike(tmp_path, lines):
    lines = [line.replace("\r", " ").replace("\n", " ").replace("\x01", " ") for line in lines]
    path = write(tmp_path / "content.jsonl", lines)
    src = source(tmp_path)
    ref, ref_rows = read(src, path, 10**9)
    bulk, bulk_rows = read(src, path, 0)
    assert bulk_rows == ref_rows
    assert (bulk.records_read, bulk.loaded, bulk.quarantined) == (ref.records_read, ref.loaded, ref.quarantined)


@pytest.mark.parametrize("chunk_lines", [None, 7])
def test_lines_checked_before_the_read_give_the_same_rows_and_the_same_refusals(tmp_path, monkeypatch, chunk_lines):
    """The checks of a file's lines begun ahead (LineChecks, as ingest begins them while other sources load, the
    first file's first chunk read ahead too) give what the checks made at the read give: the same rows for a file
    read in bulk, whole or in chunks after the one read ahead, and the same reason for one left."""
    from kvforensics.sources.common import bulk_lines
    from kvforensics.sources.common.bulk_lines import LineChecks

    if chunk_lines:
        monkeypatch.setattr(bulk_lines, "CHUNK_LINES", chunk_lines)
        monkeypatch.setattr(bulk_lines, "SLICE_LINES", 3)

    rng = random.Random(5)
    good = [json.dumps({"request_id": f"r{i}", "prompt": text(rng, 20)}) for i in range(60)]
    files = {
        "every.jsonl.gz": write(tmp_path / "every.jsonl.gz", lines_of_every_shape(random.Random(6)), True),
        "cr.jsonl": write(tmp_path / "cr.jsonl", [good[0] + "\r", *good[1:]]),
        "bom.jsonl": write(tmp_path / "bom.jsonl", ["\ufeff" + good[0], *good[1:]]),
    }
    for name, path in files.items():
        src = source(tmp_path, name=name)
        now, now_rows = read(src, path, 0)
        con = connect()
        with LineChecks(con, [path], 0) as checks:
            found = checks.get(path).result()
            if not isinstance(found, str):  # the first chunk read ahead is the first the read would take
                read_now = next(bulk_lines.numbered_lines(connect(), path, 0).chunks())
                assert found.first is not None and found.first.equals(read_now)
                assert found.first.num_rows < found.lines if chunk_lines else found.first.num_rows == found.lines
            ahead = load_content(con, src, path, KEY, 16, bulk_from=0, checked=checks.get(path))
            assert checks.get(tmp_path / "other.jsonl") is None
        assert (ahead.reader, ahead.notes, ahead.records_read, ahead.quarantined) == (
            now.reader,
            now.notes,
            now.records_read,
            now.quarantined,
        ), name
        assert {t: con.execute(q).fetchall() for t, q in TABLES.items()} == now_rows, name
    assert now.reader == "python" and "byte-order mark" in now.notes[0]


def test_checks_begun_for_an_ingest_that_fails_end_with_it(tmp_path):
    """An ingest that fails while a file's lines are being checked stops the check and closes its connection."""
    from kvforensics.sources.common.bulk_lines import LineChecks

    rng = random.Random(8)
    path = write(
        tmp_path / "big.jsonl.gz",
        [json.dumps({"request_id": f"r{i}", "prompt": text(rng, 30)}) for i in range(20_000)],
        True,
    )
    con = connect()
    with pytest.raises(RuntimeError, match="failed elsewhere"), LineChecks(con, [path], 0) as checks:
        raise RuntimeError("failed elsewhere")
    assert checks.get(path).done()
    with pytest.raises(Exception, match="closed"):
        checks._cursor.execute("SELECT 1")


def test_ingest_begins_the_content_files_line_checks_on_their_own_thread(tmp_path, monkeypatch, sample_incident):
    """The sample ingested with its content file read in bulk: the file's lines were checked on the checks' own
    thread (begun when the ingest starts), and the fingerprints are the ones a check made at the read gives."""
    import threading

    from kvforensics.investigation import Investigation
    from kvforensics.sources.common import bulk_lines
    from kvforensics.sources.content import entry

    events: list[tuple[str, str]] = []
    check = bulk_lines.check_lines

    def recording_check(*args):
        events.append(("check", threading.current_thread().name))
        return check(*args)

    monkeypatch.setattr(entry, "BULK_MIN_LINES", 0)
    monkeypatch.setattr(content_loader, "BULK_MIN_LINES", 0)
    monkeypatch.setattr(bulk_lines, "check_lines", recording_check)
    inv = Investigation.open(sample_incident, tmp_path / "out")
    inv.ingest()
    checks = [name for what, name in events if what == "check"]
    assert checks and all(name.startswith("kvf-line-checks") for name in checks), events
    notes = inv.con.execute("SELECT notes FROM load_report WHERE kind = 'content'").fetchall()
    assert notes and all("read in bulk by DuckDB" in n[0] for n in notes), notes
    fingerprints_ahead = inv.con.execute(TABLES["content_fingerprints"]).fetchall()
    inv.con.close()
    monkeypatch.setattr(entry, "begin", None)  # no checks begun: each made at its file's read
    again = Investigation.open(sample_incident, tmp_path / "again")
    again.ingest()
    assert again.con.execute(TABLES["content_fingerprints"]).fetchall() == fingerprints_ahead


@pytest.mark.parametrize(
    ("last", "cut"),
    [
        ('{"request_id": "r9", "prompt": "a b c', True),  # inside a string
        ('{"request_id": "r9", "prompt_tokens": 12', True),  # before a delimiter
        ('{"request_id": "r9", "ok": tr', True),  # inside a literal
        ('{"request_id": "r9", "prompt":', True),  # before a value
        ('{"request_id": "r9" "prompt": "x"}', False),  # a mistake in a complete line
        ('{"request_id": "r9", "prompt": "x"}}', False),
        ("not json at all", False),
    ],
)
@pytest.mark.parametrize("compress", [False, True])
def test_a_file_whose_last_record_is_cut_short_says_it_ends_early(tmp_path, last, cut, compress):
    """A content file cut inside its last record and then written whole (a copy stopped mid-file, then gzipped):
    no stream ends early, but the last line's JSON stops before the record does. Both readers say the file ends
    early there (the conclusiveness gate's truncated_file: inconclusive); a complete line with a mistake in it
    is only quarantined. The last line has no line end, as a cut file has none."""
    lines = lines_of_every_shape(random.Random(5))
    data = ("".join(line + "\n" for line in lines) + last).encode("utf-8", "surrogatepass")
    path = tmp_path / ("content.jsonl.gz" if compress else "content.jsonl")
    path.write_bytes(gzip.compress(data) if compress else data)
    bulk, _ = assert_agree(tmp_path, path)
    assert bulk.reader == "duckdb-bulk"
    ends = [n for n in bulk.notes if "ends early" in n]
    if cut:
        assert ends == [
            f"input ends early after line {len(lines)} (its last line, {len(lines) + 1}, is a record cut short: its "
            "JSON stops before the record does, so the file was cut there); later records, if any, are lost"
        ]
    else:
        assert ends == []
