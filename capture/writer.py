"""The writer process: finished turns leave the proxy's process at once.

The proxy's hooks append each finished call to a spool (capture/spool.py) and go on. A separate
process, `python -m lcap.capture.writer`, reads the spool, builds the rows (JSON, SSE reassembly,
redaction) and appends them to DuckDB in batches, one open per batch. None of that work competes
with the proxy's event loop for the GIL, so the agent does not wait for capture.

The writer outlives its proxy on purpose: when lcap dies (kill -9 included) the writer's stdin
closes, and it writes what is left before exiting. A spool whose proxy and writer both died is
replayed by the next proxy on the same store, skipping turns that are there already.
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
import uuid
from pathlib import Path
from typing import IO, Any

from lcap.capture.spool import SpoolAppender, SpoolReader, spool_store
from lcap.capture.turn import PendingTurn, build_row
from lcap.config import lcap_home
from lcap.store import Store

log = logging.getLogger("lcap.capture")

_LOCK_NAME = "writer.lock"


class TurnWriter:
    """The proxy's handle on its writer process: `put` finished turns, `flush`, `stop`."""

    def __init__(self, store: Store, *, interval: float = 0.25, spool_root: Path | None = None) -> None:
        self.store = store
        self.interval = interval
        self.spool_root = spool_root or lcap_home() / "spool"
        self._spool: SpoolAppender | None = None
        self._proc: subprocess.Popen | None = None
        self._progress = threading.Condition()
        self._committed = (0, 0)
        self._exited = False
        self.written = 0
        self.failed = 0

    def start(self) -> None:
        directory = self.spool_root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._spool = SpoolAppender(directory, self.store.path)
        self._exited = False
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lcap.capture.writer",
                str(directory),
                str(self.store.path),
                "--interval",
                str(self.interval),
                "--timeout",
                str(self.store.timeout),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C must not cut a write
        )
        threading.Thread(
            target=self._follow, args=(self._proc.stdout,), name="lcap-writer-progress", daemon=True
        ).start()

    def put(self, turn: PendingTurn) -> None:
        assert self._spool is not None, "TurnWriter.put before start"
        self._spool.append(turn)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until every turn put before this call is in the store (False after `timeout`)."""
        if self._spool is None:
            return True
        target = self._spool.position()
        self._send(b"flush\n")
        with self._progress:
            self._progress.wait_for(lambda: self._committed >= target or self._exited, timeout)
            return self._committed >= target

    def stop(self, timeout: float | None = None) -> bool:
        """Write everything put so far and end the writer; False if some turns stay in the spool."""
        if self._spool is None or self._proc is None:
            return True
        self._spool.close()
        self._send(b"stop\n")
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            code = self._proc.wait(timeout if timeout is not None else self.store.timeout + 30)
        except subprocess.TimeoutExpired:
            log.error("lcap: the turn writer is still busy; it finishes on its own (spool %s)", self._spool.directory)
            code = None
        with self._progress:
            self._progress.wait_for(lambda: self._exited, 5)
        self._spool = None
        return code == 0

    def _send(self, command: bytes) -> None:
        stdin = self._proc.stdin if self._proc is not None else None
        try:
            if stdin is not None:
                stdin.write(command)
                stdin.flush()
        except (OSError, ValueError):  # the writer is gone: `flush` reports it by timing out
            pass

    def _follow(self, stdout: IO[bytes]) -> None:
        """Track the writer's progress lines: `committed SEGMENT OFFSET WRITTEN FAILED`."""
        for line in stdout:
            parts = line.split()
            if len(parts) == 5 and parts[0] == b"committed":
                with self._progress:
                    self._committed = (int(parts[1]), int(parts[2]))
                    self.written, self.failed = int(parts[3]), int(parts[4])
                    self._progress.notify_all()
        with self._progress:
            self._exited = True
            self._progress.notify_all()


# --- the writer process ---------------------------------------------------------------------------


def build_rows(records: list[Any]) -> tuple[list[dict[str, Any]], int]:
    rows, failed = [], 0
    for pending in records:
        try:
            rows.append(build_row(pending))
        except Exception:
            log.exception("lcap: dropped a turn that could not be read")
            failed += 1
    return rows, failed


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _lock(directory: Path) -> int | None:
    """Hold the spool's writer lock (until this process ends); None if another writer holds it."""
    fd = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def replay_dead_spools(store: Store, root: Path, *, skip: Path | None = None) -> int:
    """Store the turns of spools on this store whose proxy and writer both died; return how many were new."""
    mine = str(store.path.resolve())
    recovered = 0
    for directory in sorted(p for p in root.glob("*-*") if p.is_dir() and p != skip):
        if _pid_alive(directory.name.split("-", 1)[0]) or spool_store(directory) != mine:
            continue
        fd = _lock(directory)
        if fd is None:
            continue  # its writer is still at work
        try:
            rows, _ = build_rows(SpoolReader(directory).read())
            recovered += store.append("turns", rows, new_by="turn_id")  # its writer may have stored some
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
        return 2
    try:
        replay_dead_spools(store, directory.parent, skip=directory)
    except Exception as exc:
        log.error("lcap: could not replay spools left by dead proxies yet: %s", exc)
    reader = SpoolReader(directory)
    unwritten: list[dict[str, Any]] = []
    written = failed = 0
    reported = None
    stopping = False
    while True:
        command = _commands(0 if stopping else interval)
        stopping = stopping or command is None or b"stop" in command
        rows, bad = build_rows(reader.read())
        failed += bad
        unwritten += rows
        if unwritten:
            try:
                store.append("turns", unwritten)
            except Exception as exc:
                log.error(
                    "lcap: could not write %d turns to %s yet (kept in the spool, retried): %s",
                    len(unwritten),
                    store.path,
                    exc,
                )
                if stopping:
                    return 1  # the spool stays: the next proxy on this store writes it
                continue
            written += len(unwritten)
            unwritten = []
        reader.delete_finished()
        if reader.position() != reported or command:
            reported = reader.position()
            _report(f"committed {reported[0]} {reported[1]} {written} {failed}")
        if stopping:
            shutil.rmtree(directory, ignore_errors=True)
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lcap.capture.writer", description="lcap's turn writer process")
    parser.add_argument("spool", type=Path)
    parser.add_argument("db", type=Path)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the proxy's end (stdin closing) is what stops the writer
    os.nice(10)  # storing turns is background work: on a busy machine the agent's calls get the CPU first
    return run(args.spool, Store(args.db, timeout=args.timeout), args.interval)


if __name__ == "__main__":
    sys.exit(main())
