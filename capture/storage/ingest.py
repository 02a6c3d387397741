"""The driver's side of the hand-off from node outboxes (outbox.py): one thread that takes their turns and appends them
to the one store writer's spool.

`lcap collect --ray` runs a capture proxy on each node with an `Outbox` for a writer (DuckDB admits one writing
process per file). The driver's `Ingest` long-polls every outbox it knows of, one take in flight per outbox: each
take names the spool position the driver has appended up to, which acknowledges everything before it (exactly
once: a reply that never arrived is asked for again from the same position), and returns the records after it,
up to `TAKE_RECORDS` and about `TAKE_BYTES`. The records come sealed with the run's hand-off key; they are resealed
with this home's spool key (spool.py `reseal`) and appended, as they are, to the driver's `TurnWriter`, whose
writer process builds and stores the rows (degraded rows and dead letters included).

How the outboxes are reached is the caller's (`Sources`: dataset/collect/node_proxies.py asks node proxies over
Ray); an outbox that cannot be reached any more (`OutboxLost`) is forgotten, and what it still held belongs to
episodes that are run again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lcap.capture.storage.outbox import Position, Taken
from lcap.capture.storage.spool import reseal
from lcap.capture.storage.writer import TurnWriter

log = logging.getLogger("lcap.capture")

TAKE_RECORDS = 2000  # a take's bound, the writer's batch
TAKE_BYTES = 32 << 20
TAKE_WAIT_S = 0.5  # a take waits this long on the node for a record (long poll)
SETTLE_S = 60.0  # every turn appended so far reaching the store
STOP_S = 60.0  # the thread's end (a take in flight returns within TAKE_WAIT_S)


class OutboxLost(Exception):
    """An outbox that cannot be reached any more (its proxy, or its node, is gone)."""


class Sources(Protocol):
    """The outboxes an `Ingest` takes from, by key, and how a take reaches one."""

    def known(self) -> dict[str, Any]:
        """Every outbox started and not forgotten, by key (an outbox started again has a new key)."""
        ...

    def forget(self, key: str) -> None:
        """The outbox of `key` was lost."""
        ...

    def take(self, outbox: Any, after: Position | None, limit: int, max_bytes: int, wait: float) -> Any:
        """Start `Outbox.take` on `outbox`; returns what `ready` and `taken` are given."""
        ...

    def ready(self, takes: list[Any], timeout: float) -> list[Any]:
        """The takes among `takes` that have answered, once one has (or `timeout` passed: maybe none)."""
        ...

    def taken(self, take: Any) -> Taken:
        """A ready take's answer; OutboxLost when its outbox is gone."""
        ...


@dataclass
class _Feed:
    """One outbox as the ingest sees it."""

    outbox: Any
    after: Position | None = None  # appended up to here (what the next take acknowledges)
    taking: Any = None  # the take in flight
    dead: bool = False


class Ingest:
    """The driver's thread that takes the outboxes' turns and appends them to the one writer's spool."""

    def __init__(self, sources: Sources, writer: TurnWriter, key: bytes) -> None:
        """`key`: the run's hand-off key, which the outboxes seal their records with."""
        self.sources, self.writer = sources, writer
        self.source_cipher = AESGCM(key)
        self.feeds: dict[str, _Feed] = {}
        self.appending = threading.Lock()  # held while a batch is appended: `settle` waits for it
        self.lock = threading.Lock()  # over `feeds`, which the driver's threads read
        self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lcap-ray-ingest", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(STOP_S)

    def live(self) -> dict[str, Any]:
        """The outboxes not found lost, by key."""
        with self.lock:
            return {key: feed.outbox for key, feed in self.feeds.items() if not feed.dead}

    def settle(self, timeout: float = SETTLE_S) -> bool:
        """Every turn appended so far is in the store (False after `timeout`)."""
        with self.appending:
            pass
        return self.writer.flush(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._refresh()
                taking = {}
                for key, feed in list(self.feeds.items()):
                    if feed.dead:
                        continue
                    if feed.taking is None:
                        feed.taking = self.sources.take(feed.outbox, feed.after, TAKE_RECORDS, TAKE_BYTES, TAKE_WAIT_S)
                    taking[feed.taking] = key
                if not taking:
                    self._stop.wait(0.1)
                    continue
                for take in self.sources.ready(list(taking), TAKE_WAIT_S * 2):
                    self._append(taking[take], take)
        except BaseException as exc:  # the run cannot go on without its turns: the driver stops on it
            self.error = exc
            log.error("lcap: the driver stopped taking turns from the nodes: %s", _first_line(exc))

    def _refresh(self) -> None:
        known = self.sources.known()
        with self.lock:
            for key, outbox in known.items():
                self.feeds.setdefault(key, _Feed(outbox))

    def _append(self, key: str, take: Any) -> None:
        feed = self.feeds[key]
        feed.taking = None
        try:
            taken = self.sources.taken(take)
        except OutboxLost as exc:
            log.warning("lcap: lost the capture proxy of node %s: %s", key[:8], exc)
            with self.lock:
                feed.dead = True
            self.sources.forget(key)
            return
        with self.appending:
            for payload in taken.records:
                self.writer.put_sealed(reseal(self.source_cipher, self.writer.cipher, payload))
            feed.after = taken.end
            self.records += len(taken.records)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__
