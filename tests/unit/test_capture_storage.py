"""The row a turn becomes and the store agree on a clean turn (the writer process, the spool and their failures:
tests/integration/test_capture_storage.py)."""

from __future__ import annotations

from fixtures_capture import pending_turn, turns

from lcap.capture.turns.turn import build_row
from lcap.store import Store


def test_build_row_and_store_agree_on_a_clean_turn(tmp_path):
    """The fast path is untouched: a clean turn's row is stored exactly as built, with no flag."""
    pending = pending_turn("clean")
    Store(tmp_path / "db.duckdb").append("turns", [build_row(pending)])
    (row,) = turns(tmp_path / "db.duckdb")
    assert row["turn_id"] == pending.turn_id and row["degraded"] is None and row["completion_text"] == "hi"
