"""Where an exposed proxy, or one serving sandboxed agents, may connect: public addresses only, unless
`--allow-private`.

A proxy listening on a network address would otherwise fetch, for anyone who can reach it, what only
its own machine can reach: loopback services, cloud metadata (link-local), the private network. A sandboxed
agent's only way out is its episode's listener on the proxy (capture/sandbox.py): through it, the host's
loopback (`lcap ui`, another store's proxy, a database) would be one CONNECT away. In both cases
(`restricts`) every destination but the configured upstream (the route the user named: `--upstream URL`,
the policy) is resolved first, every address the name resolves to must be public, and the connection goes to
the address that was checked, so a name that resolves differently the next time (DNS rebinding) cannot slip
through.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket


def restricts(*, exposed: bool, sandboxed: bool, allow_private: bool) -> bool:
    """Whether a proxy checks its destinations: listening beyond this machine, or serving sandboxed agents."""
    return (exposed or sandboxed) and not allow_private


class Forbidden(Exception):
    """A destination an exposed proxy does not connect to: the agent gets a 403."""


def is_public(address: str) -> bool:
    """A globally routable unicast address (IPv4 inside IPv6 judged as IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ip.ipv4_mapped or ip.sixtofour or ip
    return ip.is_global and not ip.is_multicast


def is_loopback_host(host: str) -> bool:
    """Whether a listen address is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Destinations:
    """Resolves and checks destinations when `restricted` (an exposed proxy without `--allow-private`)."""

    def __init__(self, *, restricted: bool, timeout: float = 30.0) -> None:
        self.restricted = restricted
        self.timeout = timeout
        self.refused = 0

    async def address(self, host: str, port: int) -> str:
        """The address to connect to for `host`: `host` itself when unrestricted, else its checked address."""
        if not self.restricted:
            return host
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
            addresses = [host]
        except ValueError:
            try:
                infos = await asyncio.wait_for(
                    asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), self.timeout
                )
            except (TimeoutError, OSError) as exc:
                raise OSError(f"cannot resolve {host}: {exc}") from None
            addresses = [str(info[4][0]) for info in infos]
        private = [a for a in addresses if not is_public(a)]
        if private or not addresses:
            self.refused += 1
            raise Forbidden(
                f"{host} is {'a' if host in private else 'resolved to a'} non-public address"
                f"{'' if host in private else ' (' + private[0] + ')'}: refused while the proxy is exposed or "
                "serves sandboxed agents (--allow-private allows it)"
            )
        return addresses[0]

    async def check_tunnel(self, host: str, port: int) -> None:
        """Refuse a CONNECT to a non-public destination early; a name that does not resolve is left to the
        connection (an LLM call in it may go to `--upstream` and never to that name)."""
        if not self.restricted:
            return
        try:
            await self.address(host, port)
        except OSError:
            pass
