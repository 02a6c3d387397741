"""The reward endpoint of `lcap proxy --serve`: `POST /lcap/v1/rewards`, for rewards that arrive after the episode.

A poster proves who it is with `Authorization: Bearer TOKEN`: either the proxy's reward token (in the proxy's
record, `LCAP_HOME/proxies/PORT.json`, mode 0600), which may reward any episode, or the upstream credential a
tenant's agents send (capture/proxy/sessions.py), which may reward that tenant's episodes only; another
tenant's episode is answered as an unknown one (404). The body is a JSON object:

    {"episode_id": ID | "session": NAME | "label": {KEY: VALUE, ...},
     "value": NUMBER, "source": TEXT, "details": OBJECT, "key": TEXT}

`key` makes the post idempotent: a reward with that key already stored for the episode is not stored again (200,
`stored: false`); another episode's key, another tenant's above all, is no match.
Rewards are stored by one thread, in batches: the posts waiting when it turns to them share one attach of the store
file (which a writer process or `lcap loop --live` may hold for a while), and each is answered once its row is in
the store. Past `max_pending` waiting, a post gets 429 with Retry-After; a store that stays locked past its timeout,
503. An episode this proxy opened is placed from memory (`KnownEpisodes`), its row stored or not yet; a post naming
one the store does not hold either looks again once the episode rows the proxy has opened so far are stored
(`settle`): a reward posted right after its session's first call is not refused for arriving first.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from lcap.capture.proxy.http1 import BadRequest, parse_request_head
from lcap.capture.proxy.sessions import session_episode, take_batch, tenant_of_token
from lcap.capture.trust.destinations import is_loopback_host
from lcap.store import Store

log = logging.getLogger("lcap.capture")
PATH = "/lcap/v1/rewards"
MAX_HEAD = 16 * 1024
HEAD_TIMEOUT_S = 3.0  # a poster sends its head at once: a slow one only holds a connection
BODY_TIMEOUT_S = 10.0
MAX_TEXT = 1024  # characters of an id, session, label value, source or key
MAX_CONNECTIONS = 1024
MAX_PER_ADDRESS = 128  # one address's idle connections leave the others room


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]


class Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KnownEpisodes:
    """The episodes this proxy run opened, by id, with their tenant: a post naming one by id, or by a tenant's
    session, is placed without the store. Bounded: the oldest are forgotten (the store still knows them)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._tenants: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, episode: str, labels: dict[str, str]) -> None:
        with self._lock:
            self._tenants[episode] = labels.get("tenant")
            while len(self._tenants) > self.limit:
                self._tenants.popitem(last=False)

    def find(self, post: dict[str, Any], tenant: str | None) -> str | None:
        """The episode `post` names, when this proxy opened it and `tenant` (None: the proxy's token) may reward it."""
        if "episode_id" in post:
            episode = post["episode_id"]
        elif "session" in post and tenant is not None:
            episode = session_episode(tenant, post["session"])
        else:  # a session under the proxy's token may be several tenants', a label any episode's: the store says
            return None
        with self._lock:
            if episode not in self._tenants or (tenant is not None and self._tenants[episode] != tenant):
                return None
        return episode


class _Post:
    def __init__(self, post: dict[str, Any], token: str | None, loop: asyncio.AbstractEventLoop) -> None:
        self.post, self.token, self.loop = post, token, loop
        self.answer: asyncio.Future[Answer] = loop.create_future()

    def reply(self, answer: Answer) -> None:
        try:
            self.loop.call_soon_threadsafe(self._set, answer)
        except RuntimeError:  # the endpoint stopped: nobody waits for the answer
            pass

    def _set(self, answer: Answer) -> None:
        if not self.answer.done():  # a post whose connection went away
            self.answer.set_result(answer)


class RewardEndpoint:
    """An asyncio HTTP/1.1 listener on a thread of its own; `start` returns once it accepts connections."""

    def __init__(
        self,
        store: Store,
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_pending: int = 256,
        max_body: int = 64 * 1024,
        settle: Callable[[], None] = lambda: None,
        known: KnownEpisodes | None = None,
    ) -> None:
        """`settle`: waits until the rows of the episodes the proxy opened so far are stored (a post naming none
        that the store knows looks again after it). `known`: the episodes the proxy opened."""
        self.store, self.token, self.settle = store, token, settle
        self.known = known if known is not None else KnownEpisodes()
        self.host, self.port = host, port
        self.max_pending, self.max_body = max_pending, max_body
        self.pending = 0  # posts read and waiting for, or in, the store thread
        self.connections = 0
        self._by_address: dict[str, int] = {}  # open connections by the client's address
        self._queue: queue.Queue[_Post | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="lcap-rewards", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{PATH}"

    def start(self) -> None:
        if not is_loopback_host(self.host):
            log.warning(
                "lcap: the reward endpoint listens on %s, beyond this machine: every post needs the reward token or "
                "a tenant's credential, sent in clear over HTTP (put TLS in front of it)",
                self.host,
            )
        self._worker.start()
        self._thread = threading.Thread(target=self._run, name="lcap-reward-endpoint", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._server is None:
            raise RuntimeError("the reward endpoint did not start")

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10)
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join(120)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        loop.set_exception_handler(_quiet_cancel)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._connection, self.host, self.port, limit=MAX_HEAD)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        finally:
            self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._close())
            loop.close()

    async def _close(self) -> None:
        """Stop listening, and end every connection: a client's kept-alive one still waits on its next request."""
        assert self._server is not None
        self._server.close()
        # Connections accepted before the close may start their handlers meanwhile: until none is left.
        while handlers := asyncio.all_tasks() - {asyncio.current_task()}:
            for handler in handlers:
                handler.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        if self.connections >= MAX_CONNECTIONS or self._by_address.get(address, 0) >= MAX_PER_ADDRESS:
            writer.close()
            return
        self.connections += 1
        self._by_address[address] = self._by_address.get(address, 0) + 1
        try:
            while True:
                try:
                    answer, keep = await self._one(reader)
                except Refusal as exc:
                    answer, keep = Answer(exc.status, {"error": str(exc)}), False
                if answer is None:
                    return
                _write(writer, answer, keep)
                await writer.drain()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:  # the endpoint stops; a handler ended cancelled is logged as an error by asyncio
            return
        finally:
            self.connections -= 1
            self._by_address[address] -= 1
            if not self._by_address[address]:
                del self._by_address[address]
            writer.close()

    async def _one(self, reader: asyncio.StreamReader) -> tuple[Answer | None, bool]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise Refusal(400, "incomplete request head") from None
            return None, False
        except asyncio.LimitOverrunError:
            raise Refusal(431, "request head too large") from None
        except TimeoutError:
            raise Refusal(408, "request head too slow") from None
        try:
            request = parse_request_head(head)  # the front's strict llhttp reading
        except BadRequest as exc:
            raise Refusal(400, f"bad request head: {exc}") from None
        fields = {name.decode("latin-1").lower(): value.decode("latin-1").strip() for name, value in request.fields}
        keep = fields.get("connection", "").lower() != "close"
        if request.target.split(b"?", 1)[0] != PATH.encode():
            raise Refusal(404, f"no such endpoint: POST {PATH}")
        if request.method != b"POST":
            raise Refusal(405, f"POST {PATH}")
        if request.length is None:  # chunked, or no body length at all
            raise Refusal(411, "send the body with a Content-Length")
        length = request.length
        if length > self.max_body:
            raise Refusal(413, f"the body is over {self.max_body} bytes (--max-reward-bytes)")
        scheme, _, token = fields.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refusal(401, "Authorization: Bearer TOKEN required")
        try:
            body = await asyncio.wait_for(reader.readexactly(length), BODY_TIMEOUT_S)
        except TimeoutError:
            raise Refusal(408, "request body too slow") from None
        admin = hmac.compare_digest(token.strip().encode(), self.token.encode())
        post = _read_post(body)
        if self.pending >= self.max_pending:
            return Answer(429, {"error": "too many rewards waiting to be stored: retry later"}), keep
        self.pending += 1
        try:
            waiting = _Post(post, None if admin else token.strip(), asyncio.get_running_loop())
            self._queue.put(waiting)
            answer = await waiting.answer
        finally:
            self.pending -= 1
        return answer, keep

    def _work(self) -> None:
        """The store thread: every post waiting, in one batch."""
        done = False
        while not done:
            posts = take_batch(self._queue)
            done = None in posts
            batch = [post for post in posts if post is not None]
            if not batch:
                continue
            try:
                answers = self._store(batch)
            except Exception as exc:  # the store stayed locked past its timeout, or broke
                log.warning("lcap: %d rewards were not stored: %s", len(batch), exc)
                answers = [Answer(503, {"error": f"the store is unavailable, retry later: {exc}"})] * len(batch)
            for post, answer in zip(batch, answers, strict=True):
                post.reply(answer)

    def _store(self, batch: list[_Post]) -> list[Answer]:
        """Place and store a batch of rewards: one attach, and one more (after `settle`) for those that name an
        episode the store does not hold yet."""
        answers: list[Answer | None] = [None] * len(batch)
        tenants = [tenant_of_token(p.token) if p.token is not None else None for p in batch]
        todo = list(range(len(batch)))
        for attempt in range(2):
            if attempt:
                self.settle()  # a session opened a moment ago: its row may still be on its way to the store
            again = []
            with self.store.connect():
                for i in todo:
                    post, tenant = batch[i].post, tenants[i]
                    try:
                        episode = self.known.find(post, tenant) or self._episode(post, tenant)
                    except Refusal as exc:
                        if attempt == 0 and exc.status in (401, 404):
                            again.append(i)
                        else:
                            answers[i] = Answer(exc.status, {"error": str(exc)})
                        continue
                    stored = self.store.add_reward(
                        episode,
                        post["value"],
                        details=json.dumps(post["details"]),
                        source=post["source"],
                        key=post["key"],
                    )
                    answers[i] = Answer(201 if stored else 200, {"episode_id": episode, "stored": stored})
            if not again:
                break
            todo = again
        return [a if a is not None else Answer(500, {"error": "not answered"}) for a in answers]

    def _episode(self, post: dict[str, Any], tenant: str | None) -> str:
        where, params = [], []
        if "episode_id" in post:
            where.append("episode_id = ?")
            params.append(post["episode_id"])
        elif "session" in post:
            if tenant is not None:
                where.append("episode_id = ?")
                params.append(session_episode(tenant, post["session"]))
            else:
                where.append("labels->>'session' = ?")
                params.append(post["session"])
        else:
            for key, value in post["label"].items():
                where.append("labels->>? = ?")
                params += [key, value]
        if tenant is not None:
            where.append("labels->>'tenant' = ?")
            params.append(tenant)
        rows = self.store.fetchall(f"SELECT episode_id FROM episodes WHERE {' AND '.join(where)} LIMIT 2", params)
        if len(rows) == 1:
            return rows[0][0]
        if len(rows) > 1:
            raise Refusal(409, "several episodes match: name one by its id")
        if tenant is not None and not self.store.fetchall(
            "SELECT 1 FROM episodes WHERE labels->>'tenant' = ? LIMIT 1", [tenant]
        ):
            raise Refusal(401, "the token is neither the proxy's reward token nor a tenant's credential")
        raise Refusal(404, "no such episode")


def _read_post(body: bytes) -> dict[str, Any]:
    try:
        post = json.loads(body)
    except (ValueError, RecursionError):
        raise Refusal(400, "the body is not JSON") from None
    if not isinstance(post, dict):
        raise Refusal(400, "the body must be a JSON object")
    named = [name for name in ("episode_id", "session", "label") if name in post]
    if len(named) != 1:
        raise Refusal(400, "name the episode by exactly one of episode_id, session, label")
    value = post.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Refusal(400, "value must be a finite number")
    label = post.get("label")
    if named[0] == "label" and (
        not isinstance(label, dict) or not label or not all(_text(k) and _text(v) for k, v in label.items())
    ):
        raise Refusal(400, "label must be an object of text values")
    if named[0] != "label" and not _text(post[named[0]]):
        raise Refusal(400, f"{named[0]} must be text")
    details = post.get("details", {})
    if not isinstance(details, dict):
        raise Refusal(400, "details must be a JSON object")
    source = post.get("source", "api")
    key = post.get("key")
    if not _text(source) or (key is not None and not _text(key)):
        raise Refusal(400, "source and key must be text")
    return {named[0]: post[named[0]], "value": float(value), "details": details, "source": source, "key": key}


def _text(value: Any) -> bool:
    """Text the store can hold: JSON's `\\ud800` decodes to a lone surrogate, which no UTF-8 column takes (raised in
    the store thread, it failed every post of the batch)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _quiet_cancel(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's error handler: a connection's handler cancelled at stop before it ran is no error (asyncio's
    stream callback reports one, CancelledError); anything else is."""
    if not isinstance(context.get("exception"), asyncio.CancelledError):
        loop.default_exception_handler(context)


def _write(writer: asyncio.StreamWriter, answer: Answer, keep: bool) -> None:
    body = json.dumps(answer.body).encode() + b"\n"
    reason = HTTPStatus(answer.status).phrase
    head = [
        f"HTTP/1.1 {answer.status} {reason}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: " + ("keep-alive" if keep else "close"),
    ]
    if answer.status in (429, 503):
        head.append("Retry-After: 1")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
