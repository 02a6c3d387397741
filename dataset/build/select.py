"""`--where`: the episodes a SQL condition picks from the view `episode_selection` (lcap.schema).

The condition runs on `Store.user_sql`, the instance `lcap sql` uses: read-only, no file system, configuration
locked; so a condition can read the store and nothing else, and change nothing. It must be one expression: it
is checked to parse as the WHERE clause of one SELECT, and anything DuckDB refuses is one line naming it.
"""

from __future__ import annotations

import duckdb

from lcap.config import LcapError
from lcap.store import Store

SELECTION_VIEW = "episode_selection"


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
            return [row[0] for row in con.execute(sql).fetchall()]
    except duckdb.Error as exc:
        raise LcapError(f"bad --where: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0]
