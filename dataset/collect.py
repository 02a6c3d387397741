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
import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lcap.capture.options import ProxyOptions
from lcap.capture.redact import redact_text
from lcap.config import LcapError
from lcap.dataset.options import CollectOptions
from lcap.dataset.summary import CollectSummary, summarize
from lcap.dataset.verifiers import (
    Verifier,
    VerifierContext,
    VerifierError,
    hash_protected,
    load_verifier,
    resolve_argv,
    tampered_files,
)
from lcap.display import printable
from lcap.processes import kill_group, run_child
from lcap.store import Store, now

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


def collect(
    store: Store,
    *,
    tasks: Path,
    command: list[str],
    options: CollectOptions = CollectOptions(),
    labels: Mapping[str, str] = {},
    progress: bool | None = None,
    proxy_options: ProxyOptions | None = None,
) -> CollectResult:
    """Run `command` group_size times per task through one capture proxy, verify, record every episode.
    `proxy_options` sets the proxy's limits and timeouts; its upstream and model are `options`'."""
    if not command:
        raise LcapError("no agent command (put it after --)")
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

    result = CollectResult(episodes=len(specs), run_id=run_id, run_dir=str(run_dir))
    done = _finished(store, [s.episode_id for s in specs])
    todo = [s for s in specs if s.episode_id not in done]
    result.skipped = len(specs) - len(todo)
    if todo:
        _forget_partial(store, [s.episode_id for s in todo])

        from lcap.capture.server import CaptureProxy

        proxy_options = replace(proxy_options or ProxyOptions(), upstream=options.upstream, model=options.model)
        proxy = CaptureProxy(store, proxy_options)
        proxy.start()
        runner = _Runner(store, proxy, judge, guard, options.timeout, tasks.parent.resolve(), result)
        try:
            runner.run_all(todo, options.concurrency, progress=sys.stderr.isatty() if progress is None else progress)
        finally:
            proxy.stop()
    result.summary = summarize(store, [s.episode_id for s in specs], run_dir, round)
    return result


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


class _Runner:
    """Runs episodes on a thread pool and keeps the tallies the progress bar shows."""

    def __init__(
        self,
        store: Store,
        proxy,
        judge: Verifier | None,
        guard: tuple[str, ...],
        timeout: float | None,
        tasks_dir: Path,
        result: CollectResult,
    ) -> None:
        self.store, self.proxy, self.judge, self.guard, self.timeout = store, proxy, judge, guard, timeout
        self.tasks_dir = tasks_dir
        self.result = result
        self.rewards: list[float] = []
        self.lock = threading.Lock()
        self.running: dict[str, subprocess.Popen] = {}
        self.stopping = threading.Event()
        self._timed_out: set[str] = set()

    def run_all(self, specs: list[EpisodeSpec], concurrency: int, *, progress: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.text import Text

        console = Console(stderr=True)
        bar = Progress(
            TextColumn("collect"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            disable=not progress,
            transient=False,
        )
        with bar, ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="lcap-episode") as pool:
            job = bar.add_task(self._describe(), total=len(specs))
            futures = {pool.submit(self.run_one, spec): spec for spec in specs}
            try:
                for future in as_completed(futures):
                    spec = futures[future]
                    status, reason = future.result()
                    if status != "ok" and status != "skipped":  # the reason quotes the agent: text, not markup
                        console.print(
                            Text.assemble((f"{spec.episode_id}: {status} ", "yellow"), printable(reason or ""))
                        )
                    bar.update(job, advance=1, description=self._describe())
            except KeyboardInterrupt:
                self.stopping.set()
                for f in futures:
                    f.cancel()
                self.kill_all()
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def _describe(self) -> str:
        r = self.result
        mean = f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"
        return f"ok {r.finished} failed {r.failed} running {len(self.running)} reward {mean}"

    def kill_all(self) -> None:
        with self.lock:
            children = list(self.running.values())
        for child in children:
            kill_group(child.pid)

    def run_one(self, spec: EpisodeSpec) -> tuple[str, str | None]:
        if self.stopping.is_set():
            return "skipped", None
        try:
            status, exit_code, reason = self._episode(spec)
        except Exception as exc:  # lcap's own failure on one episode: recorded, the run goes on
            status, exit_code, reason = "error", None, f"{exc.__class__.__name__}: {exc}"
            self._end(spec, status, exit_code, reason)
        with self.lock:
            self.result.statuses[status] = self.result.statuses.get(status, 0) + 1
            if status == "ok":
                self.result.finished += 1
            else:
                self.result.failed += 1
            self.result.mean_reward = sum(self.rewards) / len(self.rewards) if self.rewards else None
        return status, reason

    def _episode(self, spec: EpisodeSpec) -> tuple[str, int | None, str | None]:
        # Recorded first, so that even a task whose workdir cannot be set up leaves an episode row.
        self.store.start_episode(
            spec.episode_id, command=redact_text(shlex.join(spec.argv)), cwd=str(spec.workdir), labels=spec.labels
        )
        if spec.dir.exists():
            shutil.rmtree(spec.dir)
        spec.workdir.mkdir(parents=True)
        _populate(spec.workdir, spec.task, self.tasks_dir)
        guard = tuple(self.guard) + tuple(spec.task.get("protected") or ())
        before = hash_protected(spec.workdir, guard) if guard else {}

        env = self.proxy.child_env(spec.episode_id)
        env["LCAP_TASK"] = json.dumps(dict(spec.task), ensure_ascii=False)
        env["LCAP_WORKDIR"] = str(spec.workdir)
        exit_code = self._run_agent(spec, env)
        # The episode's turns are in the store before it is verified and marked finished.
        if not self.proxy.flush(spec.episode_id):
            log.warning("lcap: episode %s: some of its turns are not in the store yet", spec.episode_id)
            self.store.flag_episode(spec.episode_id, "turns_unstored", {"reason": "not stored when the agent ended"})
        if self.stopping.is_set():
            self._end(spec, "interrupted", exit_code, "collect was interrupted")
            return "interrupted", exit_code, "interrupted"
        if spec.episode_id in self._timed_out:
            reason = f"timed out after {self.timeout:g}s"
            self._end(spec, "timeout", None, reason)
            return "timeout", None, reason
        if exit_code != 0:
            reason = f"agent exited {exit_code}: {_tail(spec.dir / 'stderr.txt')}"
            self._end(spec, "failed", exit_code, reason)
            return "failed", exit_code, reason

        if guard:
            changed = tampered_files(before, hash_protected(spec.workdir, guard))
            if changed:
                details = {"tampered": changed, "protected": list(guard)}
                self.store.flag_episode(spec.episode_id, "tampered", details)
                self._reward_and_end(spec, exit_code, 0.0, details, "tamper-guard")
                with self.lock:
                    self.result.tampered += 1
                return "ok", exit_code, None
        if self.judge is None:  # rewards may come later (`lcap reward`)
            self._end(spec, "ok", exit_code, None)
            return "ok", exit_code, None
        ctx = VerifierContext(
            task=spec.task,
            episode_id=spec.episode_id,
            workdir=spec.workdir,
            stdout=(spec.dir / "stdout.txt").read_text(errors="replace"),
            exit_code=exit_code,
            status="ok",
        )
        try:
            verdict = self.judge(ctx)
        except VerifierError as exc:
            self.store.flag_episode(spec.episode_id, "verifier_error", {"error": str(exc)})
            self._end(spec, "error", exit_code, f"verifier: {exc}")
            return "error", exit_code, f"verifier: {exc}"
        self._reward_and_end(spec, exit_code, verdict.reward, verdict.details, self.judge.name)
        return "ok", exit_code, None

    def _run_agent(self, spec: EpisodeSpec, env: dict[str, str]) -> int:
        def started(child: subprocess.Popen) -> None:
            with self.lock:
                self.running[spec.episode_id] = child

        with open(spec.dir / "stdout.txt", "wb") as out, open(spec.dir / "stderr.txt", "wb") as err:
            try:
                ended = run_child(
                    spec.argv,
                    env,
                    cwd=spec.workdir,
                    timeout=self.timeout,
                    own_group=True,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    on_start=started,
                )
            except LcapError as exc:
                err.write(f"{exc}\n".encode())
                return 127
            finally:
                with self.lock:
                    self.running.pop(spec.episode_id, None)
        if ended.timed_out:
            self._timed_out.add(spec.episode_id)
        return ended.code

    def _reward(self, spec: EpisodeSpec, value: float, details: Mapping[str, Any], source: str) -> None:
        self.store.append(
            "rewards",
            [
                {
                    "episode_id": spec.episode_id,
                    "value": float(value),
                    "details": json.dumps(dict(details), default=str),
                    "source": source,
                    "created_at": now(),
                }
            ],
        )
        with self.lock:
            self.rewards.append(float(value))

    def _reward_and_end(
        self, spec: EpisodeSpec, exit_code: int, value: float, details: Mapping[str, Any], source: str
    ) -> None:
        """Reward the episode and mark it `ok` in one attach of the store (the nested writes share it)."""
        with self.store.connect():
            self._reward(spec, value, details, source)
            self._end(spec, "ok", exit_code, None)

    def _end(self, spec: EpisodeSpec, status: str, exit_code: int | None, error: str | None) -> None:
        self.store.end_episode(spec.episode_id, status=status, exit_code=exit_code, error=error)


def _populate(workdir: Path, task: Mapping[str, Any], tasks_dir: Path) -> None:
    """A task may bring a `template` directory (copied) and `files` ({relative path: text}) into its workdir."""
    template = task.get("template")
    if template:
        src = (tasks_dir / template).resolve()
        if not src.is_dir():
            raise LcapError(f"task {task['id']}: template {src} is not a directory")
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
