"""The writer process: finished turns leave the proxy's process at once.

The proxy's hooks append each finished call to a spool (capture/storage/spool.py) and go on. A separate
process, `python -I -m lcap.capture.storage.writer`, reads the spool, builds the rows (JSON, SSE reassembly,
redaction) and appends them to DuckDB in batches, one open per batch (capture/storage/batch.py: a record the
store refuses is stored degraded or as a dead letter, never holding up the rest). None of that work
competes with the proxy's event loop for the GIL, so the agent does not wait for capture.

The proxy supervises its writer: one that dies is started again on the same spool, which is the
source of truth (the writer keeps its position in the spool's `progress` file; a turn it may have
stored just before dying is skipped by turn_id). The writer runs isolated (`-I`): nothing is imported
from the agent's working directory or PYTHONPATH. It outlives its proxy on purpose: when lcap dies
(kill -9 included) the writer's stdin closes, and it writes what is left before exiting. A spool whose
proxy and writer both died is replayed by the next proxy on the same store.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lcap.capture.storage.batch import Outcome, StoreUnavailable, store_entries
from lcap.capture.storage.spool import (
    SPOOL_BACKLOG_BYTES,
    Entry,
    Progress,
    SpoolAppender,
    SpoolReader,
    private_dir,
    segment_path,
    spool_key,
    spool_store,
)
from lcap.capture.turns.turn import PendingTurn
from lcap.config import lcap_home
from lcap.locks import flock_within
from lcap.processes import alive, python_helper
from lcap.store import Store

log = logging.getLogger("lcap.capture")

_LOCK_NAME = "writer.lock"
BATCH_RECORDS = 2000  # a batch's bound: the writer holds at most this many records in memory
BATCH_BYTES = 64 << 20
_RESTART_DELAY = (0.1, 5.0)  # the supervisor's backoff between restarts of a writer that keeps dying
_RESTARTS_AT_STOP = 3  # restarts allowed once the proxy stops (each drains what is left, or dies trying)
_UNREACHABLE = 3  # the writer's exit code when it stops with turns left in the spool: the store is unreachable
_LOCKED = 4  # another writer works on this spool
POISON_TRIES = 2  # writers that may die on one record alone before it is kept unread as a dead letter
_HELD_WAIT_AT_END = 5.0  # seconds the proxy's end waits for a refusing disk to take the turns held in memory
POISONED_DIR = "poisoned"  # beside the spools: records too big to keep even as a dead letter row


@dataclass
class WriterReport:
    """What became of the turns a proxy spooled, at its end."""

    spooled: int
    stored: int
    degraded: int
    dead: int
    restarts: int
    spool: Path
    lost: int = 0  # finished calls whose turn never reached the spool (its disk refused them to the end)

    @property
    def unstored(self) -> int:
        """Turns spooled and not stored (the next proxy on the store writes those still in the spool)."""
        return max(0, self.spooled - self.stored - self.degraded - self.dead)

    def summary(self, db: Path) -> str:
        flagged = f" ({self.degraded} degraded, {self.dead} dead letters)" if self.degraded or self.dead else ""
        line = f"lcap: {self.stored + self.degraded} of {self.spooled + self.lost} turns stored in {db}{flagged}"
        if self.restarts:
            line += f"; the writer process was restarted {self.restarts} time(s)"
        if self.unstored and self.spool.is_dir():
            line += (
                f"; warning: {self.unstored} not stored yet, left in {self.spool}"
                " (the next lcap proxy on this store writes them)"
            )
        elif self.unstored:
            line += f"; warning: {self.unstored} spooled but not stored, and {self.spool} is gone: they are lost"
        if self.lost:
            line += f"; warning: {self.lost} lost, never spooled: the spool's disk refused them (see the log above)"
        return line


class TurnSink(Protocol):
    """Where a capture proxy hands its finished turns: a `TurnWriter` (the store, through a writer process) or,
    on a Ray node, an `Outbox` (capture/storage/outbox.py) that the driver empties into its own writer."""

    def start(self) -> None: ...

    def put(self, turn: PendingTurn) -> None: ...

    def flush(self, timeout: float | None = 30.0) -> bool: ...

    def finish(self, timeout: float | None = None) -> WriterReport | None: ...

    def stop(self, timeout: float | None = None) -> bool: ...

    @property
    def spool_directory(self) -> Path | None: ...

    def counters(self) -> dict[str, int | None]: ...


class TurnWriter:
    """The proxy's handle on its writer process: `put` finished turns, `flush`, `stop`. Restarts a writer
    that dies."""

    def __init__(
        self,
        store: Store,
        *,
        interval: float = 0.25,
        spool_root: Path | None = None,
        max_backlog: int = SPOOL_BACKLOG_BYTES,
    ) -> None:
        self.store = store
        self.interval = interval
        self.spool_root = spool_root or lcap_home() / "spool"
        self.max_backlog = max_backlog  # bytes of turns held in memory while the spool's disk refuses them
        self._spool: SpoolAppender | None = None
        self._proc: subprocess.Popen | None = None
        self._progress = threading.Condition()
        self._committed = (0, 0)
        self._stopping = False
        self._exited = False
        self._supervisor: threading.Thread | None = None
        self.stored = self.degraded = self.dead = 0
        self.restarts = 0

    @property
    def written(self) -> int:
        """Turns in the store (degraded ones included)."""
        return self.stored + self.degraded

    @property
    def spool_directory(self) -> Path | None:
        return self._spool.directory if self._spool is not None else None

    def counters(self) -> dict[str, int | None]:
        """Where the turns put so far are, and which process stores them (for `lcap status`)."""
        spool, proc = self._spool, self._proc
        return {
            "turns_spooled": spool.appended if spool is not None else 0,
            "turns_held": spool.held if spool is not None else 0,
            "turns_lost": spool.lost if spool is not None else 0,
            "turns_stored": self.stored,
            "turns_degraded": self.degraded,
            "dead_letters": self.dead,
            "writer_pid": proc.pid if proc is not None and not self._exited else None,
            "writer_restarts": self.restarts,
        }

    def start(self) -> None:
        directory = self.spool_root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._spool = SpoolAppender(directory, self.store.path, max_backlog=self.max_backlog)
        self._stopping = self._exited = False
        self._proc = self._spawn()
        self._supervisor = threading.Thread(target=self._supervise, name="lcap-writer-supervisor", daemon=True)
        self._supervisor.start()

    def _spawn(self) -> subprocess.Popen:
        assert self._spool is not None
        args = [str(self._spool.directory), str(self.store.path)]
        args += ["--interval", str(self.interval), "--timeout", str(self.store.timeout)]
        argv = python_helper(sys.executable, "-m", "lcap.capture.storage.writer", *args)
        return subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C must not cut a write
        )

    def put(self, turn: PendingTurn) -> None:
        assert self._spool is not None, "TurnWriter.put before start"
        self._spool.append(turn)

    def put_sealed(self, payload: bytes) -> None:
        """A record already sealed with this home's spool key (a Ray node's turn, resealed by the driver)."""
        assert self._spool is not None, "TurnWriter.put_sealed before start"
        self._spool.append_payload(payload)

    @property
    def cipher(self) -> AESGCM:
        """The key this writer's spool is sealed with."""
        assert self._spool is not None, "TurnWriter.cipher before start"
        return self._spool.cipher

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until every turn put before this call is in the store (False after `timeout`)."""
        if self._spool is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._spool.wait_written(timeout):
            return False
        target = self._spool.position()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._send(b"flush\n")
        with self._progress:
            self._progress.wait_for(lambda: self._committed >= target or self._exited, timeout)
            return self._committed >= target

    def stop(self, timeout: float | None = None) -> bool:
        """Write everything put so far and end the writer; False if some turns stay in the spool."""
        report = self.finish(timeout)
        return report is None or report.unstored == 0

    def finish(self, timeout: float | None = None) -> WriterReport | None:
        """`stop`, returning what became of the turns put (None if the writer was not started)."""
        spool = self._spool
        if spool is None or self._proc is None:
            return None
        spool.wait_written(_HELD_WAIT_AT_END if timeout is None else min(timeout, _HELD_WAIT_AT_END))
        spool.close()
        with self._progress:  # the supervisor restarts writers under this lock: `proc` is the current one
            self._stopping = True
            proc = self._proc
        self._end_input(proc)
        wait = timeout if timeout is not None else self.store.timeout + 30
        with self._progress:
            if not self._progress.wait_for(lambda: self._exited, wait):
                log.error("lcap: the turn writer is still busy; it finishes on its own (spool %s)", spool.directory)
        self._spool = None
        return WriterReport(
            spool.appended, self.stored, self.degraded, self.dead, self.restarts, spool.directory, spool.lost
        )

    def _end_input(self, proc: subprocess.Popen) -> None:
        """Tell a writer to store what is left and exit (also what closing its stdin says)."""
        _tell(proc, b"stop\n")
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass

    def _send(self, command: bytes) -> None:
        with self._progress:
            proc = self._proc
        _tell(proc, command)

    def _supervise(self) -> None:
        """Follow the writer's progress; start a new writer on the same spool when one dies."""
        delay, restarts_at_stop = _RESTART_DELAY[0], 0
        while True:
            with self._progress:
                proc = self._proc
            assert proc is not None and proc.stdout is not None
            started = time.monotonic()
            self._follow(proc.stdout)
            code = proc.wait()
            with self._progress:
                stopping = self._stopping
            if code in (0, _UNREACHABLE, _LOCKED) or (stopping and restarts_at_stop >= _RESTARTS_AT_STOP):
                break  # done; or the store is unreachable at the end (the spool stays); or it keeps dying
            log.warning("lcap: the turn writer %s; starting it again", _death(code))
            for pipe in (proc.stdin, proc.stdout):  # the dead writer's, or each restart leaves its pipes open
                if pipe is not None:
                    pipe.close()
            if time.monotonic() - started > 10:
                delay = _RESTART_DELAY[0]
            time.sleep(delay)
            delay = min(delay * 2, _RESTART_DELAY[1])
            with self._progress:
                restarts_at_stop += self._stopping
                self.restarts += 1
                try:
                    self._proc = self._spawn()
                except OSError as exc:
                    log.error("lcap: cannot start the turn writer: %s", exc)
                    break
                new, stopping = self._proc, self._stopping
            if stopping:
                self._end_input(new)
        with self._progress:
            self._exited = True
            self._progress.notify_all()

    def _follow(self, stdout: IO[bytes]) -> None:
        """Track the writer's progress lines: `committed SEGMENT OFFSET STORED DEGRADED DEAD`."""
        for line in stdout:
            parts = line.split()
            if len(parts) == 6 and parts[0] == b"committed":
                with self._progress:
                    self._committed = (int(parts[1]), int(parts[2]))
                    self.stored, self.degraded, self.dead = int(parts[3]), int(parts[4]), int(parts[5])
                    self._progress.notify_all()


def _tell(proc: subprocess.Popen | None, command: bytes) -> None:
    """Write `command` to a writer's stdin; a writer that is gone hears nothing (`flush` reports it by timing out)."""
    stdin = proc.stdin if proc is not None else None
    try:
        if stdin is not None:
            stdin.write(command)
            stdin.flush()
    except (OSError, ValueError):
        pass


def _death(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# --- the writer process ---------------------------------------------------------------------------


class Drain:
    """Stores one spool's records in bounded batches, resuming where the last writer on it stopped."""

    def __init__(self, directory: Path, store: Store) -> None:
        self.directory, self.store = directory, store
        self.cipher = spool_key(directory.parent)
        self.progress = Progress.load(directory)
        self.reader = SpoolReader(directory, self.progress.position)
        self.batch: list[Entry] = []
        self.batch_at = self.batch_end = self.reader.position()
        self.first = True
        self.retried = False  # the batch failed part way (the store went away): some of its rows may be in
        self.unsaved = False  # the last batch is stored but the spool's disk refused its progress: not noted yet
        # A writer before this one died storing the records up to here (it may have stored some): take them one
        # at a time, skipping turns already stored.
        self.careful_until = self.progress.attempt_end if self.progress.attempts else None

    def step(self, *, final: bool = False) -> bool:
        """Store the next batch (or retry the last); False when the spool had nothing new. `final`: nothing more
        is appended, so bytes left at the end that are not a whole record are a torn write (a dead letter).
        Raises StoreUnavailable, keeping the batch for the next step."""
        progress = self.progress
        if self.unsaved:
            self._save("the stored batch's progress")
            self.unsaved = False
            self.reader.delete_finished()
        if not self.batch:
            self.batch_at = self.reader.position()
            careful = self.careful_until is not None and self.batch_at < self.careful_until
            # Where the records are and their sizes only: the attempt is noted before any is read, so a record
            # that kills the writer while it is read is counted too.
            self.batch = self.reader.read(
                limit=1 if careful else BATCH_RECORDS, max_bytes=BATCH_BYTES, payloads=False
            ) or (self.reader.read_end(payloads=False) if final else [])
            self.batch_end = self.reader.position()
            if not self.batch:
                return False
        # The attempt is named by its records (the end of one segment and the start of the next are one place).
        first, last = self.batch[0], self.batch[-1]
        at, end = (first.segment, first.offset), (last.segment, last.end)
        prior = progress.attempts if (progress.attempt_at, progress.attempt_end) == (at, end) else 0
        poisoned = prior >= POISON_TRIES and len(self.batch) == 1  # writers died on this record alone: kept unread
        progress.attempt_at, progress.attempt_end, progress.attempts = at, end, prior + 1
        try:
            self._save("an attempt")  # before the attempt: a writer that dies in it tells its successor
        except StoreUnavailable:
            progress.attempts = prior
            raise
        reason = None
        if poisoned:
            reason = self._set_aside(self.batch[0], prior)
        else:
            for entry in self.batch:
                entry.payload = self.reader.payload(entry)
        # The first batch too: a writer killed after storing a batch but before noting anything leaves no trace.
        only_new = self.first or self.retried or (self.careful_until is not None and self.batch_at < self.careful_until)
        try:
            outcome = store_entries(
                self.store, self.directory, self.batch, self.cipher, only_new=only_new, poisoned=reason
            )
        except StoreUnavailable:
            progress.attempts = prior
            try:
                progress.save(self.directory)
            except OSError:
                pass  # the attempt stays counted: one more writer death than there was, at worst
            self.retried = True
            raise
        self._done(outcome)
        return True

    def _set_aside(self, entry: Entry, prior: int) -> str:
        """Why a record that writers died on is kept unread. The first time its sealed bytes go to the dead letter;
        if a writer dies doing that too, they are copied a slice at a time to a file beside the spools instead."""
        reason = f"the writer process died on this record ({prior} times)"
        if prior == POISON_TRIES:
            entry.payload = self.reader.payload(entry)
            return reason
        target = (
            private_dir(self.directory.parent / POISONED_DIR) / f"{self.directory.name}.{entry.segment}.{entry.offset}"
        )
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(segment_path(self.directory, entry.segment), "rb") as source, open(fd, "wb") as out:
                source.seek(entry.offset)
                left = entry.end - entry.offset
                while left > 0 and (chunk := source.read(min(left, 1 << 20))):
                    out.write(chunk)
                    left -= len(chunk)
                    if left % (16 << 20) < len(chunk):  # written back as it goes: little memory held dirty
                        out.flush()
                        os.fsync(out.fileno())
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            return f"{reason}; it also died keeping it, and its bytes could not be copied aside: {exc}"
        return f"{reason}; it also died keeping it: its sealed bytes (length-prefixed) are in {target}"

    def _save(self, what: str) -> None:
        try:
            self.progress.save(self.directory)
        except OSError as exc:
            raise StoreUnavailable(f"cannot note {what} in the spool's progress file: {exc}") from exc

    def _done(self, outcome: Outcome) -> None:
        progress = self.progress
        progress.position = self.batch_end
        progress.stored += outcome.stored
        progress.degraded += outcome.degraded
        progress.dead += outcome.dead
        progress.attempt_at, progress.attempt_end, progress.attempts = None, None, 0
        self.batch, self.first, self.retried = [], False, False
        if self.careful_until is not None and self.batch_end >= self.careful_until:
            self.careful_until = None
        try:
            progress.save(self.directory)
        except OSError as exc:
            # Stored, not noted: a successor would take the batch carefully (the attempt is noted), skipping what
            # is in. Its segments stay until the note is made.
            log.error("lcap: cannot note stored turns in %s yet: %s", self.directory, exc)
            self.unsaved = True
            return
        self.reader.delete_finished()

    def drain(self, *, final: bool = False) -> None:
        """Store everything the spool holds now (`final`: its end too, whole record or not)."""
        while self.step(final=final):
            pass


def _lock(directory: Path) -> int | None:
    """Hold the spool's writer lock (until this process ends); None if another writer holds it."""
    fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    if not flock_within(fd, fcntl.LOCK_EX, 0):
        os.close(fd)
        return None
    return fd


def replay_dead_spools(store: Store, root: Path, *, skip: Path | None = None) -> int:
    """Store the turns of spools on this store whose proxy and writer both died; return how many were handled."""
    mine = str(store.path.resolve())
    recovered = 0
    for directory in sorted(p for p in root.glob("*-*") if p.is_dir() and p != skip):
        owner = directory.name.split("-", 1)[0]
        if (owner.isdigit() and alive(int(owner))) or spool_store(directory) != mine:
            continue
        fd = _lock(directory)
        if fd is None:
            continue  # its writer is still at work
        try:
            drain = Drain(directory, store)
            before = drain.progress.handled
            drain.drain(final=True)
            recovered += drain.progress.handled - before
        except StoreUnavailable:
            raise
        except Exception as exc:  # this spool stays for a later try; the others and this writer's own go on
            log.error("lcap: could not replay the spool %s: %s", directory, exc)
            continue
        finally:
            os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
    if recovered:
        log.warning("lcap: recovered %d turns from a spool left by a proxy that died", recovered)
    return recovered


def _commands(timeout: float) -> bytes | None:
    """Wait up to `timeout` for the proxy's commands on stdin; None once stdin is closed (the proxy is gone)."""
    ready, _, _ = select.select([sys.stdin.fileno()], [], [], timeout)
    if not ready:
        return b""
    return os.read(sys.stdin.fileno(), 4096) or None


def _report(line: str) -> None:
    """Tell the proxy how far the store is; a proxy that is gone no longer listens."""
    try:
        os.write(sys.stdout.fileno(), f"{line}\n".encode())
    except OSError:
        pass


def run(directory: Path, store: Store, interval: float) -> int:
    if _lock(directory) is None:
        log.error("lcap: another writer holds %s", directory)
        return _LOCKED
    try:
        replay_dead_spools(store, directory.parent, skip=directory)
    except StoreUnavailable as exc:
        log.error("lcap: could not replay spools left by dead proxies yet: %s", exc)
    drain = Drain(directory, store)
    reported = None
    stopping = busy = False
    logged = 0.0  # when a store failure was last logged: once a minute while it lasts
    while True:
        command = _commands(0 if stopping or busy else interval)
        stopping = stopping or command is None or b"stop" in command
        try:
            busy = drain.step(final=stopping)  # one bounded batch, then the proxy hears of it
            logged = 0.0
        except StoreUnavailable as exc:
            busy = False
            if stopping or time.monotonic() - logged > 60:
                logged = time.monotonic()
                log.error(
                    "lcap: could not write turns to %s yet (they stay in the spool and are retried): %s",
                    store.path,
                    exc,
                )
            if stopping:
                return _UNREACHABLE  # the spool stays: the next proxy on this store writes it
            continue
        progress = drain.progress
        state = (*drain.reader.position(), progress.stored, progress.degraded, progress.dead)
        if state != reported or command:
            reported = state
            _report("committed " + " ".join(map(str, state)))
        if stopping and not busy:
            shutil.rmtree(directory, ignore_errors=True)
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lcap.capture.storage.writer", description="lcap's turn writer process"
    )
    parser.add_argument("spool", type=Path)
    parser.add_argument("db", type=Path)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the proxy's end (stdin closing) is what stops the writer
    os.nice(10)  # storing turns is background work: on a busy machine the agent's calls get the CPU first
    private_dir(args.spool)
    return run(args.spool, Store(args.db, timeout=args.timeout), args.interval)


if __name__ == "__main__":
    sys.exit(main())
