"""`lcap ui`'s options: each default and help, written once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from lcap.cli_options import option
from lcap.config import LcapError


@dataclass(frozen=True)
class UiOptions:
    """Where the UI listens and how it reads the store."""

    host: str = option("127.0.0.1", help="Listen address; any other than loopback requires the printed token.")
    port: int = option(8765, help="Listen port (0: a free one).")
    poll: float = option(2.0, help="Seconds between the live view's checks of the store for new rows.")
    stream_seconds: float = option(
        300.0,
        help="Seconds a page's live stream stays open before the page opens a new one by itself (lower it where a "
        "proxy in front cuts long responses).",
    )
    store_timeout: float = option(
        10.0, help="Seconds a page waits for the store while another process (a proxy's writer) holds it."
    )
    tokenizer: str | None = option(
        None,
        help="Tokenizer (a folder with tokenizer.json, or the file) that decodes token ids, instead of each "
        "deployment's base model.",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise LcapError(f"--port {self.port}: use 0 to 65535")
        if not 0.2 <= self.poll <= 60:
            raise LcapError(f"--poll {self.poll}: use 0.2 to 60 seconds")
        if not 1 <= self.stream_seconds <= 3600:
            raise LcapError(f"--stream-seconds {self.stream_seconds}: use 1 to 3600 seconds")
        if self.store_timeout <= 0:
            raise LcapError(f"--store-timeout {self.store_timeout}: must be positive")

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach the UI (then no token is asked)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False  # a host name: it may resolve anywhere
