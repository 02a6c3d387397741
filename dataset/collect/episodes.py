"""`lcap collect`: run an unmodified agent on every task, `group_size` times, through one capture proxy.

One in-process capture proxy serves the whole run (DuckDB admits one writing process, so the
agents must not each start their own); each child is attributed to its episode through the proxy
URL's credentials. Episodes run in a local thread pool, each in its own working directory, its
whole process group killed on timeout. After the agent, the tamper guard and the verifier run
outside it, and the episode is recorded with its status and reason: never dropped.

Episode ids are deterministic: the collect run's id (a hash of the command template, the tasks
file and the verifier) plus the key (round, split, task id, sample index). Re-running the same
collect skips episodes already finished; ones left running or interrupted are run again, their
partial turns deleted first.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lcap.capture.options import ProxyOptions
from lcap.capture.trust.redact import redact_text
from lcap.config import LcapError
from lcap.dataset.collect.summary import CollectSummary, summarize
from lcap.dataset.collect.verifiers import (
    Verifier,
    VerifierContext,
    VerifierError,
    hash_protected,
    load_verifier,
    resolve_argv,
    tampered_files,
)
from lcap.dataset.options import CollectOptions
from lcap.display import printable
from lcap.processes import kill_group, run_child
from lcap.store import Store, now

if TYPE_CHECKING:
    from lcap.capture.proxy.server import Child
    from lcap.dataset.collect.on_ray import NodeProxies

log = logging.getLogger("lcap.dataset")

FINISHED = ("ok", "failed", "timeout", "error")
_SHELLS = {"sh", "bash", "zsh", "dash", "ksh"}
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass
class CollectResult:
    episodes: int = 0  # episodes this run asked for (tasks x group_size)
    finished: int = 0  # ran to the end with a reward, this run
    failed: int = 0  # agent failed, timed out, verifier error, interrupted (this run)
    skipped: int = 0  # already finished by an earlier run of the same collect
    mean_reward: float | None = None  # over the rewards given in this run
    run_id: str = ""
    run_dir: str = ""
    statuses: dict[str, int] = field(default_factory=dict)
    tampered: int = 0
    summary: CollectSummary | None = None  # every episode of this collect, this run's and earlier ones'


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    task: Mapping[str, Any]
    sample: int
    argv: list[str]
    dir: Path  # run_dir/<episode_id>: stdout.txt, stderr.txt, work/
    labels: dict[str, str]

    @property
    def workdir(self) -> Path:
        return self.dir / "work"


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


def episode_id(run_id: str, round: int, split: str, task_id: str, sample: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", task_id)
    if safe != task_id or len(safe) > 48:
        safe = safe[:40] + "-" + hashlib.sha1(task_id.encode()).hexdigest()[:7]
    return f"c{run_id}-r{round}-{split}-{safe}-{sample}"


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
    *, tasks: Path, command: list[str], options: CollectOptions, labels: Mapping[str, str] = {}
) -> CollectPlan:
    """Every episode of `tasks` x `options.group_size` for `options.round` and `options.split`, in task order."""
    tasks = Path(tasks)
    task_rows = load_tasks(tasks)
    base = Path.cwd()
    template = resolve_argv(command, base)
    judge = load_verifier(options.verifier, base=base) if options.verifier else None
    guard = tuple(options.protect) + (judge.protected if judge else ())
    run_id = collect_run_id(command, tasks, options.verifier)
    run_dir = Path(options.run_dir or base / "lcap-runs" / f"collect-{run_id}").resolve()
    round, split = options.round, options.split

    specs = []
    for task in task_rows:
        for sample in range(options.group_size):
            eid = episode_id(run_id, round, split, task["id"], sample)
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
                    },
                )
            )
    return CollectPlan(
        run_id,
        run_dir,
        specs,
        EpisodeRules(judge, guard, options.timeout, options.verify_failed),
        TaskFiles(tasks.parent.resolve()),
    )


def collect_proxy_options(options: CollectOptions, proxy_options: ProxyOptions | None) -> ProxyOptions:
    """The capture proxy's options for a collect: `proxy_options`' limits, `options`' upstream and model."""
    return replace(
        proxy_options or ProxyOptions(), upstream=options.upstream, model=options.model, transparent=options.transparent
    )


def collect(
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
        from lcap.ray_cluster import connect

        connect(options.ray)
    elif options.episode_resources or options.episode_cpus != 1.0:
        raise LcapError("--episode-cpus and --episode-resources place episodes on a Ray cluster: add --ray ADDRESS")
    plan = plan_collect(tasks=tasks, command=command, options=options, labels=labels)
    tasks, run_id, run_dir, specs = Path(tasks), plan.run_id, plan.run_dir, plan.specs
    round = options.round

    result = CollectResult(episodes=len(specs), run_id=run_id, run_dir=str(run_dir))
    done = _finished(store, [s.episode_id for s in specs])
    todo = [s for s in specs if s.episode_id not in done]
    result.skipped = len(specs) - len(todo)
    if todo:
        _forget_partial(store, [s.episode_id for s in todo])

        proxy_options = collect_proxy_options(options, proxy_options)
        tally = Tally(result)
        show = sys.stderr.isatty() if progress is None else progress
        if options.ray is not None:
            from lcap.dataset.collect.on_ray import RayPool

            RayPool(store, plan.rules, tasks.parent.resolve(), options, proxy_options, tally, node_proxies).run_all(
                todo, progress=show
            )
        else:
            _run_local(store, todo, plan.rules, plan.files, tally, proxy_options, options, show)
    result.summary = summarize(store, [s.episode_id for s in specs], run_dir, round, options.transparent)
    return result


def _run_local(
    store: Store,
    todo: list[EpisodeSpec],
    rules: EpisodeRules,
    files: TaskFiles,
    tally: Tally,
    proxy_options: ProxyOptions,
    options: CollectOptions,
    show: bool,
) -> None:
    """The local pool: one capture proxy in this process, `--concurrency` episodes at a time on threads."""
    from lcap.capture.proxy.server import CaptureProxy

    proxy = CaptureProxy(store, proxy_options)
    proxy.start()
    try:
        _Runner(store, proxy, rules, files, tally).run_all(todo, options.concurrency, progress=show)
    finally:
        proxy.stop()


def _finished(store: Store, ids: list[str]) -> set[str]:
    rows = store.fetchall(
        "SELECT episode_id FROM episodes WHERE episode_id IN (SELECT unnest(?)) AND status IN "
        f"({', '.join(repr(s) for s in FINISHED)})",
        [ids],
    )
    return {r[0] for r in rows}


def _forget_partial(store: Store, ids: list[str]) -> None:
    """An interrupted attempt's turns, rewards and flags would mix with the new attempt's: delete them."""
    with store.connect() as con:
        for table in ("turns", "rewards", "episode_flags"):
            con.execute(f"DELETE FROM {table} WHERE episode_id IN (SELECT unnest(?))", [ids])


@dataclass(frozen=True)
class EpisodeRules:
    """What every episode of a collect run shares: the verifier, the tamper guard's globs, the agent's timeout."""

    judge: Verifier | None
    guard: tuple[str, ...]
    timeout: float | None
    verify_failed: bool = False  # an agent's non-zero exit is an outcome to verify, not a failure


@dataclass(frozen=True)
class TaskFiles:
    """Where a task's `template` directory comes from: the tasks file's directory, or (on a Ray node, which may not
    see this machine's files) the directory's contents as a tar archive shipped with the episode."""

    tasks_dir: Path
    archive: bytes | None = None


@dataclass
class EpisodeOutcome:
    """How one episode ended: what the store gets (`record_outcome`), wherever the episode ran."""

    status: str  # ok | failed | timeout | error | interrupted
    exit_code: int | None = None
    reason: str | None = None
    reward: float | None = None  # with `source` and `details`: the reward to store, if any
    source: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    flags: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (flag, details) to raise
    tampered: bool = False


def run_episode(
    spec: EpisodeSpec,
    env: Mapping[str, str],
    rules: EpisodeRules,
    files: TaskFiles,
    *,
    flush: Callable[[], bool],
    on_start: Callable[[subprocess.Popen], None] | None = None,
    stopping: Callable[[], bool] = lambda: False,
    agent: Child | None = None,
) -> EpisodeOutcome:
    """Run one episode here: set up its working directory, run the agent with `env` (the capture proxy's
    environment for this episode), check the tamper guard and run the verifier. Writes nothing to the store:
    `flush()` must return once the episode's turns are stored (False if they may not be), and the caller
    records the outcome. The local pool and a Ray node run episodes through this one function. `agent`, from
    `CaptureProxy.episode_child`, says how to start the agent (in namespaces of its own with `--transparent`)."""
    if spec.dir.exists():
        shutil.rmtree(spec.dir)
    spec.workdir.mkdir(parents=True)
    _populate(spec.workdir, spec.task, files)
    guard = tuple(rules.guard) + tuple(spec.task.get("protected") or ())
    before = hash_protected(spec.workdir, guard) if guard else {}

    child_env = dict(env)
    child_env["LCAP_TASK"] = json.dumps(dict(spec.task), ensure_ascii=False)
    child_env["LCAP_WORKDIR"] = str(spec.workdir)
    exit_code, timed_out = _run_agent(spec, child_env, rules.timeout, on_start, agent)
    outcome = EpisodeOutcome("ok", exit_code)
    # The episode's turns are in the store before it is verified and marked finished.
    if not flush():
        log.warning("lcap: episode %s: some of its turns are not in the store yet", spec.episode_id)
        outcome.flags.append(("turns_unstored", {"reason": "not stored when the agent ended"}))
    if stopping():
        outcome.status, outcome.reason = "interrupted", "collect was interrupted"
        return outcome
    if timed_out:
        outcome.status, outcome.exit_code = "timeout", None
        outcome.reason = f"timed out after {rules.timeout:g}s"
        return outcome
    if exit_code != 0 and not rules.verify_failed:
        outcome.status, outcome.reason = "failed", f"agent exited {exit_code}: {_tail(spec.dir / 'stderr.txt')}"
        return outcome

    if guard:
        changed = tampered_files(before, hash_protected(spec.workdir, guard))
        if changed:
            details = {"tampered": changed, "protected": list(guard)}
            outcome.flags.append(("tampered", details))
            outcome.reward, outcome.details, outcome.source, outcome.tampered = 0.0, details, "tamper-guard", True
            return outcome
    if rules.judge is None:  # rewards may come later (`lcap reward`)
        return outcome
    ctx = VerifierContext(
        task=spec.task,
        episode_id=spec.episode_id,
        workdir=spec.workdir,
        stdout=(spec.dir / "stdout.txt").read_text(errors="replace"),
        exit_code=exit_code,
        status="ok",
    )
    try:
        verdict = rules.judge(ctx)
    except VerifierError as exc:
        outcome.flags.append(("verifier_error", {"error": str(exc)}))
        outcome.status, outcome.reason = "error", f"verifier: {exc}"
        return outcome
    outcome.reward, outcome.details, outcome.source = verdict.reward, dict(verdict.details), rules.judge.name
    return outcome


def _run_agent(
    spec: EpisodeSpec,
    env: dict[str, str],
    timeout: float | None,
    on_start: Callable[[subprocess.Popen], None] | None,
    agent: Child | None = None,
) -> tuple[int, bool]:
    """(exit code, timed out). The agent leads a process group of its own, which ends with it; an exception
    here (a cancelled Ray task's KeyboardInterrupt) ends the group too."""
    child: subprocess.Popen | None = None

    def started(proc: subprocess.Popen) -> None:
        nonlocal child
        child = proc
        if agent is not None:
            agent.on_start(proc)
        if on_start is not None:
            on_start(proc)

    with open(spec.dir / "stdout.txt", "wb") as out, open(spec.dir / "stderr.txt", "wb") as err:
        try:
            ended = run_child(
                agent.argv if agent is not None else spec.argv,
                env,
                cwd=spec.workdir,
                timeout=timeout,
                own_group=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                on_start=started,
                pass_fds=agent.pass_fds if agent is not None else (),
            )
        except LcapError as exc:
            err.write(f"{exc}\n".encode())
            return 127, False
        except BaseException:
            if child is not None:
                kill_group(child.pid, grace=1.0)
            raise
    return ended.code, ended.timed_out


def record_outcome(store: Store, spec: EpisodeSpec, outcome: EpisodeOutcome) -> None:
    """Store an episode's flags, reward and end in one attach of the store."""
    with store.connect():
        for flag, details in outcome.flags:
            store.flag_episode(spec.episode_id, flag, details)
        if outcome.reward is not None:
            store.append(
                "rewards",
                [
                    {
                        "episode_id": spec.episode_id,
                        "value": float(outcome.reward),
                        "details": json.dumps(outcome.details, default=str),
                        "source": outcome.source,
                        "created_at": now(),
                    }
                ],
            )
        store.end_episode(spec.episode_id, status=outcome.status, exit_code=outcome.exit_code, error=outcome.reason)


def start_episode(store: Store, spec: EpisodeSpec) -> None:
    """The episode's row, marked running: even a task whose workdir cannot be set up leaves one."""
    store.start_episode(
        spec.episode_id,
        command=redact_text(shlex.join(spec.argv)),
        cwd=str(spec.workdir),
        labels=spec.labels,
        replace=True,
    )


class Tally:
    """The run's counts and rewards as episodes end, and the progress bar's line; shared by both pools."""

    def __init__(self, result: CollectResult) -> None:
        self.result = result
        self.rewards: list[float] = []
        self.running = 0
        self.lock = threading.Lock()

    def add(self, outcome: EpisodeOutcome) -> None:
        with self.lock:
            r = self.result
            r.statuses[outcome.status] = r.statuses.get(outcome.status, 0) + 1
            if outcome.status == "ok":
                r.finished += 1
            else:
                r.failed += 1
            if outcome.tampered:
                r.tampered += 1
            if outcome.reward is not None:
                self.rewards.append(float(outcome.reward))
            r.mean_reward = sum(self.rewards) / len(self.rewards) if self.rewards else None

    def describe(self) -> str:
        r = self.result
        mean = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"
        return f"ok {r.finished} failed {r.failed} running {self.running} reward {mean}"


def progress_bar(show: bool):
    """The console and progress bar both pools draw on stderr."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(
        TextColumn("collect"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        disable=not show,
        transient=False,
    )
    return console, bar


def report_end(console, spec: EpisodeSpec, outcome: EpisodeOutcome) -> None:
    if outcome.status != "ok":  # the reason quotes the agent: text, not markup
        from rich.text import Text

        console.print(
            Text.assemble((f"{spec.episode_id}: {outcome.status} ", "yellow"), printable(outcome.reason or ""))
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
    ) -> None:
        self.store, self.proxy, self.rules, self.files, self.tally = store, proxy, rules, files, tally
        self.running: dict[str, subprocess.Popen] = {}
        self.stopping = stopping or threading.Event()

    def run_all(self, specs: list[EpisodeSpec], concurrency: int, *, progress: bool) -> None:
        console, bar = progress_bar(progress)
        with bar, ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lcap-episode") as pool:
            job = bar.add_task(self.tally.describe(), total=len(specs))
            futures = {pool.submit(self.run_one, spec): spec for spec in specs}
            try:
                for future in as_completed(futures):
                    outcome = future.result()
                    if outcome is not None:
                        report_end(console, futures[future], outcome)
                    bar.update(job, advance=1, description=self.tally.describe())
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
        from lcap.capture.proxy.server import CaptureProxy

        self.store, self.concurrency = store, concurrency
        self.proxy = CaptureProxy(store, collect_proxy_options(options, proxy_options))
        self.result = CollectResult()
        self.tally = Tally(self.result)
        self.stopping = threading.Event()
        self.ended = threading.Condition()  # notified whenever an episode ends
        self._runners: list[_Runner] = []
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
        done = _finished(self.store, [s.episode_id for s in specs])
        todo = [s for s in specs if s.episode_id not in done]
        if not todo:
            return 0
        _forget_partial(self.store, [s.episode_id for s in todo])
        runner = _Runner(self.store, self.proxy, plan.rules, plan.files, self.tally, stopping=self.stopping)
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


def template_dir(task: Mapping[str, Any], tasks_dir: Path) -> Path | None:
    """The task's `template` directory (relative to the tasks file), or None if it has none."""
    template = task.get("template")
    if not template:
        return None
    src = (tasks_dir / template).resolve()
    if not src.is_dir():
        raise LcapError(f"task {task['id']}: template {src} is not a directory")
    return src


def _populate(workdir: Path, task: Mapping[str, Any], files: TaskFiles) -> None:
    """A task may bring a `template` directory (copied) and `files` ({relative path: text}) into its workdir."""
    if files.archive is not None:
        with tarfile.open(fileobj=io.BytesIO(files.archive)) as tar:
            tar.extractall(workdir, filter="tar")  # symlinks kept as they are, as copytree(symlinks=True) does
    else:
        src = template_dir(task, files.tasks_dir)
        if src is not None:
            shutil.copytree(src, workdir, dirs_exist_ok=True, symlinks=True)
    for rel, text in (task.get("files") or {}).items():
        target = (workdir / rel).resolve()
        if workdir.resolve() not in target.parents:
            raise LcapError(f"task {task['id']}: file {rel!r} is outside the workdir")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text if isinstance(text, str) else json.dumps(text))


def _tail(path: Path, n: int = 300) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    text = " ".join(text.splitlines()[-3:])
    return text[-n:] if text else "(no stderr)"
