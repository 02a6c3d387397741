"""`lcap collect`: run an unmodified agent on every task, `group_size` times, through one capture proxy.

One in-process capture proxy serves the whole run (DuckDB admits one writing process, so the
agents must not each start their own); each child is attributed to its episode through the proxy
URL's credentials. Episodes run in a local thread pool, each in its own working directory, its
whole process group killed on timeout. After the agent, the tamper guard and the verifier run
outside it, and the episode is recorded with its status and reason: never dropped.

An episode id is the collect run's id (a hash of the command template, the tasks file and the
verifier), the key (round, split, task id, sample index) and a random part, so that no agent can
guess another's. Re-running the same collect finds its earlier episodes in the store by their
labels (collect, round, split, task, sample) and keeps their ids: it skips the ones finished;
ones left running or interrupted are run again, their partial turns deleted first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lcap.capture import CaptureProxy, ProxyOptions, Sandbox, closed_folder, ensure_node_capture, sandbox_limits
from lcap.capture import missing as sandbox_missing
from lcap.config import LcapError
from lcap.dataset.collect.episode import (
    CollectResult,
    EpisodeOutcome,
    EpisodeRules,
    EpisodeSpec,
    RunProgress,
    Tally,
    TaskFiles,
    record_outcome,
    run_episode,
    start_episode,
    unfinished,
)
from lcap.dataset.collect.summary import summarize
from lcap.dataset.collect.verifiers import load_verifier, resolve_argv
from lcap.dataset.collect.workspaces import check_paths
from lcap.dataset.judge.prompt import is_judge
from lcap.dataset.judge.run import JudgeResult, check_judge, judge_episodes
from lcap.dataset.options import CollectOptions
from lcap.display import printable
from lcap.processes import kill_group
from lcap.ray_cluster import connect
from lcap.store import Store

if TYPE_CHECKING:
    from lcap.dataset.collect.on_ray import NodeProxies

log = logging.getLogger("lcap.dataset")

_SHELLS = {"sh", "bash", "zsh", "dash", "ksh"}
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """JSONL rows, each an object with an `id`; ids are compared as strings and must be unique."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise LcapError(f"cannot read tasks {path}: {exc.strerror or exc}") from None
    tasks, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LcapError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(task, dict) or task.get("id") in (None, ""):
            raise LcapError(f"{path}:{n}: a task must be a JSON object with an 'id'")
        task["id"] = str(task["id"])
        if task["id"] in seen:
            raise LcapError(f"{path}:{n}: duplicate task id {task['id']!r}")
        seen.add(task["id"])
        tasks.append(task)
    if not tasks:
        raise LcapError(f"{path}: no tasks")
    return tasks


def render_command(template: Sequence[str], values: Mapping[str, Any]) -> list[str]:
    """Substitute `{field}` in each argument; in a `sh -c` script the value is shell-quoted."""
    shell = bool(template) and Path(template[0]).name in _SHELLS
    out = []
    for i, arg in enumerate(template):
        quote = shell and i > 0 and template[i - 1] == "-c"

        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name not in values:
                raise LcapError(
                    f"placeholder {{{name}}} in the command is not a task field (fields: {', '.join(sorted(values))})"
                )
            value = values[name]
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return shlex.quote(text) if quote else text

        out.append(_PLACEHOLDER.sub(sub, arg))
    return out


def collect_run_id(command: Sequence[str], tasks: Path, verifier: str | None) -> str:
    key = json.dumps([list(command), str(Path(tasks).resolve()), verifier or ""])
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def episode_id(run_id: str, round: int, split: str, task_id: str, sample: int, nonce: str = "") -> str:
    """The id of an episode of a collect; `nonce` is its random part (`plan_collect` draws one)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", task_id)
    if safe != task_id or len(safe) > 48:
        safe = safe[:40] + "-" + hashlib.sha1(task_id.encode()).hexdigest()[:7]
    return f"c{run_id}-r{round}-{split}-{safe}-{sample}" + (f"-{nonce}" if nonce else "")


def earlier_episodes(store: Store, run_id: str, round: int, split: str) -> dict[tuple[str, int], str]:
    """(task id, sample) -> id of the episode an earlier run of this collect recorded for it (the latest)."""
    rows = store.fetchall(
        "SELECT labels->>'task', labels->>'sample', episode_id FROM episodes WHERE labels->>'collect' = ? "
        "AND labels->>'round' = ? AND labels->>'split' = ? ORDER BY started_at",
        [run_id, str(round), split],
    )
    return {(task, int(sample)): eid for task, sample, eid in rows if sample is not None and sample.isdigit()}


def check_round_is_free(
    store: Store, run_id: str, round: int, split: str, *, replace: bool = False, echo: Callable[[str], None] = print
) -> None:
    """Refuse to collect a round and split the store already holds episodes of from another collect (another
    command, tasks file or verifier; a manual `lcap collect --round N` beside a loop): this one's episodes would
    supersede them (the latest episode of a task and sample trains) and the round would mix two runs. The same
    collect run again (its run id) resumes and is never refused. With `replace` (`--replace`), say how many it
    supersedes and go on. `lcap collect` and both loops collect through here."""
    rows = store.fetchall(
        "SELECT count(*), any_value(collect_run) FROM episode_summary "
        "WHERE round = ? AND split = ? AND collect_run IS DISTINCT FROM ?",
        [round, split, run_id],
    )
    count, other = rows[0] if rows else (0, None)
    if not count:
        return
    source = f"collect {other}" if other else "not from `lcap collect`"
    held = f"round {round} ({split}) already has {count} episodes of another collect in this store ({source})"
    if replace:
        echo(f"{held}: collect {run_id} supersedes them (--replace)")
        return
    raise LcapError(
        f"{held}: collect {run_id} would supersede them and the round would mix two runs; collect into a store of "
        "its own (--db), or add --replace to supersede them"
    )


@dataclass
class CollectPlan:
    """A collect's episodes, before any runs: what `collect` runs at once and the async loop's pool runs as they
    are admitted (one definition of episode ids, commands, labels and rules for both)."""

    run_id: str
    run_dir: Path
    specs: list[EpisodeSpec]
    rules: EpisodeRules
    files: TaskFiles


def plan_collect(
    *, tasks: Path, command: list[str], options: CollectOptions, labels: Mapping[str, str] = {}, store: Store
) -> CollectPlan:
    """Every episode of `tasks` x `options.group_size` for `options.round` and `options.split`, in task order; an
    episode an earlier run recorded in `store` keeps its id."""
    tasks = Path(tasks)
    task_rows = load_tasks(tasks)
    files = TaskFiles(tasks.parent.resolve(), root=Path(options.tasks_root).resolve() if options.tasks_root else None)
    for task in task_rows:
        check_paths(task, files.tasks_dir, files.root)
    base = Path.cwd()
    template = resolve_argv(command, base)
    # a judge is no per-episode verifier: it judges stored episodes once the agents ran (`judge_collected`)
    judge = load_verifier(options.verifier, base=base) if options.verifier and not is_judge(options.verifier) else None
    if judge is not None:
        judge.timeout = options.verifier_timeout
    guard = tuple(options.protect) + (judge.protected if judge else ())
    run_id = collect_run_id(command, tasks, options.verifier)
    run_dir = Path(options.run_dir or base / "lcap-runs" / f"collect-{run_id}").resolve()
    round, split = options.round, options.split
    earlier = earlier_episodes(store, run_id, round, split)

    specs = []
    for task in task_rows:
        for sample in range(options.group_size):
            eid = earlier.get((task["id"], sample)) or episode_id(
                run_id, round, split, task["id"], sample, secrets.token_hex(8)
            )
            edir = run_dir / f"round-{round}" / eid
            values = {
                **task,
                "episode_id": eid,
                "sample": sample,
                "round": round,
                "split": split,
                "workdir": str(edir / "work"),
                "cwd": str(base),
            }
            specs.append(
                EpisodeSpec(
                    episode_id=eid,
                    task=task,
                    sample=sample,
                    argv=render_command(template, values),
                    dir=edir,
                    labels={
                        **labels,
                        "task": task["id"],
                        "round": str(round),
                        "sample": str(sample),
                        "split": split,
                        "collect": run_id,
                        **({"sandbox": "true"} if options.sandbox else {}),  # rescore verifies it sandboxed too
                    },
                )
            )
    return CollectPlan(
        run_id, run_dir, specs, EpisodeRules(judge, guard, options.timeout, options.verify_failed), files
    )


def collect_proxy_options(options: CollectOptions, proxy_options: ProxyOptions | None) -> ProxyOptions:
    """The capture proxy's options for a collect: `proxy_options`' limits, `options`' upstream and model, and
    whether its agents are sandboxed (it then connects to no private address but the upstream's)."""
    return replace(
        proxy_options or ProxyOptions(),
        upstream=options.upstream,
        model=options.model,
        transparent=options.transparent,
        sandbox=options.sandbox,
    )


def collect_episodes(
    store: Store,
    *,
    tasks: Path,
    command: list[str],
    options: CollectOptions = CollectOptions(),
    labels: Mapping[str, str] = {},
    progress: bool | None = None,
    proxy_options: ProxyOptions | None = None,
    node_proxies: NodeProxies | None = None,
) -> CollectResult:
    """Run `command` group_size times per task through one capture proxy, verify, record every episode.
    `proxy_options` sets the proxy's limits and timeouts; its upstream and model are `options`'. `node_proxies`
    (with `options.ray`): node proxies that the caller keeps across its collects, in place of this collect's own."""
    if not command:
        raise LcapError("no agent command (put it after --)")
    if options.ray is not None:  # an unreachable cluster is a one-line error before anything runs
        connect(options.ray)
    elif options.episode_resources or options.episode_cpus != 1.0:
        raise LcapError("--episode-cpus and --episode-resources place episodes on a Ray cluster: add --ray ADDRESS")
    if is_judge(options.verifier):  # no rubric or no judge endpoint: a one-line error before any agent runs
        check_judge(options.verifier or "", options)
    if not options.transparent:  # in its namespace every call reaches lcap: Node needs no preload there
        ensure_node_capture(command)
    plan = plan_collect(tasks=tasks, command=command, options=options, labels=labels, store=store)
    check_round_is_free(store, plan.run_id, options.round, options.split, replace=options.replace)
    specs = plan.specs
    result = CollectResult(episodes=len(specs), run_id=plan.run_id, run_dir=str(plan.run_dir))
    todo = unfinished(store, specs)
    result.skipped = len(specs) - len(todo)
    tally = Tally(result)
    if todo:
        proxy_options = collect_proxy_options(options, proxy_options)
        show = sys.stderr.isatty() if progress is None else progress
        if options.ray is not None:
            from lcap.dataset.collect.on_ray import RayPool  # the ray extra

            RayPool(store, plan.rules, plan.files.tasks_dir, options, proxy_options, tally, node_proxies).run_all(
                todo, progress=show
            )
        else:
            _run_local(store, todo, plan, tally, proxy_options, options, show)
    if is_judge(options.verifier):
        result.judge = judge_collected(store, specs, options)
        rewards = [*result.judge.rewards, *tally.rewards]
        result.mean_reward = sum(rewards) / len(rewards) if rewards else None
    result.summary = summarize(
        store,
        [s.episode_id for s in specs],
        plan.run_dir,
        options.round,
        options.transparent,
        {s.episode_id: s.task for s in specs},
    )
    return result


def judge_collected(store: Store, specs: Sequence[EpisodeSpec], options: CollectOptions) -> JudgeResult:
    """`--verifier judge:RUBRIC.md`: judge the collect's episodes that ended ok and have no reward yet (a rerun
    judges again those a failed judge call left unrewarded)."""
    assert options.verifier is not None
    rows = store.fetchall(
        "SELECT episode_id FROM episode_summary WHERE episode_id IN (SELECT unnest(?)) AND status = 'ok' "
        "AND reward IS NULL",
        [[s.episode_id for s in specs]],
    )
    tasks = {str(s.task["id"]): s.task for s in specs}
    return judge_episodes(
        store, [r[0] for r in rows], options, options.verifier, source=options.verifier.strip(), tasks=tasks
    )


def _run_local(
    store: Store,
    todo: list[EpisodeSpec],
    plan: CollectPlan,
    tally: Tally,
    proxy_options: ProxyOptions,
    options: CollectOptions,
    show: bool,
) -> None:
    """The local pool: one capture proxy in this process, `--concurrency` episodes at a time on threads."""
    if options.sandbox and (reason := sandbox_missing()):  # before the proxy starts: a one-line error
        raise LcapError(reason)
    proxy = CaptureProxy(store, proxy_options)
    proxy.start()
    try:
        sandbox = _sandbox(options, proxy, store, plan)
        try:
            _Runner(store, proxy, plan.rules, plan.files, tally, sandbox=sandbox).run_all(
                todo, options.concurrency, progress=show
            )
        finally:
            if sandbox is not None:
                sandbox.close()
    finally:
        proxy.stop()


def _sandbox(options: CollectOptions, proxy: CaptureProxy, store: Store, plan: CollectPlan) -> Sandbox | None:
    """--sandbox's shared part: what every episode's sandbox hides (lcap's home, the store's folder, the run
    folder with the other episodes' workspaces, the store's files) and the proxy that serves their listeners.
    Refused when the sandbox's user cannot reach the run folder or the agent's command."""
    limits = sandbox_limits(options)
    if limits is None:
        return None
    run_dir = plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_reachable(plan)
    return Sandbox(limits, proxy, [run_dir], [Path(store.path)], cache=run_dir)


def _check_reachable(plan: CollectPlan) -> None:
    """A one-line error naming the first folder the sandbox's user (nobody) cannot enter on the way to the run
    folder (the workspaces are in it), to a file the agent's command names, or to $LCAP_HARNESS_DIR when set
    (scripts/harnesses/); else every episode would fail on its own, unable to start in its workspace."""
    ways: dict[Path, tuple[str, str]] = {
        plan.run_dir.parent: (f"the run folder {plan.run_dir}", "use a --run-dir elsewhere")
    }
    named = {arg for spec in plan.specs for arg in spec.argv if os.path.isabs(arg) and os.path.isfile(arg)}
    for arg in sorted(named):
        real = Path(arg).resolve()
        shown = arg if str(real) == arg else f"{arg} ({real})"
        ways.setdefault(real.parent, (f"{shown}, in the agent's command", "put it elsewhere"))
    harnesses = os.environ.get("LCAP_HARNESS_DIR")
    if harnesses and os.path.isdir(harnesses):
        ways.setdefault(Path(harnesses).resolve(), (f"LCAP_HARNESS_DIR {harnesses}", "install the harnesses elsewhere"))
    closed = closed_folder(list(ways))
    if closed is None:
        return
    what, fix = next(way for folder, way in ways.items() if folder == closed or closed in folder.parents)
    raise LcapError(
        f"--sandbox runs the agent as nobody, who cannot enter {closed} on the way to {what}: {fix}, or chmod o+x {closed}"
    )


class _Runner:
    """Runs episodes on a thread pool against one local capture proxy."""

    def __init__(
        self,
        store: Store,
        proxy,
        rules: EpisodeRules,
        files: TaskFiles,
        tally: Tally,
        stopping: threading.Event | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        self.store, self.proxy, self.rules, self.files, self.tally = store, proxy, rules, files, tally
        self.sandbox = sandbox
        self.running: dict[str, subprocess.Popen] = {}
        self.stopping = stopping or threading.Event()

    def run_all(self, specs: list[EpisodeSpec], concurrency: int, *, progress: bool) -> None:
        with (
            RunProgress(progress, self.tally, len(specs)) as shown,
            ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lcap-episode") as pool,
        ):
            futures = {pool.submit(self.run_one, spec): spec for spec in specs}
            try:
                for future in as_completed(futures):
                    shown.ended(futures[future], future.result())
            except KeyboardInterrupt:
                self.stopping.set()
                for f in futures:
                    f.cancel()
                self.kill_all()
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def kill_all(self) -> None:
        with self.tally.lock:
            children = list(self.running.values())
        for child in children:
            kill_group(child.pid)

    def run_one(self, spec: EpisodeSpec) -> EpisodeOutcome | None:
        if self.stopping.is_set():
            return None
        eid = spec.episode_id

        def started(child: subprocess.Popen) -> None:
            with self.tally.lock:
                self.running[eid] = child
                self.tally.running = len(self.running)

        try:
            start_episode(self.store, spec)
            with self.proxy.episode_child(eid, spec.argv) as agent:
                outcome = run_episode(
                    spec,
                    agent.env,
                    self.rules,
                    self.files,
                    flush=lambda: self.proxy.flush(eid),
                    on_start=started,
                    stopping=self.stopping.is_set,
                    agent=agent,
                    sandbox=self.sandbox,
                )
        except Exception as exc:  # lcap's own failure on one episode: recorded, the run goes on
            outcome = EpisodeOutcome("error", None, f"{exc.__class__.__name__}: {exc}")
        finally:
            with self.tally.lock:
                self.running.pop(eid, None)
                self.tally.running = len(self.running)
        record_outcome(self.store, spec, outcome)
        self.tally.add(outcome)
        return outcome


class EpisodePool:
    """Episodes run as they are submitted, `concurrency` at a time, through one capture proxy for the pool's whole
    life: the async loop's producer (loop/overlap.py). Each episode runs, is verified and is recorded exactly as in
    `lcap collect` (`_Runner.run_one`); the pool adds the submission, a wake-up when an episode ends, and the
    measure of its idle slots."""

    def __init__(
        self, store: Store, options: CollectOptions, proxy_options: ProxyOptions | None, concurrency: int
    ) -> None:
        self.store, self.concurrency, self.options = store, concurrency, options
        if is_judge(options.verifier):
            raise LcapError("--verifier judge: is not supported by lcap loop --async yet: use lcap loop")
        if options.sandbox and (reason := sandbox_missing()):
            raise LcapError(reason)
        self.proxy = CaptureProxy(store, collect_proxy_options(options, proxy_options))
        self.result = CollectResult()
        self.tally = Tally(self.result)
        self.stopping = threading.Event()
        self.ended = threading.Condition()  # notified whenever an episode ends
        self._runners: list[_Runner] = []
        self._sandboxes: dict[Path, Sandbox | None] = {}
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lcap-episode")
        self._busy = 0
        self._idle = 0.0  # slot-seconds with no episode running in the slot
        self._since = time.monotonic()
        self._clock = threading.Lock()

    def __enter__(self) -> EpisodePool:
        self.proxy.start()
        self._since = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def submit(self, plan: CollectPlan, specs: Sequence[EpisodeSpec]) -> int:
        """Queue `specs` (of `plan`) that have not finished yet, an interrupted attempt's turns forgotten first;
        returns how many were queued."""
        todo = unfinished(self.store, specs)
        if not todo:
            return 0
        sandbox = self._sandboxes.get(plan.run_dir)  # one per run folder: its workspaces' lower layers made once
        if sandbox is None:
            sandbox = self._sandboxes[plan.run_dir] = _sandbox(self.options, self.proxy, self.store, plan)
        runner = _Runner(
            self.store, self.proxy, plan.rules, plan.files, self.tally, stopping=self.stopping, sandbox=sandbox
        )
        self._runners.append(runner)
        for spec in todo:
            self._pool.submit(self._run, runner, spec)
        return len(todo)

    def idle_seconds(self) -> float:
        """Idle slot-seconds so far, over the slots: the seconds the whole pool would have stood idle."""
        with self._clock:
            self._tick()
            return self._idle / self.concurrency

    def stop(self) -> None:
        """Kill the episodes in flight (recorded as interrupted; a later run reruns them) and drop queued ones."""
        self.stopping.set()
        for runner in self._runners:
            runner.kill_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for sandbox in self._sandboxes.values():
            if sandbox is not None:
                sandbox.close()
        self.proxy.stop()

    def _tick(self) -> None:
        t = time.monotonic()
        self._idle += max(self.concurrency - self._busy, 0) * (t - self._since)
        self._since = t

    def _run(self, runner: _Runner, spec: EpisodeSpec) -> None:
        with self._clock:
            self._tick()
            self._busy += 1
        try:
            outcome = runner.run_one(spec)
            if outcome is not None and outcome.status != "ok":
                log.warning("lcap: episode %s: %s %s", spec.episode_id, outcome.status, printable(outcome.reason or ""))
        except Exception:  # run_one records lcap's own failures; anything past it must not kill the pool silently
            log.exception("lcap: episode %s", spec.episode_id)
        finally:
            with self._clock:
                self._tick()
                self._busy -= 1
            with self.ended:
                self.ended.notify_all()
