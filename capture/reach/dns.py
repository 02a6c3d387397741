"""DNS for `--transparent` agents: every query from an agent's namespace is answered here.

A (IPv4) questions are resolved through the host's own resolver (`getaddrinfo`, so /etc/hosts,
nsswitch and the host's nameservers all count). When the host cannot resolve a name and calls are
rerouted (`--upstream`), the name gets a stand-in address from 198.18.0.0/15 (a range reserved for
benchmarks, never routed on the internet): a connection to it reaches lcap like any other, which
knows the name again (`Names`, capture/reach/names.py), so an LLM call to a host this machine cannot
resolve still reaches the upstream (offline machines, private API names). AAAA questions get an empty
answer: inside the namespace only IPv4 is routed. Other record types (SRV, TXT, MX, ...) are relayed
to the host's nameservers as they are.

Bounded: names remembered (`MAX_NAMES`, least recently used go), questions in flight per namespace
(`MAX_IN_FLIGHT`, more are dropped: the client retries), a deadline on every resolution.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

from lcap.capture.reach.names import MAX_NAMES, Names

log = logging.getLogger("lcap.capture")

MAX_IN_FLIGHT = 64
RESOLVE_TIMEOUT = 5.0
TTL = 30  # seconds a client may keep an answer
CACHE_SECONDS = 30.0

QTYPE_A, QTYPE_AAAA = 1, 28
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, NOTIMP = 0, 1, 2, 3, 4
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class Resolver:
    """Answers DNS queries (bytes in, bytes out) for every namespace of one proxy."""

    def __init__(
        self, names: Names, stand_ins: Callable[[], bool], nameservers: list[tuple[str, int]] | None = None
    ) -> None:
        self.names = names
        self.stand_ins = stand_ins  # whether names the host cannot resolve get a stand-in address now
        self.nameservers = host_nameservers() if nameservers is None else nameservers
        self._cache: OrderedDict[str, tuple[float, list[str], int]] = OrderedDict()
        self.answered = 0
        self.failed = 0

    async def answer(self, query: bytes) -> bytes | None:
        """The response to one query; None for what is not worth an answer (not a query at all)."""
        try:
            _, flags, qdcount = struct.unpack_from("!HHH", query)
        except struct.error:
            return None
        if flags & 0x8000:  # a response: not ours to answer
            return None
        if (flags >> 11) & 0xF != 0 or qdcount != 1:  # not a standard query of one question
            return _reply(query[:12], NOTIMP if qdcount == 1 else FORMERR)
        try:
            name, qtype, qclass, end = _question(query)
        except ValueError:
            return _reply(query[:12], FORMERR)
        self.answered += 1
        if qclass != 1:
            return _reply(query[:end], NOTIMP)
        if qtype == QTYPE_AAAA:
            return _reply(query[:end], NOERROR)
        if qtype != QTYPE_A:
            return await self._relay(query) or _reply(query[:end], SERVFAIL)
        addresses, why = await self._resolve(name)
        if not addresses:
            if not self.stand_ins():
                return _reply(query[:end], why)
            addresses = [self.names.stand_in(name.lower())]
        for address in addresses:
            self.names.remember(name.lower(), address)
        records = b"".join(
            struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, TTL, 4) + socket.inet_aton(a) for a in addresses[:8]
        )
        return _reply(query[:end], NOERROR, records, min(len(addresses), 8))

    async def _resolve(self, name: str) -> tuple[list[str], int]:
        """The host's IPv4 addresses for `name`, or [] and why (NXDOMAIN: no such name; SERVFAIL: the resolver
        failed, which is what a host without nameservers says)."""
        key = name.lower()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1], cached[2]
        loop = asyncio.get_running_loop()
        why = NOERROR
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT
            )
            addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        except socket.gaierror as exc:
            addresses, why = [], NXDOMAIN if exc.errno in _NO_SUCH_NAME else SERVFAIL
        except (TimeoutError, OSError, UnicodeError):
            addresses, why = [], SERVFAIL
        if why == SERVFAIL:
            self.failed += 1
        self._cache[key] = (now + CACHE_SECONDS, addresses, why)
        self._cache.move_to_end(key)
        if len(self._cache) > MAX_NAMES:
            self._cache.popitem(last=False)
        return addresses, why

    async def _relay(self, query: bytes) -> bytes | None:
        """Ask the host's nameservers, in turn, with the query as it came."""
        loop = asyncio.get_running_loop()
        for server in self.nameservers:
            try:
                with socket.socket(socket.AF_INET6 if ":" in server[0] else socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, server)
                    await loop.sock_sendall(sock, query)
                    answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), RESOLVE_TIMEOUT / 2)
            except (TimeoutError, OSError):
                continue
            if answer[:2] == query[:2]:
                return answer
        self.failed += 1
        return None


class NamespaceDns(asyncio.DatagramProtocol):
    """The DNS socket of one agent namespace (bound there, read here): each query answered by `Resolver`."""

    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self.transport: asyncio.DatagramTransport | None = None
        self.in_flight = 0
        self.dropped = 0
        self.closed = asyncio.Event()  # set once the transport let go of the socket
        self._tasks: set[asyncio.Task] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's UDP transport is not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.in_flight >= MAX_IN_FLIGHT:
            self.dropped += 1
            return
        self.in_flight += 1
        task = asyncio.ensure_future(self._answer(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            response = await self.resolver.answer(data)
            if response is not None and self.transport is not None and not self.transport.is_closing():
                self.transport.sendto(response, addr)
        except Exception:
            log.exception("lcap: DNS answer failed")
        finally:
            self.in_flight -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.closed.set()


def _question(message: bytes) -> tuple[str, int, int, int]:
    """(name, type, class, offset after the question) of a query's one question (no compression in questions)."""
    labels = []
    offset = 12
    while True:
        if offset >= len(message):
            raise ValueError("truncated name")
        size = message[offset]
        offset += 1
        if size == 0:
            break
        if size & 0xC0 or offset + size > len(message):
            raise ValueError("bad label")
        labels.append(message[offset : offset + size].decode("ascii"))
        offset += size
    if offset + 4 > len(message) or not labels or sum(len(x) + 1 for x in labels) > 255:
        raise ValueError("bad question")
    qtype, qclass = struct.unpack_from("!HH", message, offset)
    return ".".join(labels), qtype, qclass, offset + 4


def _reply(question: bytes, rcode: int, records: bytes = b"", count: int = 0) -> bytes:
    """A response to `question` (the query's header and question): recursion desired kept, available set."""
    ident, flags = struct.unpack_from("!HH", question)
    out_flags = 0x8000 | (flags & 0x0100) | 0x0080 | rcode
    qdcount = 1 if len(question) > 12 else 0
    return struct.pack("!HHHHHH", ident, out_flags, qdcount, count, 0, 0) + question[12:] + records


def host_nameservers(path: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    servers = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            servers.append((parts[1].split("%", 1)[0], 53))
    return servers[:3]
