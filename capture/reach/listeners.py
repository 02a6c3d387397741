"""What capture.reach asks of the proxy's front: a listener whose every connection is one episode's.

The front (capture/proxy/front.py) provides it; reach names only this shape, so that it never imports the proxy."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Protocol

# `admit(listener, peer)`: whether a connection from `peer` to `listener` (host, port pairs) is the episode's
Admit = Callable[[tuple[str, int], tuple[str, int]], bool]


class EpisodeListeners(Protocol):
    async def listen_episode(
        self, episode: str, sock: socket.socket | None = None, *, redirected: bool = False, admit: Admit | None = None
    ) -> asyncio.Server:
        """A listener whose every connection is `episode`'s, no credentials needed: a new loopback port that serves
        only the connections `admit` accepts, or `sock`, a listener made in the episode's own network
        (`redirected`: every connection there was redirected to it, `--transparent`)."""
        ...
