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
  crosses nodes to be captured and TLS ends where the agent runs. `NodeProxies` (node_proxies.py) holds them
  with the hand-off below: a collect's own, or the one `lcap loop --ray` keeps across its collects (the
  proxies then start once per node and loop, and take each deploy's record).
* The proxy's turns go to an `Outbox` (capture/storage/outbox.py), a spool on the node sealed with this run's
  hand-off key, and the driver's `Ingest` (capture/storage/ingest.py) takes them in bounded batches, reseals
  them with this home's spool key and appends them to its own `TurnWriter`: the one store writer, with its row
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
import tarfile
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lcap.capture import ProxyOptions
from lcap.config import LcapError
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
from lcap.dataset.collect.node_proxies import CALL_S, PROXY_START_S, NodeProxies, first_line, ignoring_sigint
from lcap.dataset.collect.workspaces import source_dir
from lcap.dataset.options import CollectOptions
from lcap.policy import read_policy, record_path
from lcap.ray_cluster import describe
from lcap.store import Store

log = logging.getLogger("lcap.dataset")

MAX_ATTEMPTS = 3  # runs of one episode whose node was lost, before it is recorded as an error
MAX_MOVES = 3  # times one episode is sent back to a node whose proxy was missing, before it is an error
FLUSH_S = 30.0  # an episode's turns reaching the driver after its agent ended
MAX_TEMPLATE_BYTES = 1 << 30  # a template directory shipped through the object store


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
        return _Report(lost=f"its node's capture proxy was lost: {first_line(exc)}", node=where)
    return _Report(outcome=outcome, node=where)


_node_proxy: dict[tuple[str, str], Any] = {}  # in a Ray worker: its node's proxy, asked for once per run


_episode_remote = ray.remote(_episode_task)


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
            run = _Run(
                self, proxies, ray.put(self.rules), _Templates(self.tasks_dir, specs, self.options.tasks_root), pins
            )
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
                report = _Report(EpisodeOutcome("error", None, f"lcap on the node: {first_line(exc)}"))
            except ray.exceptions.TaskCancelledError:
                report = _Report(EpisodeOutcome("interrupted", None, "collect was interrupted"))
            except ray.exceptions.RayError as exc:  # its node or worker died
                lost.append((attempt, f"{type(exc).__name__}: {first_line(exc)}"))
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
        with ignoring_sigint():
            kills = [proxy.kill_all.remote() for proxy in self.ingest.live().values()]
            if kills:
                ray.wait(kills, num_returns=len(kills), timeout=CALL_S)
            for ref in refs:
                ray.cancel(ref, force=True, recursive=True)
            self.ingest.settle(timeout=10)
            for attempt in self.inflight.values():
                self._finish(attempt.spec, EpisodeOutcome("interrupted", None, "collect was interrupted"), ended)
            self.inflight.clear()


class _Templates:
    """Each task's template directory as a tar archive in Ray's object store: packed when its first episode is
    submitted, released after its last, so that a run holds few at a time."""

    def __init__(self, tasks_dir: Path, specs: Iterable[EpisodeSpec], root: Path | None = None) -> None:
        self.tasks_dir, self.root = tasks_dir, Path(root).resolve() if root is not None else None
        self.left = Counter(spec.task["id"] for spec in specs)
        self.refs: dict[str, Any] = {}

    def ref(self, spec: EpisodeSpec, *, again: bool = False) -> Any:
        src = source_dir(spec.task, self.tasks_dir, self.root)
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
