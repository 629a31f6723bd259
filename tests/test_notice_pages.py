"""The notices' HTML pages written by a worker process while the report's pages are drawn: the same files as written
in the process, and every page still written when the worker is lost."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from kvforensics.config import load_incident
from kvforensics.core.db import connect
from kvforensics.report import notices


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def in_process(sample_run, sample_incident, tmp_path_factory):
    """The sample's notices written without a worker, and what to write them again from."""
    incident = load_incident(sample_incident)
    out = tmp_path_factory.mktemp("notices-in-process")
    con = connect(sample_run / "evidence.duckdb", read_only=True)
    try:
        written = notices.write_notices(con, incident, out)
    finally:
        con.close()
    assert len(written) > 2 * notices._HTML_CHUNK // 4  # several chunks once the chunk is made smaller below
    return incident, out, written


def _started(incident, sample_run, out: Path, monkeypatch, pool=None, chunk: int | None = None):
    """The sample's notices begun with a worker (``pool``: the executor class standing in for the process pool),
    as start_notices leaves them before the wait."""
    monkeypatch.setattr(notices, "HTML_WORKER_FROM", 1)
    monkeypatch.setattr(notices, "_cores", lambda: 2)
    if chunk is not None:
        monkeypatch.setattr(notices, "_HTML_CHUNK", chunk)
    if pool is not None:
        monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", pool)
    con = connect(sample_run / "evidence.duckdb", read_only=True)
    try:
        return notices.start_notices(con, incident, out)
    finally:
        con.close()


def test_a_worker_process_writes_the_same_pages(in_process, sample_run, tmp_path, monkeypatch):
    incident, expected, written = in_process
    pending = _started(incident, sample_run, tmp_path, monkeypatch, chunk=16)
    assert pending._pool is not None and len(pending._futures) == -(-len(written) // 16)
    got = pending.wait()
    assert [p.relative_to(tmp_path) for p in got] == [p.relative_to(expected) for p in written]
    assert files(tmp_path) == files(expected)
    assert pending._pool is None  # shut down


def test_below_the_threshold_or_on_one_core_no_process_is_started(in_process, sample_run, tmp_path, monkeypatch):
    incident, expected, written = in_process
    con = connect(sample_run / "evidence.duckdb", read_only=True)
    try:
        monkeypatch.setattr(notices, "HTML_WORKER_FROM", len(written) + 1)
        small = notices.start_notices(con, incident, tmp_path / "a")
        monkeypatch.setattr(notices, "HTML_WORKER_FROM", 1)
        monkeypatch.setattr(notices, "_cores", lambda: 1)
        one_core = notices.start_notices(con, incident, tmp_path / "b")
    finally:
        con.close()
    assert small._pool is None and one_core._pool is None
    small.wait(), one_core.wait()
    assert files(tmp_path / "a") == files(expected) == files(tmp_path / "b")


class _LostWorker(concurrent.futures.Executor):
    """A pool whose worker died before doing anything (killed, out of memory)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(BrokenProcessPool("a child process terminated abruptly"))
        return future


def test_pages_a_lost_worker_did_not_write_are_written_here(in_process, sample_run, tmp_path, monkeypatch):
    incident, expected, _ = in_process
    pending = _started(incident, sample_run, tmp_path, monkeypatch, _LostWorker)
    assert isinstance(pending._pool, _LostWorker)
    pending.wait()
    assert files(tmp_path) == files(expected)


class _BusyWorker(concurrent.futures.Executor):
    """A pool whose worker never gets to the tasks (busy with the first, slow to start): each stays pending, so it
    can be cancelled; one not taken fails after a while rather than hang the test."""

    def __init__(self, *args, **kwargs) -> None:
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, fn, /, *args, **kwargs):
        import threading

        future: concurrent.futures.Future = concurrent.futures.Future()
        timer = threading.Timer(60, lambda: future.done() or future.set_exception(TimeoutError("never taken")))
        timer.daemon = True
        timer.start()
        self.futures.append(future)
        return future

    def shutdown(self, wait=True, *, cancel_futures=False):
        pass


def test_tasks_the_worker_has_not_begun_are_written_here(in_process, sample_run, tmp_path, monkeypatch):
    """Waiting, the report's process takes every task the worker has not begun (the last first) and writes it."""
    incident, expected, _ = in_process
    pending = _started(incident, sample_run, tmp_path, monkeypatch, _BusyWorker, chunk=16)
    pool = pending._pool
    assert isinstance(pool, _BusyWorker) and len(pool.futures) == 1 + len(pending._futures)  # the first readies it
    assert not any(tmp_path.rglob("*.md"))  # nothing written before the wait: the worker has it all
    pending.wait()
    assert all(f.cancelled() for f in pool.futures[1:])
    assert files(tmp_path) == files(expected)


def test_a_worker_that_fails_fails_the_report(in_process, sample_run, tmp_path, monkeypatch):
    incident, expected, written = in_process
    # the worker cannot write one page: a folder stands where it goes
    (tmp_path / written[-1].relative_to(expected).with_suffix(".html")).mkdir(parents=True)
    pending = _started(incident, sample_run, tmp_path, monkeypatch)
    assert pending._pool is not None
    with pytest.raises(IsADirectoryError):
        pending.wait()
    assert pending._pool is None


def _env(cache):
    from jinja2 import Environment, FileSystemLoader

    from kvforensics.report.templating import TEMPLATES

    return Environment(loader=FileSystemLoader(TEMPLATES), bytecode_cache=cache, trim_blocks=True, lstrip_blocks=True)


def test_compiled_templates_are_kept_and_a_broken_cache_is_only_slower(tmp_path, monkeypatch):
    """The report's templates compiled once are read back by the next run (no compiling), render the same, and a
    cache file that is damaged, or a cache folder that cannot be written, still renders the same."""
    from jinja2 import Environment
    from jinja2.bccache import bc_magic

    from kvforensics.report.templating import _TemplateCache

    folder = tmp_path / "cache"
    folder.mkdir()
    fresh = _env(_TemplateCache(str(folder))).get_template("notice.html.j2")
    expected = fresh.render(title="t <b>", body="x")
    assert len(list(folder.iterdir())) == 1

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    with monkeypatch.context() as m:
        m.setattr(Environment, "_compile", no_compiling)
        assert (
            _env(_TemplateCache(str(folder))).get_template("notice.html.j2").render(title="t <b>", body="x") == expected
        )

    for damage in (b"", b"\x00garbage", bc_magic + b"\x00" * 7, bc_magic + b"\xff" * 80):
        for cached in folder.iterdir():
            cached.write_bytes(damage)
        assert (
            _env(_TemplateCache(str(folder))).get_template("notice.html.j2").render(title="t <b>", body="x") == expected
        )

    gone = tmp_path / "not-a-folder"
    gone.write_text("a file where the cache folder should be")
    assert _env(_TemplateCache(str(gone))).get_template("notice.html.j2").render(title="t <b>", body="x") == expected
