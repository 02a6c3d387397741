"""The store: schema versions and migrations, batched appends, processes taking turns at the file."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import duckdb

from lcap.store import Store

# A process with a backlog (as the turn writer has one): it attaches the store again the moment it detaches.
BACKLOG = """
import sys, time
from lcap.store import Store
store = Store(sys.argv[1])
for i in range(int(sys.argv[2])):
    with store.connect():
        if i == 0:
            print("attached", flush=True)
        time.sleep(float(sys.argv[3]))
"""


def test_append_takes_every_rows_columns_not_only_the_first_rows(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    rows = [{"episode_id": "a"}, {"episode_id": "b", "status": "ok", "exit_code": 3}]
    assert store.append("episodes", rows) == 2
    assert store.fetchall("SELECT episode_id, status, exit_code FROM episodes ORDER BY 1") == [
        ("a", None, None),
        ("b", "ok", 3),
    ]


def test_a_store_from_before_schema_versions_is_migrated(tmp_path):
    """Version 1 stores had episodes.group_index and no split column: the first write migrates them."""
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("""CREATE TABLE episodes (episode_id VARCHAR PRIMARY KEY, command VARCHAR, cwd VARCHAR,
                   started_at TIMESTAMPTZ, ended_at TIMESTAMPTZ, exit_code INTEGER, status VARCHAR, error VARCHAR,
                   labels JSON, task_id VARCHAR, round INTEGER, group_index INTEGER)""")
    labels = json.dumps({"task": "t", "round": "1", "sample": "3", "split": "eval"})
    con.execute(
        "INSERT INTO episodes (episode_id, labels, task_id, round, group_index, status) "
        "VALUES ('e1', ?, 't', 1, 3, 'ok')",
        [labels],
    )
    con.close()
    store = Store(path)
    with store.connect():  # the first unit of work that may write brings the schema up to date
        pass
    assert store.fetchall("SELECT episode_id, sample, split FROM episodes") == [("e1", 3, "eval")]
    assert store.fetchall("SELECT group_id FROM episode_summary") == [("1/eval/t",)]
    (version,) = store.fetchall("SELECT version FROM schema_version")[0]
    from lcap.schema import SCHEMA_VERSION

    assert version == SCHEMA_VERSION


def test_a_version_2_store_gets_turns_degraded(tmp_path):
    """Version 3 added turns.degraded (capture: why a row is not the call exactly as captured)."""
    path = tmp_path / "v2.duckdb"
    Store(path).append("turns", [{"turn_id": "t1"}])
    con = duckdb.connect(str(path))  # back to version 2's shape
    con.execute("ALTER TABLE turns DROP COLUMN degraded; UPDATE schema_version SET version = 2")
    con.close()
    store = Store(path)
    store.append("turns", [{"turn_id": "t2", "degraded": "why"}])
    assert store.fetchall("SELECT turn_id, degraded FROM turns ORDER BY turn_id") == [("t1", None), ("t2", "why")]


def test_a_version_4_store_gets_turns_replica(tmp_path):
    """Version 5 added turns.replica (the policy replica lcap routed the call to)."""
    path = tmp_path / "v4.duckdb"
    Store(path).append("turns", [{"turn_id": "t1"}])
    con = duckdb.connect(str(path))  # back to version 4's shape
    con.execute("ALTER TABLE turns DROP COLUMN replica; UPDATE schema_version SET version = 4")
    con.close()
    store = Store(path)
    store.append("turns", [{"turn_id": "t2", "replica": "r1"}])
    assert store.fetchall("SELECT turn_id, replica FROM turns ORDER BY turn_id") == [("t1", None), ("t2", "r1")]


def test_a_process_waiting_for_the_store_gets_it_before_one_with_a_backlog(tmp_path):
    """DuckDB's lock is no queue: a process retrying while another detaches and attaches again at once would get
    in only when a retry fell into that instant. The one waiting goes first (`_Waiters`): each of three attaches
    waits for the holder's current unit of work at most, however many follow it."""
    path = tmp_path / "s.duckdb"
    store = Store(path)
    store.execute("SELECT 1")  # the file and its schema
    hold, cycles = 0.3, 30
    holder = subprocess.Popen(
        [sys.executable, "-c", BACKLOG, str(path), str(cycles), str(hold)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "attached"
        waits = []
        for _ in range(3):
            t0 = time.monotonic()
            with store.connect():
                waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        assert holder.poll() is None, "the holder ended before the checks: no backlog was left to wait behind"
        assert max(waits) < 3 * hold, waits  # without the queue: one attach in a few gets in within a few holds
    finally:
        holder.kill()
        holder.wait()
