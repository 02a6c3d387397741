"""`--where`: the episodes a SQL condition picks from the view `episode_selection` (lcap.schema).

The condition runs on `Store.user_sql`, the instance `lcap sql` uses: read-only, no file system, configuration
locked; so a condition can read the store and nothing else, and change nothing. It must be one expression: it
is checked to parse as the WHERE clause of one SELECT, and anything DuckDB refuses is one line naming it; one
still running after `WHERE_TIMEOUT_S` is interrupted.
"""

from __future__ import annotations

import threading
from typing import Any

import duckdb

from lcap.config import LcapError
from lcap.store import Store

SELECTION_VIEW = "episode_selection"
WHERE_TIMEOUT_S = 300.0


def select_episodes(store: Store, where: str) -> list[str]:
    """The ids of the episodes of `episode_selection` for which `where` holds, oldest first."""
    sql = f"SELECT episode_id FROM {SELECTION_VIEW} WHERE ({where}\n) ORDER BY started_at, episode_id"
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise LcapError(f"bad --where: {_first_line(exc)}") from None
    if len(statements) != 1:
        raise LcapError("bad --where: give one SQL condition, not statements")
    with store.connect():  # a store from an older lcap gets the current views
        pass
    try:
        with store.user_sql() as con:
            return [row[0] for row in _interruptible(con, sql)]
    except duckdb.Error as exc:
        raise LcapError(f"bad --where: {_first_line(exc)}") from None


def _interruptible(con: duckdb.DuckDBPyConnection, sql: str) -> list[Any]:
    """`sql`'s rows, the query interrupted if it runs past `WHERE_TIMEOUT_S`."""
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        con.interrupt()

    timer = threading.Timer(WHERE_TIMEOUT_S, stop)
    timer.daemon = True
    timer.start()
    try:
        return con.execute(sql).fetchall()
    except duckdb.InterruptException:
        if stopped.is_set():
            raise LcapError(f"bad --where: the condition ran past {WHERE_TIMEOUT_S:g}s and was stopped") from None
        raise
    finally:
        timer.cancel()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0]
