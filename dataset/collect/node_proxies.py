"""The capture proxies of `lcap collect --ray`: one per node that runs episodes, started and owned by the driver.

A `NodeProxy` is a Ray actor pinned to its node (NodeAffinitySchedulingStrategy): a capture proxy whose writer is
an `Outbox` (capture/storage/outbox.py `node_outbox`: a spool on the node sealed with the run's hand-off key), and
the reaper of the agents of its node's episodes. Agents reach it on the node's loopback, so their traffic never
crosses nodes to be captured and TLS ends where the agent runs. It is started by the driver, so that it ends with
the driver.

`NodeProxies` holds a run's proxies and the hand-off of their turns: the driver's `Ingest`
(capture/storage/ingest.py), which takes them in bounded batches, exactly once by spool position, and appends them
to the one `TurnWriter`. `_Proxies` is how the ingest reaches the outboxes: Ray actor calls. A collect has its own
`NodeProxies`, or uses the one `lcap loop --ray` keeps across its collects (the proxies then start once per node
and take each deploy's record). The episodes' scheduling is dataset/collect/on_ray.py's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lcap.capture import (
    CaptureProxy,
    Ingest,
    Outbox,
    OutboxLost,
    Position,
    ProxyOptions,
    Taken,
    TurnWriter,
    node_outbox,
)
from lcap.config import LcapError
from lcap.policy import PolicyServer, publish
from lcap.processes import kill_group
from lcap.store import Store

log = logging.getLogger("lcap.dataset")

PROXY_START_S = 120.0  # a node proxy's start: its CA, the upstream's probe, its port
CALL_S = 60.0  # any other call to a node proxy
STOP_S = 20.0  # node proxies' drain at the end of the run


@dataclass(frozen=True)
class NodeConfig:
    """What every node proxy of a run is started with. It travels in Ray's actor arguments, never through a file;
    the keys stay out of its repr (Ray shows arguments in some errors)."""

    options: ProxyOptions
    policy: str | None  # the policy record's text (`--upstream policy`), written on the node for its Router
    key: bytes = field(repr=False)  # the run's hand-off key: the outbox is sealed with it
    run: str  # names the node's spool directory
    max_concurrency: int
    # The policy replicas' key itself: the record names a file on the driver's machine, which another host lacks.
    # The node's proxy holds it in memory only.
    policy_key: str | None = field(default=None, repr=False)


class NodeProxy:
    """A capture proxy on one node with an Outbox for a writer, and the reaper of the node's agents.

    Runs as a threaded Ray actor: episodes' flushes wait while the driver takes turns."""

    def __init__(self, config: NodeConfig) -> None:
        """Nothing slow: the actor is alive once it has its worker process (`placed`), and `start`, called by whoever
        creates it, starts the proxy, so that where the start's time goes (Ray's worker or lcap's proxy) shows."""
        self.config = config
        self.error: str | None = None
        self.groups: dict[str, int] = {}  # episode -> its agent's process group
        self.lock = threading.Lock()
        self.started = threading.Event()
        self.outbox: Outbox | None = None
        self.proxy: Any = None

    def placed(self) -> int:
        """Its worker's pid, once this actor has its worker process (before its proxy started)."""
        return os.getpid()

    def start(self) -> None:
        """Start the proxy (its CA, the upstream's probe, its port); every other call waits for it."""
        try:
            config = self.config
            outbox = node_outbox(config.run, config.key)
            if config.policy is not None:
                # this actor's process: the record its Router reads, and `set_policy` publishes
                os.environ["LCAP_POLICY_RECORD"] = str(_policy_file(outbox.directory))
                publish(PolicyServer(**json.loads(config.policy)))
            self.outbox = outbox
            self.proxy = CaptureProxy(None, config.options, writer=self.outbox, policy_key=config.policy_key)
            self.proxy.start()
        except LcapError as exc:
            self.error = str(exc)
        except Exception as exc:  # the driver says it in one line (episodes on this node end with it), no traceback
            self.error = f"{exc.__class__.__name__}: {first_line(exc)}"
        finally:
            self.started.set()

    def ready(self) -> str | None:
        """None once the proxy listens; else why it could not start."""
        if not self.started.wait(PROXY_START_S):
            return f"the capture proxy did not start in {PROXY_START_S:g}s"
        return self.error

    def _outbox(self) -> Outbox:
        """The outbox, once `start` has made it (the driver's takes may come first)."""
        self.started.wait(PROXY_START_S)
        if self.outbox is None:
            raise RuntimeError(f"this node's capture proxy did not start: {self.error}")
        return self.outbox

    def set_policy(self, policy: str) -> None:
        """A new policy record (a deploy between two collects of a loop), published over this proxy's copy: returns
        once any call routed from now on is routed by it."""
        if os.environ.get("LCAP_POLICY_RECORD") != str(_policy_file(self._outbox().directory)):
            raise RuntimeError("this node's capture proxy was started without a policy record")  # not to publish home's
        publish(PolicyServer(**json.loads(policy)))

    def child_env(self, episode_id: str, base: Mapping[str, str]) -> dict[str, str]:
        self._outbox()
        return self.proxy.child_env(episode_id, base)

    def adopt(self, episode_id: str, pgid: int) -> None:
        """The agent of `episode_id` leads process group `pgid`: `fence` and `kill_all` end it even when its runner
        (a Ray worker) is gone."""
        with self.lock:
            self.groups[episode_id] = pgid

    def release(self, episode_id: str) -> None:
        with self.lock:
            self.groups.pop(episode_id, None)

    def flush(self, episode_id: str, timeout: float) -> bool:
        self._outbox()
        return self.proxy.flush(episode_id, timeout=timeout)

    def take(self, after: Position | None, limit: int, max_bytes: int, wait: float) -> Taken:
        return self._outbox().take(after, limit=limit, max_bytes=max_bytes, wait=wait)

    def fence(self, episode_ids: list[str], timeout: float) -> bool:
        """End these episodes here: kill their agents, let their calls finish and wait for the driver to take their
        turns; False if that took longer than `timeout`."""
        for eid in episode_ids:
            with self.lock:
                group = self.groups.pop(eid, None)
            if group is not None:
                kill_group(group, grace=1.0)
        deadline = time.monotonic() + timeout
        self.started.wait(timeout)
        if self.proxy is None or self.error is not None:
            return True
        return all(self.proxy.flush(eid, timeout=max(0.0, deadline - time.monotonic())) for eid in episode_ids)

    def kill_all(self) -> int:
        with self.lock:
            groups, self.groups = list(self.groups.values()), {}
        for pgid in groups:
            kill_group(pgid, grace=1.0)
        return len(groups)

    def stop(self, timeout: float) -> int:
        """Kill what agents are left, stop the proxy (the driver takes its last turns, for up to `timeout`
        seconds), delete its spool; returns the turns it never handed off."""
        self.kill_all()
        self.started.wait(timeout)
        report = self.proxy.stop(drain=min(timeout, 10.0)) if self.proxy is not None and self.error is None else None
        if self.outbox is not None:
            self.outbox.remove()
            _policy_file(self.outbox.directory).unlink(missing_ok=True)
        return report.unstored if report is not None else 0


def _policy_file(spool: Path) -> Path:
    """The node proxy's copy of the policy record, beside its spool (`PID-*`: deleted with it if its proxy died)."""
    return spool.with_name(spool.name + ".policy.json")


def _start_proxy(config: NodeConfig, node_id: str) -> Any:
    """A node proxy pinned to `node_id`, owned by this process (it ends with it), starting."""
    handle: Any = _NodeProxyActor.options(
        num_cpus=0,
        max_concurrency=config.max_concurrency,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(config)
    handle.start.remote()
    return handle


class RayOutboxes:
    """How the driver's `Ingest` reaches the node proxies' outboxes: Ray actor calls (its `Sources`, less the
    proxies it knows of)."""

    def take(self, outbox: Any, after: Position | None, limit: int, max_bytes: int, wait: float) -> Any:
        return outbox.take.remote(after, limit, max_bytes, wait)

    def ready(self, takes: list[Any], timeout: float) -> list[Any]:
        ready, _ = ray.wait(takes, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(takes, num_returns=len(takes), timeout=0)
        return ready

    def taken(self, take: Any) -> Taken:
        try:
            return ray.get(take, timeout=CALL_S)
        except ray.exceptions.RayError as exc:
            raise OutboxLost(first_line(exc)) from None


class _Proxies(RayOutboxes):
    """A run's node proxies, one per node, held by the driver, which starts them and owns them (they end with it:
    no actor of a run outlives its driver). Thread-safe: the ingest thread forgets the ones it finds dead."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.proxies: dict[str, tuple[str, Any]] = {}  # node id -> (this proxy's key, its handle)
        self.every: list[Any] = []  # every proxy started, dead ones included: all are killed at the end
        self.lock = threading.Lock()
        self.ref: Any = ray.put({})  # {node id: handle} in the object store, for the episodes' tasks

    def ensure(self, node_ids: Iterable[str]) -> None:
        """A proxy on each of these nodes, started now where there is none."""
        with self.lock:
            missing = [node_id for node_id in node_ids if node_id not in self.proxies]
            for node_id in missing:
                handle = _start_proxy(self.config, node_id)
                self.every.append(handle)
                self.proxies[node_id] = (f"{node_id}#{len(self.every)}", handle)
            if missing:
                self.ref = ray.put({node_id: handle for node_id, (_, handle) in self.proxies.items()})

    def replace(self, node_id: str, lost: str | None) -> None:
        """An episode found no live proxy on `node_id` (`lost`: the actor id of the one it found dead): start one,
        unless another replaced it meanwhile."""
        with self.lock:
            if lost and node_id in self.proxies and self.proxies[node_id][1]._actor_id.hex() == lost:
                del self.proxies[node_id]
        self.ensure([node_id])

    def set_policy(self, policy: str) -> bool:
        """A new policy record for every proxy, those running and those started from now on; False if a proxy did
        not answer in time (one that is gone is the ingest's to see)."""
        with self.lock:
            self.config = replace(self.config, policy=policy)
            calls = [handle.set_policy.remote(policy) for _, handle in self.proxies.values()]
        if not calls:
            return True
        _, late = ray.wait(calls, num_returns=len(calls), timeout=CALL_S)
        return not late

    def known(self) -> dict[str, Any]:
        """Every proxy started and not forgotten, by key (a node's proxy started again has a new key)."""
        with self.lock:
            return {key: handle for key, handle in self.proxies.values()}

    def forget(self, key: str) -> None:
        """A proxy that died: the next episode on its node (if the node lives) has another started."""
        node_id = key.split("#", 1)[0]
        with self.lock:
            if node_id in self.proxies and self.proxies[node_id][0] == key:
                del self.proxies[node_id]


_NodeProxyActor = ray.remote(NodeProxy)


class NodeProxies:
    """The node proxies of one or more collects and the hand-off of their turns to the store (the ingest thread and
    the one writer).

    A standalone `lcap collect --ray` has its own, stopped at its end. `lcap loop --ray` keeps one for all its
    collects (each round's and each held-out one): a node's proxy is started once, by the first collect that runs
    an episode there, and serves the loop's later collects too, instead of a new actor process per node and
    collect. What stays per collect is what always was per episode: its credentials in the proxy URL (the turns'
    episode, hence their round and split) and its flush. A deploy between two collects reaches the running
    proxies through `prepare` (the new policy record, published over each proxy's copy) before any episode of the
    next collect starts. Options that proxies are started with (the proxy options, the concurrency bound, the
    replicas' key) cannot change under a running proxy: a collect that asks for others stops these and starts
    new ones. Each collect also starts proxies on nodes that joined since (and on those whose proxy was lost)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.proxies: _Proxies | None = None
        self.ingest: Ingest | None = None
        self.writer: TurnWriter | None = None
        self._shape: tuple[ProxyOptions, int, str | None] | None = None  # what the running proxies were started with
        self._policy: str | None = None
        self.starts = 0  # how many times the proxies and their hand-off were started (a test and the benchmark read it)

    def __enter__(self) -> NodeProxies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def started(self) -> list[Any]:
        """[a reference to the running proxies by node], what the episodes' tasks are given."""
        return [self.proxies.ref] if self.proxies is not None else []

    @property
    def run(self) -> str:
        """Names the running proxies (an episode's worker keeps its node's proxy under it)."""
        return self.proxies.config.run if self.proxies is not None else ""

    def known(self) -> dict[str, Any]:
        """The live proxies, by key."""
        return self.proxies.known() if self.proxies is not None else {}

    def prepare(
        self,
        options: ProxyOptions,
        *,
        max_concurrency: int,
        policy: str | None,
        policy_key: str | None,
        name: str,
        nodes: list[str],
    ) -> None:
        """Ready for a collect: started (or kept, with `policy` pushed to them if it changed), and the proxies of
        `nodes` starting."""
        shape = (options, max_concurrency, policy_key)
        if self.proxies is not None and (shape != self._shape or (self.ingest and self.ingest.error is not None)):
            self.close()  # started with other options, or its hand-off failed: these proxies cannot serve it
        if self.proxies is not None and policy is not None and policy != self._policy:
            if self.proxies.set_policy(policy):
                self._policy = policy
            else:  # new proxies start with the new record
                log.warning("lcap: the node proxies did not take the new policy record in time: starting new ones")
                self.close()
        if self.proxies is None:
            config = NodeConfig(
                options, policy, os.urandom(32), f"{name}-{os.urandom(4).hex()}", max_concurrency, policy_key=policy_key
            )
            self._start(config, nodes)
            self._shape, self._policy = shape, policy
        else:
            self.proxies.ensure(nodes)  # nodes that joined since, and those whose proxy was lost

    def replace(self, node_id: str, lost: str | None) -> None:
        """Start a proxy on `node_id`, which an episode found without a live one."""
        assert self.proxies is not None
        self.proxies.replace(node_id, lost)

    def with_proxy(self, nodes: list[str]) -> list[str]:
        """`nodes`, those where a proxy of these runs already (kept from an earlier collect) first."""
        have = {key.split("#", 1)[0] for key in self.known()}
        return sorted(nodes, key=lambda node: node not in have)

    def _start(self, config: NodeConfig, nodes: list[str]) -> None:
        """The proxies of `nodes` (first: each is an actor process to start), the writer and the ingest."""
        self.proxies = _Proxies(config)
        self.proxies.ensure(nodes)
        self.writer = TurnWriter(self.store)
        self.writer.start()
        self.starts += 1
        self.ingest = Ingest(self.proxies, self.writer, config.key)
        self.ingest.start()

    def close(self) -> None:
        """Stop every node proxy (each kills the agents left on its node; the ingest takes their last turns
        meanwhile), then the writer. Safe to call twice; Ctrl-C does not interrupt it."""
        if self.proxies is None:
            return
        proxies, ingest, writer = self.proxies, self.ingest, self.writer
        self.proxies = self.ingest = self.writer = None
        self._shape = self._policy = None
        with ignoring_sigint():
            try:
                if ingest is not None:
                    _stop_proxies(ingest)
            finally:
                if ingest is not None:
                    ingest.stop()
                for proxy in proxies.every:
                    ray.kill(proxy)
                report = writer.finish() if writer is not None else None
                if report is not None and report.unstored:
                    log.warning("%s", report.summary(self.store.path))


def _stop_proxies(ingest: Ingest) -> None:
    """Stop the live node proxies: the ingest takes their last turns meanwhile."""
    proxies = ingest.live()
    stops = [proxy.stop.remote(STOP_S) for proxy in proxies.values()]
    if stops:
        ready, _ = ray.wait(stops, num_returns=len(stops), timeout=STOP_S + CALL_S)
        for ref in ready:
            try:
                unsent = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            if unsent:
                log.warning("lcap: %d turns were left on a node proxy at its end", unsent)
    ingest.settle(timeout=30)


class ignoring_sigint:
    """The clean-up after Ctrl-C runs to its end; a second Ctrl-C during it would leave agents running."""

    def __enter__(self) -> None:
        try:
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread
            self.previous = None

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def first_line(exc: BaseException) -> str:
    """An exception's first line, for one-line errors (a Ray error's text holds the remote traceback)."""
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__
