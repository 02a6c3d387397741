"""The store and its WAL are created private to their owner, by their modes, not by the process's umask, which lcap
never changes (redaction end to end: tests/integration/test_capture_secrets.py)."""

from __future__ import annotations

import re
import stat
import threading
from pathlib import Path

import pytest
from fixtures_capture import is_private

from lcap.store import Store


def process_umask() -> int:
    """The umask, read without setting it (Linux shows it in /proc since 4.7)."""
    found = re.search(r"^Umask:\s*([0-7]+)$", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert found, "no Umask line in /proc/self/status"
    return int(found.group(1), 8)


@pytest.fixture
def umask_lets_others_read():
    """Under a umask that already hides files from others, a test of their modes proves nothing."""
    if process_umask() & 0o044 == 0o044:
        pytest.skip("this process's umask already hides new files from group and others")
    return process_umask()


def test_the_store_and_its_wal_are_created_private(tmp_path, umask_lets_others_read):
    """DuckDB creates both with the process's umask, and the WAL again after each checkpoint: lcap makes the store
    file private before it has its name and puts a private WAL in place before a unit of work's first write; the
    umask stays as it was, so files the user's own code creates are as they were."""
    db = tmp_path / "new" / "lcap.duckdb"
    store = Store(db)
    before = process_umask()
    for _ in range(2):  # the second unit of work makes a new WAL
        with store.connect() as con:
            con.execute("INSERT INTO rewards (episode_id, value) VALUES ('e', 1)")
            wal = db.with_name(db.name + ".wal")
            assert wal.exists() and is_private(wal) and is_private(db)
    with store.user_sql(write=True) as con:  # `lcap sql --write`
        con.execute("INSERT INTO rewards (episode_id, value) VALUES ('e', 2)")
        assert is_private(db.with_name(db.name + ".wal"))
    with store.connect():  # units of work that write nothing
        pass
    with store.user_sql(write=True) as con:
        con.execute("SELECT count(*) FROM rewards").fetchall()
    assert process_umask() == before
    # no staging folder or unused WAL left; the lock file stays (removing it would split the lock), private and empty
    assert sorted(p.name for p in db.parent.iterdir()) == ["lcap.duckdb", "lcap.duckdb.lock"]
    lock = db.with_name(db.name + ".lock")
    assert is_private(lock) and lock.stat().st_size == 0


def test_the_wal_stays_private_past_duckdbs_automatic_checkpoint(tmp_path, umask_lets_others_read):
    """DuckDB checkpoints by itself once the WAL passes 16 MiB, deleting it, and the next write makes a new WAL with
    the umask's mode: within a unit of work the store's DuckDB does not checkpoint."""
    db = tmp_path / "lcap.duckdb"
    wal = db.with_name(db.name + ".wal")
    with Store(db).connect() as con:
        con.execute("CREATE TABLE filler (s VARCHAR)")
        written = 0
        while written < 24 << 20:  # rows below a row group's size go through the WAL
            con.execute("INSERT INTO filler SELECT repeat('x', 1000) FROM range(2000)")
            written += 2000 * 1000
            assert wal.exists() and is_private(wal), oct(stat.S_IMODE(wal.stat().st_mode)) if wal.exists() else None
        assert wal.stat().st_size > 16 << 20


def test_a_crashed_writers_wal_is_made_private_when_the_store_is_next_written(tmp_path, umask_lets_others_read):
    db = tmp_path / "lcap.duckdb"
    store = Store(db)
    store.execute("INSERT INTO rewards (episode_id, value) VALUES ('e', 1)")
    wal = db.with_name(db.name + ".wal")
    wal.touch()
    wal.chmod(0o644)  # as another tool left it
    with store.connect():
        assert is_private(wal)


def test_a_file_another_thread_makes_during_a_store_write_gets_the_users_umask(tmp_path, umask_lets_others_read):
    """The umask is one setting for every thread: a store write that changed it would give a file another thread
    makes meanwhile (a sandboxed verifier's tests, an agent's stdout) modes the sandbox's user cannot read."""
    store = Store(tmp_path / "db" / "lcap.duckdb")
    theirs = tmp_path / "theirs.txt"
    folder = tmp_path / "their-folder"
    for _ in range(2):  # creating the store, then writing to it
        theirs.unlink(missing_ok=True)
        if folder.exists():
            folder.rmdir()
        with store.connect() as con:
            con.execute("INSERT INTO rewards (episode_id, value) VALUES ('e', 1)")
            other = threading.Thread(target=lambda: (theirs.write_text("x"), folder.mkdir()))
            other.start()
            other.join()
        assert stat.S_IMODE(theirs.stat().st_mode) == 0o666 & ~umask_lets_others_read
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask_lets_others_read
