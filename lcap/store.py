"""The DuckDB store every stage reads and writes.

DuckDB lets one process hold a database file read-write, and while it does no other process can
open it, not even read-only. lcap runs several processes on one store (a proxy writing turns,
`lcap sql` reading them, a verifier adding rewards), so nobody keeps the file open: each access
opens it for one short transaction and closes it, and an open that finds the file locked retries
until `timeout`. Writers batch their rows so that a whole batch costs one open.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from lcap.config import LcapError
from lcap.schema import TABLES, VIEWS

_LOCKED = ("Could not set lock", "Conflicting lock", "database is locked")


def now() -> datetime:
    return datetime.now(timezone.utc)


class Store:
    """A DuckDB file opened per transaction. Safe to share between threads of one process."""

    def __init__(self, path: str | Path, *, timeout: float = 60.0, extra_schema: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._extra_schema = tuple(extra_schema)
        self._lock = threading.RLock()
        self._schema_ready = False

    @contextmanager
    def connect(self, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """Open the file for one unit of work; waits while another process holds it."""
        with self._lock:
            con = self._open(read_only)
            try:
                if not read_only and not self._schema_ready:
                    self._create_schema(con)
                yield con
            finally:
                con.close()

    def _open(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        if read_only and not self.path.exists():
            raise LcapError(f"no store at {self.path} (run `lcap proxy` first, or pass --db)")
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only)
            except duckdb.IOException as exc:
                if not any(marker in str(exc) for marker in _LOCKED):
                    raise LcapError(f"cannot open store {self.path}: {exc}") from exc
                if time.monotonic() > deadline:
                    raise LcapError(f"store {self.path} stayed locked by another process for {self.timeout:.0f}s") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _create_schema(self, con: duckdb.DuckDBPyConnection) -> None:
        con.execute(TABLES)
        for ddl in self._extra_schema:
            con.execute(ddl)
        con.execute(VIEWS)
        self._schema_ready = True

    def append(self, table: str, rows: Sequence[dict[str, Any]]) -> None:
        """Insert many rows in one transaction, matching columns by name; missing ones are NULL."""
        if not rows:
            return
        batch = pa.Table.from_pylist(list(rows))
        with self.connect() as con:
            con.register("_lcap_batch", batch)
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _lcap_batch")
            con.unregister("_lcap_batch")

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> None:
        with self.connect() as con:
            con.execute(sql, params)

    def fetchall(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple]:
        with self.connect() as con:
            return con.execute(sql, params).fetchall()

    def fetch_arrow(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        with self.connect() as con:
            return con.sql(sql, params=params).to_arrow_table()

    # Episodes are shared by capture (one per `lcap proxy -- CMD`) and collect (one per task run).

    def start_episode(self, episode_id: str, *, command: str | None, cwd: str | None, labels: dict[str, str]) -> None:
        """Record an episode as running; labels `task`, `round` and `sample` are also promoted to columns."""
        self.execute(
            """INSERT OR REPLACE INTO episodes
               (episode_id, command, cwd, started_at, status, labels, task_id, round, group_index)
               VALUES (?, ?, ?, ?, 'running', ?, ?, TRY_CAST(? AS INTEGER), TRY_CAST(? AS INTEGER))""",
            [episode_id, command, cwd, now(), _json(labels), labels.get("task"), labels.get("round"), labels.get("sample")],
        )

    def end_episode(self, episode_id: str, *, status: str, exit_code: int | None = None, error: str | None = None) -> None:
        self.execute(
            "UPDATE episodes SET ended_at = ?, status = ?, exit_code = ?, error = ? WHERE episode_id = ?",
            [now(), status, exit_code, error, episode_id],
        )


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)
