"""Where LLM calls go: a fixed upstream, or one replica of the policy server per episode.

With `--upstream policy`, the `Router` reads the policy record (lcap/policy.py, again whenever it
changes) and sends each episode to one replica: the one that ranks first for the episode id by
rendezvous hashing (highest random weight). The choice is stable (an episode's calls meet their
own prefix cache) and consistent: a replica that leaves moves only its own episodes, each to its
second choice, and they come back when it returns.

A replica leaves the rotation when a call to it fails (no connection, the connection closed before
any answer, a 5xx) or when the periodic probe of its `/v1/models` fails twice or no longer lists
the deployment calls ask for; it is probed again with a bounded back-off and rejoins at the first
good answer. A replica the record marks `draining` (a full checkpoint is replacing it) gets no new
call. When no replica is left by the probes' verdicts, calls go to the whole set anyway: a stale
verdict must not turn into a 503. When the record marks every replica draining (one replica alone
restarting on a new checkpoint), the router is `holding`: the transports keep new calls until a
replica serves again (capture/proxy/calls.py `Calls.hold`) instead of sending them to a server that is
going away.

A call asks vLLM for the name its deployment is served under (the record's `served_as`: a full
checkpoint reloaded in place keeps the name vLLM started with) and its turn stores the deployment,
settled when the call ends (`Router.settle`). A proxy given a model that is one of the policy's
adapters (one loaded beside the current deployment, as `lcap loop --live` evaluates a candidate) sends
every call to it and labels the turns with it; a proxy given role -> adapter pins (`role_models`, as
`lcap loop --per-role` evaluates a round's candidates) sends each pinned role's calls to its adapter, the others
to their deployments.

Each call asks for its role's deployment (the record's `roles`; a role without one of its own gets the default's):
the replica is picked per episode as above, then the role picks the adapter on it. Everything a call's route is
made of comes from one read of the record (`_Table`, swapped whole), so a deploy of several roles, one record, is
seen whole or not at all.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from lcap.policy import DEFAULT_ROLE, REFRESH_S, PolicyServer, Replica, read_policy, record_version

log = logging.getLogger("lcap.capture")

HEALTH_INTERVAL_S = 2.0  # between two probes of a replica in the rotation
PROBE_TIMEOUT_S = 5.0  # a busy CPU server can be slow to answer
SWEEP_FAILURES = 2  # consecutive failed periodic probes that take a replica out (a failed call takes it out at once)
BACKOFF_FIRST_S = 0.5  # the first re-probe of a replica out of the rotation; doubled after each failed probe
BACKOFF_MAX_S = 10.0


@dataclass(frozen=True)
class Route:
    """Where a recognised call goes instead of its original host."""

    scheme: str
    host: str
    port: int
    base_path: str  # e.g. "" or "/v1"
    model: str | None  # the model to ask for, or None to keep the agent's
    deployment: str | None  # the policy deployment name stored on the turn
    replica: str | None = None  # the policy replica (r0, r1, ...) stored on the turn
    authorization: bytes | None = None  # the Authorization value the replica requires, if any
    lcap: bool = False  # the server has lcap's policy endpoints (capture/routing/policy_wire.py)

    @functools.cached_property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"

    @functools.cached_property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode("idna")

    def path_for(self, agent_path: str) -> str:
        """Map the agent's path onto the upstream: keep it whole, or graft what follows `/v1`. Bytes past ASCII
        (a raw 0xFF, unencoded UTF-8), which an HTTP/1 server may refuse (RFC 9112 3.2), are percent-encoded as
        browsers and curl send them; the turn keeps the path the agent wrote."""
        if not agent_path.isascii():
            agent_path = _PAST_ASCII.sub(_percent, agent_path.encode("utf-8", "surrogateescape")).decode()
        if not self.base_path:
            return agent_path
        path, sep, query = agent_path.partition("?")
        idx = path.find("/v1/")
        tail = path[idx + 3 :] if idx >= 0 else path
        return f"{self.base_path}{tail}{sep}{query}"


_PAST_ASCII = re.compile(rb"[\x80-\xff]")


def _percent(match: re.Match[bytes]) -> bytes:
    return b"%%%02X" % match[0][0]


def parse_upstream(
    url: str,
    model: str | None,
    deployment: str | None = None,
    *,
    replica: str | None = None,
    key: str | None = None,
    lcap: bool = False,
) -> Route:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    authorization = f"Bearer {key}".encode() if key else None
    path = parts.path.rstrip("/")
    return Route(parts.scheme, parts.hostname, port, path, model, deployment, replica, authorization, lcap)


def rank(episode: str, replica: str) -> int:
    """The episode's weight for a replica: the replica with the highest weight serves the episode."""
    return int.from_bytes(hashlib.blake2b(f"{replica}\0{episode}".encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class _Table:
    """What the router read of one policy record: the routes every call is picked from, replaced whole."""

    routes: tuple[Route, ...] = ()  # every replica's route for the default role
    rotation: tuple[Route, ...] = ()  # the replicas new calls go to (none draining)
    holding: bool = False  # the record marks every replica draining: new calls wait (`holding`)
    by_replica: dict[str | None, Route] = field(default_factory=dict)
    served_as: dict[str, str] = field(default_factory=dict)  # the record's deployment -> vLLM name map
    by_role: dict[tuple[str, str | None], Route] = field(default_factory=dict)  # (role, replica): a role's own


@dataclass(slots=True)
class _Health:
    """A replica's standing with this router: out of the rotation or not, and when to probe it next."""

    url: str
    out: bool = False
    failures: int = 0  # consecutive failed periodic probes
    delay: float = BACKOFF_FIRST_S
    due: float = 0.0


class Router:
    """Resolves the route of each call: a fixed URL, the policy's replicas (from its record), or none."""

    def __init__(
        self,
        upstream: str | None,
        model: str | None,
        *,
        health_interval: float = HEALTH_INTERVAL_S,
        lcap_endpoints: bool = False,
        policy_key: str | None = None,
        role_models: Mapping[str, str] | None = None,
    ) -> None:
        """`lcap_endpoints`: the fixed URL's server has lcap's policy endpoints (the policy record says it itself).
        `policy_key`: the replicas' key, in place of the record's key file (which a Ray node's proxy cannot read).
        `role_models`: role -> an adapter the replicas serve that the role's calls ask for instead of the role's
        deployment (`lcap loop --per-role` evaluates a round's candidates so); a role not in it keeps its own."""
        self.upstream, self.model = upstream, model
        self.role_models = dict(role_models or {})
        self.policy_key = policy_key
        self.health_interval = health_interval
        fixed = upstream if upstream not in (None, "policy") else None
        self._fixed = parse_upstream(fixed, model, lcap=lcap_endpoints) if fixed is not None else None
        self._checked = 0.0
        self._seen: tuple[int, int, int] | None = (-1, -1, -1)  # the record file's identity at the last read
        self._table = _Table()
        self._out: frozenset[str] = frozenset()  # replicas out of the rotation until a probe answers
        self._health: dict[str, _Health] = {}
        self._round_robin = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        if upstream == "policy":
            with self._lock:
                self._refresh(time.monotonic())  # replicas are probed from the start, not from the first call

    # --- routing ------------------------------------------------------------------------------

    def route(
        self, episode: str | None = None, avoid: frozenset[str] = frozenset(), role: str | None = None
    ) -> Route | None:
        """The route of a call of `episode` made by `role` (None: the default role's); `avoid`: replicas this call
        already failed on (None when none is left)."""
        if self.upstream != "policy":
            return None if avoid else self._fixed
        self._look()
        table = self._table  # one read of the record for the whole choice
        replica = self._replica(table, episode, avoid)
        if replica is None or not table.by_role or role is None:
            return replica
        return table.by_role.get((role, replica.replica), replica)

    def _replica(self, table: _Table, episode: str | None, avoid: frozenset[str]) -> Route | None:
        rotation = table.rotation
        if len(rotation) == 1 and not avoid:
            return rotation[0]
        candidates = [r for r in rotation if r.replica not in avoid] or [
            r for r in table.routes if r.replica not in avoid
        ]
        if len(candidates) > 1:
            out = self._out
            candidates = [r for r in candidates if r.replica not in out] or candidates
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        if episode is None:  # nothing to stick to: spread
            return candidates[next(self._round_robin) % len(candidates)]
        return max(candidates, key=lambda r: rank(episode, r.replica or ""))

    def holding(self) -> bool:
        """Whether every replica of the policy is draining (a deploy restarts them all, or the only one): a new
        call then waits for one to serve again rather than go to a server that is about to stop."""
        if self.upstream != "policy":
            return False
        self._look()
        return self._table.holding

    def settle(self, replica: str | None, deployment: str | None) -> str | None:
        """The deployment that served a call to `replica` that has just ended, labelled `deployment` when it was sent.

        A full checkpoint reloaded in place (serve/deploy.py) changes a replica's weights under the name vLLM serves:
        a call sent while the replica was paused for the reload waits in vLLM and is served by the new weights. The
        deploy switches the record while the replica is paused with nothing running and resumes it only once every
        proxy has had time to read the switch (lcap.policy `publish`), so a call that ends after the switch was served by
        the new deployment when both deployments are served under the same name; a LoRA or a restart changes the
        name, and then the label given when the call was sent stands."""
        if replica is None or deployment is None or self.upstream != "policy":
            return deployment
        self._look()
        table = self._table
        route = table.by_replica.get(replica)
        if route is None or route.deployment is None or route.deployment == deployment:
            return deployment
        served = table.served_as
        if served.get(route.deployment, route.deployment) == served.get(deployment, deployment):
            return route.deployment
        return deployment

    def trusted(self, host: str, port: int) -> bool:
        """Whether (host, port) is an upstream lcap routes to (connections there are not checked as destinations)."""
        routes = (self._fixed,) if self._fixed is not None else self._table.routes
        return any((host, port) == (r.host, r.port) for r in routes)

    def routes(self) -> tuple[Route, ...]:
        """Every replica's route as last read from the record."""
        return self._table.routes

    def out_of_rotation(self) -> frozenset[str]:
        return self._out

    # --- health -------------------------------------------------------------------------------

    def failed(self, replica: str | None, why: str) -> None:
        """A call to `replica` failed: it leaves the rotation until a probe finds it serving again."""
        if replica is None or self.upstream != "policy":
            return
        with self._lock:
            health = self._health.get(replica)
            if health is None or health.out:
                return
            self._take_out(health, replica)
        log.warning("lcap: policy replica %s left the rotation (%s); its episodes go to the others", replica, why)
        self._wake.set()

    def _take_out(self, health: _Health, replica: str) -> None:
        health.out, health.failures = True, 0
        health.delay = BACKOFF_FIRST_S
        health.due = time.monotonic() + health.delay
        self._out = self._out | {replica}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._prober is not None:
            self._prober.join(PROBE_TIMEOUT_S + 1)

    def _probe_loop(self) -> None:
        import httpx  # start-up: httpx, for policy replicas only

        next_sweep = 0.0
        with (
            httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client,
            ThreadPoolExecutor(8, thread_name_prefix="lcap-replica-probe") as pool,
        ):
            while not self._stop.is_set():
                now = time.monotonic()
                sweep = now >= next_sweep
                if sweep:
                    next_sweep = now + self.health_interval
                due = []
                for route in self._table.routes:
                    health = self._health.get(route.replica or "")
                    if health is None:
                        continue
                    if health.due <= now if health.out else sweep:  # out: its back-off is over; in: every sweep
                        due.append(route)
                for route, ok in zip(due, pool.map(lambda r: _serving(client, r), due), strict=True):
                    self._probed(route, ok)
                with self._lock:
                    waits = [h.due for h in self._health.values() if h.out] + [next_sweep]
                self._wake.wait(max(0.01, min(waits) - time.monotonic()))
                self._wake.clear()

    def _probed(self, route: Route, ok: bool) -> None:
        name = route.replica or ""
        came_back = False
        with self._lock:
            health = self._health.get(name)
            if health is None or health.url != route.url:
                return
            if ok:
                came_back, health.out, health.failures = health.out, False, 0
                self._out = self._out - {name}
            elif health.out:
                health.delay = min(health.delay * 2, BACKOFF_MAX_S)
                health.due = time.monotonic() + health.delay
            else:
                health.failures += 1
                if health.failures < SWEEP_FAILURES:
                    return
                self._take_out(health, name)
                log.warning(
                    "lcap: policy replica %s left the rotation (its probe failed); its episodes go to the others", name
                )
        if came_back:
            log.warning("lcap: policy replica %s is serving again: back in the rotation", name)

    # --- the record ---------------------------------------------------------------------------

    def _look(self) -> None:
        """Read the record again if it changed and REFRESH_S passed since the last look: what `publish` counts on."""
        now = time.monotonic()
        if now - self._checked >= REFRESH_S:
            with self._lock:
                self._refresh(now)

    def _refresh(self, now: float) -> None:
        self._checked = now
        seen = record_version()
        if seen == self._seen:
            return
        self._seen = seen
        try:
            record = read_policy()
            table = self._read(record) if record is not None else _Table()
        except (ValueError, TypeError, KeyError, OSError) as exc:  # a record being rewritten: keep the last routes
            log.warning("lcap: unreadable policy record (%s); keeping the previous routes", exc)
            return
        if table.holding != self._table.holding:
            if table.holding:
                log.warning("lcap: every policy replica is restarting (a deploy): new calls wait for one to serve")
            else:
                log.warning("lcap: the policy replicas are no longer all restarting: held calls go on")
        previous = {r.replica: r for r in self._table.rotation}
        health: dict[str, _Health] = {}
        for route in table.rotation:
            name = route.replica or ""
            kept = self._health.get(name)
            # A replica that changed (restarted, rolled to a new checkpoint, back from draining) starts afresh.
            health[name] = kept if kept is not None and previous.get(name) == route else _Health(route.url)
        self._health = health
        self._out = frozenset(name for name, h in health.items() if h.out)
        self._table = table
        if len(table.routes) > 1 and self._prober is None:
            self._prober = threading.Thread(target=self._probe_loop, name="lcap-replica-health", daemon=True)
            self._prober.start()
        self._wake.set()

    def _read(self, record: PolicyServer) -> _Table:
        """The routes of `record`: each replica's for the default role, and for each role with its own deployment."""
        key = self.policy_key if self.policy_key is not None else record.api_key()
        if pins := {role: name for role, name in self.role_models.items() if name in record.loras}:
            own = {role: name for role, name in pins.items() if role != DEFAULT_ROLE}
            record = replace(record, current=pins.get(DEFAULT_ROLE, record.current), roles={**record.roles, **own})
        # a model that is one of the adapters the replicas serve: its calls are labelled with it
        pinned = self.model if self.model is not None and self.model in record.loras else None

        def route(replica: Replica, role: str) -> Route:
            deployment = replica.serving(record, role)
            return parse_upstream(
                replica.url,
                self.model or record.served_name(deployment),
                pinned or deployment,
                replica=replica.name,
                key=key,
                lcap=record.lcap_endpoints,
            )

        routes = tuple(route(r, DEFAULT_ROLE) for r in record.replicas)
        draining = {r.name for r in record.replicas if r.draining}
        rotation = tuple(r for r in routes if r.replica not in draining) or routes
        return _Table(
            routes=routes,
            rotation=rotation,
            holding=bool(routes) and all(r.replica in draining for r in routes),
            by_replica={r.replica: r for r in routes},
            served_as=dict(record.served_as),
            by_role={(role, r.name): route(r, role) for role in record.roles for r in record.replicas},
        )


def _serving(client, route: Route) -> bool:
    """Whether the replica answers `/v1/models` and lists the deployment its calls ask for."""
    headers = {"authorization": route.authorization.decode()} if route.authorization else {}
    try:
        answer = client.get(f"{route.scheme}://{route.host}:{route.port}/v1/models", headers=headers)
        if answer.status_code != 200:
            return False
        served = {m.get("id") for m in answer.json().get("data") or [] if isinstance(m, dict)}
    except Exception:  # unreachable, or not an OpenAI server's answer
        return False
    return route.model is None or route.model in served
