"""The store and its WAL are created private to their owner (redaction end to end:
tests/integration/test_capture_secrets.py)."""

from __future__ import annotations

import os

from fixtures_capture import is_private


def test_the_store_and_its_wal_are_created_private(tmp_path):
    """DuckDB creates both with the process's umask, and the WAL again after each checkpoint: lcap holds the
    umask at 077 while a unit of work may create them, and gives it back after."""
    from lcap.store import Store

    db = tmp_path / "new" / "lcap.duckdb"
    store = Store(db)
    before = os.umask(0o022)
    os.umask(before)
    for _ in range(2):  # the second unit of work makes a new WAL
        with store.connect() as con:
            con.execute("INSERT INTO rewards (episode_id, value) VALUES ('e', 1)")
            wal = db.with_name(db.name + ".wal")
            assert wal.exists() and is_private(wal) and is_private(db)
    with store.user_sql(write=True) as con:  # `lcap sql --write`
        con.execute("INSERT INTO rewards (episode_id, value) VALUES ('e', 2)")
        assert is_private(db.with_name(db.name + ".wal"))
    current = os.umask(0o022)
    os.umask(current)
    assert current == before  # given back: files the user's own code creates are as they were
