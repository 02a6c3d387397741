"""Nothing answered is lost, and nothing stuck blocks the rest: a spool on a file system that fills up (a small
tmpfs under $LCAP_HOME/spool, filled and freed mid-run), and a record that kills the writer however it is read
(an OOM kill in a memory cgroup, cgroups v1).

Real parts throughout: `lcap proxy --serve` with its writer process, an httpx agent through it, the fake LLM,
DuckDB files. Mounting and cgroups need root: without it these tests skip.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import httpx
import pytest
from fixtures_capture import LCAP, pending_turn, serve_proxy, turns, wait_until
from fixtures_memory import memory_cgroup

from lcap.capture.storage.writer import POISONED_DIR, TurnWriter
from lcap.store import Store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and memory cgroups need root")


def _rows(db: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@contextmanager
def small_disk(path: Path, size: str = "8M") -> Iterator[Path]:
    """A tmpfs of `size` mounted on `path` for the test's length."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill `disk` with one file until it refuses more, then give `leave` bytes back."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (bytes(1 << 20), bytes(4096)):
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    if leave:
        os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def _status(env: dict[str, str], db: Path) -> dict:
    done = subprocess.run(
        [LCAP, "status", "--db", str(db), "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _counters(env: dict[str, str], db: Path) -> dict:
    (proxy,) = _status(env, db)["proxies"]
    return proxy["counters"]


def _settled(env: dict[str, str], db: Path, calls: int) -> bool:
    """The proxy's record shows CALLS calls, none of them in flight."""
    counters = _counters(env, db)
    return (counters["calls"], counters["calls_in_flight"]) == (calls, 0)


def _stop(proxy: subprocess.Popen) -> str:
    proxy.send_signal(signal.SIGINT)
    _, err = proxy.communicate(timeout=120)
    return err


@pytest.fixture
def full_env(capture_env, tmp_path) -> Iterator[tuple[dict[str, str], Path, Path]]:
    """An lcap home whose spool directory is an 8 MiB tmpfs, and a store beside it on the ordinary disk."""
    home = tmp_path / "home"
    with small_disk(home / "spool") as spool:
        yield {**capture_env, "LCAP_HOME": str(home)}, tmp_path / "lcap.duckdb", spool


def _caller(port: int, env: dict[str, str]):
    url = subprocess.run(
        [LCAP, "episode", "new", "--port", str(port)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    client = httpx.Client(proxy=url, trust_env=False, timeout=60)
    pad = "x" * 20_000  # a record of some 20 KB: larger than the room left on the disk, so its write tears

    def call(i: int) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": f"call {i} {pad}"}]}
        return client.post("http://api.openai.com/v1/chat/completions", json=body).status_code

    return client, call


def test_a_full_spool_disk_answers_every_call_and_stores_every_turn(full_env, llm):
    """Disk-full soak: the disk fills mid-run, leaving room for part of a record (a torn write). Every call is
    answered 200 as the upstream answered it, `lcap status` shows the turns held in memory and none in flight,
    and once the disk is freed every answered turn is stored, once, with no dead letter: the torn part was cut
    off before anything was appended after it."""
    env, db, spool = full_env
    proxy, port = serve_proxy(env, "--upstream", llm.url, "--db", str(db))
    answered: list[int] = []
    try:
        client, call = _caller(port, env)
        with client:
            answered += [call(i) for i in range(5)]
            wait_until(lambda: _counters(env, db)["turns_stored"] == 5, timeout=60)
            filler = fill(spool, leave=8192)
            answered += [call(i) for i in range(5, 25)]
            # The proxy's record shows its counters at most a second late, and a call leaves the in-flight count
            # just after its agent has the answer: wait for the record that shows the last call closed.
            wait_until(lambda: _settled(env, db, 25), timeout=30)
            full = _counters(env, db)
            assert full["turns_held"] > 0 and full["calls_in_flight"] == 0, full
            assert full["turns_lost"] == 0
            filler.unlink()
            answered += [call(i) for i in range(25, 35)]
            wait_until(lambda: _counters(env, db)["turns_stored"] == 35, timeout=60)
            assert _counters(env, db)["turns_held"] == 0
    finally:
        err = _stop(proxy)
    assert answered == [200] * 35
    assert f"lcap: 35 of 35 turns stored in {db}" in err, err
    assert "cannot write to the spool" in err and "takes records again" in err
    stored = sorted(int(r["request"]["messages"][0]["content"].split()[1]) for r in turns(db))
    assert stored == list(range(35))
    assert _rows(db, "SELECT count(*) FROM dead_letters") == [(0,)]
    assert not [p for p in spool.iterdir() if p.name not in ("key", "filler")]  # the spool is stored and gone


def test_a_disk_full_to_the_end_says_what_was_lost(full_env, llm):
    """The disk never takes the held turns back: the agent still got its answers, the exit message says how many
    turns were lost instead of claiming they wait in a spool, `lcap status` keeps nothing in flight, and
    `lcap doctor` warns that the spool's disk is nearly full."""
    env, db, spool = full_env
    proxy, port = serve_proxy(env, "--upstream", llm.url, "--db", str(db))
    try:
        client, call = _caller(port, env)
        with client:
            assert call(0) == 200
            wait_until(lambda: _counters(env, db)["turns_stored"] == 1, timeout=60)
            fill(spool)
            assert [call(i) for i in range(1, 4)] == [200] * 3
            wait_until(lambda: _settled(env, db, 4), timeout=30)
            counters = _counters(env, db)
            assert (counters["calls_in_flight"], counters["turns_held"]) == (0, 3), counters
    finally:
        err = _stop(proxy)
    assert f"lcap: 1 of 4 turns stored in {db}" in err, err
    assert "warning: 3 lost, never spooled: the spool's disk refused them" in err
    assert "left in" not in err
    assert _status(env, db)["proxies"] == []
    assert _rows(db, "SELECT count(*) FROM turns") == [(1,)]
    doctor = subprocess.run(
        [LCAP, "doctor", "spool.disk", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    (check,) = json.loads(doctor.stdout)["checks"]
    assert check["status"] == "warn" and "nearly full" in check["summary"] and check["details"]["free_bytes"] < 1 << 20


def test_a_record_that_oom_kills_every_writer_is_set_aside(tmp_path, capture_home):
    """A record too big for the writer's memory kills it whenever it is read, also when the writer only means to
    keep it as a dead letter. The tries are counted before each read, so after the set number of deaths its
    bytes are copied aside a slice at a time, a dead letter says where, and the turn after it is stored."""
    db, root = tmp_path / "db.duckdb", tmp_path / "spool"
    writer = TurnWriter(Store(db), interval=0.05, spool_root=root)
    with memory_cgroup(160 << 20) as group:
        confined: set[int] = set()
        done = threading.Event()

        def confine() -> None:  # each writer the proxy starts goes into the cgroup while it imports
            while not done.is_set():
                proc = writer._proc
                if proc is not None and proc.pid not in confined:
                    try:
                        group.add(proc.pid)
                    except OSError:
                        pass
                    confined.add(proc.pid)
                time.sleep(0.005)

        watcher = threading.Thread(target=confine, daemon=True)
        watcher.start()
        try:
            writer.start()
            assert writer._spool is not None
            writer.put(pending_turn("first"))
            assert writer.flush(timeout=60)
            big = b"E" + bytes(192 << 20)  # past the cgroup's whole limit: reading it whole always kills
            writer._spool.append_payload(big)
            writer.put(pending_turn("last"))
            assert writer.flush(timeout=180)
            report = writer.finish(timeout=60)
        finally:
            done.set()
            watcher.join(5)
    # Writers died reading it twice, then once keeping it whole as a dead letter; the fourth sets it aside.
    assert report is not None and report.restarts == 3, report
    assert (report.stored, report.dead, report.unstored) == (2, 1, 0)
    assert sorted(r["episode_id"] for r in turns(db)) == ["first", "last"]
    ((reason, record),) = _rows(db, "SELECT reason, record FROM dead_letters")
    assert record is None and reason.startswith("the writer process died on this record (3 times)")
    (aside,) = (root / POISONED_DIR).iterdir()
    assert str(aside) in reason and aside.stat().st_size == 4 + len(big)


def test_the_writer_stores_a_spool_whose_disk_is_full(tmp_path, capture_home):
    """The spool's own disk is full: the writer still stores what the spool holds (its progress is rewritten in
    place, needing no new space), a turn put meanwhile waits in memory, and is stored by itself once the disk
    has room again."""
    db = tmp_path / "db.duckdb"
    with small_disk(tmp_path / "spool") as root:
        writer = TurnWriter(Store(db), interval=0.05, spool_root=root)
        writer.start()
        assert writer._spool is not None and writer._proc is not None
        writer.put(pending_turn("first"))
        assert writer.flush(timeout=60)
        os.kill(writer._proc.pid, signal.SIGSTOP)
        try:
            writer.put(pending_turn("queued-1"))
            writer.put(pending_turn("queued-2"))
            filler = fill(root)
        finally:
            os.kill(writer._proc.pid, signal.SIGCONT)
        wait_until(lambda: writer.stored == 3, timeout=60)
        writer.put(pending_turn("held", "x" * 20_000))  # more than the last page of the segment has left
        assert writer._spool.held == 1 and not writer.flush(timeout=1)
        filler.unlink()
        assert writer.flush(timeout=60)
        report = writer.finish(timeout=60)
    assert report is not None and (report.spooled, report.stored, report.lost, report.unstored) == (4, 4, 0, 0)
    assert sorted(r["episode_id"] for r in turns(db)) == ["first", "held", "queued-1", "queued-2"]


def test_a_store_whose_disk_fills_before_its_checkpoint_keeps_the_write_and_says_why(tmp_path, caplog):
    """The store's own disk fills after a unit of work has written its WAL and before the checkpoint that releases
    the file: the unit of work ends without an error (its writes are committed), the failed checkpoint is logged
    with its cause, and the rows are there for the next unit of work, which checkpoints them once there is room."""
    with small_disk(tmp_path / "disk") as disk:
        store = Store(disk / "lcap.duckdb")
        with store.connect() as con:
            con.execute("CREATE TABLE notes (note VARCHAR)")
        note = os.urandom(400_000).hex()  # little to compress: the checkpoint needs room for it
        with caplog.at_level("WARNING", logger="lcap.store"), store.connect() as con:
            con.execute("INSERT INTO notes VALUES (?)", [note])
            filler = fill(disk)
        assert "its checkpoint failed" in caplog.text and "No space left on device" in caplog.text, caplog.text
        filler.unlink()
        caplog.clear()
        with store.connect() as con:
            assert con.execute("SELECT note FROM notes").fetchall() == [(note,)]
        assert caplog.text == "" and not (disk / "lcap.duckdb.wal").exists()  # checkpointed: the WAL is gone
        assert _rows(disk / "lcap.duckdb", "SELECT count(*) FROM notes") == [(1,)]
