"""The train/serve mismatch guard's columns on an older store (the guard on the trainer and the vLLM server:
tests/e2e/test_train_mismatch.py)."""

from __future__ import annotations

from lcap.store import Store


def test_a_store_of_schema_version_3_gets_the_guard_and_step_kl_columns(tmp_path):
    from lcap.schema import SCHEMA_VERSION

    store = Store(tmp_path / "lcap.duckdb")
    store.append("train_runs", [{"run": "r", "round": 1}])
    columns = ("mismatch_kl", "mismatch_logp_diff", "mismatch_seconds", "mismatch", "step_kl")
    for column in columns:
        store.execute(f"ALTER TABLE train_runs DROP COLUMN {column}")
    store.execute("UPDATE schema_version SET version = 3")

    reopened = Store(tmp_path / "lcap.duckdb")
    reopened.append("train_runs", [{"run": "r", "round": 2, "mismatch_kl": 0.5, "step_kl": 0.25}])
    assert reopened.fetchall("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    assert reopened.fetchall("SELECT round, mismatch_kl, step_kl FROM train_runs ORDER BY round") == [
        (1, None, None),
        (2, 0.5, 0.25),
    ]
