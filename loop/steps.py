"""What both loops are made of: the loop's config, its resumable state (RUN/state.json), and its steps, each
run once and recorded (`StepRunner`): a collect, a round's training, a deploy.

The synchronous loop (rounds.py) runs them round by round; the overlapped loop (overlap.py) runs the same steps
while collection goes on.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from lcap.capture import ProxyOptions
from lcap.config import LcapError
from lcap.dataset import (
    BuildOptions,
    CollectOptions,
    build_dataset,
    collect_episodes,
    explain,
    last_report,
    load_tasks,
    lost_lines,
)
from lcap.display import num, rounded
from lcap.files import atomic_write
from lcap.loop.options import LoopOptions
from lcap.policy import read_policy
from lcap.serve import deploy_policy, deploy_roles
from lcap.store import now
from lcap.train import (
    PREVIOUS_ROUND,
    NothingToLearn,
    PreviousRound,
    TrainOptions,
    equal_rewards,
    read_report,
    round_dir,
    sft_round,
    train_round,
)

SKIPPED = "skipped"  # the loop_steps step of a round with nothing to learn: its details say why and what stays


@dataclass
class LoopConfig:
    run: Path
    rounds: int
    tasks: Path | None  # None: --live, which collects no training episodes of its own
    command: list[str]
    eval_tasks: Path | None = None
    eval_group_size: int = 1
    tasks_per_round: int = 0  # 0: every task every round; else the next this many of the file each round
    collect: CollectOptions = field(default_factory=CollectOptions)
    build: BuildOptions = field(default_factory=BuildOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    proxy: ProxyOptions = field(default_factory=ProxyOptions)  # its policy-route flags (stitch, adapt)
    options: LoopOptions = field(default_factory=LoopOptions)  # the loop's own: --async and its bounds
    eval_verifier: str | None = None  # the held-out episodes' verifier (None: collect's, the training episodes')

    def __post_init__(self) -> None:
        if self.tasks_per_round < 0:
            raise LcapError("--tasks-per-round must be 0 (every task) or more")
        if (self.tasks is None) != self.options.live:
            raise LcapError(
                "--live trains on live traffic, not on --tasks"
                if self.options.live
                else "give the training tasks (--tasks FILE)"
            )
        if self.options.per_role and (
            self.train.full or self.options.overlap or self.options.live or self.options.sft_data
        ):
            raise LcapError(
                "--per-role trains a LoRA adapter per role in synchronous rounds: not with --full (one checkpoint "
                "serves every role), --async or --live (their steps train one policy), nor --sft-data (its round's "
                "adapter serves every role)"
            )

        if self.options.max_step_kl and not self.train.step_kl_samples:
            raise LcapError(
                "--max-step-kl reads each round's step KL: not with --step-kl-samples 0, which measures none"
            )
        if self.options.deploy_merge and self.train.full:
            raise LcapError(
                "--deploy-merge merges a round's LoRA adapter: --full trains a checkpoint, deployed as it is"
            )

    def key(self) -> str:
        """What must not change between a run and its resume (more rounds may be added)."""
        ident = [
            list(self.command),
            str(Path(self.tasks).resolve()) if self.tasks else None,
            self.collect.group_size,
            self.collect.verifier,
            str(Path(self.eval_tasks).resolve()) if self.eval_tasks else None,
            self.eval_group_size,
        ]
        if self.tasks_per_round:
            ident.append(self.tasks_per_round)
        if self.eval_verifier:
            ident.append(["eval-verifier", self.eval_verifier])
        if self.options.sft_data:  # its round 1 is the SFT round: the RL rounds' numbers shift by one
            ident.append(["sft", str(Path(self.options.sft_data).resolve())])
        if self.options.overlap:  # an async run's state (batches of groups) is not a synchronous run's (rounds)
            ident.append("async")
        if self.options.live:  # nor is a live run's (batches of live episodes, candidates)
            ident.append("live")
        if self.options.per_role:  # nor a per-role run's (each role's steps and adapters)
            ident.append("per-role")
        return hashlib.sha1(json.dumps(ident).encode()).hexdigest()[:12]


class LoopState:
    """RUN/state.json: the finished steps and what they produced."""

    def __init__(self, run: Path, key: str) -> None:
        self.path = Path(run) / "state.json"
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        if data and data.get("key") != key:
            raise LcapError(
                f"{self.path} belongs to a loop with another agent command, tasks, tasks per round, group size, "
                "verifier or --sft-data: use a new --run folder"
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
            atomic_write(self.path, json.dumps(self.data, indent=2, default=str))

    def where(self) -> str:
        """Where the loop stands, for the line an interrupted loop prints: after its last finished step."""
        with self.lock:
            finished = sorted(self.data["steps"].items(), key=lambda kv: kv[1].get("finished_at", 0))
        if not finished:
            return "before its first step finished"
        round_, step = finished[-1][0].split(":", 1)
        return f"after round {round_}'s {step}"

    def last_deployed(self) -> dict | None:
        deployed = self._deploys()
        return max(deployed, key=lambda x: x[0])[1] if deployed else None

    def deployed_roles(self) -> dict[str, dict]:
        """--per-role: each role's latest deployment by the loop (role -> its `name` and `path`), over every round's
        deploy (a role a later round skipped keeps an earlier round's)."""
        latest: dict[str, dict] = {}
        for _, info in sorted(self._deploys(), key=lambda x: x[0]):
            latest.update(info.get("roles") or {})
        return latest

    def _deploys(self) -> list[tuple[int, dict]]:
        """Every round's `deploy` step (not a role's step that a role named `deploy` would end with)."""
        split = [(k.split(":", 1), v) for k, v in self.data["steps"].items()]
        return [(int(key[0]), v) for key, v in split if key[1:] == ["deploy"]]


def role_step(name: str, role: str | None) -> str:
    """A step's name in state.json and `loop_steps`: `train`, or for one role of --per-role `train:planner`."""
    return name if role is None else f"{name}:{role}"


@dataclass
class RoundSummary:
    round: int
    train_reward: float | None = None
    eval_reward: float | None = None
    train: dict[str, Any] = field(default_factory=dict)
    deployed: str | None = None
    skipped: str | None = None  # why the round had nothing to learn (then nothing was trained or deployed)
    roles: dict[str, str] = field(default_factory=dict)  # --per-role: role -> the deployment the round made its
    refused: str | None = None  # why its candidate was not promoted (then it was trained, never deployed)


def split_reward(store, run_id: str, round: int, split: str) -> tuple[float | None, int]:
    """Mean reward of one collect run's episodes of a round and split, from the store (resume-proof)."""
    rows = store.fetchall(
        "SELECT avg(reward), count(reward) FROM episode_summary WHERE collect_run = ? AND round = ? AND split = ?",
        [run_id, round, split],
    )
    return (rows[0][0], rows[0][1]) if rows else (None, 0)


def collect_split(
    store,
    config: LoopConfig,
    round: int,
    split: str,
    tasks: Path,
    group_size: int,
    node_proxies: Any = None,
    model: str | None = None,
    role_models: dict[str, str] | None = None,
) -> dict:
    """One collect of the loop (`lcap collect` against the policy): a round's training episodes, or held-out ones.
    `node_proxies`: with --ray, the node proxies the loop keeps across its collects (dataset/collect/on_ray.py).
    `model`: an adapter the replicas serve to send every call to (a candidate `lcap loop --live` evaluates),
    instead of the current deployment; `role_models`: role -> such an adapter for that role's calls (the
    candidates of a round of `lcap loop --per-role`), the other roles keeping their deployments."""
    options = replace(
        config.collect,
        group_size=group_size,
        round=round,
        split=split,
        upstream="policy",
        model=model,
        run_dir=Path(config.run) / "episodes",
        tasks_root=tasks_root(config),
        ray=config.train.ray,  # one --ray: the loop collects and trains on the same cluster
        verifier=config.eval_verifier if split == "eval" and config.eval_verifier else config.collect.verifier,
    )
    pinned = tuple(sorted((role_models or {}).items()))
    proxy = replace(config.proxy, role_models=pinned) if pinned else config.proxy
    result = collect_episodes(
        store, tasks=tasks, command=config.command, options=options, proxy_options=proxy, node_proxies=node_proxies
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
    assert config.tasks is not None  # not --live: LoopConfig checks
    if not config.tasks_per_round:
        return config.tasks
    tasks = load_tasks(config.tasks)
    k = config.tasks_per_round
    if k > len(tasks):
        raise LcapError(f"--tasks-per-round {k} is more than the {len(tasks)} tasks in {config.tasks}")
    here = Path(config.tasks).resolve().parent  # a task's `workspace` and `template` are relative to the user's file
    chosen = [_anchored(tasks[i % len(tasks)], here) for i in range((n - 1) * k, n * k)]
    path = round_dir(config.run, n) / "tasks.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t) + "\n" for t in chosen))
    return path


def tasks_root(config: LoopConfig) -> Path | None:
    """The folder a round's task paths must resolve inside: the round's tasks file points into the user's."""
    return config.collect.tasks_root or (Path(config.tasks).resolve().parent if config.tasks else None)


def _anchored(task: dict[str, Any], tasks_dir: Path) -> dict[str, Any]:
    out = dict(task)
    for key in ("workspace", "template"):
        if isinstance(task.get(key), str) and task[key]:
            out[key] = str(tasks_dir / task[key])
    return out


def train_step(
    store,
    run: Path,
    n: int,
    options: TrainOptions,
    data: Path,
    init_from: Path | PreviousRound | None = PREVIOUS_ROUND,
    role: str | None = None,
) -> dict:
    """Train round `n` on the samples in `data`, from `init_from` (default: round n-1's output; with `role`, that
    role's latest adapter); with none, a one-line error that says why (build's report): `NothingToLearn` when the
    round's episodes ran well but teach nothing (the loop skips such a round, or such a role)."""
    samples = data / "samples.parquet"
    if not samples.exists() or pq.ParquetFile(samples).metadata.num_rows == 0:
        report = read_report(data) or last_report(store, data)  # a build that found nothing writes no file
        what = f"round {n}" if role is None else f"round {n} role {role}"
        message = f"{what}: nothing to train on in {data}: " + (
            explain(report) if report else f"no report.json in {data}"
        )
        equal = equal_rewards(report)
        raise NothingToLearn(message, equal) if equal else LcapError(message)
    result = train_round(
        store, run, n, options, data=data, progress=sys.stderr.isatty(), init_from=init_from, role=role
    )
    return _trained(result.output, result.metrics)


def continued(state: LoopState, n: int) -> Path | None:
    """What round `n` trains from: the output of the last round before it that deployed (rounds skipped with
    nothing to learn in between), None for the base model."""
    for m in range(n - 1, 0, -1):
        trained = state.done(m, "train")
        if trained and state.done(m, "deploy"):
            return Path(trained["output"])
    return None


def role_continued(state: LoopState, n: int, role: str) -> Path | None:
    """What role `role`'s round `n` trains from with --per-role: its adapter of the last round before `n` that
    deployed it (a round that refused its candidates, or skipped the role, deployed none), None for the base
    model."""
    for m in range(n - 1, 0, -1):
        deployed = ((state.done(m, "deploy") or {}).get("roles") or {}).get(role)
        if deployed:
            return Path(deployed["path"])
    return None


def skip_step(step: StepRunner, n: int, name: str, train: Callable[[], dict], role: str | None = None) -> dict:
    """Round `n`'s training (`train`, recorded as step `name`), or, when it has nothing to learn, the round recorded
    as `skipped` with its reason and the deployment that stays (`{"skipped": ...}`): a loop goes on without it.
    With `role` (--per-role), that role's training, skipped as `skipped:ROLE` with the role's deployment."""
    skipped = step.state.done(n, role_step(SKIPPED, role))
    if skipped is not None:
        return {"skipped": skipped}
    try:
        trained = step(n, name, train)
    except NothingToLearn as exc:
        kept = read_policy()
        why = {"reason": exc.reason, "kept": kept.deployment_of(role) if kept else None}
        return {"skipped": step(n, role_step(SKIPPED, role), lambda: why)}
    return trained


def few_groups(what: str, trained: dict, minimum: int) -> str | None:
    """The warning for a round trained on fewer than `minimum` groups (--min-groups), None otherwise (an SFT round,
    which has no groups, included)."""
    n = trained.get("n_groups")
    if n is None or n >= minimum:
        return None
    return f"warning: {what} trained on {n} group{'s' if n != 1 else ''}, fewer than --min-groups {minimum}"


def skipped_line(what: str, skipped: dict) -> str:
    """The one line a skipped round prints: "round 3: every group got the same reward (8 of 8): nothing to learn;
    policy-r2 stays"."""
    return f"{what}: {skipped['reason']}: nothing to learn; {skipped.get('kept') or 'the current deployment'} stays"


def sft_step(store, run: Path, n: int, options: TrainOptions, data: Path) -> dict:
    """Train round `n` with SFT on the supervised samples in `data` (`lcap loop --sft-data`)."""
    result = sft_round(store, run, n, replace(options, sft=True), data=data, progress=sys.stderr.isatty())
    return _trained(result.output, result.metrics)


def _trained(output: Path, metrics: dict[str, Any]) -> dict:
    """A training step's record: its output and the metrics that are numbers."""
    return {"output": str(output), **{k: v for k, v in metrics.items() if isinstance(v, (int, float)) or v is None}}


def solved(state: LoopState, n: int, k: int, held_out: Callable[[], dict] | None) -> tuple[bool, str | None]:
    """--stop-when-solved `k`: whether the loop stops after round `n`, and the line that says why (None: no line).
    It stops when rounds n-k+1..n were all skipped (nothing to learn) and the held-out reward, measured again now
    (`held_out`, None without --eval-tasks), is at least that of the last round that deployed (round 0: the base)."""
    if not k or n < k or not all(state.done(m, SKIPPED) for m in range(n - k + 1, n + 1)):
        return False, None
    said = f"{k} rounds in a row with nothing to learn"
    if held_out is None:
        return True, f"stopping: {said} (--stop-when-solved {k})"
    now, before = held_out()["mean_reward"], promoted_reward(state, n)
    if now is None or (before is not None and now < before):
        return False, f"round {n}: {said}, but held-out reward {num(now)} < {num(before)} when deployed: going on"
    return True, f"stopping: {said}, held-out reward {num(now)} >= {num(before)} (--stop-when-solved {k})"


def refused(state: LoopState, n: int) -> dict | None:
    """Round `n`'s refusal (step `promote` with `promoted` false: a gate's, or --max-step-kl's), None if it has none."""
    verdict = state.done(n, "promote")
    return verdict if verdict is not None and verdict.get("promoted") is False else None


def promoted_reward(state: LoopState, before: int) -> float | None:
    """The held-out reward of the last round before `before` that deployed its policy (round 0: the base policy)."""
    for m in range(before - 1, 0, -1):
        if state.done(m, "deploy") or (state.done(m, "promote") or {}).get("promoted"):
            return (state.done(m, "eval") or {}).get("mean_reward")
    return (state.done(0, "eval") or {}).get("mean_reward")


def build_step(
    step: StepRunner,
    config: LoopConfig,
    n: int,
    split: str,
    out: Path,
    echo: Callable[[str], None],
    role: str | None = None,
) -> None:
    """Build round `n`'s samples of `split` (of `role`'s calls alone, as step `build:ROLE`) into `out` (once), then
    say what build-dataset lost."""
    options = replace(config.build, split=split)
    step(
        n,
        role_step("build", role),
        lambda: {"samples": build_dataset(step.store, round=n, out=out, options=options, role=role).samples},
    )
    for line in lost_lines(out):
        echo(line)


def deploy_step(store, output: str, n: int, merge: bool = False) -> dict:
    """Deploy round `n`'s adapter or checkpoint (`merge`: the adapter merged into its base): its deployment's name
    and path (and `merged`, which a resume deploys it again by)."""
    name = deploy_policy(Path(output), round=n, store=store, merge=merge)
    return {"name": name, "path": output, **({"merged": True} if merge else {})}


def deploy_roles_step(store, outputs: dict[str, str], n: int) -> dict:
    """Deploy round `n`'s adapters of several roles (role -> adapter) in one atomic deploy (`lcap deploy --role A=P
    --role B=Q`'s): each role's deployment name and path, under `roles`."""
    served = deploy_roles({role: Path(path) for role, path in outputs.items()}, round=n, store=store)
    return {"roles": {role: {"name": served[role], "path": path, "round": n} for role, path in outputs.items()}}


class StopAfter(Exception):
    """`stop_after` reached: the loop ends there, as a kill would."""


@dataclass
class StepRunner:
    """A loop's steps, each run once: `step(round, name, body)` is the step's recorded result, or `body()`'s,
    recorded (store first, then state.json). The loop stops after `stop_after` (tests stage a kill there)."""

    store: Any
    state: LoopState
    run: Path
    stop_after: tuple[int, str] | None = None

    def __call__(self, round: int, name: str, body: Callable[[], dict]) -> dict:
        info = self.state.done(round, name)
        if info is None:
            t0 = time.perf_counter()
            info = {**body(), "seconds": rounded(time.perf_counter() - t0)}
            # The store's record first: a kill between the two reruns the step (and records it twice),
            # rather than resuming past a step the store never heard of.
            self.store.append(
                "loop_steps",
                [
                    {
                        "run": str(self.run.resolve()),
                        "round": round,
                        "step": name,
                        "mean_reward": info.get("mean_reward"),
                        "details": json.dumps(info, default=str),
                        "created_at": now(),
                    }
                ],
            )
            self.state.finish(round, name, info)
        if self.stop_after == (round, name):
            raise StopAfter()
        return info
