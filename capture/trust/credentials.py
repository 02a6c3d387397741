"""Episode credentials: which episode a call may be written into, and who may say so.

Each running proxy makes a random key at start. An episode's secret is the HMAC-SHA256 of its id under
that key (`EpisodeKeys.secret`), so the proxy checks a secret without keeping a list of episodes, and a
secret is worthless to any other proxy or to the next run of this one. A client presents it as the
password of its proxy URL (`http://EPISODE:SECRET@host:port`, Basic proxy credentials) or, per request,
as `X-Lcap-Episode: EPISODE:SECRET`. A name without its secret attributes nothing.

The key is also written, mode 0600, to a record of the running proxy (`LCAP_HOME/proxies/PORT.json`), so that
`lcap episode new` can mint credentials for a proxy it does not run in. The record is also how a proxy announces
itself to `lcap status`: what it runs for, and counters it rewrites at most once a second while they change.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from lcap.config import LcapError, lcap_home
from lcap.files import atomic_write
from lcap.processes import alive

HeaderFields = Sequence[tuple[bytes, bytes]]  # an HTTP message's header fields: (name, value) pairs, in order
EPISODE_HEADER = b"x-lcap-episode"
PROXY_AUTHORIZATION = b"proxy-authorization"
SECRET_HEX = 32  # 128 bits of the HMAC
MAX_CREDENTIAL = 1024  # bytes of a credential field worth checking; a longer one is refused unread
CACHE_SIZE = 4096


class EpisodeKeys:
    """Mints and checks episode secrets under one proxy's key. Checks are cached: the last `CACHE_SIZE` values."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._checked: OrderedDict[bytes, str | None] = OrderedDict()  # credential value -> its episode, or None
        self.refused = 0  # credentials presented and rejected, for the proxy's exit report

    @classmethod
    def new(cls) -> EpisodeKeys:
        return cls(secrets.token_bytes(32))

    def secret(self, episode: str) -> str:
        return hmac.new(self.key, episode.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:SECRET_HEX]

    def check(self, episode: str, secret: str) -> bool:
        return bool(episode) and secret.isascii() and hmac.compare_digest(self.secret(episode), secret)

    def pair(self, episode: str) -> str:
        """`EPISODE:SECRET`, the value of an `X-Lcap-Episode` header (the episode percent-encoded)."""
        return f"{quote(episode, safe='')}:{self.secret(episode)}"

    def proxy_url(self, episode: str, host: str, port: int) -> str:
        return f"http://{self.pair(episode)}@{_url_host(host)}:{port}"

    def take(self, fields: HeaderFields) -> tuple[str | None, bool, HeaderFields]:
        """(the episode the request's credentials prove, whether it presented any, its fields without them).

        A valid `X-Lcap-Episode` wins over the proxy credentials; an invalid one proves nothing."""
        header = auth = None
        keep = []
        for field in fields:
            name = field[0].lower()
            if name == EPISODE_HEADER:
                header = field[1]
            elif name == PROXY_AUTHORIZATION:
                auth = field[1]
            else:
                keep.append(field)
        if header is None and auth is None:
            return None, False, fields
        episode = (self._verified(header, _from_header) if header is not None else None) or (
            self._verified(auth, _from_basic) if auth is not None else None
        )
        return episode, True, tuple(keep)

    def _verified(self, value: bytes, parse) -> str | None:
        if value in self._checked:
            self._checked.move_to_end(value)
            episode = self._checked[value]
        else:
            pair = parse(value) if len(value) <= MAX_CREDENTIAL else None
            episode = pair[0] if pair is not None and self.check(*pair) else None
            if len(value) <= MAX_CREDENTIAL:
                self._checked[value] = episode
                if len(self._checked) > CACHE_SIZE:
                    self._checked.popitem(last=False)
        if episode is None:
            self.refused += 1
        return episode


def _from_basic(value: bytes) -> tuple[str, str] | None:
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return None
    return (unquote(user), password) if sep else None


def _from_header(value: bytes) -> tuple[str, str] | None:
    episode, sep, secret = value.decode("latin-1").strip().rpartition(":")
    return (unquote(episode), secret) if sep else None


def _url_host(host: str) -> str:
    """The address to put in a URL for a proxy listening on `host` (a wildcard is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


# --- records of running proxies --------------------------------------------------------------------


@dataclass(frozen=True)
class ProxyRecord:
    """A running proxy: what `lcap episode new` needs (address, key, store) and what `lcap status` shows."""

    pid: int
    host: str
    port: int
    key: str  # hex
    db: str
    started_at: float = 0.0  # time.time()
    command: str = ""  # the lcap command line it runs in (redacted)
    upstream: str | None = None
    spool: str | None = None  # its turn spool's directory
    # calls, episodes, connections, turns, the writer (CaptureProxy.counters)
    counters: dict[str, Any] = dataclasses.field(default_factory=dict)
    updated_at: float = 0.0  # when the counters were taken
    rewards_url: str | None = None  # the reward endpoint of `lcap proxy --serve` (capture/proxy/rewards_api.py)
    reward_token: str | None = None  # its bearer token for any episode

    def keys(self) -> EpisodeKeys:
        return EpisodeKeys(bytes.fromhex(self.key))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProxyRecord:
        """A record as written by this lcap or another version (unknown fields are left out)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def records_dir() -> Path:
    directory = lcap_home() / "proxies"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def write_record(record: ProxyRecord) -> Path:
    """Write the record, 0600 from its first byte (it holds the key)."""
    path = records_dir() / f"{record.port}.json"
    atomic_write(path, json.dumps(record.__dict__), mode=0o600)
    return path


def remove_record(record: ProxyRecord) -> None:
    path = records_dir() / f"{record.port}.json"
    try:
        if json.loads(path.read_text()).get("pid") == record.pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def running_proxies() -> list[ProxyRecord]:
    """Records of proxies that are still running (records of dead ones are removed)."""
    found = []
    for path in sorted(records_dir().glob("*.json")):
        try:
            record = ProxyRecord.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if alive(record.pid):
            found.append(record)
        else:
            path.unlink(missing_ok=True)
    return found


def find_proxy(port: int | None) -> ProxyRecord:
    proxies = running_proxies()
    if port is not None:
        proxies = [p for p in proxies if p.port == port]
        if not proxies:
            raise LcapError(f"no lcap proxy of {lcap_home()} is running on port {port}")
        return proxies[0]
    if not proxies:
        raise LcapError(f"no lcap proxy of {lcap_home()} is running (start one with `lcap proxy --serve`)")
    if len(proxies) > 1:
        ports = ", ".join(str(p.port) for p in proxies)
        raise LcapError(f"several lcap proxies are running (ports {ports}): pick one with --port")
    return proxies[0]
