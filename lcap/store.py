"""The DuckDB store every stage reads and writes.

DuckDB lets one process hold a database file read-write, and while it does no other process can
open it, not even read-only. lcap runs several processes on one store (a proxy writing turns,
`lcap sql` reading them, a verifier adding rewards), so nobody keeps the file open: each unit of
work attaches it, and an attach that finds the file locked retries until `timeout`. Writers batch
their rows so that a whole batch costs one attach. DuckDB's lock is no queue, so those waiting are let
in first (`_Waiters`): else a writer with a backlog, attaching again the instant it detaches, would
keep a collect's driver or `lcap sql` waiting for seconds.

DuckDB's lock alone does not keep two processes' units of work apart: an attach reads the file's headers before
it takes the lock, and never again after. An attach that read them while another process was checkpointing, and
took the lock once that process let go, would work from the headers that checkpoint replaced: its own checkpoint
would then reuse the blocks the other process had just written (their rows gone, with nothing said) and write its
header over the other's. So lcap holds a lock of its own (`_Guard`, a flock on STORE.lock) from before DuckDB
opens the file until it has closed it: exclusive for a write, shared for reads, as DuckDB's.

The file is attached to one in-memory DuckDB per file and process, kept for the process's life:
starting a DuckDB instance per unit of work costs far more CPU (it builds its catalog of built-in
functions) than attaching and detaching the file (benchmarks/bench_store.py measures both); a
collect round does hundreds of units of work.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from lcap.config import LcapError
from lcap.locks import flock_within
from lcap.private_files import made_privately, private_file
from lcap.redact import redact_labels, redact_text
from lcap.schema import MIGRATIONS, PROMOTED_LABELS, SCHEMA_VERSION, TABLES, VIEWS

log = logging.getLogger(__name__)

_LOCKED = ("Could not set lock", "Conflicting lock", "database is locked")
RETRY_MAX_S = 0.025  # the longest pause between two attempts at a locked file
LET_IN_S = 2.0  # the longest a process about to attach lets those already waiting attach first
T = TypeVar("T")


def now() -> datetime:
    return datetime.now(UTC)


_ALIAS = "lcap_store"


class _Instance:
    """The in-memory DuckDB that attaches one store file, shared by every `Store` of that file in this process."""

    def __init__(self) -> None:
        self.con = duckdb.connect(":memory:")
        self.lock = threading.RLock()
        self.depth = 0  # nested units of work share one attach
        self.read_only = False
        self.guard: _Guard | None = None  # held while the file is attached
        # A checkpoint deletes the WAL and the next write makes a new one with the umask's mode: the store checkpoints
        # when a unit of work ends (DETACH), where the WAL goes, never within one (lcap.private_files).
        self.con.execute(f"SET checkpoint_threshold = '{_NO_AUTOMATIC_CHECKPOINT}'")


_instances: dict[Path, _Instance] = {}
_instances_lock = threading.Lock()


def _instance(path: Path) -> _Instance:
    key = path.resolve()
    with _instances_lock:
        if key not in _instances:
            _instances[key] = _Instance()
        return _instances[key]


class Store:
    """A DuckDB file attached per unit of work. Safe to share between threads of one process."""

    def __init__(self, path: str | Path, *, timeout: float = 60.0, extra_schema: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._extra_schema = tuple(extra_schema)
        self._schema_ready = False

    @contextmanager
    def connect(self, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """Attach the file for one unit of work (nested ones share it); waits while another process holds it."""
        inst = _instance(self.path)
        with inst.lock:
            if inst.depth == 0:
                inst.guard = self._attach(inst.con, read_only)
                inst.read_only = read_only
            elif inst.read_only and not read_only:
                raise LcapError(f"store {self.path}: a write inside a read-only unit of work")
            inst.depth += 1
            try:
                if not read_only and not self._schema_ready:
                    self._create_schema(inst.con)
                yield inst.con
            finally:
                inst.depth -= 1
                if inst.depth == 0:
                    try:
                        if not inst.read_only:
                            self._drop_unused_wal()
                        _detach(inst.con, self.path)
                    finally:
                        if inst.guard is not None:
                            inst.guard.release()  # after the detach: DuckDB has closed the file
                            inst.guard = None

    def _attach(self, con: duckdb.DuckDBPyConnection, read_only: bool) -> _Guard:
        """Attach the file as `lcap_store` and use it; returns the guard held until it is detached."""
        if read_only and not self.path.exists():
            raise LcapError(f"no store at {self.path} (run `lcap proxy` first, or pass --db)")
        if not read_only and not self.path.exists():
            self._create(con)
        mode = " (READ_ONLY)" if read_only else ""

        def attach() -> None:
            con.execute(f"ATTACH {_sql_string(str(self.path))} AS {_ALIAS}{mode}")
            con.execute(f"USE {_ALIAS}")

        _, guard = self._while_locked(attach, exclusive=not read_only)
        if not read_only:
            try:
                self._private_wal()
            except BaseException:
                _detach(con, self.path)
                guard.release()
                raise
        return guard

    def _create(self, con: duckdb.DuckDBPyConnection) -> None:
        """A new, empty store file of mode 0600 (lcap.private_files)."""

        def make(path: Path) -> None:
            con.execute(f"ATTACH {_sql_string(str(path))} AS lcap_new")
            con.execute("DETACH lcap_new")

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            made_privately(self.path, make)
        except (OSError, duckdb.Error) as exc:
            raise LcapError(f"cannot create store {self.path}: {exc}") from exc

    def _private_wal(self) -> None:
        """The WAL this attach writes to, in place before its first write with mode 0600 (lcap.private_files)."""
        try:
            private_file(self._wal())
        except OSError as exc:
            raise LcapError(f"cannot make the WAL of store {self.path} private: {exc}") from exc

    def _drop_unused_wal(self) -> None:
        """The WAL `_private_wal` put in place, removed while the file is still attached if nothing was written to it
        (DuckDB would leave it until the next attach)."""
        with contextlib.suppress(OSError):
            wal = self._wal()
            if wal.stat().st_size == 0:
                wal.unlink()

    def _wal(self) -> Path:
        return self.path.with_name(self.path.name + ".wal")

    def _while_locked(self, open_it: Callable[[], T], *, exclusive: bool) -> tuple[T, _Guard]:
        """`open_it()` (which opens the file in DuckDB) under the store's guard, taken `exclusive` or shared, after
        any process already waiting for the file, and retried while another process holds either (up to `timeout`).
        Returns what it returned and the guard, to release once DuckDB has closed the file."""
        deadline = time.monotonic() + self.timeout
        waiters = _Waiters(self.path)
        waiters.let_in()
        guard = _Guard(self.path)
        delay = 0.005
        try:
            while True:
                if guard.take(exclusive):
                    try:
                        return open_it(), guard
                    except duckdb.Error as exc:
                        guard.release()
                        if not any(marker in str(exc) for marker in _LOCKED):
                            raise LcapError(f"cannot open store {self.path}: {exc}") from exc
                        # held by a process that does not take the guard (the duckdb CLI, say)
                    except BaseException:
                        guard.release()
                        raise
                if time.monotonic() > deadline:
                    raise LcapError(f"store {self.path} stayed locked by another process for {self.timeout:.0f}s")
                waiters.join()
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        finally:
            waiters.leave()

    @contextmanager
    def user_sql(self, *, write: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection of its own for SQL a person types (`lcap sql`), which no statement sequence can turn
        against the machine: a DuckDB instance on the store alone, read-only unless `write` (a read-only
        instance attaches every database read-only and cannot create one in memory, so detaching and
        re-attaching the store changes nothing); no file system (`enable_external_access` off: no COPY TO,
        read_text, ATTACH of another file, INSTALL or LOAD); and the configuration locked, so that no SET
        gives any of it back. `write` allows changes to the store's tables, nothing more."""
        if write:
            with self.connect():  # the schema, created private like every store
                pass
        elif not self.path.exists():
            raise LcapError(f"no store at {self.path} (run `lcap proxy` first, or pass --db)")
        with ExitStack() as stack:
            con, guard = self._while_locked(
                lambda: duckdb.connect(str(self.path), read_only=not write), exclusive=write
            )
            stack.callback(guard.release)  # last: once the connection is closed
            stack.callback(con.close)
            if write:
                self._private_wal()
                stack.callback(self._drop_unused_wal)  # before the close
            for setting in _USER_SQL_SETTINGS:
                con.execute(setting)
            yield con

    def _create_schema(self, con: duckdb.DuckDBPyConnection) -> None:
        (existing,) = _one_row(
            con.execute(
                f"SELECT count(*) FROM duckdb_tables() WHERE database_name = '{_ALIAS}' AND table_name = 'episodes'"
            )
        )
        con.execute(TABLES)
        (version,) = _one_row(con.execute("SELECT max(version) FROM schema_version"))
        version = version or (1 if existing else SCHEMA_VERSION)  # a store from before versions is version 1
        if version > SCHEMA_VERSION:
            raise LcapError(
                f"store {self.path} has schema version {version}; this lcap knows up to {SCHEMA_VERSION}: upgrade lcap"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[target]:
                if callable(statement):  # a migration SQL alone cannot write (lcap.schema.redact_episodes)
                    statement(con)
                else:
                    con.execute(statement)
        con.execute("DELETE FROM schema_version")
        con.execute("INSERT INTO schema_version VALUES (?)", [SCHEMA_VERSION])
        for ddl in self._extra_schema:
            con.execute(ddl)
        con.execute(VIEWS)
        self._schema_ready = True

    def append(self, table: str, rows: Sequence[dict[str, Any]], *, new_by: str | None = None) -> int:
        """Insert many rows in one transaction, matching columns by name (missing ones are NULL); with
        `new_by`, only rows whose value of that column is not in the table yet. Returns the rows inserted."""
        if not rows:
            return 0
        import pyarrow as pa  # start-up: pyarrow, which the processes that never append (node proxies, runners) skip

        columns = dict.fromkeys(key for row in rows for key in row)  # every row's keys, not the first row's only
        batch = pa.Table.from_pydict({column: [row.get(column) for row in rows] for column in columns})
        # NOT EXISTS, not NOT IN: one NULL in the table's column would make NOT IN drop every row
        only_new = (
            f" AS b WHERE NOT EXISTS (SELECT 1 FROM {table} AS t WHERE t.{new_by} = b.{new_by})" if new_by else ""
        )
        with self.connect() as con:
            con.register("_lcap_batch", batch)
            try:
                (inserted,) = _one_row(con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _lcap_batch{only_new}"))
            finally:
                con.unregister("_lcap_batch")
        return inserted

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> None:
        with self.connect() as con:
            con.execute(sql, params)

    def fetchall(self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None) -> list[tuple]:
        with self.connect() as con:
            return con.execute(sql, params).fetchall()

    # Episodes are shared by capture (one per `lcap proxy -- CMD`) and collect (one per task run).

    def start_episode(
        self, episode_id: str, *, command: str | None, cwd: str | None, labels: dict[str, str], replace: bool = False
    ) -> None:
        """Record an episode as running; the labels of PROMOTED_LABELS are also stored in their columns. The
        command, the cwd and the labels come from the user's invocation: they are stored redacted (`lcap.redact`).

        An id the store already holds is refused (a one-line error naming its status), unless `replace`: collect
        starts again an episode of its own that a crash cut short."""
        columns = ", ".join(column for column, _ in PROMOTED_LABELS.values())
        casts = ", ".join(f"TRY_CAST(? AS {kind})" for _, kind in PROMOTED_LABELS.values())
        verb = "INSERT OR REPLACE" if replace else "INSERT"
        command, cwd, labels = redact_text(command), redact_text(cwd), redact_labels(labels)
        try:
            self.execute(
                f"""{verb} INTO episodes (episode_id, command, cwd, started_at, status, labels, {columns})
                    VALUES (?, ?, ?, ?, 'running', ?, {casts})""",
                [episode_id, command, cwd, now(), _json(labels), *(labels.get(label) for label in PROMOTED_LABELS)],
            )
        except duckdb.ConstraintException:
            rows = self.fetchall("SELECT status FROM episodes WHERE episode_id = ?", [episode_id])
            status = rows[0][0] if rows else "unknown"
            raise LcapError(f"episode {episode_id!r} exists already (status {status}): give a new id") from None

    def add_reward(self, episode_id: str, value: float, *, details: str, source: str, key: str | None = None) -> bool:
        """Append a reward (`details`: a JSON object's text); with `key`, only if no reward of this episode holds
        that key yet (a key is the poster's, per episode: another tenant's episode may use the same one). Returns
        whether it was stored."""
        with self.connect() as con:
            (inserted,) = _one_row(
                con.execute(
                    """INSERT INTO rewards (episode_id, value, details, source, created_at, key)
                       SELECT ?, ?, ?, ?, ?, ? WHERE ? IS NULL
                          OR NOT EXISTS (SELECT 1 FROM rewards WHERE key = ? AND episode_id = ?)""",
                    [episode_id, value, details, source, now(), key, key, key, episode_id],
                )
            )
        return bool(inserted)

    def flag_episode(self, episode_id: str, flag: str, details: dict[str, Any]) -> None:
        """Raise a flag on an episode (tampered, verifier_error, turns_unstored, ...) with its details."""
        self.append(
            "episode_flags", [{"episode_id": episode_id, "flag": flag, "details": _json(details), "created_at": now()}]
        )

    def end_episode(
        self, episode_id: str, *, status: str, exit_code: int | None = None, error: str | None = None
    ) -> None:
        self.execute(
            "UPDATE episodes SET ended_at = ?, status = ?, exit_code = ?, error = ? WHERE episode_id = ?",
            [now(), status, exit_code, redact_text(error), episode_id],  # an error may quote the command
        )


_NO_AUTOMATIC_CHECKPOINT = "1000TB"  # a WAL size no unit of work reaches
_USER_SQL_SETTINGS = (
    f"SET checkpoint_threshold = '{_NO_AUTOMATIC_CHECKPOINT}'",  # as the store's own instance (`_Instance`)
    "SET enable_external_access = false",
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET lock_configuration = true",  # last: it freezes the settings above
)


def table_names(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The tables a unit of work on the store sees."""
    return {
        row[0] for row in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall()
    }


def _one_row(con: duckdb.DuckDBPyConnection) -> tuple[Any, ...]:
    """The row of a statement that always returns exactly one (an aggregate, or INSERT's row count)."""
    rows = con.fetchall()  # all of them: a result left unfinished blocks the connection's next function call
    if len(rows) != 1:
        raise LcapError(f"the store returned {len(rows)} rows where one is always expected")
    return rows[0]


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class _Guard:
    """lcap's lock on a store file, through a lock file beside it (STORE.lock): held from before DuckDB opens the
    file until it has closed it (the module's docstring says why DuckDB's own lock is not enough), exclusive for a
    write, shared for reads. A flock, owned by its open file: the threads of one process exclude each other too,
    and the probe DuckDB opens and closes before locking releases nothing of it. Where the lock file can be neither
    made nor opened (a read-only folder, where no process can write the store either), DuckDB's lock is all."""

    def __init__(self, store: Path) -> None:
        self.path = store.with_name(store.name + ".lock")
        self.fd: int | None = None

    def take(self, exclusive: bool) -> bool:
        """Whether the guard is held now (one try; True without a lock file)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return True
        if flock_within(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, 0):
            self.fd = fd
            return True
        os.close(fd)
        return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (and its lock with it)
            self.fd = None


class _Waiters:
    """The processes waiting for a store file, seen through a lock file beside it (STORE.waiters): each whose attach
    found the file locked holds a shared lock on it until it attaches. A process about to attach first waits until
    nobody holds one (an exclusive lock it can take), for `LET_IN_S` at most, so that the file, once released, goes
    to those already waiting rather than back to the process that held it. Where the lock file cannot be made,
    processes wait unseen."""

    def __init__(self, store: Path) -> None:
        self.path = store.with_name(store.name + ".waiters")
        self.fd: int | None = None

    def let_in(self) -> None:
        """Return once no process waits for the file, or after `LET_IN_S`."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # nobody has waited for this store yet
            return
        try:
            flock_within(fd, fcntl.LOCK_EX, LET_IN_S)
        finally:
            os.close(fd)  # (and its lock with it)

    def join(self) -> None:
        """This process waits for the file (until `leave`)."""
        if self.fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o600)
        except OSError:
            return
        if flock_within(fd, fcntl.LOCK_SH, LET_IN_S):
            self.fd = fd
        else:
            os.close(fd)

    def leave(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _detach(con: duckdb.DuckDBPyConnection, path: Path) -> None:
    """Release the file (DuckDB checkpoints it). A transaction the unit of work left open (one that failed inside
    it) is rolled back first: a DETACH within it would wait for its commit, leaving the file attached. A checkpoint
    that fails (a full disk) still releases the file, and what the unit of work committed stays in the WAL, which
    the next attach applies and the next detach checkpoints: logged, not raised, as the writes are kept."""
    with contextlib.suppress(duckdb.TransactionException):  # no transaction open: the usual case
        con.execute("ROLLBACK")
    con.execute("USE memory")
    try:
        con.execute(f"DETACH {_ALIAS}")
    except duckdb.Error as exc:
        attached = con.execute("SELECT count(*) FROM duckdb_databases() WHERE database_name = ?", [_ALIAS]).fetchall()
        if attached != [(0,)]:
            raise
        log.warning("store %s: its checkpoint failed; its WAL keeps what was written: %s", path, exc)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
