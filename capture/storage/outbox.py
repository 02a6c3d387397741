"""A capture proxy's writer on a Ray node: finished turns wait in a sealed spool until the driver takes them.

DuckDB admits one writing process per file, so the proxies that `lcap collect --ray` runs on the
cluster's nodes have no store: each hands its turns to an `Outbox` instead of a `TurnWriter`. The
outbox appends them to a spool on the node (capture/storage/spool.py: length-prefixed records, sealed with
the collect run's hand-off key, never in plain text on the node's disk: `node_outbox`), and the driver's
`Ingest` (ingest.py) takes them in bounded batches and appends them to its own writer's spool.

The hand-off is exactly-once by position: the driver asks for the records after the spool position
it has appended up to (`take(after=...)`), which also acknowledges everything before it. Segments
acknowledged are deleted, and an episode's `flush` returns once the driver has acknowledged every
turn the episode finished. A reply that never reached the driver is simply asked for again from the
same position: nothing is skipped and nothing is appended twice.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lcap.capture.storage.spool import SpoolAppender, SpoolReader, private_dir
from lcap.capture.storage.writer import WriterReport
from lcap.capture.turns.turn import PendingTurn
from lcap.config import lcap_home
from lcap.processes import alive

Position = tuple[int, int]  # (segment, offset) in the spool
SPOOL_DIR = "ray-spool"  # the node's outboxes, under its LCAP_HOME


@dataclass
class Taken:
    """Records from the outbox: sealed payloads, in spool order, and the position right after the last."""

    records: list[bytes]
    end: Position


class Outbox:
    """The node side of the hand-off: `put` (from the proxy), `take` (from the driver), `flush` (per episode)."""

    def __init__(self, directory: Path, cipher: AESGCM) -> None:
        self.directory = directory
        self.cipher = cipher
        self._spool: SpoolAppender | None = None
        self._reader: SpoolReader | None = None
        self._changed = threading.Condition()
        self._acked: Position = (0, 0)
        self._acked_records = 0
        self._sent: list[tuple[Position, int]] = []  # (end, records up to it) of each reply not yet acknowledged
        self._taking = threading.Lock()
        self._closed = False

    # --- the proxy's side (the TurnSink protocol) ----------------------------------------------

    def start(self) -> None:
        self._spool = SpoolAppender(self.directory, None, self.cipher)
        self._reader = SpoolReader(self.directory)
        self._acked = self._reader.position()
        self._sent = [(self._acked, 0)]

    def put(self, turn: PendingTurn) -> None:
        assert self._spool is not None, "Outbox.put before start"
        self._spool.append(turn)
        with self._changed:
            self._changed.notify_all()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until the driver has acknowledged every turn put before this call (False after `timeout`)."""
        if self._spool is None:
            return True
        target = self._spool.position()
        with self._changed:
            return self._changed.wait_for(lambda: self._acked >= target, timeout)

    def finish(self, timeout: float | None = None) -> WriterReport | None:
        """Stop taking turns; wait (up to `timeout`) for the driver to acknowledge the last ones."""
        spool = self._spool
        if spool is None:
            return None
        spool.close()
        target = spool.position()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._acked >= target, timeout if timeout is not None else 30.0)
            acked = self._acked_records
        return WriterReport(spool.appended, acked, 0, 0, 0, self.directory)

    def stop(self, timeout: float | None = None) -> bool:
        report = self.finish(timeout)
        return report is None or report.unstored == 0

    @property
    def spool_directory(self) -> Path | None:
        return self.directory if self._spool is not None else None

    def counters(self) -> dict[str, int | None]:
        """Turns put and turns the driver has taken (it stores them)."""
        return {"turns_spooled": self._spool.appended if self._spool else 0, "turns_stored": self._acked_records}

    def remove(self) -> None:
        """Delete the spool (once the proxy stopped: what the driver has not taken is lost with it)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    # --- the driver's side -----------------------------------------------------------------------

    def take(self, after: Position | None, *, limit: int, max_bytes: int, wait: float) -> Taken:
        """Acknowledge everything before `after` (None: nothing yet) and return the records that follow it, up to
        `limit` records and about `max_bytes`, waiting up to `wait` seconds for one to arrive."""
        with self._taking:
            assert self._spool is not None and self._reader is not None, "Outbox.take before start"
            if after is not None:
                self._acknowledge(after)
            deadline = time.monotonic() + wait
            while True:
                entries = self._reader.read(limit=limit, max_bytes=max_bytes)
                if entries or time.monotonic() >= deadline:
                    break
                with self._changed:
                    if self._closed:
                        break
                    self._changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            end = self._reader.position()
            if end != self._sent[-1][0]:  # (the reader may move to the next segment without a record)
                self._sent.append((end, self._sent[-1][1] + len(entries)))
            return Taken([e.payload for e in entries], end)

    def _acknowledge(self, after: Position) -> None:
        assert self._reader is not None
        known = [i for i, (end, _) in enumerate(self._sent) if end == after]
        if not known:
            raise ValueError(f"position {after} was never handed out by this outbox")
        sent = self._sent[known[-1]]
        if after != self._reader.position():  # the driver did not get the last reply: it is read again
            self._reader = SpoolReader(self.directory, after)
        self._sent = [sent]
        self._reader.delete_finished()
        with self._changed:
            self._acked, self._acked_records = after, sent[1]
            self._changed.notify_all()


def node_outbox(run: str, key: bytes) -> Outbox:
    """The outbox of this process's proxy for collect run `run` on this node, sealed with the run's hand-off `key`:
    `LCAP_HOME/ray-spool/PID-RUN`, where the node's other proxies keep theirs. Whatever a proxy that died left
    there (`PID-*`, its spool and what the proxy kept beside it) is deleted first, not replayed: it belongs to
    episodes that are run again (a finished episode's turns were all taken before it finished)."""
    root = private_dir(lcap_home() / SPOOL_DIR)
    for path in root.glob("*-*"):
        pid = path.name.split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return Outbox(root / f"{os.getpid()}-{run}", AESGCM(key))
