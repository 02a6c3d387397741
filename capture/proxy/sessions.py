"""Episodes a long-running proxy finds in what its clients already send, without per-episode set-up.

A call that proves no episode (no episode credentials, no tunnel that proved one) is attributed by the first of
these rules that applies:

1. a session header (`X-Lcap-Session` unless configured): its value names the session; the header is taken out of
   the request before it goes upstream;
2. a Responses API call's `previous_response_id`: the episode of the call that answered with that id;
3. its conversation (when `conversations` is on): the episode of an earlier call whose whole message list starts
   this call's messages, else a new episode. The digests this takes run on the proxy's event loop, one per
   message: a call of more than MAX_CONVERSATION_ITEMS messages is not digested (other agents' calls would wait
   on it) and starts a new episode.

Every key is scoped to the call's tenant, a digest of the credential it carries for its upstream (`Authorization`,
`x-api-key`, `api-key`; a call with none is a tenant of its own): one tenant's session names, response ids and
conversations never reach another tenant's episodes. A header session's episode id is a digest of (tenant, name),
so it is the same after a restart and cannot be reached without the tenant's credential; a new proxy run numbers
a header session's calls above the seqs the store holds (`session_floor`). Conversations and Responses chains are
known to the run that saw them: one that goes on after a restart starts a new episode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from lcap.capture.trust.credentials import HeaderFields
from lcap.redact import redact_labels
from lcap.store import Store, now

log = logging.getLogger("lcap.capture")

T = TypeVar("T")
SESSION_HEADER = "X-Lcap-Session"
TENANT_FIELDS = (b"authorization", b"x-api-key", b"api-key")
MAX_SESSION_LABEL = 256  # characters of a session name kept as its episode's label (the id digests all of it)
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"\\]{1,256})"')
RESPONSE_ID_WINDOW = 8192  # bytes at the start of an answer where a Responses answer names itself
MAX_CONVERSATION_ITEMS = 4096  # messages of a call digested to place it by its conversation


def tenant_of(fields: HeaderFields) -> str:
    """The tenant of a request: a digest of its upstream credentials (the same for a call without any)."""
    digest = hashlib.sha256(b"lcap-tenant\0")
    for field in sorted((name.lower(), value) for name, value in fields if name.lower() in TENANT_FIELDS):
        digest.update(field[0] + b"\0" + field[1].strip() + b"\0")
    return digest.hexdigest()[:32]


def tenant_of_token(token: str) -> str:
    """The tenant a reward poster proves with `Authorization: Bearer TOKEN`: the one its agents' calls carry."""
    return tenant_of(((b"authorization", f"Bearer {token}".encode()),))


def is_session_episode(episode: str | None) -> bool:
    return episode is not None and episode.startswith(SESSION_PREFIX)


def session_floor(store: Store) -> int:
    """The seq a header session's calls start from in a new proxy run: above every seq the header sessions of
    the store reached, so that a session going on after a restart (the same episode) keeps its turns in order."""
    rows = store.fetchall(
        "SELECT max(t.seq) FROM turns t SEMI JOIN episodes e ON e.episode_id = t.episode_id "
        "AND e.labels->>'attributed_by' = 'header'"
    )
    top = rows[0][0] if rows else None
    return 0 if top is None else int(top) + 1


SESSION_PREFIX = "s-"  # of a header session's episode id


def session_episode(tenant: str, name: str) -> str:
    return SESSION_PREFIX + hashlib.sha256(f"{tenant}\0{name}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


class Sessions:
    """The rules above, with bounded memory: the last `limit` conversations' prefixes and response ids.

    `opened(episode_id, labels)` is called once per episode this proxy run opens (the proxy stores its row)."""

    def __init__(
        self,
        *,
        header: str | None = SESSION_HEADER,
        conversations: bool = False,
        limit: int = 100_000,
        opened: Callable[[str, dict[str, str]], None] = lambda episode, labels: None,
    ) -> None:
        self.header = header.lower().encode() if header else None
        self.conversations = conversations
        self.limit = limit
        self.opened = opened
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._prefixes: OrderedDict[bytes, str | None] = OrderedDict()  # None: two conversations share it
        self._responses: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.too_long = 0  # calls of more than MAX_CONVERSATION_ITEMS messages: each a new episode, undigested

    def take_header(self, fields: HeaderFields) -> tuple[str | None, HeaderFields]:
        """(the session header's value, the fields without it); `fields` itself when it has none."""
        if self.header is None or not any(name.lower() == self.header for name, _ in fields):
            return None, fields
        value = None
        keep = []
        for name, field_value in fields:
            if name.lower() == self.header:
                value = field_value.decode("utf-8", "replace").strip() or value
            else:
                keep.append((name, field_value))
        return value, tuple(keep)

    def by_header(self, name: str, fields: HeaderFields) -> str:
        tenant = tenant_of(fields)
        episode = session_episode(tenant, name)
        self._open(episode, {"session": name[:MAX_SESSION_LABEL], "tenant": tenant, "attributed_by": "header"})
        return episode

    def by_body(self, dialect: str, request: dict[str, Any], tenant: str) -> str | None:
        """The episode a call's body places it in (rules 2 and 3), or None when neither applies."""
        previous = request.get("previous_response_id")
        if isinstance(previous, str):
            with self._lock:
                episode = self._responses.get((tenant, previous))
            if episode is not None:
                return episode
        if not self.conversations:
            return None
        items = _messages(dialect, request)
        if items is None:  # a chain this run never saw answered: a conversation of its own from here
            return self._new_conversation(tenant) if isinstance(previous, str) else None
        if len(items) > MAX_CONVERSATION_ITEMS:
            self.too_long += 1
            return self._new_conversation(tenant)
        digests = _prefix_digests(tenant, dialect, items)
        with self._lock:
            earlier = (self._prefixes[digest] for digest in reversed(digests[1:-1]) if digest in self._prefixes)
            found = next(earlier, None)
            fresh = found is None
            episode = found if found is not None else _conversation_id()
            whole = digests[-1]
            if whole in self._prefixes and self._prefixes[whole] != episode:
                self._prefixes[whole] = None
            else:
                self._prefixes[whole] = episode
            self._prefixes.move_to_end(whole)
            while len(self._prefixes) > self.limit:
                self._prefixes.popitem(last=False)
        if fresh:
            self._open(episode, {"tenant": tenant, "attributed_by": "conversation"})
        return episode

    def _new_conversation(self, tenant: str) -> str:
        episode = _conversation_id()
        self._open(episode, {"tenant": tenant, "attributed_by": "conversation"})
        return episode

    def answered(self, episode: str, tenant: str, answer: bytes) -> None:
        """A Responses answer of `episode`: its id now leads there (rule 2)."""
        found = _RESPONSE_ID.search(answer[:RESPONSE_ID_WINDOW])
        if found is None:
            return
        with self._lock:
            self._responses[(tenant, found.group(1).decode("ascii", "replace"))] = episode
            while len(self._responses) > self.limit:
                self._responses.popitem(last=False)

    def _open(self, episode: str, labels: dict[str, str]) -> None:
        with self._lock:
            if episode in self._known:
                self._known.move_to_end(episode)
                return
            self._known[episode] = None
            while len(self._known) > self.limit:
                self._known.popitem(last=False)
        self.opened(episode, labels)


def _conversation_id() -> str:
    return "c-" + uuid.uuid4().hex


def _messages(dialect: str, request: dict[str, Any]) -> list[Any] | None:
    if dialect == "chat" and isinstance(request.get("messages"), list):
        return request["messages"]
    if dialect == "messages" and isinstance(request.get("messages"), list):
        return [{"system": request.get("system")}, *request["messages"]]
    if dialect == "responses" and "previous_response_id" not in request:
        given = request.get("input")
        items = given if isinstance(given, list) else [given]
        return [{"instructions": request.get("instructions")}, *items]
    return None


def _prefix_digests(tenant: str, dialect: str, items: list[Any]) -> list[bytes]:
    """The digest of each prefix of `items` (the first: of the empty one), chained: one pass over the messages."""
    digest = hashlib.sha256(f"{tenant}\0{dialect}".encode()).digest()
    out = [digest]
    for item in items:
        canonical = json.dumps(item, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
        digest = hashlib.sha256(digest + canonical.encode("utf-8", "surrogatepass")).digest()
        out.append(digest)
    return out


class EpisodeRows:
    """Writes the row of each episode `Sessions` opens, off the proxy's event loop, in batches; an id the store
    holds already (a session seen before a restart) is left as it is. A write that fails (the store locked past
    its timeout) is tried again, the rows kept, after RETRY_S doubling up to RETRY_MAX_S, until the proxy stops.
    Past `backlog` rows waiting, a row is dropped with a warning: its turns are still stored."""

    RETRY_S = 1.0
    RETRY_MAX_S = 30.0

    def __init__(self, store: Store, *, backlog: int = 10_000) -> None:
        self.store = store
        self.backlog = backlog
        self._queue: queue.Queue[dict[str, Any] | threading.Event | None] = queue.Queue(backlog)
        self._thread = threading.Thread(target=self._run, name="lcap-episode-rows", daemon=True)
        self.dropped = 0  # rows never stored: past the backlog, or still failing when the proxy stopped
        self.failed_writes = 0

    def start(self) -> None:
        self._thread.start()

    def put(self, episode: str, labels: dict[str, str]) -> None:
        row = {
            "episode_id": episode,
            "started_at": now(),
            "status": "running",
            "labels": json.dumps(redact_labels(labels)),
        }
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self.dropped += 1
            log.warning("lcap: the row of episode %s was not stored (too many new episodes at once)", episode)

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until the rows of every episode opened so far are stored (or `timeout` passes): a reward posted
        right after its session's first call names an episode whose row may still be on its way."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Store the rows still waiting and end the thread. The default wait covers one more write, which may wait
        the store's whole attach timeout for a lock (a thread cut short there would drop its rows unsaid)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.store.timeout + 10.0 if timeout is None else timeout)
            if self._thread.is_alive():
                log.warning("lcap: the session episode rows were still being written when the proxy stopped")

    def _run(self) -> None:
        waiting: dict[str, dict[str, Any]] = {}  # rows not stored yet, by episode id
        settles: list[threading.Event] = []
        stopping = False
        retry = self.RETRY_S
        while not stopping or waiting:
            for item in take_batch(self._queue, retry if waiting else None, room=self.backlog - len(waiting)):
                if item is None:
                    stopping = True
                elif isinstance(item, threading.Event):
                    settles.append(item)
                else:
                    waiting[item["episode_id"]] = item
            if waiting:
                try:
                    self.store.append("episodes", list(waiting.values()), new_by="episode_id")
                    waiting.clear()
                    retry = self.RETRY_S
                except Exception as exc:  # the proxy goes on; the rows wait for the next try
                    self.failed_writes += 1
                    if stopping:
                        self.dropped += len(waiting)
                        log.warning("lcap: %d episode rows were not stored: %s", len(waiting), exc)
                        waiting.clear()
                    else:
                        log.warning(
                            "lcap: %d episode rows not stored yet, next try in %.0fs: %s", len(waiting), retry, exc
                        )
                        retry = min(2 * retry, self.RETRY_MAX_S)
            if not waiting:
                for event in settles:
                    event.set()
                settles.clear()


def take_batch(source: queue.Queue[T], timeout: float | None = None, room: int = sys.maxsize) -> list[T]:
    """What `source` holds: its first item within `timeout` (None: wait for it; [] when none came), then all that
    is there, up to `room` more."""
    try:
        items = [source.get(timeout=timeout)]
    except queue.Empty:
        return []
    while room > 0:
        try:
            items.append(source.get_nowait())
        except queue.Empty:
            break
        room -= 1
    return items
