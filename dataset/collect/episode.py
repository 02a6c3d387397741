"""One episode of a collect, wherever it runs: its spec, running it (workdir, agent, tamper guard, verifier),
its outcome and the store's record of it, and the counts and progress bar of a run.

The local pool (episodes.py: threads in this process) and the Ray pool (on_ray.py: a Ray task per episode) both
run episodes through these pieces, so an episode is the same wherever it ran.
"""

from __future__ import annotations

import io
import json
import logging
import shlex
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text

from lcap.capture import limits_text, release_mounts
from lcap.config import LcapError
from lcap.dataset.collect.summary import CollectSummary
from lcap.dataset.collect.verifiers import (
    VERIFIER_OUTPUT,
    Verdict,
    Verifier,
    VerifierContext,
    VerifierError,
    hash_protected,
    tail,
    tampered_files,
    verifier_files,
)
from lcap.dataset.collect.workspaces import place_tests, pristine_tests, source_dir
from lcap.display import printable
from lcap.processes import kill_group, run_child
from lcap.progress import Reporter
from lcap.store import Store

if TYPE_CHECKING:
    from lcap.capture import Child, EpisodeSandbox, Sandbox
    from lcap.dataset.judge.run import JudgeResult

log = logging.getLogger("lcap.dataset")

FINISHED = ("ok", "failed", "timeout", "error")


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
    judge: JudgeResult | None = None  # --verifier judge:RUBRIC.md: the judge pass over the collect's episodes

    def not_ok(self) -> str:
        """This run's episodes that did not end ok, in the words of their status (`2 error`), as the summary's
        `episodes:` line names them; `0 failed` when none."""
        return ", ".join(f"{n} {status}" for status, n in self.statuses.items() if status != "ok") or "0 failed"


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


def finished_episodes(store: Store, ids: list[str]) -> set[str]:
    rows = store.fetchall(
        "SELECT episode_id FROM episodes WHERE episode_id IN (SELECT unnest(?)) AND status IN "
        f"({', '.join(repr(s) for s in FINISHED)})",
        [ids],
    )
    return {r[0] for r in rows}


def forget_partial(store: Store, ids: list[str]) -> None:
    """An interrupted attempt's turns, rewards and flags would mix with the new attempt's: delete them."""
    with store.connect() as con:
        for table in ("turns", "rewards", "episode_flags"):
            con.execute(f"DELETE FROM {table} WHERE episode_id IN (SELECT unnest(?))", [ids])


def unfinished(store: Store, specs: Sequence[EpisodeSpec]) -> list[EpisodeSpec]:
    """The episodes of `specs` to run: those no earlier run finished, an interrupted attempt's turns forgotten."""
    done = finished_episodes(store, [s.episode_id for s in specs])
    todo = [s for s in specs if s.episode_id not in done]
    if todo:
        forget_partial(store, [s.episode_id for s in todo])
    return todo


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
    root: Path | None = None  # the folder a task's paths must resolve inside (--tasks-root; None: tasks_dir)


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
    sandbox: Sandbox | None = None,
) -> EpisodeOutcome:
    """Run one episode here: set up its working directory, run the agent with `env` (the capture proxy's
    environment for this episode), check the tamper guard and run the verifier. Writes nothing to the store:
    `flush()` must return once the episode's turns are stored (False if they may not be), and the caller
    records the outcome. The local pool and a Ray node run episodes through this one function. `agent`, from
    `CaptureProxy.episode_child`, says how to start the agent (in namespaces of its own with `--transparent`);
    `sandbox` (`--sandbox`), that it runs in a bubblewrap sandbox of its own, whose limits reached end it."""
    if spec.dir.exists():
        if sandbox is not None:  # a workspace a killed lcap left mounted
            release_mounts(spec.dir)
        shutil.rmtree(spec.dir)
    spec.workdir.mkdir(parents=True)
    box = sandbox.episode(spec.episode_id, spec.workdir) if sandbox is not None else None
    try:
        return _run_in(spec, env, rules, files, flush, on_start, stopping, agent, box)
    finally:
        if box is not None:
            box.close()


def _run_in(
    spec: EpisodeSpec,
    env: Mapping[str, str],
    rules: EpisodeRules,
    files: TaskFiles,
    flush: Callable[[], bool],
    on_start: Callable[[subprocess.Popen], None] | None,
    stopping: Callable[[], bool],
    agent: Child | None,
    box: EpisodeSandbox | None,
) -> EpisodeOutcome:
    if box is None:
        _populate(spec.workdir, spec.task, files)
    else:
        source = source_dir(spec.task, files.tasks_dir, files.root) if files.archive is None else None
        if source is not None:  # copy-on-write over the task's directory, its copy made once per run
            box.prepare(lower=box.sandbox.lower(source))
            _write_files(spec.workdir, spec.task)
        else:
            box.prepare()
            _populate(spec.workdir, spec.task, files)
        box.own()
    guard = tuple(rules.guard) + tuple(spec.task.get("protected") or ())
    before = hash_protected(spec.workdir, guard) if guard else {}

    child_env = {**env, "LCAP_TASK": json.dumps(dict(spec.task), ensure_ascii=False), "LCAP_WORKDIR": str(spec.workdir)}
    if box is not None:
        if agent is None:
            raise LcapError("--sandbox needs the capture proxy's episode child")
        agent, child_env = box.child(spec.argv, child_env, box.sandbox.proxy.port or 0)
    exit_code, timed_out = _run_agent(spec, child_env, rules.timeout, on_start, agent)
    outcome = EpisodeOutcome("ok", exit_code)
    reached = box.limits_reached() if box is not None else {}
    if reached:
        outcome.flags.append(("sandbox_limit", reached))
    # The episode's turns are in the store before it is verified and marked finished.
    if not flush():
        log.warning("lcap: episode %s: some of its turns are not in the store yet", spec.episode_id)
        outcome.flags.append(("turns_unstored", {"reason": "not stored when the agent ended"}))
    if stopping():
        outcome.status, outcome.reason = "interrupted", "collect was interrupted"
        return outcome
    if timed_out:
        outcome.status, outcome.exit_code = "timeout", None
        outcome.reason = f"timed out after {rules.timeout:g}s" + (f"; {limits_text(reached)}" if reached else "")
        return outcome
    if reached:
        outcome.status, outcome.reason = "failed", f"{limits_text(reached)} (agent exited {exit_code})"
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
        sample=spec.sample,
    )
    try:
        verdict = rules.judge(ctx) if box is None else _verify_in_sandbox(spec, rules.judge, ctx, box, files)
    except VerifierError as exc:
        (spec.dir / VERIFIER_OUTPUT).write_text(exc.output or str(exc))  # the summary's example for this reason
        outcome.flags.append(("verifier_error", {"error": str(exc)}))
        outcome.status, outcome.reason = "error", f"verifier: {exc}"
        return outcome
    outcome.reward, outcome.details, outcome.source = verdict.reward, dict(verdict.details), rules.judge.name
    return outcome


def _verify_in_sandbox(
    spec: EpisodeSpec, judge: Verifier, ctx: VerifierContext, box: EpisodeSandbox, files: TaskFiles
) -> Verdict:
    """The verifier in a fresh sandbox over the agent's final workspace; all it printed goes to verifier.txt."""
    tests = pristine_tests(spec.task, files.tasks_dir, files.root)
    shown = [spec.dir / "stdout.txt"]
    verdict = verify_in_sandbox(
        box.sandbox, judge, ctx, spec.dir / "verify", lower=spec.workdir, tests=tests, shown=shown
    )
    (spec.dir / VERIFIER_OUTPUT).write_text(verdict.output)
    return verdict


def verify_in_sandbox(
    sandbox: Sandbox,
    judge: Verifier,
    ctx: VerifierContext,
    folder: Path,
    *,
    lower: Path,
    tests: Mapping[str, bytes],
    shown: Sequence[Path] = (),
) -> Verdict:
    """`judge` in a fresh sandbox (`Sandbox.verifier`: no network, the host hidden but for `shown` and what the
    verifier loads): its workspace, mounted at `folder` and seen at `ctx.workdir`, an overlay over `lower` (a
    folder the sandbox's user owns) with the task's pristine `tests` put over it first (the agent never saw this
    copy of them). What it writes there is dropped with it. collect's and rescore's sandboxed verifiers."""
    checker = sandbox.verifier(ctx.episode_id, ctx.workdir, folder, shown=[*shown, *verifier_files(judge)])
    try:
        checker.prepare(lower=lower)
        place_tests(checker.workdir, tests)
        checker.own()
        try:
            return judge(ctx, checker)
        except VerifierError as exc:
            reached = checker.limits_reached()
            if reached:
                raise VerifierError(f"{exc}; {limits_text(reached)}", exc.output) from None
            raise
    finally:
        checker.close()


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
            assert outcome.source is not None  # a reward always names its source
            verdict = json.dumps(outcome.details, default=str)
            store.add_reward(spec.episode_id, float(outcome.reward), details=verdict, source=outcome.source)
        store.end_episode(spec.episode_id, status=outcome.status, exit_code=outcome.exit_code, error=outcome.reason)


def start_episode(store: Store, spec: EpisodeSpec) -> None:
    """The episode's row, marked running: even a task whose workdir cannot be set up leaves one."""
    store.start_episode(
        spec.episode_id, command=shlex.join(spec.argv), cwd=str(spec.workdir), labels=spec.labels, replace=True
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
            r.tampered += outcome.tampered
            if outcome.reward is not None:
                self.rewards.append(float(outcome.reward))
            r.mean_reward = sum(self.rewards) / len(self.rewards) if self.rewards else None

    def describe(self) -> str:
        r = self.result
        mean = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"
        return f"ok {r.finished}, {r.not_ok()}, running {self.running}, reward {mean}"


class RunProgress:
    """Both pools' progress (lcap/progress.py: a bar on a terminal, else a line every 30 s) with the tally's counts,
    and one line for each episode that did not end ok."""

    def __init__(self, show: bool, tally: Tally, total: int) -> None:
        self.tally = tally
        self.reporter = Reporter("collect", total, tally.describe, show=show)

    def __enter__(self) -> RunProgress:
        self.reporter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reporter.__exit__(*exc)

    def refresh(self) -> None:
        self.reporter.refresh()

    def ended(self, spec: EpisodeSpec, outcome: EpisodeOutcome | None) -> None:
        """An episode ended (`outcome` None: it never ran)."""
        if outcome is not None and outcome.status != "ok":  # the reason quotes the agent: text, not markup
            self.reporter.print(  # one line per episode, however narrow the terminal: logs are read with grep
                Text.assemble((f"{spec.episode_id}: {outcome.status} ", "yellow"), printable(outcome.reason or "")),
                soft_wrap=True,
            )
        self.reporter.advance()


def _populate(workdir: Path, task: Mapping[str, Any], files: TaskFiles) -> None:
    """A task may bring a `workspace` directory or a `repo` at a `commit` (copied) and `files` ({relative path:
    text}) into its workdir."""
    if files.archive is not None:
        with tarfile.open(fileobj=io.BytesIO(files.archive)) as tar:
            tar.extractall(workdir, filter="tar")  # symlinks kept as they are, as copytree(symlinks=True) does
    else:
        src = source_dir(task, files.tasks_dir, files.root)
        if src is not None:
            shutil.copytree(src, workdir, dirs_exist_ok=True, symlinks=True)
    _write_files(workdir, task)


def _write_files(workdir: Path, task: Mapping[str, Any]) -> None:
    for rel, text in (task.get("files") or {}).items():
        target = (workdir / rel).resolve()
        if workdir.resolve() not in target.parents:
            raise LcapError(f"task {task['id']}: file {rel!r} is outside the workdir")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text if isinstance(text, str) else json.dumps(text))


def _tail(path: Path) -> str:
    try:
        return tail(path.read_text(errors="replace"), 3, "(no stderr)")
    except OSError:
        return ""
