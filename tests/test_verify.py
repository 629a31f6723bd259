"""``kvforensics verify`` re-derives everything: each tampering of an output folder is caught, an untouched folder
passes, a folder it cannot check ends in one line (exit 2), and a signed manifest cannot be edited unnoticed."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from conftest import write_mini

from kvforensics.cli import main
from kvforensics.core.db import connect
from kvforensics.core.errors import ConfigError
from kvforensics.evidence.digests import _Buckets
from kvforensics.evidence.verify import check_signature, table_digests, verify
from kvforensics.investigation import run
from kvforensics.sources.common.textio import file_digest

SSH_KEYGEN = shutil.which("ssh-keygen")
needs_ssh_keygen = pytest.mark.skipif(SSH_KEYGEN is None, reason="ssh-keygen (OpenSSH) is not installed")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One investigation of the mini incident; tests tamper with copies of its output folder."""
    root = tmp_path_factory.mktemp("verify")
    incident = write_mini(root / "mini")
    run(incident, root / "out", progress=False, pdf=False)
    return root / "out"


@pytest.fixture
def out(built: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(built, copy)
    return copy


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2) + "\n")


def test_an_untouched_folder_verifies_and_verify_leaves_the_evidence_as_it_was(out: Path, capsys) -> None:
    con = connect(out / "evidence.duckdb", read_only=True)
    before = table_digests(con)
    con.close()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tables"] == before
    assert {"scope.json", "affected_requests.csv", "notifications.csv", "report.html", "report.md"} <= set(
        manifest["outputs"]
    )
    assert any(name.startswith("notices/") for name in manifest["outputs"])
    assert main(["verify", str(out)]) == 0
    assert "re-derived and matching" in capsys.readouterr().out
    con = connect(out / "evidence.duckdb", read_only=True)
    assert table_digests(con) == before
    con.close()


def test_a_deleted_findings_row_is_caught(out: Path) -> None:
    con = duckdb.connect(str(out / "evidence.duckdb"))
    (n,) = con.execute("SELECT count(*) FROM findings").fetchone()
    assert n >= 1
    con.execute("DELETE FROM findings WHERE rowid = (SELECT min(rowid) FROM findings)")
    con.execute("CHECKPOINT")
    con.close()
    problems = verify(out)
    findings = [p for p in problems if "table findings" in p]
    assert any("the manifest records" in p for p in findings), problems
    assert any("detection and scope re-run on it give" in p for p in findings), problems


def test_a_changed_window_end_in_scope_json_is_caught(out: Path) -> None:
    edit_json(out / "scope.json", lambda s: s["windows"][0].update(last="2026-08-28T23:59:59Z"))
    problems = verify(out)
    assert any(p.startswith("scope.json windows[0].last = \"2026-08-28T23:59:59Z\", re-derived") for p in problems)
    assert any(p.startswith("output changed since the run: scope.json") for p in problems)


def test_changed_account_class_numbers_are_caught(out: Path) -> None:
    def change(s: dict) -> None:
        s["by_account_class"]["customer"]["responses"] += 5
        s["by_account_class"]["internal"]["accounts"] += 1

    edit_json(out / "scope.json", change)
    problems = verify(out)
    assert any(p.startswith("scope.json by_account_class.customer.responses = ") for p in problems), problems
    assert any(p.startswith("scope.json by_account_class.internal.accounts = ") for p in problems), problems


def test_a_deleted_notifications_row_is_caught(out: Path) -> None:
    path = out / "notifications.csv"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) >= 2
    path.write_text("".join(lines[:1] + lines[2:]))
    problems = verify(out)
    assert any(p.startswith("notifications.csv: ") and "1 missing" in p for p in problems), problems
    assert any(p.startswith("output changed since the run: notifications.csv") for p in problems)


@pytest.mark.parametrize("name", ["report.html", "report.md"])
def test_an_edited_report_is_caught(out: Path, name: str) -> None:
    path = out / name
    path.write_text(path.read_text().replace("affected", "unaffected", 1))
    assert [p for p in verify(out) if p.startswith("output")] == [
        f"output changed since the run: {name} (sha256 {file_digest(path)[0]} != "
        f"{json.loads((out / 'manifest.json').read_text())['outputs'][name]})"
    ]


def test_a_forged_notice_and_a_removed_one_are_caught(out: Path) -> None:
    notices = sorted((out / "notices").rglob("*.md"))
    notices[0].rename(notices[0].with_name("someone-else.md"))
    problems = verify(out)
    rel = notices[0].relative_to(out).as_posix()
    assert f"{rel.removeprefix('notices/')} is missing; the evidence gives it" in " ".join(problems)
    assert any("someone-else.md is not a notice the evidence gives" in p for p in problems)
    assert any(p.endswith("someone-else.md") and p.startswith("output not in the manifest") for p in problems)


def test_deleted_notices_of_a_run_are_caught(out: Path) -> None:
    listed = [rel for rel in json.loads((out / "manifest.json").read_text())["outputs"] if rel.startswith("notices/")]
    assert listed
    shutil.rmtree(out / "notices")
    problems = verify(out)
    assert {f"output missing: {rel}" for rel in listed} <= set(problems), problems
    assert {f"{rel} is missing; the evidence gives it" for rel in listed} <= set(problems), problems


def test_a_folder_written_by_the_stage_commands_up_to_scope_verifies_as_its_manifest_lists_it(
    tmp_path: Path, capsys
) -> None:
    incident = write_mini(tmp_path / "mini")
    out = tmp_path / "out"
    for command in ("ingest", "detect", "scope"):
        assert main([command, str(incident), "--out", str(out), "--quiet"]) in (0, 3)
    listed = json.loads((out / "manifest.json").read_text())["outputs"]
    assert sorted(listed) == [
        "affected_requests.csv",
        "notifications.csv",
        "possible_responses.csv",
        "quarantine.csv",
        "scope.json",
    ]
    assert not (out / "notices").exists() and not (out / "report.html").exists()
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0, capsys.readouterr().out
    assert verify(out) == []

    forged = out / "notices" / "customers" / "someone-else.md"  # a notice no stage wrote
    forged.parent.mkdir(parents=True)
    forged.write_text("# Notice\n")
    assert verify(out) == [
        "output not in the manifest: notices/customers/someone-else.md",
        "notices/customers/someone-else.md is not a notice the evidence gives",
    ]
    shutil.rmtree(out / "notices")

    (out / "notifications.csv").unlink()  # a file the manifest lists
    problems = verify(out)
    assert "output missing: notifications.csv" in problems and "notifications.csv is missing" in problems, problems
    assert main(["verify", str(out)]) == 1


def test_an_input_changed_together_with_its_hash_in_the_manifest_is_caught(tmp_path: Path) -> None:
    incident = write_mini(tmp_path / "mini")
    out = tmp_path / "out"
    run(incident, out, progress=False, pdf=False)
    log = tmp_path / "mini" / "gateway" / "day1.jsonl"
    lines = log.read_text().splitlines()
    row = json.loads(lines[3])
    row["prompt_tokens"] += 1000  # the input says something else now
    log.write_text("\n".join(lines[:3] + [json.dumps(row)] + lines[4:]) + "\n")
    digest, size = file_digest(log)

    def cover_up(m: dict) -> None:
        for item in m["inputs"]:
            if item["file"].endswith("day1.jsonl"):
                item.update(sha256=digest, bytes=size)

    edit_json(out / "manifest.json", cover_up)
    problems = verify(out)
    assert not any(p.startswith("input changed") for p in problems)  # the hashes agree ...
    # ... but the evidence no longer is what the inputs give
    assert any(
        p.startswith("evidence.duckdb: table requests has ") and p.endswith("a fresh ingest of the inputs gives")
        for p in problems
    ), problems


def test_a_missing_database_and_a_folder_that_is_no_run_output_end_in_one_line(
    out: Path, tmp_path: Path, capsys
) -> None:
    (out / "evidence.duckdb").unlink()
    assert main(["verify", str(out)]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "Traceback" not in " ".join(err)
    assert err[0].startswith("Error: ") and "evidence.duckdb is missing" in err[0]
    assert err[1].endswith("manifest.json is missing: name the output folder of a `kvforensics run`")


def test_a_manifest_of_an_older_run_without_hashes_is_a_problem(out: Path) -> None:
    edit_json(out / "manifest.json", lambda m: (m.pop("outputs"), m.pop("tables")))
    problems = verify(out)
    assert sum("written by an older kvforensics" in p for p in problems) == 2


def test_sql_and_paths_in_an_edited_manifest_are_never_used(out: Path, tmp_path: Path) -> None:
    written = tmp_path / "written.csv"

    def hostile(m: dict) -> None:
        m["headline_queries"]["affected_responses"] = f"COPY (SELECT 1) TO '{written}'"
        m["outputs"]["../../elsewhere.txt"] = "0" * 64

    edit_json(out / "manifest.json", hostile)
    problems = verify(out)
    assert not written.exists()
    assert problems == [
        "manifest.json lists '../../elsewhere.txt' among the outputs, which no run writes: the manifest was edited"
    ]


# --- signing ----------------------------------------------------------------------------------------------------


def keypair(folder: Path, principal: str) -> tuple[Path, Path]:
    """An ed25519 key without passphrase and an allowed-signers file naming its public key for ``principal``."""
    key = folder / f"{principal}.key"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", principal, "-f", str(key)], check=True)
    signers = folder / f"{principal}.allowed_signers"
    signers.write_text(f'{principal} namespaces="kvforensics" {Path(f"{key}.pub").read_text().strip()}\n')
    return key, signers


@needs_ssh_keygen
def test_a_signed_manifest_verifies_and_an_edit_of_it_is_caught(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    key, signers = keypair(tmp_path, "ir-lead@example.com")
    _, other = keypair(tmp_path, "someone@example.com")
    out = tmp_path / "out"
    assert main(["run", str(incident), "--out", str(out), "--quiet", "--no-pdf", "--sign-key", str(key)]) in (0, 3)
    assert (out / "manifest.json.sig").read_text().startswith("-----BEGIN SSH SIGNATURE-----")
    assert main(["verify", str(out), "--allowed-signers", str(signers)]) == 0
    assert "manifest signature holds" in capsys.readouterr().out
    # the signature and the hashes alone, nothing re-derived
    args = ["--allowed-signers", str(signers), "--identity", "ir-lead@example.com", "--hashes-only"]
    assert main(["verify", str(out), *args]) == 0
    assert "manifest signature holds; inputs, outputs and evidence tables unchanged" in capsys.readouterr().out

    problems = verify(out, allowed_signers=other, rederive=False)  # signed by a key this file does not allow
    assert len(problems) == 1 and problems[0].startswith("manifest.json: the signature does not hold"), problems

    # an edit of a field verify cannot re-derive: only the signature sees it
    edit_json(out / "manifest.json", lambda m: m["run"].update(finished="2026-01-01T00:00:00Z"))
    assert main(["verify", str(out), "--allowed-signers", str(signers), "--hashes-only"]) == 1
    printed = capsys.readouterr().out
    assert "manifest.json: the signature does not hold for 'ir-lead@example.com'" in printed
    assert verify(out) == []  # unsigned checks alone cannot see an edit of a field they do not re-derive

    (out / "manifest.json.sig").unlink()
    assert verify(out, allowed_signers=signers, rederive=False) == [
        "manifest.json.sig is missing: the manifest is not signed (run with --sign-key)"
    ]


@needs_ssh_keygen
def test_a_signing_key_that_does_not_exist_stops_the_run_before_it_starts(tmp_path: Path, capsys) -> None:
    incident = write_mini(tmp_path / "mini")
    out = tmp_path / "out"
    assert main(["run", str(incident), "--out", str(out), "--quiet", "--sign-key", str(tmp_path / "nope")]) == 2
    assert "signing key" in capsys.readouterr().err and not (out / "evidence.duckdb").exists()
    with pytest.raises(ConfigError, match="allowed signers file .* does not exist"):
        check_signature(tmp_path, tmp_path / "nope")


def _digest_of(
    rows: list[tuple], method: str = "rows-v2", rows_per_pass: int | None = None, rows_per_bucket: int | None = None
) -> dict:
    con = connect()
    con.execute("CREATE TABLE t (id VARCHAR, ts TIMESTAMPTZ, ms DOUBLE, tags VARCHAR[])")
    if rows:
        con.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", rows)
    return table_digests(con, method, rows_per_pass, rows_per_bucket)["t"]


def test_row_hashes_sorted_through_bucket_files_are_in_byte_order_whatever_the_bucket_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    hashes = rng.integers(0, 256, size=(500, 32), dtype=np.uint8)
    hashes[:40] = hashes[40]  # 41 identical hashes: split down to their last byte
    hashes[100:140, :31] = hashes[140, :31]  # 41 that differ in their last byte only
    hashes[200:230, :8] = hashes[230, :8]  # 31 that tie on the first 8 bytes
    expected = sorted(bytes(r) for r in hashes)
    for per_bucket in (1, 3, 7, 64, 1000):
        with _Buckets(tmp_path, per_bucket) as buckets:
            batches = (hashes[i : i + 50] for i in range(0, len(hashes), 50))
            got = [bytes(r) for part in buckets.sorted(batches, len(hashes), 0, 16**4) for r in part]
            assert got == expected, per_bucket
            assert (buckets._made > 0) == (per_bucket < len(hashes)), per_bucket  # files only when too many
        assert list(tmp_path.iterdir()) == []  # the bucket files and their folder are gone


def test_a_table_digest_through_bucket_files_and_passes_is_the_hash_of_its_sorted_row_hashes(
    tmp_path: Path, monkeypatch
) -> None:
    rows = [(f"r{i}", f"2026-08-28T10:00:{i % 60:02d}Z", i / 7, [str(i)] * (i % 3)) for i in range(200)]
    rows += [rows[3]] * 30  # identical rows: identical hashes
    con = connect(tmp_path / "evidence.duckdb", memory_limit="1GB")  # spills to evidence.spill
    con.execute("CREATE TABLE t (id VARCHAR, ts TIMESTAMPTZ, ms DOUBLE, tags VARCHAR[])")
    con.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", rows)
    tables = set(table_digests(con))
    made = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(kw["dir"]) or mkdtemp(**kw))
    lines = con.execute("""SELECT sha256(json_array(id, epoch_us(ts), CASE WHEN ms IS NULL THEN NULL
                           WHEN isfinite(ms) THEN printf('%.12g', ms) ELSE CAST(ms AS VARCHAR) END, tags)) AS h
                           FROM t ORDER BY h""").fetchall()
    expected = hashlib.sha256(b'["id", "ts", "ms", "tags"]\n' + "".join(f"{h}\n" for (h,) in lines).encode())
    for per_pass, per_bucket in ((None, None), (None, 5), (40, 3), (7, 1000), (1, 2)):
        digests = table_digests(con, "rows-v2", per_pass, per_bucket)
        assert digests["t"] == {"rows": 230, "sha256": expected.hexdigest()}, (per_pass, per_bucket)
        assert set(digests) == tables
        # the bucket files were in evidence.spill, made for them and removed with them
        assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".wal") == ["evidence.duckdb"]
    assert made and set(made) == {tmp_path / "evidence.spill"}


def test_a_table_sorted_in_passes_over_ranges_of_row_hashes_has_the_digest_of_one_sort() -> None:
    rows = [(f"r{i}", f"2026-08-28T10:00:{i % 60:02d}Z", i / 7, [str(i)] * (i % 3)) for i in range(300)]
    one = _digest_of(rows)
    assert one["rows"] == 300
    for per_pass in (1, 7, 100, 299):
        assert _digest_of(rows, rows_per_pass=per_pass) == one, per_pass
    assert _digest_of(rows[:-1], rows_per_pass=7)["sha256"] != one["sha256"]
    names = hashlib.sha256(b'["id", "ts", "ms", "tags"]\n').hexdigest()  # an empty table: its column names only
    assert _digest_of([], rows_per_pass=1) == _digest_of([]) == {"rows": 0, "sha256": names}


def test_a_table_digest_depends_on_its_rows_never_on_their_order_or_a_sums_last_bits() -> None:
    rows = [
        ("a", "2026-08-28T10:00:00Z", 0.1 + 0.2, ["x"]),
        ("b", "2026-08-28T11:00:00+02:00", None, None),
        ("c", None, float("inf"), []),
    ]
    for method in ("rows-v1", "rows-v2", "rows-v3", "rows-v4"):
        base = _digest_of(rows, method)
        assert base["rows"] == 3
        assert _digest_of(rows[::-1], method) == base
        assert _digest_of([("a", "2026-08-28T10:00:00Z", 0.3, ["x"]), *rows[1:]], method) == base
        for changed in (
            ("a", "2026-08-28T10:00:01Z", 0.3, ["x"]),
            ("a", "2026-08-28T10:00:00Z", 0.31, ["x"]),
            ("a", "2026-08-28T10:00:00Z", 0.3, ["y"]),
            ("A", "2026-08-28T10:00:00Z", 0.3, ["x"]),
        ):
            assert _digest_of([changed, *rows[1:]], method)["sha256"] != base["sha256"], (method, changed)
        assert _digest_of([*rows, rows[0]], method)["sha256"] != base["sha256"]  # a duplicated row counts
        assert _digest_of(rows[1:], method)["sha256"] != base["sha256"]  # so does a deleted one
        # a row deleted and another duplicated: as many rows, another multiset
        assert _digest_of([*rows[:2], rows[0]], method)["sha256"] != base["sha256"]


def test_a_manifest_of_an_earlier_version_is_checked_with_the_digests_it_recorded(out: Path) -> None:
    con = connect(out / "evidence.duckdb", read_only=True)
    v1 = table_digests(con, "rows-v1")
    con.close()
    edit_json(out / "manifest.json", lambda m: (m.update(tables=v1), m.pop("table_digest")))
    assert verify(out) == []
    con = duckdb.connect(str(out / "evidence.duckdb"))
    con.execute("DELETE FROM findings WHERE rowid = (SELECT min(rowid) FROM findings)")
    con.execute("CHECKPOINT")
    con.close()
    assert any("findings" in p for p in verify(out, rederive=False))
    edit_json(out / "manifest.json", lambda m: m.update(table_digest="rows-v9"))
    assert any("table_digest" in p for p in verify(out, rederive=False))


def test_an_edited_report_with_its_hash_fixed_in_an_unsigned_manifest_is_caught(out: Path, capsys) -> None:
    """Issue 28, observation 8: the report was the one output checked only by hash; verify re-renders report.md and
    report.html from the evidence and compares them, and says when a signature was there but not checked."""
    for name, old, new in (("report.md", "affected", "unaffected"), ("report.html", "<h2", "<h2 hidden")):
        path = out / name
        text = path.read_text()
        path.write_text(text.replace(old, new, 1))
        edit_json(out / "manifest.json", lambda m, n=name, p=path: m["outputs"].__setitem__(n, file_digest(p)[0]))
    (out / "manifest.json.sig").write_text("-----BEGIN SSH SIGNATURE-----\n")  # present, never checked here
    assert main(["verify", str(out)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert [p.split(",")[0] for p in printed if p.startswith("report.")] == [
        "report.md differs from the report the evidence gives",
        "report.html differs from the report the evidence gives",
    ]
    assert "output changed since the run" not in "\n".join(printed)
    assert (
        "note: manifest.json.sig was not checked: the folder is signed, but who signed it is only checked with "
        "--allowed-signers (and --identity)"
    ) in printed
    # the hashes alone cannot see it (the manifest was edited to match): what --hashes-only says it does not do
    assert main(["verify", str(out), "--hashes-only"]) == 0
    assert "nothing re-derived" in capsys.readouterr().out


def _lthash_reference(con: duckdb.DuckDBPyConnection, table: str, columns: list[str], values: str) -> str:
    """rows-v3 as its definition reads, row by row in Python: each row's SHA-256 expanded by MGF1-SHA-256
    (RFC 8017) to 1024 little-endian 16-bit lanes, the lanes summed as integers."""
    lanes = np.zeros(1024, dtype=np.uint64)
    for (row_hash,) in con.execute(f"SELECT sha256(json_array({values})) FROM {table}").fetchall():
        seed = bytes.fromhex(row_hash)
        stream = b"".join(hashlib.sha256(seed + j.to_bytes(4, "big")).digest() for j in range(64))
        lanes += np.frombuffer(stream, dtype="<u2").astype(np.uint64)
    return hashlib.sha256(
        b"kvforensics rows-v3 LtHash16 1024 MGF1-SHA-256\n"
        + json.dumps(columns).encode()
        + b"\n"
        + lanes.astype("<u8").tobytes()
    ).hexdigest()


def test_a_rows_v3_digest_is_ltHash16_of_the_row_hashes_whatever_the_batches(monkeypatch) -> None:
    import kvforensics.evidence.digests as digests

    rows = [(f"r{i}", f"2026-08-28T10:00:{i % 60:02d}Z", i / 7, [str(i)] * (i % 3)) for i in range(60)]
    rows += [rows[3]] * 5
    con = connect(memory_limit="1GB")
    con.execute("CREATE TABLE t (id VARCHAR, ts TIMESTAMPTZ, ms DOUBLE, tags VARCHAR[])")
    con.executemany("INSERT INTO t VALUES (?, ?, ?, ?)", rows)
    expected = _lthash_reference(
        con,
        "t",
        ["id", "ts", "ms", "tags"],
        """id, epoch_us(ts), CASE WHEN ms IS NULL
        THEN NULL WHEN isfinite(ms) THEN printf('%.12g', ms) ELSE CAST(ms AS VARCHAR) END, tags""",
    )
    for batch in (1, 7, 8192):
        monkeypatch.setattr(digests, "_V3_BATCH", batch)
        assert table_digests(con, "rows-v3")["t"] == {"rows": 65, "sha256": expected}, batch
    con.execute("CREATE TABLE empty (id VARCHAR)")
    assert table_digests(con, "rows-v3")["empty"]["rows"] == 0


def test_a_row_repeated_2_to_the_16_times_does_not_vanish_from_a_rows_v3_digest() -> None:
    """LtHash16 sums its lanes modulo 2^16: 65,536 copies of one row would hash as 65,536 copies of any other
    (each lane times 2^16 is 0). rows-v3 sums them exactly, so the two tables differ."""
    con = connect()
    for name, value in (("a", "x"), ("b", "y")):
        con.execute(f"CREATE TABLE {name} AS SELECT '{value}' AS v FROM range(65536)")
    digests = table_digests(con, "rows-v3")
    assert digests["a"]["rows"] == digests["b"]["rows"] == 65536
    assert digests["a"]["sha256"] != digests["b"]["sha256"]


def _rows_v4_reference(columns: list[tuple[str, str]], rows: list[tuple]) -> str:
    """rows-v4 as its definition reads, in Python: canonical values (integers, or bytes), the rows sorted by
    them column by column (nulls last), per column a stream of values and one of nulls or lengths."""

    def canonical(value, kind):
        if value is None:
            return None
        if kind == "int":
            return int(value)
        if isinstance(value, float):
            return (f"{value:.12g}" if np.isfinite(value) else str(value)).encode()
        return value if isinstance(value, bytes) else str(value).encode()

    kinds = [kind for _, kind in columns]
    values = sorted(
        (tuple(canonical(v, k) for v, k in zip(row, kinds, strict=True)) for row in rows),
        key=lambda r: tuple((v is None, v if v is not None else 0) for v in r),
    )
    h = hashlib.sha256(b"kvforensics rows-v4 sorted columns SHA-256\n" + json.dumps([c for c, _ in columns]).encode())
    h.update(b"\n" + json.dumps(kinds).encode() + b"\n" + len(values).to_bytes(8, "little"))
    for j, kind in enumerate(kinds):
        column = [row[j] for row in values]
        if kind == "int":
            data = b"".join((v or 0).to_bytes(8, "little", signed=True) for v in column)
            shape = bytes(v is not None for v in column)
        else:
            data = b"".join(v for v in column if v is not None)
            shape = b"".join((-1 if v is None else len(v)).to_bytes(8, "little", signed=True) for v in column)
        h.update(hashlib.sha256(data).digest() + hashlib.sha256(shape).digest())
    return h.hexdigest()


def test_a_rows_v4_digest_is_the_sorted_tables_columns_hashed_whatever_the_batches(monkeypatch) -> None:
    import kvforensics.evidence.digests as digests

    rows = [
        (f"r{i % 23}", i % 5 == 0, None if i % 7 == 0 else i - 30, f"2026-08-28T10:00:{i % 60:02d}Z", i / 7)
        for i in range(60)
    ]
    rows += [rows[3]] * 5  # duplicates count
    rows += [
        ("", None, None, None, None),
        (None, True, 2**62, None, float("nan")),
        ("é\u2028", False, -(2**62), None, 0.1),
    ]
    rows += [("ab", None, 1, None, None), ("a", None, 1, None, None)]  # a prefix sorts first, bytewise
    con = connect(memory_limit="1GB")
    con.execute("CREATE TABLE t (id VARCHAR, ok BOOLEAN, n BIGINT, ts TIMESTAMPTZ, ms DOUBLE)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?)", rows)
    canonical_rows = con.execute("SELECT id, ok, n, epoch_us(ts), ms FROM t").fetchall()
    expected = _rows_v4_reference(
        [("id", "bytes"), ("ok", "int"), ("n", "int"), ("ts", "int"), ("ms", "bytes")], canonical_rows
    )
    for batch_bytes, min_rows in ((1, 1), (100, 1), (1000, 16), (32 * 2**20, 16)):
        monkeypatch.setattr(digests, "_V4_BATCH_BYTES", batch_bytes)
        monkeypatch.setattr(digests, "_V4_MIN_ROWS", min_rows)
        assert table_digests(con, "rows-v4")["t"] == {"rows": len(rows), "sha256": expected}, batch_bytes
    # the same strings split otherwise across rows, or a null for an empty string: another digest
    for name, values in (("a", [("ab",), ("c",)]), ("b", [("a",), ("bc",)]), ("c", [("",)]), ("d", [(None,)])):
        con.execute(f"CREATE TABLE {name} (v VARCHAR)")
        con.executemany(f"INSERT INTO {name} VALUES (?)", values)
    digests_now = table_digests(con, "rows-v4")
    assert len({digests_now[n]["sha256"] for n in "abcd"}) == 4
    con.execute("CREATE TABLE empty (id VARCHAR)")
    assert digests_now.get("empty") is None and table_digests(con, "rows-v4")["empty"]["rows"] == 0


def test_a_rows_v4_table_sorted_by_a_first_column_that_only_looked_unique_is_sorted_again_by_every_column() -> None:
    from kvforensics.evidence.digests import _canonical_v4, _first_column_unique, _profile, _ties

    con = connect(memory_limit="1GB")
    con.execute("CREATE TABLE u AS SELECT 'u' || lpad(i::VARCHAR, 5, '0') AS id, 3000 - i AS n FROM range(3000) t(i)")
    con.execute("INSERT INTO u VALUES ('u01500', -1), ('u01500', 9999), (NULL, 5), (NULL, 4)")
    profile = _profile(con, "u", [_canonical_v4('"id"', "VARCHAR"), _canonical_v4('"n"', "BIGINT")])
    assert profile.rows == 3004 and profile.widest == 6 and profile.groups is not None
    assert _first_column_unique(profile)  # only looked unique: two rows share an id, two have none
    expected = _rows_v4_reference([("id", "bytes"), ("n", "int")], con.execute("SELECT * FROM u").fetchall())
    assert table_digests(con, "rows-v4")["u"] == {"rows": 3004, "sha256": expected}
    # ties within a batch, across batches, and of nulls; none in distinct values
    assert _ties(pa.array(["a", "b", "b"]), "x") == (True, "b")
    assert _ties(pa.array(["b", "c"]), "b") == (True, "c")
    assert _ties(pa.array([1, None, None]), 0) == (True, None)
    assert _ties(pa.chunked_array([pa.array(["a"]), pa.array(["b", None])]), None) == (False, None)
    assert _ties(pa.array([], pa.string()), "z") == (False, "z")


def test_a_rows_v4_column_with_bytes_behind_a_null_hashes_as_its_values_say() -> None:
    """Arrow lets a null slot keep bytes (its offsets need not be equal); rows-v4 hashes values, never those."""
    from kvforensics.evidence.digests import _hash_column

    def streams(array: pa.Array) -> tuple[str, str]:
        values, shape = hashlib.sha256(), hashlib.sha256()
        _hash_column(array, "bytes", values, shape)
        return values.hexdigest(), shape.hexdigest()

    clean = pa.array(["ab", None, "c"])
    offsets = np.array([0, 2, 5, 6], dtype=np.int32).tobytes()
    dirty = pa.Array.from_buffers(
        pa.string(), 3, [pa.py_buffer(bytes([0b101])), pa.py_buffer(offsets), pa.py_buffer(b"abXYZc")], null_count=1
    )
    assert dirty.to_pylist() == clean.to_pylist()
    assert streams(dirty) == streams(clean) == streams(pa.chunked_array([clean.slice(0, 1), clean.slice(1)]))


def _record_tables(out: Path, method: str) -> None:
    """The manifest of a folder with its tables digested by *method*, as a run writing that method records them."""
    from kvforensics.evidence.digests import TABLE_DIGEST_CONSTRUCTIONS

    con = connect(out / "evidence.duckdb", read_only=True)
    tables = table_digests(con, method)
    con.close()
    edit_json(
        out / "manifest.json",
        lambda m: m.update(
            tables=tables, table_digest=method, table_digest_construction=TABLE_DIGEST_CONSTRUCTIONS[method]
        ),
    )


@pytest.mark.parametrize("method", ["rows-v2", "rows-v3", "rows-v4"])
def test_a_manifest_of_either_digest_verifies_and_a_row_changed_deleted_or_duplicated_is_caught(
    out: Path, method: str
) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["table_digest"] == "rows-v4" and "SHA-256" in manifest["table_digest_construction"]
    _record_tables(out, method)
    assert verify(out) == []
    pristine = out.parent / "pristine.duckdb"
    shutil.copyfile(out / "evidence.duckdb", pristine)
    for tamper in (
        "UPDATE findings SET strength = strength || 'x' WHERE rowid = (SELECT min(rowid) FROM findings)",
        "DELETE FROM findings WHERE rowid = (SELECT min(rowid) FROM findings)",
        "INSERT INTO findings SELECT * FROM findings WHERE rowid = (SELECT min(rowid) FROM findings)",
    ):
        shutil.copyfile(pristine, out / "evidence.duckdb")
        con = duckdb.connect(str(out / "evidence.duckdb"))
        con.execute(tamper)
        con.execute("CHECKPOINT")
        con.close()
        # the table's digest is what catches it: the hashes alone, nothing re-derived
        findings = [p for p in verify(out, rederive=False) if "table findings" in p]
        assert any("the manifest records" in p for p in findings), (method, tamper, findings)


def test_the_rows_of_a_table_written_again_in_another_order_still_verify_under_rows_v3(out: Path) -> None:
    _record_tables(out, "rows-v3")
    con = duckdb.connect(str(out / "evidence.duckdb"))
    before = con.execute("SELECT * FROM findings").fetchall()
    con.execute("CREATE TABLE shuffled AS SELECT * FROM findings ORDER BY rowid DESC")
    con.execute("DELETE FROM findings")
    con.execute("INSERT INTO findings SELECT * FROM shuffled")
    con.execute("DROP TABLE shuffled")
    con.execute("CHECKPOINT")
    after = con.execute("SELECT * FROM findings").fetchall()
    con.close()
    assert sorted(after) == sorted(before) and after != before  # the same rows, stored in another order
    assert verify(out, rederive=False) == []


def test_a_run_whose_largest_table_could_not_be_sorted_on_the_free_disk_records_rows_v2_and_verifies(
    tmp_path: Path, monkeypatch
) -> None:
    """rows-v4 sorts each table in the database, which spills beyond its memory limit; when the largest
    tables' sort could need more than two thirds of the free disk, a run records rows-v2 (which hashes in
    passes) instead of failing at the end."""
    import collections

    import kvforensics.evidence.digests as digests

    con = connect(memory_limit="16MB")
    con.execute("CREATE TABLE big AS SELECT 'request-' || i::VARCHAR AS id, i AS n FROM range(200000) t(i)")
    assert digests.run_method(con) == "rows-v4"
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(digests.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 10**5, 10**5))
    assert digests.run_method(con) == "rows-v2"
    con.execute("SET VARIABLE kvf_memory_limit = 10000000000")  # it would be sorted in memory: rows-v4
    assert digests.run_method(con) == "rows-v4"
    monkeypatch.setattr(digests, "_v4_row_bytes", lambda con, name: 10**12)  # any limit, any disk
    incident = write_mini(tmp_path / "mini")
    run(incident, tmp_path / "out", progress=False, pdf=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["table_digest"] == "rows-v2" and "sorted order" in manifest["table_digest_construction"]
    monkeypatch.undo()
    assert verify(tmp_path / "out") == []


def test_a_rows_v4_table_sorted_as_groups_has_the_digest_of_its_rows_sorted_one_by_one(monkeypatch) -> None:
    """A table whose other columns repeat is sorted as groups of its last column (content_fingerprints' shape):
    nulls in the keys and in the lists, duplicate rows, groups longer than a hashing slice and slices of one row
    give the digest of the definition, and the digest of the row-by-row sort."""
    import kvforensics.evidence.digests as digests

    con = connect(memory_limit="1GB")
    con.execute(
        "CREATE TABLE g AS SELECT 'r' || (i % 37)::VARCHAR AS request_id, "
        "CASE WHEN i % 3 = 0 THEN 'output' WHEN i % 11 = 0 THEN NULL ELSE 'prompt' END AS part, "
        "CASE WHEN i % 13 = 0 THEN NULL ELSE (i * 7919) % 503 - 250 END AS fp FROM range(4000) t(i)"
    )
    con.execute(
        "INSERT INTO g VALUES (NULL, 'prompt', 5), (NULL, NULL, NULL), ('r1', 'prompt', 5), ('r1', 'prompt', 5)"
    )
    columns = [("request_id", "bytes"), ("part", "bytes"), ("fp", "int")]
    expected = _rows_v4_reference(columns, con.execute("SELECT * FROM g").fetchall())
    seen: dict[str, list[float | None]] = {}
    grouped = digests._grouped

    def recording(con, name, canonical, profile):
        seen.setdefault(name, []).append(grouped(con, name, canonical, profile))
        return seen[name][-1]

    monkeypatch.setattr(digests, "_grouped", recording)
    monkeypatch.setattr(digests, "_GROUPED_MIN_ROWS", 100)
    for max_rows in (1, 7, 1 << 20):
        monkeypatch.setattr(digests, "_V4_MAX_ROWS", max_rows)
        assert table_digests(con, "rows-v4")["g"] == {"rows": 4004, "sha256": expected}, max_rows
    assert len(seen["g"]) == 3 and all(s is not None for s in seen["g"])  # each digest above went through groups
    monkeypatch.setattr(digests, "_GROUPED_MIN_ROWS", 10**9)
    seen.clear()
    assert table_digests(con, "rows-v4")["g"] == {"rows": 4004, "sha256": expected}
    assert seen["g"] == [None]
    # a table whose last column is not an integer, or whose rows hardly repeat, is sorted row by row
    monkeypatch.setattr(digests, "_GROUPED_MIN_ROWS", 100)
    con.execute("CREATE TABLE u AS SELECT i AS n, (i * 2)::VARCHAR AS s FROM range(1000) t(i)")
    con.execute("CREATE TABLE v AS SELECT i AS n, i * 2 AS m FROM range(1000) t(i)")
    seen.clear()
    assert table_digests(con, "rows-v4")["v"]["sha256"] == _rows_v4_reference(
        [("n", "int"), ("m", "int")], con.execute("SELECT * FROM v").fetchall()
    )
    assert seen["u"] == [None] and seen["v"] == [None]
