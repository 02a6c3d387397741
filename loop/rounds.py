"""`lcap loop`: collect -> build-dataset -> train -> deploy, round after round, resumable.

Every finished step is written to RUN/state.json (atomically) before the next one starts, and
mirrored in the store's `loop_steps` table for SQL. Run the same command again after a kill and
it continues at the first unfinished step: collect resumes itself (finished episodes are kept),
build and train are redone from their inputs, and the last deployed adapter is deployed again if
the policy server no longer serves it (e.g. it was restarted).

Round numbering: round N's samples are collected with the policy trained in round N-1 (round 1
with the base), train on them, and deploy the result. With --eval-tasks the held-out tasks run
before round 1 (`eval` of round 0, the base policy) and after each round's deploy.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lcap.capture.options import ProxyOptions
from lcap.config import LcapError
from lcap.dataset.options import BuildOptions, CollectOptions
from lcap.display import num, rounded
from lcap.loop.options import LoopOptions
from lcap.store import now
from lcap.train.grpo import round_dir
from lcap.train.options import TrainOptions
from lcap.train.progress import training_text


@dataclass
class LoopConfig:
    run: Path
    rounds: int
    tasks: Path
    command: list[str]
    eval_tasks: Path | None = None
    eval_group_size: int = 1
    tasks_per_round: int = 0  # 0: every task every round; else the next this many of the file each round
    collect: CollectOptions = field(default_factory=CollectOptions)
    build: BuildOptions = field(default_factory=BuildOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    proxy: ProxyOptions = field(default_factory=ProxyOptions)  # its policy-route flags (stitch, adapt)
    options: LoopOptions = field(default_factory=LoopOptions)  # the loop's own: --async and its bounds

    def __post_init__(self) -> None:
        if self.tasks_per_round < 0:
            raise LcapError("--tasks-per-round must be 0 (every task) or more")

    def key(self) -> str:
        """What must not change between a run and its resume (more rounds may be added)."""
        ident = [
            list(self.command),
            str(Path(self.tasks).resolve()),
            self.collect.group_size,
            self.collect.verifier,
            str(Path(self.eval_tasks).resolve()) if self.eval_tasks else None,
            self.eval_group_size,
        ]
        if self.tasks_per_round:
            ident.append(self.tasks_per_round)
        if self.options.overlap:  # an async run's state (batches of groups) is not a synchronous run's (rounds)
            ident.append("async")
        return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:12]


class LoopState:
    """RUN/state.json: the finished steps and what they produced."""

    def __init__(self, run: Path, key: str) -> None:
        self.path = Path(run) / "state.json"
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        if data and data.get("key") != key:
            raise LcapError(
                f"{self.path} belongs to a loop with another agent command, tasks, tasks per round, group size or "
                "verifier: use a new --run folder"
            )
        self.data = data or {"key": key, "steps": {}}
        self.lock = threading.RLock()  # the async loop's held-out runs record their steps from a thread of their own

    def done(self, round: int, step: str) -> dict | None:
        return self.data["steps"].get(f"{round}:{step}")

    def finish(self, round: int, step: str, info: dict) -> None:
        with self.lock:
            self.data["steps"][f"{round}:{step}"] = {**info, "finished_at": time.time()}
            self.save()

    def save(self) -> None:
        """Write the state atomically (a reader, or a resumed loop, never sees half a file)."""
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str))
            tmp.replace(self.path)

    def last_deployed(self) -> dict | None:
        deployed = [(int(k.split(":")[0]), v) for k, v in self.data["steps"].items() if k.endswith(":deploy")]
        return max(deployed, key=lambda x: x[0])[1] if deployed else None


@dataclass
class RoundSummary:
    round: int
    train_reward: float | None = None
    eval_reward: float | None = None
    train: dict[str, Any] = field(default_factory=dict)
    deployed: str | None = None


def split_reward(store, run_id: str, round: int, split: str) -> tuple[float | None, int]:
    """Mean reward of one collect run's episodes of a round and split, from the store (resume-proof)."""
    rows = store.fetchall(
        "SELECT avg(reward), count(reward) FROM episode_summary WHERE collect_run = ? AND round = ? AND split = ?",
        [run_id, round, split],
    )
    return (rows[0][0], rows[0][1]) if rows else (None, 0)


def run_loop(
    store, config: LoopConfig, *, echo: Callable[[str], None] = print, stop_after: tuple[int, str] | None = None
) -> list[RoundSummary]:
    """Run (or resume) the loop; `stop_after=(round, step)` ends it there (tests use it to stage a kill)."""
    from lcap.policy import read_policy
    from lcap.train.grpo import resolve_base_model

    run = Path(config.run)
    state = LoopState(run, config.key())
    policy = read_policy()
    if policy is None:
        raise LcapError("no policy server is running: start one with `lcap serve --model M` (or run `lcap demo`)")
    resolve_base_model(run, config.train.base_model or policy.base_model)
    if config.train.ray is not None:  # an unreachable cluster fails now, not after the first collect
        from lcap.ray_cluster import connect

        connect(config.train.ray)
    elif config.train.num_workers > 1:
        raise LcapError(f"--num-workers {config.train.num_workers} trains on a Ray cluster: add --ray ADDRESS")
    (run / "loop.json").write_text(json.dumps({**asdict(config), "key": config.key()}, indent=2, default=str))
    _redeploy_if_lost(state, store, echo)
    if config.options.overlap:
        from lcap.loop.overlap import run_async_loop

        return run_async_loop(store, config, state, policy.current, echo=echo, stop_after=stop_after)

    def step(round: int, name: str, body: Callable[[], dict]) -> dict:
        info = run_step(store, state, run, round, name, body)
        if stop_after == (round, name):
            raise _Stop()
        return info

    if config.train.ray is None:
        return _rounds(store, config, step, echo, None)
    from lcap.dataset.collect.on_ray import NodeProxies

    with NodeProxies(store) as node_proxies:  # started by the first collect, serving every collect of the loop
        return _rounds(store, config, step, echo, node_proxies)


def _rounds(
    store,
    config: LoopConfig,
    step: Callable[[int, str, Callable[[], dict]], dict],
    echo: Callable[[str], None],
    node_proxies: Any,
) -> list[RoundSummary]:
    """The synchronous loop's rounds; `node_proxies`: with --ray, the Ray node proxies of all its collects."""
    from lcap.dataset.build.builder import build_dataset
    from lcap.serve.deploy import deploy

    def collect_step(round: int, split: str, tasks: Path, group_size: int) -> dict:
        return collect_split(store, config, round, split, tasks, group_size, node_proxies)

    run = Path(config.run)
    eval_tasks = config.eval_tasks
    summaries: list[RoundSummary] = []
    try:
        if eval_tasks:
            info = step(0, "eval", lambda: collect_step(0, "eval", eval_tasks, config.eval_group_size))
            echo(f"round 0 (base policy): held-out reward {num(info['mean_reward'])} ({info['rewarded']} episodes)")
            summaries.append(RoundSummary(round=0, eval_reward=info["mean_reward"]))
        for n in range(1, config.rounds + 1):
            t0 = time.perf_counter()
            s = RoundSummary(round=n)
            tasks = round_tasks(config, n)
            got = step(n, "collect", lambda: collect_step(n, "train", tasks, config.collect.group_size))
            s.train_reward = got["mean_reward"]
            data = round_dir(run, n) / "data"
            step(
                n,
                "build",
                lambda: {
                    "samples": build_dataset(
                        store, round=n, out=data, options=replace(config.build, split="train")
                    ).samples
                },
            )
            trained = step(n, "train", lambda: _train(store, run, n, config.train, data))
            s.train = trained
            deployed = step(
                n,
                "deploy",
                lambda: {"name": deploy(Path(trained["output"]), round=n, store=store), "path": trained["output"]},
            )
            s.deployed = deployed["name"]
            if eval_tasks:
                ev = step(n, "eval", lambda: collect_step(n, "eval", eval_tasks, config.eval_group_size))
                s.eval_reward = ev["mean_reward"]
            summaries.append(s)
            echo(
                f"round {n}: train reward {num(s.train_reward)} ({got['rewarded']} episodes)"
                + (f" | held-out {num(s.eval_reward)}" if config.eval_tasks else "")
                + f" | {training_text(trained)}"
                + f" | deployed {s.deployed} | {time.perf_counter() - t0:.0f}s"
            )
    except _Stop:
        pass
    return summaries


def run_step(store, state: LoopState, run: Path, round: int, name: str, body: Callable[[], dict]) -> dict:
    """A step of the loop, once: its recorded result, or `body()`'s, recorded (store first, then state.json)."""
    info = state.done(round, name)
    if info is None:
        t0 = time.perf_counter()
        info = {**body(), "seconds": rounded(time.perf_counter() - t0)}
        # The store's record first: a kill between the two reruns the step (and records it twice),
        # rather than resuming past a step the store never heard of.
        store.append(
            "loop_steps",
            [
                {
                    "run": str(run.resolve()),
                    "round": round,
                    "step": name,
                    "mean_reward": info.get("mean_reward"),
                    "details": json.dumps(info, default=str),
                    "created_at": now(),
                }
            ],
        )
        state.finish(round, name, info)
    return info


def collect_split(
    store, config: LoopConfig, round: int, split: str, tasks: Path, group_size: int, node_proxies: Any = None
) -> dict:
    """One collect of the loop (`lcap collect` against the policy): a round's training episodes, or held-out ones.
    `node_proxies`: with --ray, the node proxies the loop keeps across its collects (dataset/collect/on_ray.py)."""
    from lcap.dataset.collect.episodes import collect

    options = replace(
        config.collect,
        group_size=group_size,
        round=round,
        split=split,
        upstream="policy",
        run_dir=Path(config.run) / "episodes",
        ray=config.train.ray,  # one --ray: the loop collects and trains on the same cluster
    )
    result = collect(
        store,
        tasks=tasks,
        command=config.command,
        options=options,
        proxy_options=config.proxy,
        node_proxies=node_proxies,
    )
    mean, n = split_reward(store, result.run_id, round, split)
    return {
        "mean_reward": mean,
        "rewarded": n,
        "episodes": result.episodes,
        "failed": result.failed,
        "skipped": result.skipped,
        "collect_run": result.run_id,
    }


def round_tasks(config: LoopConfig, n: int) -> Path:
    """Round n's training tasks: the whole file, or with `tasks_per_round` k the file's tasks (n-1)k .. nk-1,
    wrapping around at its end, written to RUN/round-n/tasks.jsonl (the same bytes when a round is resumed)."""
    if not config.tasks_per_round:
        return config.tasks
    from lcap.dataset.collect.episodes import load_tasks

    tasks = load_tasks(config.tasks)
    k = config.tasks_per_round
    if k > len(tasks):
        raise LcapError(f"--tasks-per-round {k} is more than the {len(tasks)} tasks in {config.tasks}")
    here = Path(config.tasks).resolve().parent  # a task's `template` is relative to the user's file, not this one
    chosen = [_anchored(tasks[i % len(tasks)], here) for i in range((n - 1) * k, n * k)]
    path = round_dir(config.run, n) / "tasks.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in chosen))
    return path


def _anchored(task: dict[str, Any], tasks_dir: Path) -> dict[str, Any]:
    template = task.get("template")
    return {**task, "template": str(tasks_dir / template)} if isinstance(template, str) and template else task


def _train(store, run: Path, n: int, options: TrainOptions, data: Path) -> dict:
    from lcap.train.grpo import train_round

    samples = data / "samples.parquet"
    if not samples.exists() or _parquet_rows(samples) == 0:
        from lcap.dataset.build.explain import explain

        try:
            report = json.loads((data / "report.json").read_text())
        except (OSError, ValueError):
            report = None
        why = explain(report) if report else f"no report.json in {data}"
        raise LcapError(f"round {n}: nothing to train on in {data}: {why}")
    result = train_round(store, run, n, options, data=data, progress=sys.stderr.isatty())
    return {
        "output": str(result.output),
        **{k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) or v is None},
    }


def _redeploy_if_lost(state: LoopState, store, echo) -> None:
    from lcap.policy import read_policy
    from lcap.serve.deploy import deploy

    last = state.last_deployed()
    policy = read_policy()
    if last and policy and policy.current != last["name"]:
        echo(f"policy server serves {policy.current}, not {last['name']}: deploying {last['path']} again")
        deploy(Path(last["path"]), name=last["name"], store=store)


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


class _Stop(Exception):
    """`stop_after` reached: the loop ends there, as a kill would."""
