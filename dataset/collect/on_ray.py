"""`lcap collect --ray`: each episode is a Ray task on any node, captured by a proxy on that node.

The driver (this process) keeps what the local pool keeps: the store, the episodes' rows, the progress
bar, resume. What runs where:

* An episode is a Ray task (`--episode-cpus`, `--episode-resources`; at most `--concurrency` in flight).
  It runs `episode.run_episode` on its node, the function the local pool runs: the workdir (at the run
  directory's path, on the node), the agent, the tamper guard and the verifier are all there, and only
  the outcome (status, reward, details, flags) comes back. A task's `template` directory travels with
  it as an archive in Ray's object store (once per node), its `files` inside the task's spec.
* Each node that runs an episode has one capture proxy: a `NodeProxy` actor pinned to the node
  (NodeAffinitySchedulingStrategy), started and owned by the driver, so that it ends with the driver. The
  driver starts those of the nodes the episodes go to before it sends any; an episode that lands on a node
  without one (joined since, or its proxy lost) comes back unrun, and the driver starts one there and sends
  the episode back to that node. Agents reach the proxy on the node's loopback, so their traffic never
  crosses nodes to be captured and TLS ends where the agent runs. `NodeProxies` holds them with the
  hand-off below: a collect's own, or the one `lcap loop --ray` keeps across its collects (the proxies then
  start once per node and loop, and take each deploy's record).
* The proxy's turns go to an `Outbox` (capture/storage/outbox.py), a spool on the node sealed with this run's
  hand-off key, and the driver's ingest thread takes them in bounded batches, reseals them with this
  home's spool key and appends them to its own `TurnWriter`: the one store writer, with its row
  builder, degraded rows and dead letters. The hand-off is exactly-once by spool position: each take
  names the position it has appended up to, which acknowledges everything before it.
* An episode's task calls its node proxy's flush before returning, and that returns once the driver
  has appended every turn of the episode; the driver flushes its writer before it records the outcome.
  So an episode marked finished has all its turns in the store.

A node lost mid-run (its tasks end with a system error: NodeDiedError, WorkerCrashedError, its proxy
actor dead) costs only its unfinished episodes: the driver fences them on every live proxy (any agent
left is killed, its calls finished, its turns taken), flushes its writer, deletes their partial turns
and runs them again, on any node, up to `MAX_ATTEMPTS` times. Ctrl-C cancels the tasks (a cancelled
runner ends its agent's process group), and the node proxies kill any group left.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import tarfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lcap.capture import REFRESH_S, CaptureProxy, Outbox, Position, ProxyOptions, Taken, TurnWriter, private_dir, reseal
from lcap.config import LcapError, lcap_home
from lcap.dataset.collect.episode import (
    EpisodeOutcome,
    EpisodeRules,
    EpisodeSpec,
    RunProgress,
    Tally,
    TaskFiles,
    forget_partial,
    record_outcome,
    run_episode,
    start_episode,
)
from lcap.dataset.collect.workspaces import source_dir
from lcap.dataset.options import CollectOptions
from lcap.policy import read_policy, record_path
from lcap.processes import alive, kill_group
from lcap.ray_cluster import describe
from lcap.store import Store

log = logging.getLogger("lcap.dataset")

MAX_ATTEMPTS = 3  # runs of one episode whose node was lost, before it is recorded as an error
MAX_MOVES = 3  # times one episode is sent back to a node whose proxy was missing, before it is an error
PROXY_START_S = 120.0  # a node proxy's start: its CA, the upstream's probe, its port
CALL_S = 60.0  # any other call to a node proxy
FLUSH_S = 30.0  # an episode's turns reaching the driver after its agent ended
TAKE_RECORDS = 2000  # a take's bound, the writer's batch
TAKE_BYTES = 32 << 20
TAKE_WAIT_S = 0.5  # a take waits this long on the node for a record (long poll)
STOP_S = 20.0  # node proxies' drain at the end of the run
MAX_TEMPLATE_BYTES = 1 << 30  # a template directory shipped through the object store
SPOOL_DIR = "ray-spool"  # under the node's LCAP_HOME


# --- on each node: the capture proxy --------------------------------------------------------------


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
            root = private_dir(lcap_home() / SPOOL_DIR)
            _remove_dead_spools(root)
            directory = root / f"{os.getpid()}-{config.run}"
            if config.policy is not None:
                record = _policy_file(directory)
                _write_private(record, config.policy)
                os.environ["LCAP_POLICY_RECORD"] = str(record)  # this actor's process: what its Router reads
            self.outbox = Outbox(directory, AESGCM(config.key))
            self.proxy = CaptureProxy(None, config.options, writer=self.outbox, policy_key=config.policy_key)
            self.proxy.start()
        except LcapError as exc:
            self.error = str(exc)
        except Exception as exc:  # the driver says it in one line (episodes on this node end with it), no traceback
            self.error = f"{exc.__class__.__name__}: {_first_line(exc)}"
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
        """A new policy record (a deploy between two collects of a loop): written over this proxy's copy, which its
        Router reads again when the file changes. Returns once any call routed from now on is routed by it: the
        Router looks at the file at most `REFRESH_S` after its last look."""
        record = _policy_file(self._outbox().directory)
        tmp = record.with_name(record.name + ".tmp")
        _write_private(tmp, policy)
        tmp.replace(record)
        time.sleep(REFRESH_S)

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
    """The node proxy's copy of the policy record, beside its spool."""
    return spool.with_name(spool.name + ".policy.json")


def _write_private(path: Path, text: str) -> None:
    """`text` in a file only this user reads: a policy record may hold the replicas' key."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)


def _remove_dead_spools(root: Path) -> None:
    """Spools of node proxies that died: what they hold belongs to episodes that are run again (a finished
    episode's turns were all taken before it finished), so they are deleted, not replayed."""
    for path in root.glob("*-*"):
        pid = path.name.split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _start_proxy(config: NodeConfig, node_id: str) -> Any:
    """A node proxy pinned to `node_id`, owned by this process (it ends with it), starting."""
    handle: Any = _NodeProxyActor.options(
        num_cpus=0,
        max_concurrency=config.max_concurrency,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(config)
    handle.start.remote()
    return handle


class _Proxies:
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


# --- on each node: one episode ------------------------------------------------------------------------


@dataclass
class _Report:
    """What an episode's task returns: its outcome, or why the driver must run it again or stop."""

    outcome: EpisodeOutcome | None = None
    lost: str | None = None  # its node proxy went away mid-episode: run it again
    proxy_error: str | None = None  # the node's capture proxy could not start
    node: str = ""
    # Nothing ran: its node has no proxy yet ("") or the one there is dead (its actor id). The driver starts one
    # there and sends the episode back to that node.
    no_proxy: str | None = None
    node_id: str = ""


def _episode_task(
    run: str, started: list[Any], spec: EpisodeSpec, rules: EpisodeRules, archive: bytes | None
) -> _Report:
    """`started`: [a reference to the run's node proxies by node] (in a list, so that Ray passes the reference and
    the task reads it only if its worker has no proxy for this node yet)."""
    context = ray.get_runtime_context()
    node = context.get_node_id()
    where = f"{ray.util.get_node_ip_address()} ({node[:8]})"
    cached = (run, node)
    eid = spec.episode_id
    try:
        proxy: Any = _node_proxy.get(cached)
        if proxy is not None:
            try:
                env = ray.get(proxy.child_env.remote(eid, dict(os.environ)), timeout=CALL_S)
            except ray.exceptions.RayActorError:  # gone since an earlier episode here (proxies a loop keeps across
                # its collects): nothing of this episode ran yet, so the driver starts another and sends it back
                _node_proxy.pop(cached, None)
                return _Report(no_proxy=proxy._actor_id.hex(), node=where, node_id=node)
        else:
            proxy = ray.get(started[0], timeout=CALL_S).get(node)
            if proxy is None:  # a node that joined since the run's proxies started
                return _Report(no_proxy="", node=where, node_id=node)
            try:
                error = ray.get(proxy.ready.remote(), timeout=PROXY_START_S)
            except ray.exceptions.RayActorError:
                return _Report(no_proxy=proxy._actor_id.hex(), node=where, node_id=node)
            if error is not None:
                return _Report(proxy_error=error, node=where)
            _node_proxy.clear()  # a worker serves one run at a time: older runs' proxies are gone
            _node_proxy[cached] = proxy
            env = ray.get(proxy.child_env.remote(eid, dict(os.environ)), timeout=CALL_S)

        def adopt(child) -> None:
            ray.get(proxy.adopt.remote(eid, child.pid), timeout=CALL_S)

        def flush() -> bool:
            return ray.get(proxy.flush.remote(eid, FLUSH_S), timeout=FLUSH_S + CALL_S)

        try:
            outcome = run_episode(spec, env, rules, TaskFiles(Path.cwd(), archive), flush=flush, on_start=adopt)
        except ray.exceptions.RayError:
            raise
        except Exception as exc:  # lcap's own failure on one episode: recorded, the run goes on
            outcome = EpisodeOutcome("error", None, f"{exc.__class__.__name__}: {exc}")
        finally:
            proxy.release.remote(eid)
    except ray.exceptions.RayError as exc:
        _node_proxy.pop(cached, None)  # the next episode here looks for the node's proxy again
        return _Report(lost=f"its node's capture proxy was lost: {_first_line(exc)}", node=where)
    return _Report(outcome=outcome, node=where)


_node_proxy: dict[tuple[str, str], Any] = {}  # in a Ray worker: its node's proxy, asked for once per run


_episode_remote = ray.remote(_episode_task)


# --- on the driver: turns from the nodes into the store --------------------------------------------


@dataclass
class _Source:
    proxy: Any
    after: Position | None = None  # appended up to here (what the next take acknowledges)
    taking: Any = None  # the take in flight
    dead: bool = False


class _Ingest:
    """The driver's thread that takes the node proxies' turns and appends them to the one writer's spool."""

    def __init__(self, proxies: _Proxies, writer: TurnWriter, key: bytes) -> None:
        self.proxies, self.writer = proxies, writer
        self.source_cipher = AESGCM(key)
        self.sources: dict[str, _Source] = {}
        self.appending = threading.Lock()  # held while a batch is appended: `settle` waits for it
        self.lock = threading.Lock()  # over `sources`, which the driver's threads read
        self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lcap-ray-ingest", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CALL_S)

    def live(self) -> dict[str, Any]:
        with self.lock:
            return {node: s.proxy for node, s in self.sources.items() if not s.dead}

    def settle(self, timeout: float = FLUSH_S + 30) -> bool:
        """Every turn appended so far is in the store (False after `timeout`)."""
        with self.appending:
            pass
        return self.writer.flush(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._refresh()
                taking = {}
                for node, source in list(self.sources.items()):
                    if source.dead:
                        continue
                    if source.taking is None:
                        source.taking = source.proxy.take.remote(source.after, TAKE_RECORDS, TAKE_BYTES, TAKE_WAIT_S)
                    taking[source.taking] = node
                if not taking:
                    self._stop.wait(0.1)
                    continue
                ready, _ = ray.wait(list(taking), num_returns=1, timeout=TAKE_WAIT_S * 2)
                if ready:
                    ready, _ = ray.wait(list(taking), num_returns=len(taking), timeout=0)
                for ref in ready:
                    self._append(taking[ref], ref)
        except BaseException as exc:  # the run cannot go on without its turns: the driver stops on it
            self.error = exc
            log.error("lcap: the driver stopped taking turns from the nodes: %s", _first_line(exc))

    def _refresh(self) -> None:
        known = self.proxies.known()
        with self.lock:
            for key, proxy in known.items():
                self.sources.setdefault(key, _Source(proxy))

    def _append(self, node: str, ref: Any) -> None:
        source = self.sources[node]
        source.taking = None
        try:
            taken: Taken = ray.get(ref, timeout=CALL_S)
        except ray.exceptions.RayError as exc:
            log.warning("lcap: lost the capture proxy of node %s: %s", node[:8], _first_line(exc))
            with self.lock:
                source.dead = True
            self.proxies.forget(node)
            return
        with self.appending:
            for payload in taken.records:
                self.writer.put_sealed(reseal(self.source_cipher, self.writer.cipher, payload))
            source.after = taken.end
            self.records += len(taken.records)


class NodeProxies:
    """The node proxies of one or more collects and the hand-off of their turns to the store (the ingest thread and
    the one writer).

    A standalone `lcap collect --ray` has its own, stopped at its end. `lcap loop --ray` keeps one for all its
    collects (each round's and each held-out one): a node's proxy is started once, by the first collect that runs
    an episode there, and serves the loop's later collects too, instead of a new actor process per node and
    collect. What stays per collect is what always was per episode: its credentials in the proxy URL (the turns'
    episode, hence their round and split) and its flush. A deploy between two collects reaches the running
    proxies through `prepare` (the new policy record, written over each proxy's copy) before any episode of the
    next collect starts. Options that proxies are started with (the proxy options, the concurrency bound, the
    replicas' key) cannot change under a running proxy: a collect that asks for others stops these and starts
    new ones. Each collect also starts proxies on nodes that joined since (and on those whose proxy was lost)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.proxies: _Proxies | None = None
        self.ingest: _Ingest | None = None
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
        self.ingest = _Ingest(self.proxies, self.writer, config.key)
        self.ingest.start()

    def close(self) -> None:
        """Stop every node proxy (each kills the agents left on its node; the ingest takes their last turns
        meanwhile), then the writer. Safe to call twice; Ctrl-C does not interrupt it."""
        if self.proxies is None:
            return
        proxies, ingest, writer = self.proxies, self.ingest, self.writer
        self.proxies = self.ingest = self.writer = None
        self._shape = self._policy = None
        with _ignoring_sigint():
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


def _stop_proxies(ingest: _Ingest) -> None:
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


# --- on the driver: the pool ----------------------------------------------------------------------------


@dataclass
class _Attempt:
    spec: EpisodeSpec
    number: int = 1
    errors: list[str] = field(default_factory=list)
    pin: str | None = None  # the node it is sent to (soft affinity)
    moves: int = 0  # times it was sent back to a node that had no proxy yet


class RayPool:
    """Runs a collect's episodes as Ray tasks; records their outcomes as the local pool does."""

    def __init__(
        self,
        store: Store,
        rules: EpisodeRules,
        tasks_dir: Path,
        options: CollectOptions,
        proxy_options: ProxyOptions,
        tally: Tally,
        node_proxies: NodeProxies | None = None,
    ) -> None:
        """`node_proxies`: the node proxies to run on, kept by the caller across several collects (`lcap loop`);
        None: this collect's own, stopped at its end."""
        self.store, self.rules, self.tasks_dir, self.options, self.tally = store, rules, tasks_dir, options, tally
        self.proxy_options = proxy_options
        self.node_proxies = node_proxies
        self.need = {"CPU": options.episode_cpus, **options.resources()}
        if not options.episode_cpus:
            del self.need["CPU"]

    def run_all(self, specs: list[EpisodeSpec], *, progress: bool) -> None:
        nodes = self._nodes_that_fit()
        policy, policy_key = self._policy_record()
        proxies = self.node_proxies or NodeProxies(self.store)
        if proxies.store.path != self.store.path:  # their writer would store this collect's turns elsewhere
            raise ValueError(f"node proxies of {proxies.store.path} used for a collect into {self.store.path}")
        # Fewer episodes than nodes: they go to as many nodes (soft affinity: elsewhere if that node is lost), those
        # with a proxy first, and only those nodes start one.
        pins = proxies.with_proxy(nodes)[: len(specs)] if len(specs) < len(nodes) else []
        try:
            proxies.prepare(
                self.proxy_options,
                max_concurrency=min(self.options.concurrency, 4096) + 16,
                policy=policy,
                policy_key=policy_key,
                name=self.tally.result.run_id,
                nodes=pins or nodes,
            )
            run = _Run(self, proxies, ray.put(self.rules), _Templates(self.tasks_dir, specs), pins)
            run.schedule(specs, progress)
        finally:
            if proxies is not self.node_proxies:
                proxies.close()

    def _nodes_that_fit(self) -> list[str]:
        """The ids of the live nodes that can run an episode. A cluster where none can would queue the episodes
        forever: that is an error now."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        fit = [n["NodeID"] for n in nodes if _fits(n.get("Resources", {}), self.need)]
        if fit:
            return fit
        have = "; ".join(_resources_text(n.get("Resources", {})) for n in nodes) or "no live node"
        raise LcapError(
            f"no node of the Ray cluster at {describe(self.options.ray or '')} can run an episode, which needs "
            f"{_resources_text(self.need)} (nodes: {have}): lower --episode-cpus, or add nodes with these resources"
        )

    def _policy_record(self) -> tuple[str | None, str | None]:
        """The policy record and its replicas' key (read here, where the record's key file is), for the nodes'
        proxies (`--upstream policy`); the replicas must be reachable from the nodes."""
        if self.proxy_options.upstream != "policy":
            return None, None
        record = read_policy()
        if record is None:
            raise LcapError(f"--upstream policy: no policy server record at {record_path()} (run `lcap serve`)")
        try:
            key = record.api_key()
        except OSError as exc:
            raise LcapError(
                f"--upstream policy: cannot read the policy replicas' key {record.api_key_file} "
                f"({exc.strerror or exc}): is this the machine `lcap serve` ran on?"
            ) from None
        return record_path().read_text(), key


class _Run:
    """One run of the pool: the episodes in flight, their retries, Ctrl-C."""

    def __init__(
        self, pool: RayPool, proxies: NodeProxies, rules_ref: Any, templates: _Templates, pins: list[str]
    ) -> None:
        assert proxies.ingest is not None
        self.pool, self.proxies, self.ingest = pool, proxies, proxies.ingest
        self.rules_ref, self.templates = rules_ref, templates
        self.pins = pins
        self.store, self.tally = pool.store, pool.tally
        self.inflight: dict[Any, _Attempt] = {}
        self.waiting_since: float | None = None

    def schedule(self, specs: list[EpisodeSpec], progress: bool) -> None:
        queue = deque(
            _Attempt(spec, pin=self.pins[i % len(self.pins)] if self.pins else None) for i, spec in enumerate(specs)
        )
        with RunProgress(progress, self.tally, len(specs)) as shown:
            ended = shown.ended
            try:
                while queue or self.inflight:
                    self._fill(queue, ended)
                    self.tally.running = len(self.inflight)
                    shown.refresh()
                    if self.ingest.error is not None:
                        raise LcapError(f"the turns of the nodes cannot reach the store: {self.ingest.error}")
                    finished, lost, moved = self._collect()
                    for attempt, report in moved:
                        self._move(attempt, report, queue, ended)
                    self._fill(queue, ended)  # the slots of the episodes that ended, before waiting for their turns
                    self._record(finished, ended)
                    for attempt, why in lost:
                        self._retry(attempt, why, queue, ended)
                    self._warn_if_stuck()
            except BaseException:
                self._interrupt(ended)
                raise

    def _fill(self, queue: deque[_Attempt], ended) -> None:
        while queue and len(self.inflight) < self.pool.options.concurrency:
            self._submit(queue.popleft(), ended)

    def _submit(self, attempt: _Attempt, ended) -> None:
        spec = attempt.spec
        try:
            archive = self.templates.ref(spec, again=attempt.number > 1 or attempt.moves > 0)
        except LcapError as exc:  # as the local pool: an episode whose workdir cannot be set up is an error
            start_episode(self.store, spec)
            self._finish(spec, EpisodeOutcome("error", None, f"{exc.__class__.__name__}: {exc}"), ended)
            return
        start_episode(self.store, spec)
        pin = attempt.pin
        ref = _episode_remote.options(
            num_cpus=self.pool.options.episode_cpus,
            resources=self.pool.options.resources(),
            max_retries=0,  # a lost episode is run again by the driver, after its partial turns are removed
            retry_exceptions=False,
            scheduling_strategy=NodeAffinitySchedulingStrategy(pin, soft=True) if pin else "DEFAULT",
        ).remote(self.proxies.run, self.proxies.started, spec, self.rules_ref, archive)
        self.inflight[ref] = attempt

    def _collect(
        self,
    ) -> tuple[list[tuple[_Attempt, _Report]], list[tuple[_Attempt, str]], list[tuple[_Attempt, _Report]]]:
        """The episodes that ended: finished, lost with their node or runner, and sent back for want of a proxy."""
        refs = list(self.inflight)
        if not refs:
            return [], [], []
        ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        finished, lost, moved = [], [], []
        for ref in ready:
            attempt = self.inflight.pop(ref)
            try:
                report: _Report = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the task's own code failed: an error, as locally
                report = _Report(EpisodeOutcome("error", None, f"lcap on the node: {_first_line(exc)}"))
            except ray.exceptions.TaskCancelledError:
                report = _Report(EpisodeOutcome("interrupted", None, "collect was interrupted"))
            except ray.exceptions.RayError as exc:  # its node or worker died
                lost.append((attempt, f"{type(exc).__name__}: {_first_line(exc)}"))
                continue
            if report.no_proxy is not None:
                moved.append((attempt, report))
                continue
            if report.proxy_error is not None:
                raise LcapError(
                    f"the capture proxy on node {report.node} did not start: {report.proxy_error} (the upstream must "
                    "be reachable from every node that runs agents)"
                )
            if report.lost is not None:
                lost.append((attempt, report.lost))
                continue
            finished.append((attempt, report))
        return finished, lost, moved

    def _record(self, finished: list[tuple[_Attempt, _Report]], ended) -> None:
        if not finished:
            return
        # Each task's node flushed its turns to this process before it returned: once the writer has them all,
        # its episode is complete in the store and can be marked finished.
        stored = self.ingest.settle()
        for attempt, report in finished:
            outcome = report.outcome
            assert outcome is not None
            if not stored:
                outcome.flags.append(("turns_unstored", {"reason": "the store writer did not keep up"}))
            self._finish(attempt.spec, outcome, ended)

    def _finish(self, spec: EpisodeSpec, outcome: EpisodeOutcome, ended) -> None:
        record_outcome(self.store, spec, outcome)
        self.tally.add(outcome)
        ended(spec, outcome)

    def _move(self, attempt: _Attempt, report: _Report, queue: deque[_Attempt], ended) -> None:
        """An episode that found no live proxy on its node (nothing of it ran): a proxy started there, and the
        episode sent back to that node, first in line."""
        attempt.moves += 1
        if attempt.moves > MAX_MOVES:
            reason = f"no capture proxy could be started on node {report.node} for it ({MAX_MOVES} tries)"
            self._finish(attempt.spec, EpisodeOutcome("error", None, reason), ended)
            return
        self.proxies.replace(report.node_id, report.no_proxy or None)
        attempt.pin = report.node_id
        queue.appendleft(attempt)

    def _retry(self, attempt: _Attempt, why: str, queue: deque[_Attempt], ended) -> None:
        """An episode whose node (or runner) was lost: its partial turns removed, run again or given up."""
        spec = attempt.spec
        attempt.errors.append(why)
        log.warning("lcap: episode %s lost (%s); %s", spec.episode_id, why, "running it again")
        self._fence([spec.episode_id])
        if attempt.number >= MAX_ATTEMPTS:
            reason = f"lost {attempt.number} times with its node: {'; '.join(attempt.errors)}"
            self._finish(spec, EpisodeOutcome("error", None, reason), ended)
            return
        forget_partial(self.store, [spec.episode_id])
        queue.appendleft(_Attempt(spec, attempt.number + 1, attempt.errors))

    def _fence(self, episode_ids: list[str]) -> None:
        """Make sure nothing more of these episodes' attempts reaches the store: their agents killed on every live
        node proxy and their last turns taken (a proxy that is gone sends nothing more), then stored."""
        calls = [proxy.fence.remote(episode_ids, FLUSH_S) for proxy in self.ingest.live().values()]
        for ref in calls:
            try:
                handed = ray.get(ref, timeout=FLUSH_S + CALL_S)
            except ray.exceptions.RayError:
                continue
            if not handed:
                log.warning("lcap: a node proxy did not hand over the turns of %s in time", ", ".join(episode_ids))
        self.ingest.settle()

    def _warn_if_stuck(self) -> None:
        """Episodes that no live node can run wait for one to join (an autoscaler may add it): said once a minute."""
        if not self.inflight:
            self.waiting_since = None
            return
        now = time.monotonic()
        if self.waiting_since is not None and now - self.waiting_since < 60:
            return
        self.waiting_since = now
        if not any(_fits(n.get("Resources", {}), self.pool.need) for n in ray.nodes() if n.get("Alive")):
            log.warning(
                "lcap: no live node of the Ray cluster can run an episode now (each needs %s): waiting for one",
                _resources_text(self.pool.need),
            )

    def _interrupt(self, ended) -> None:
        """Ctrl-C (or a failure of the run): the node proxies end the agents' process groups, the tasks are cancelled
        (their workers killed), and the episodes in flight are recorded as interrupted."""
        refs = list(self.inflight)
        with _ignoring_sigint():
            kills = [proxy.kill_all.remote() for proxy in self.ingest.live().values()]
            if kills:
                ray.wait(kills, num_returns=len(kills), timeout=CALL_S)
            for ref in refs:
                ray.cancel(ref, force=True, recursive=True)
            self.ingest.settle(timeout=10)
            for attempt in self.inflight.values():
                self._finish(attempt.spec, EpisodeOutcome("interrupted", None, "collect was interrupted"), ended)
            self.inflight.clear()


class _ignoring_sigint:
    """The clean-up after Ctrl-C runs to its end; a second Ctrl-C during it would leave agents running."""

    def __enter__(self) -> None:
        try:
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread
            self.previous = None

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class _Templates:
    """Each task's template directory as a tar archive in Ray's object store: packed when its first episode is
    submitted, released after its last, so that a run holds few at a time."""

    def __init__(self, tasks_dir: Path, specs: Iterable[EpisodeSpec]) -> None:
        self.tasks_dir = tasks_dir
        self.left = Counter(spec.task["id"] for spec in specs)
        self.refs: dict[str, Any] = {}

    def ref(self, spec: EpisodeSpec, *, again: bool = False) -> Any:
        src = source_dir(spec.task, self.tasks_dir)
        if src is None:
            return None
        tid = spec.task["id"]
        ref = self.refs.get(tid)
        if ref is None:
            ref = ray.put(pack_template(src, spec.task))
            self.refs[tid] = ref
        if not again:
            self.left[tid] -= 1
            if self.left[tid] <= 0:
                self.refs.pop(tid, None)  # the tasks submitted hold it while they need it
        return ref


def pack_template(src: Path, task: Mapping[str, Any]) -> bytes:
    """`src`'s contents as an uncompressed tar (symlinks kept as links); bounded by MAX_TEMPLATE_BYTES."""
    total = 0

    def count(info: tarfile.TarInfo) -> tarfile.TarInfo:
        nonlocal total
        total += info.size
        if total > MAX_TEMPLATE_BYTES:
            raise LcapError(
                f"task {task['id']}: template {src} is over {MAX_TEMPLATE_BYTES >> 20} MiB, too large to ship with "
                "each episode: put it in the nodes' image and copy it from the agent command"
            )
        return info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name, filter=count)
    return buffer.getvalue()


def _fits(have: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(have.get(name, 0) >= amount for name, amount in need.items())


def _resources_text(resources: Mapping[str, float]) -> str:
    hidden = ("memory", "object_store_memory")
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "accelerator_type:")) and k not in hidden}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(shown.items())) or "nothing"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__
