"""Connections as the front uses them: how many agents may hold open (`Admission`), the agent's side (which says
at once when the agent leaves), TLS done in memory, kept-alive upstream connections, the deadline of whatever a
connection waits for, and where a connection a namespace redirected (`--transparent`) was going.

Deadlines. Every wait of the front has one (a head, a body, an upstream connecting, answering, pausing
mid-stream, an agent not reading). `asyncio.timeout` would schedule and cancel a loop timer for each of
them, several per call and two per chunk of a stream; here each agent connection has one `Watch` whose
deadline is two attribute writes to move, and `Watches` looks at all of them every `TICK` seconds,
cancelling the task of one that ran out, which `Watch.within` turns into `Expired` where it waited.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import certifi

READ_SIZE = 65536
POOL_IDLE = 256  # idle upstream connections kept, over all upstreams
POOL_AGE = 60.0  # seconds an idle upstream connection is kept
TICK = 0.25  # seconds between two looks at the deadlines
SO_ORIGINAL_DST = 80


class Expired(Exception):
    """A wait ran past its deadline; the message says which."""


class Watch:
    """The deadline of what one task (an agent connection's) waits for now: `with watch.within(30, "head"):`."""

    __slots__ = ("at", "fired", "task", "what")

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.at: float | None = None
        self.what = ""
        self.fired = False

    def within(self, seconds: float, what: str) -> Watch:
        self.at, self.what = time.monotonic() + seconds, what
        return self

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.at = None
        if self.fired:
            self.fired = False
            if kind is not None and issubclass(kind, asyncio.CancelledError):
                self.task.uncancel()
                raise Expired(self.what) from None


class Watches:
    """Every `Watch` of a server, looked at every `TICK` seconds while it runs."""

    def __init__(self) -> None:
        self.active: set[Watch] = set()
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(TICK, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def add(self, task: asyncio.Task) -> Watch:
        watch = Watch(task)
        self.active.add(watch)
        return watch

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        for watch in self.active:
            if watch.at is not None and watch.at <= now and not watch.fired:
                watch.fired = True
                watch.task.cancel()
        self._timer = loop.call_later(TICK, self._tick, loop)


class AgentReader(asyncio.StreamReader):
    """The agent's side of a connection. It says at once when the agent closes or resets it, so that a call
    whose agent left is cancelled then, not when its upstream answers (`on_close`)."""

    closed = False
    on_close: Callable[[], None] | None = None

    def feed_eof(self) -> None:
        super().feed_eof()
        self._gone()

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        self._gone()

    def notify(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once the agent's side ends, now if it has already; None stops."""
        self.on_close = callback
        if callback is not None and self.closed:
            self._gone()

    def _gone(self) -> None:
        self.closed = True
        callback, self.on_close = self.on_close, None
        if callback is not None:
            callback()


class Seat:
    """One agent connection's place in `Admission`: its group (the address it came from while it has proved no
    episode, then its episode), and how to close it."""

    __slots__ = ("close", "group", "left")

    def __init__(self, group: tuple[str, str], close: Callable[[], None]) -> None:
        self.group, self.close = group, close
        self.left = False

    @property
    def attributed(self) -> bool:
        return self.group[0] == "episode"


class Admission:
    """Agent connections open at once: in total, per client address (those that proved no episode yet) and per
    episode. Past a limit the oldest idle connection of the same kind is closed to make room (one that proved no
    episode first, for the total); with none idle, the newcomer is refused (503). An idle connection waits for its
    next request, nothing begun: closing it loses nothing, and its client opens another when it needs one. So one
    agent's idle connections never refuse another episode's, though every agent connects from 127.0.0.1."""

    def __init__(self, total: int, per_client: int, per_episode: int) -> None:
        self.total, self.per_client, self.per_episode = total, per_client, per_episode
        self.open = 0
        self.shed = 0  # idle connections closed to make room
        self.by_group: dict[tuple[str, str], int] = {}
        self.idle: dict[Seat, None] = {}  # oldest idle first

    def enter(self, group: tuple[str, str], close: Callable[[], None]) -> Seat | None:
        """A seat for a new connection of `group` (("address", ADDRESS) or ("episode", EPISODE)), or None: refused."""
        if self.open >= self.total and not self._shed(None):
            return None
        if self._full(group) and not self._shed(group):
            return None
        seat = Seat(group, close)
        self.open += 1
        self.by_group[group] = self.by_group.get(group, 0) + 1
        return seat

    def attribute(self, seat: Seat, episode: str) -> bool:
        """The connection proved `episode`: it counts as the episode's from now on. False: the episode has its limit
        of connections open and none idle (the caller refuses)."""
        group = ("episode", episode)
        if seat.group == group or seat.left:
            return True
        if self._full(group) and not self._shed(group):
            return False
        self._count(seat.group, -1)
        seat.group = group
        self._count(group, 1)
        return True

    def waiting(self, seat: Seat) -> None:
        """The connection waits idle for its next request."""
        if not seat.left:
            self.idle[seat] = None

    def busy(self, seat: Seat) -> None:
        self.idle.pop(seat, None)

    def leave(self, seat: Seat) -> None:
        if seat.left:
            return
        seat.left = True
        self.busy(seat)
        self.open -= 1
        self._count(seat.group, -1)

    def _full(self, group: tuple[str, str]) -> bool:
        limit = self.per_episode if group[0] == "episode" else self.per_client
        return self.by_group.get(group, 0) >= limit

    def _count(self, group: tuple[str, str], change: int) -> None:
        count = self.by_group.get(group, 0) + change
        if count:
            self.by_group[group] = count
        else:
            self.by_group.pop(group, None)

    def _shed(self, group: tuple[str, str] | None) -> bool:
        """Close the oldest idle connection of `group` (None: any, one that proved no episode first)."""
        if group is not None:
            oldest = next((seat for seat in self.idle if seat.group == group), None)
        else:
            oldest = next((seat for seat in self.idle if not seat.attributed), None) or next(iter(self.idle), None)
        if oldest is None:
            return False
        self.leave(oldest)
        self.shed += 1
        oldest.close()
        return True


class Connection:
    """A TCP connection as the front uses it: recv / send / drain / close. An agent's has the `Watch` of its waits."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, watch: Watch | None = None) -> None:
        self.reader, self.writer = reader, writer
        self.watch = watch
        self.idle_since = 0.0
        self.episode: str | None = None  # an agent's connection to an episode's own listener: that episode
        self.seat: Seat | None = None  # an agent's connection: its place in the front's `Admission`
        self.served = False  # an agent's connection: a request began on it

    def deadline(self, seconds: float, what: str) -> Watch:
        """`with conn.deadline(30, "head"): await ...`: `Expired` past it (an agent's connection only)."""
        assert self.watch is not None, "only an agent's connection has deadlines"
        return self.watch.within(seconds, what)

    async def recv(self) -> bytes:
        return await self.reader.read(READ_SIZE)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()

    def send_eof(self) -> None:
        if self.writer.can_write_eof() and not self.writer.is_closing():
            self.writer.write_eof()
        else:  # a TLS stream cannot half-close
            self.close()

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        """Close at once, dropping what is unsent: a pending read returns b"" (the fd is freed now)."""
        self.writer.transport.abort()


class TlsServerSide(Connection):
    """The agent's side of an intercepted tunnel, TLS done in memory so the ClientHello can be read first."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        watch: Watch | None,
        seat: Seat | None,
    ) -> None:
        super().__init__(reader, writer, watch)
        self.seat = seat
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)

    async def handshake(self, client_hello: bytes) -> None:
        self.incoming.write(client_hello)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = await self.reader.read(READ_SIZE)
                if not data:
                    raise ConnectionError("the agent closed the connection during the TLS handshake") from None
                self.incoming.write(data)
        self._flush()

    async def recv(self) -> bytes:
        while True:
            if self.incoming.pending or self.tls.pending():  # else reading would only raise SSLWantReadError
                try:
                    return self.tls.read(READ_SIZE)
                except ssl.SSLWantReadError:
                    pass
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    return b""
            self._flush()
            data = await self.reader.read(READ_SIZE)
            if not data:
                return b""
            self.incoming.write(data)

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def send_eof(self) -> None:
        self.close()

    def _flush(self) -> None:
        if out := self.outgoing.read():
            self.writer.write(out)


class UpstreamPool:
    """Keep-alive connections to upstreams, reused call after call: at most `POOL_IDLE` idle ones in all, none
    idle for longer than `POOL_AGE` seconds."""

    def __init__(self) -> None:
        self.idle: OrderedDict[tuple[str, str, int], list[Connection]] = OrderedDict()
        self.count = 0
        self._pruning: asyncio.TimerHandle | None = None

    def take(self, key: tuple[str, str, int]) -> Connection | None:
        idle = self.idle.get(key)
        oldest = time.monotonic() - POOL_AGE
        while idle:
            conn = idle.pop()
            self.count -= 1
            if (
                conn.idle_since > oldest
                and not conn.reader.at_eof()
                and not conn.writer.is_closing()
                and not _buffered(conn.reader)
            ):
                return conn
            conn.close()
        return None

    async def open(self, key: tuple[str, str, int], address: str) -> Connection:
        scheme, host, port = key
        tls = self._tls if scheme == "https" else None
        reader, writer = await asyncio.open_connection(
            address, port, ssl=tls, server_hostname=host if tls else None, limit=READ_SIZE
        )
        return Connection(reader, writer)

    def give_back(self, key: tuple[str, str, int], conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.setdefault(key, []).append(conn)
        self.idle.move_to_end(key)
        self.count += 1
        while self.count > POOL_IDLE:  # the least recently used upstream gives up its oldest connection
            first_key, conns = next(iter(self.idle.items()))
            if conns:
                conns.pop(0).close()
                self.count -= 1
            if not conns:
                del self.idle[first_key]
        if self._pruning is None:
            self._pruning = asyncio.get_running_loop().call_later(POOL_AGE, self._prune)

    def _prune(self) -> None:
        """Close the connections idle for `POOL_AGE`: a proxy no call uses keeps none open (`take` only looks at
        the upstream it takes from), then look again when the next one comes of age."""
        self._pruning = None
        now = time.monotonic()
        for key, conns in list(self.idle.items()):
            kept = [conn for conn in conns if conn.idle_since > now - POOL_AGE]
            for conn in conns:
                if conn.idle_since <= now - POOL_AGE:
                    conn.close()
            self.count -= len(conns) - len(kept)
            if kept:
                self.idle[key] = kept
            else:
                del self.idle[key]
        if self.count:
            oldest = min(conn.idle_since for conns in self.idle.values() for conn in conns)
            self._pruning = asyncio.get_running_loop().call_later(oldest + POOL_AGE - now, self._prune)

    @functools.cached_property
    def _tls(self) -> ssl.SSLContext:
        """Verified against certifi's roots, as mitmproxy verifies upstreams: one trust store for both paths."""
        context = ssl.create_default_context(cafile=certifi.where())
        context.set_alpn_protocols(["http/1.1"])
        return context

    def close(self) -> None:
        if self._pruning is not None:
            self._pruning.cancel()
            self._pruning = None
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()
        self.count = 0


def _buffered(reader: asyncio.StreamReader) -> int:
    """Bytes an idle upstream connection has received and nobody read: it is out of step, never reused."""
    return len(getattr(reader, "_buffer", b""))


def original_destination(sock: Any) -> tuple[str, int] | None:
    """Where a redirected connection was going (IPv4 SO_ORIGINAL_DST); None when it was not redirected."""
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except (OSError, AttributeError):
        return None
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port
