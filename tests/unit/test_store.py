"""The store: schema versions and migrations, batched appends (processes taking turns at the file:
tests/integration/test_store.py)."""

from __future__ import annotations

import json

import duckdb
import pytest

from lcap.store import Store


def test_append_takes_every_rows_columns_not_only_the_first_rows(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    rows = [{"episode_id": "a"}, {"episode_id": "b", "status": "ok", "exit_code": 3}]
    assert store.append("episodes", rows) == 2
    assert store.fetchall("SELECT episode_id, status, exit_code FROM episodes ORDER BY 1") == [
        ("a", None, None),
        ("b", "ok", 3),
    ]


def test_append_only_new_rows_is_not_blinded_by_a_null_key(tmp_path):
    """A row with a NULL key in the table (a dead letter's skeleton turn) must not make `new_by` skip every new row:
    SQL's `x NOT IN (..., NULL)` is never true."""
    store = Store(tmp_path / "lcap.duckdb")
    store.append("dead_letters", [{"record_id": None, "reason": "no id"}])
    assert store.append("dead_letters", [{"record_id": "r1", "reason": "a"}], new_by="record_id") == 1
    assert store.append("dead_letters", [{"record_id": "r1", "reason": "again"}], new_by="record_id") == 0


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


def test_a_version_11_store_gets_turns_role_and_episode_selection_reads_it(tmp_path):
    """Version 12 added turns.role (issue #52); a turn captured before it counts as `default` in `roles`."""
    path = tmp_path / "v11.duckdb"
    store = Store(path)
    store.append("episodes", [{"episode_id": "e1", "status": "ok"}])
    store.append("turns", [{"turn_id": "t1", "episode_id": "e1"}])
    con = duckdb.connect(str(path))  # back to version 11's shape (the view reads the column: it goes too)
    con.execute(
        "DROP VIEW episode_selection; ALTER TABLE turns DROP COLUMN role; UPDATE schema_version SET version = 11"
    )
    con.close()
    store = Store(path)
    store.append("turns", [{"turn_id": "t2", "episode_id": "e1", "role": "planner"}])
    assert store.fetchall("SELECT turn_id, role FROM turns ORDER BY turn_id") == [("t1", None), ("t2", "planner")]
    assert store.fetchall("SELECT roles FROM episode_selection") == [(["default", "planner"],)]


def test_an_episode_is_stored_with_its_invocation_redacted(tmp_path):
    """Every writer of an episode's row goes through start_episode: command, cwd, labels, error redacted (#54)."""
    from lcap.redact import REDACTED

    store = Store(tmp_path / "s.duckdb")
    store.start_episode(
        "e1",
        command="bash -c 'env CODEX_API_KEY=plain-value python agent.py'",
        cwd="/work/API_TOKEN=in-a-folder-name",
        labels={"api_key": "label-value", "task": "sk-proj-abcdefghij0123456789XYZ", "split": "train"},
    )
    store.end_episode("e1", status="failed", error="cannot run env CODEX_API_KEY=plain-value python agent.py")
    (row,) = store.fetchall("SELECT command, cwd, labels, task_id, error FROM episodes")
    command, cwd, labels, task_id, error = row
    assert command == f"bash -c 'env CODEX_API_KEY={REDACTED} python agent.py'"
    assert cwd == f"/work/API_TOKEN={REDACTED}"
    assert json.loads(labels) == {"api_key": REDACTED, "task": REDACTED, "split": "train"}
    assert task_id == REDACTED and error == f"cannot run env CODEX_API_KEY={REDACTED} python agent.py"


def test_a_version_9_store_has_its_invocations_redacted_on_first_write(tmp_path):
    """Stores made before version 10 held commands, cwds and labels in clear: the migration redacts their rows
    (DuckDB does not zero the pages it frees: the file may keep the old bytes until it reuses them)."""
    from lcap.redact import REDACTED

    path = tmp_path / "v9.duckdb"
    Store(path).append("episodes", [{"episode_id": "x"}])
    labels = json.dumps({"task": "t", "token": "label-value", "note": "sk-proj-abcdefghij0123456789XYZ"})
    con = duckdb.connect(str(path))  # written in clear, as lcap before version 10 did
    con.execute(
        "INSERT INTO episodes (episode_id, command, cwd, labels, task_id, error) VALUES ('e1', ?, ?, ?, 't', ?)",
        ["env OPENAI_API_KEY=plain-value agent --api-key v2", "/w/DB_PASSWORD=p", labels, "agent --token v3 failed"],
    )
    con.execute("UPDATE schema_version SET version = 9")
    con.close()
    store = Store(path)
    with store.connect():  # the first unit of work that may write brings the schema up to date
        pass
    rows = store.fetchall("SELECT command, cwd, labels, task_id, error FROM episodes WHERE episode_id = 'e1'")
    ((command, cwd, labels, task_id, error),) = rows
    assert command == f"env OPENAI_API_KEY={REDACTED} agent --api-key {REDACTED}"
    assert cwd == f"/w/DB_PASSWORD={REDACTED}" and error == f"agent --token {REDACTED} failed"
    assert json.loads(labels) == {"task": "t", "token": REDACTED, "note": REDACTED} and task_id == "t"
    assert store.fetchall("SELECT command FROM episodes WHERE episode_id = 'x'") == [(None,)]


def test_a_reward_key_is_scoped_to_its_episode_not_the_whole_store(tmp_path):
    """Tenant B's reward with the key tenant A used on its own episode is stored; the same key again on one
    episode is not (issue 48 row 1: B's reward was answered `stored: false` and lost)."""
    store = Store(tmp_path / "s.duckdb")
    for episode in ("ep-a", "ep-b"):
        store.start_episode(episode, command=None, cwd=None, labels={})
    assert store.add_reward("ep-a", 1.0, details="{}", source="ci", key="grade-1")
    assert store.add_reward("ep-b", 0.5, details="{}", source="ci", key="grade-1")
    assert not store.add_reward("ep-a", 0.0, details="{}", source="ci", key="grade-1")
    rows = store.fetchall("SELECT episode_id, value FROM rewards WHERE key = 'grade-1' ORDER BY 1")
    assert rows == [("ep-a", 1.0), ("ep-b", 0.5)]


def test_a_unit_of_work_that_fails_inside_a_transaction_is_rolled_back_and_the_store_stays_usable(tmp_path):
    store = Store(tmp_path / "lcap.duckdb")
    with store.connect() as con:
        con.execute("CREATE TABLE notes (note VARCHAR)")
    with pytest.raises(RuntimeError), store.connect() as con:
        con.execute("BEGIN")
        con.execute("INSERT INTO notes VALUES ('half done')")
        raise RuntimeError("the unit of work fails with its transaction open (and not aborted: no SQL error)")
    with store.connect() as con:
        assert con.execute("SELECT count(*) FROM notes").fetchall() == [(0,)]
        con.execute("INSERT INTO notes VALUES ('next')")
    assert store.fetchall("SELECT note FROM notes") == [("next",)]


def test_a_version_13_store_gets_train_runs_dropped_alone(tmp_path):
    """Version 14 added train_runs.dropped_alone; a round trained before it has NULL there."""
    from lcap.schema import SCHEMA_VERSION

    path = tmp_path / "v13.duckdb"
    store = Store(path)
    store.append("train_runs", [{"run": "r", "round": 1}])
    con = duckdb.connect(str(path))  # back to version 13's shape
    con.execute("ALTER TABLE train_runs DROP COLUMN dropped_alone; UPDATE schema_version SET version = 13")
    con.close()
    store = Store(path)
    store.append("train_runs", [{"run": "r", "round": 2, "dropped_alone": 3}])
    assert store.fetchall("SELECT round, dropped_alone FROM train_runs ORDER BY round") == [(1, None), (2, 3)]
    assert store.fetchall("SELECT max(version) FROM schema_version") == [(SCHEMA_VERSION,)]
