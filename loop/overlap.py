"""`lcap loop --async`: collection never stops; each training step takes the next complete groups.

A producer thread draws groups wave by wave (wave w = the tasks the synchronous loop collects in round
w) and runs their episodes on one `EpisodePool` (lcap collect's episode runner, one capture proxy for
the loop), admitting a new group only while collection is at most --max-staleness steps ahead of
training. The trainer (this thread) waits for --groups-per-step complete, trainable groups (the store
is the queue), records them as the step's batch, builds them, drops samples past --max-staleness,
trains from the previous step's output and deploys, while the episodes in flight keep running.
docs/architecture.md ("The overlapped loop") gives the rules; loop/steps.py the steps it shares with loop/rounds.py.

Resumable: a step's batch is recorded (store, then RUN/state.json) before anything is built from it,
and a group in any recorded batch is never taken again.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lcap.config import LcapError
from lcap.dataset import (
    EpisodePool,
    build_dataset,
    check_round_is_free,
    load_tasks,
    plan_collect,
    read_samples_table,
    write_samples,
)
from lcap.display import num
from lcap.loop.promotion import guard_step, refused_text
from lcap.loop.steps import (
    SKIPPED,
    LoopConfig,
    LoopState,
    RoundSummary,
    StepRunner,
    StopAfter,
    collect_split,
    continued,
    deploy_step,
    refused,
    round_tasks,
    skip_step,
    skipped_line,
    solved,
    tasks_root,
    train_step,
)
from lcap.progress import Reporter
from lcap.store import now
from lcap.train import round_dir, training_text

WAKE_S = 1.0  # the trainer re-reads the store at least this often while it waits (an episode's end wakes it sooner)
UNTRAINABLE_MAX = 4  # a step stops waiting once this many batches' worth of groups in a row could not train
UNKNOWN = "unknown"  # the staleness of a sample served by a deployment the loop did not make

# Complete groups of the loop's training episodes not in any batch yet, the first finished first: complete when
# every episode of the group has finished (and been verified), trainable when two or more of them are rewarded
# and (unless zero-variance groups are kept) their rewards differ; equal when two or more are and they do not.
_COMPLETE = """
SELECT group_id, max(ended_at) AS done_at,
       count(*) FILTER (WHERE status = 'ok' AND reward IS NOT NULL) >= 2
       AND ($keep_zero_variance OR coalesce(max(reward) FILTER (WHERE status = 'ok')
                                            > min(reward) FILTER (WHERE status = 'ok'), false)) AS trainable,
       count(*) FILTER (WHERE status = 'ok' AND reward IS NOT NULL) >= 2
       AND max(reward) FILTER (WHERE status = 'ok') = min(reward) FILTER (WHERE status = 'ok') AS equal
FROM episode_summary
WHERE split = 'train' AND collect_run IN (SELECT unnest($runs::VARCHAR[]))
  AND group_id NOT IN (SELECT unnest($taken::VARCHAR[]))
GROUP BY group_id
HAVING count(*) FILTER (WHERE status IN ('ok', 'failed', 'timeout', 'error')) = $group_size
ORDER BY done_at, group_id
"""


@dataclass
class Staleness:
    """A batch's samples by staleness (versions behind the policy being trained), and how many were dropped."""

    histogram: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    kept: int = 0
    trainable: bool = False  # a group with two or more samples is left


def drop_stale(samples: Path, versions: dict[str, int], trained: int, max_staleness: int) -> Staleness:
    """Rewrite `samples` without the samples served more than `max_staleness` versions before `trained` (or by a
    deployment not in `versions`). Each sample has one deployment: the merge never joins two deployments' calls."""
    table = read_samples_table(samples)
    names = pa.array(list(versions), pa.string())
    index = pc.index_in(table["deployment"], value_set=names).to_numpy(zero_copy_only=False)
    known = ~np.isnan(index.astype(float))
    version = np.array(list(versions.values()) or [0], dtype=np.int64)
    behind = np.where(known, trained - version[np.where(known, index, 0).astype(np.int64)], -1)
    keep = known & (behind <= max_staleness)
    out = Staleness(dropped=int((~keep).sum()), kept=int(keep.sum()))
    values, counts = np.unique(behind[known], return_counts=True)
    out.histogram = {str(int(v)): int(c) for v, c in zip(values, counts)}
    if (~known).any():
        out.histogram[UNKNOWN] = int((~known).sum())
    kept = table.filter(pa.array(keep))
    sizes = pc.value_counts(kept["group_id"]).field("counts") if len(kept) else pa.array([], pa.int64())
    out.trainable = bool(len(sizes)) and bool(pc.any(pc.greater_equal(sizes, 2)).as_py())
    if out.dropped:
        write_samples(kept, Path(samples))
    return out


class Producer:
    """The thread that keeps the pool fed: groups wave after wave, each admitted while collection is at most
    `max_staleness` steps ahead of training."""

    def __init__(self, config: LoopConfig, pool, group_size: int, per_step: int, wasted: int) -> None:
        self.config, self.pool, self.group_size, self.per_step = config, pool, group_size, per_step
        self.runs: list[str] = []  # the collect runs (one per wave's tasks file) whose groups the trainer reads
        self.launched = 0  # groups drawn so far (those finished by an earlier run of the loop included)
        self.version = 0  # the deployed step
        self.wasted = wasted  # groups taken but not trained (untrainable, or a void batch): they do not count
        self.error: BaseException | None = None
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="lcap-producer", daemon=True)

    def advance(self, version: int, wasted: int) -> None:
        with self.lock:
            self.version, self.wasted = version, wasted
            self.lock.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.pool.stopping.set()
            self.lock.notify_all()

    def collect_runs(self) -> list[str]:
        with self.lock:
            return list(self.runs)

    def _admitted(self) -> bool:
        ahead = self.launched - self.wasted
        limit = min(
            (self.version + self.config.options.max_staleness + 1) * self.per_step,
            self.config.rounds * self.per_step,  # nothing past what the last step needs
        )
        return ahead < limit

    def _run(self) -> None:
        options = replace(
            self.config.collect,
            split="train",
            upstream="policy",
            run_dir=Path(self.config.run) / "episodes",
            tasks_root=tasks_root(self.config),
        )
        try:
            wave = 0
            while not self.pool.stopping.is_set():
                wave += 1
                tasks = round_tasks(self.config, wave)
                plan = plan_collect(
                    tasks=tasks,
                    command=self.config.command,
                    options=replace(options, round=wave),
                    store=self.pool.store,
                )
                check_round_is_free(self.pool.store, plan.run_id, wave, "train", replace=self.config.collect.replace)
                with self.lock:
                    if plan.run_id not in self.runs:
                        self.runs.append(plan.run_id)
                for i in range(0, len(plan.specs), self.group_size):
                    with self.lock:
                        while not self._admitted() and not self.pool.stopping.is_set():
                            self.lock.wait(WAKE_S)
                        if self.pool.stopping.is_set():
                            return
                        self.launched += 1
                    self.pool.submit(plan, plan.specs[i : i + self.group_size])
        except BaseException as exc:  # the trainer raises it (a submit refused because the loop is ending is none)
            if not self.pool.stopping.is_set():
                self.error = exc
        finally:
            with self.pool.ended:
                self.pool.ended.notify_all()


def run_async_loop(
    store,
    config: LoopConfig,
    state: LoopState,
    base_deployment: str,
    *,
    echo: Callable[[str], None] = print,
    stop_after: tuple[int, str] | None = None,
) -> list[RoundSummary]:
    if config.train.ray is not None:
        raise LcapError("--async runs its episodes on this machine: with --ray, use the synchronous loop for now")
    run = Path(config.run)
    data = _async_state(state, base_deployment)
    per_step = config.options.groups_per_step or _wave_size(config)
    size = config.collect.group_size
    summaries: list[RoundSummary] = []

    step = StepRunner(store, state, run, stop_after)

    if config.eval_tasks:
        summaries.append(_base_held_out(step, store, config, echo))

    version = max((n for n in range(1, config.rounds + 1) if _finished(state, n, "deploy")), default=0)
    last = "eval" if config.eval_tasks else "stats"
    first = next((n for n in range(1, config.rounds + 1) if not _finished(state, n, last)), config.rounds + 1)
    pool = EpisodePool(store, config.collect, config.proxy, config.collect.concurrency)
    producer = Producer(config, pool, size, per_step, _wasted(data))
    producer.advance(version, _wasted(data))
    idle_before = 0.0
    held_out = _Background()
    with pool:
        producer.thread.start()
        try:
            for n in range(first, config.rounds + 1):
                t0 = time.perf_counter()
                versions = _versions(state, n)
                current = max(versions, key=lambda name: versions[name])  # the policy step n trains from
                batch, staleness, out = _trainable_batch(
                    step, store, config, state, producer, pool, per_step, n, versions, echo
                )
                trained = _train(step, store, config, state, n, current, batch, staleness, out)
                if "skipped" in trained:  # nothing to learn: the deployment stays, the next step takes new groups
                    producer.advance(n, _wasted(data))
                    summaries.append(RoundSummary(round=n, skipped=trained["skipped"]["reason"]))
                    echo(skipped_line(f"step {n}", trained["skipped"]))
                    stop, said = solved(
                        state, n, config.options.stop_when_solved, _measure(held_out, step, store, config, n)
                    )
                    if said:
                        echo(said)
                    if stop:
                        break
                    continue
                if kept := _refused(step, config, n, trained, echo):  # the deployment stays
                    summaries.append(kept)
                    producer.advance(n, _wasted(data))
                    continue
                held_out.wait()  # the previous step's held-out episodes are all served by the policy they measure
                deployed = step(n, "deploy", lambda: deploy_step(store, trained["output"], n))
                producer.advance(n, _wasted(data))
                idle = pool.idle_seconds()
                figures = _figures(batch, trained, state, n, idle - idle_before, pool, deployed, t0)
                idle_before = idle
                step(n, "stats", lambda: _record(store, run, n, figures))
                s = RoundSummary(round=n, train=trained, deployed=deployed["name"])
                s.train_reward = trained.get("mean_reward")
                summaries.append(s)
                echo(_line(n, figures, trained, s))
                if config.eval_tasks:
                    held_out.start(n, functools.partial(_held_out, step, store, config, n, s, echo))
            held_out.wait()
        except StopAfter:
            pass
        finally:
            producer.stop()
            producer.thread.join(timeout=60)
            held_out.wait(raising=False)
    if producer.error is not None and not isinstance(producer.error, StopAfter):
        raise producer.error
    return summaries


def _base_held_out(step: StepRunner, store, config: LoopConfig, echo: Callable[[str], None]) -> RoundSummary:
    """The held-out run of the policy the loop starts on (round 0), its line said."""
    info = step(0, "eval", lambda: _evaluate(store, config, 0))
    echo(f"round 0 (base policy): held-out reward {num(info['mean_reward'])} ({info['rewarded']} episodes)")
    return RoundSummary(round=0, eval_reward=info["mean_reward"])


def _refused(
    step: StepRunner, config: LoopConfig, n: int, trained: dict, echo: Callable[[str], None]
) -> RoundSummary | None:
    """Step `n` refused by --max-step-kl, its line said: its summary (nothing deployed); None: deploy it."""
    verdict = guard_step(step, config, n, trained)
    if verdict is None:
        return None
    echo(f"step {n}: {refused_text(verdict)} | {training_text(trained)}")
    return RoundSummary(round=n, train=trained, refused=verdict["reason"])


def _async_state(state: LoopState, base_deployment: str) -> dict:
    """The loop state's data, with what the asynchronous loop keeps in it."""
    data = state.data
    data.setdefault("base_deployment", base_deployment)
    data.setdefault("void", [])  # groups of batches whose every sample was dropped as stale
    data.setdefault("untrainable", [])  # complete groups GRPO cannot learn from (fewer than two rewards, or equal)
    return data


def _trainable_batch(
    step: StepRunner,
    store,
    config: LoopConfig,
    state: LoopState,
    producer: Producer,
    pool,
    per_step: int,
    n: int,
    versions: dict,
    echo: Callable[[str], None],
) -> tuple[dict, Any, Path]:
    """Step `n`'s batch and its built samples' staleness: a batch whose every sample was stale is spent (its
    groups void) and the next one taken; a batch without groups (equal rewards) ends the search."""
    run, data = Path(config.run), state.data
    staleness: Any = None
    out = round_dir(run, n) / "data"
    while True:
        batch = step(n, "batch", lambda: _take_batch(store, config, state, producer, pool, per_step))
        if not batch["groups"]:  # a batch's worth of groups in a row got equal rewards
            break
        out = round_dir(run, n) / "data"
        staleness = _build(store, config, n, batch["groups"], out, versions)
        if staleness.trainable:
            break
        # every sample of the batch was stale: its groups are spent, the step takes another batch
        with state.lock:
            data["void"] = sorted(set(data["void"]) | set(batch["groups"]))
            del data["steps"][f"{n}:batch"]
        before = state.done(n, "void") or {"groups": [], "staleness": {}, "dropped": 0}
        void = {
            "groups": before["groups"] + batch["groups"],
            "staleness": _merged(before["staleness"], staleness.histogram),
            "dropped": before["dropped"] + staleness.dropped,
        }
        state.finish(n, "void", void)
        producer.advance(n - 1, _wasted(data))
        echo(f"step {n}: every sample of {len(batch['groups'])} groups was stale, taking the next ones")
    return batch, staleness, out


def _train(
    step: StepRunner,
    store,
    config: LoopConfig,
    state: LoopState,
    n: int,
    current: str,
    batch: dict,
    staleness,
    out: Path,
) -> dict:
    """Step `n`'s training on the batch's samples (built in `out`) from the `current` policy, or, for a batch
    without groups, the step skipped with the reason."""
    run = Path(config.run)
    if batch["groups"]:
        train_options = replace(config.train, current=current, mismatch_current_only=True)
        stale = {"staleness": staleness.histogram, "dropped_stale_async": staleness.dropped}
        init = continued(state, n)
        trained = skip_step(step, n, "train", lambda: {**train_step(store, run, n, train_options, out, init), **stale})
    else:
        why = {"reason": batch["reason"], "kept": current, "groups": batch["equal"]}
        trained = {"skipped": step(n, SKIPPED, lambda: why)}
    return trained


def _figures(
    batch: dict, trained: dict, state: LoopState, n: int, agent_wait: float, pool, deployed: dict, t0: float
) -> dict[str, Any]:
    """Step `n`'s figures, as its stats row records them."""
    return {
        "groups": len(batch["groups"]),
        "queue": batch["queue"],
        "samples": trained.get("n_samples"),
        "dropped_stale": trained["dropped_stale_async"] + (state.done(n, "void") or {}).get("dropped", 0),
        "staleness": _merged(trained["staleness"], (state.done(n, "void") or {}).get("staleness", {})),
        "trainer_wait_s": batch["trainer_wait_s"],
        "agent_wait_s": agent_wait,
        "in_flight": pool.tally.running,
        "deployed": deployed["name"],
        "seconds": time.perf_counter() - t0,
    }


def _take_batch(store, config: LoopConfig, state: LoopState, producer: Producer, pool, per_step: int) -> dict:
    """`_next_batch`, shown while the trainer waits for it (lcap/progress.py: a line at least every 30 s)."""
    ready = [0]
    said = lambda: f"waiting for {per_step} complete trainable groups, {ready[0]} ready"  # noqa: E731
    with Reporter("trainer", describe=said, counted=False):
        return _next_batch(store, config, state, producer, pool, per_step, ready)


def _next_batch(
    store, config: LoopConfig, state: LoopState, producer: Producer, pool, per_step: int, shown: list[int]
) -> dict:
    """Wait for `per_step` complete, trainable groups not taken yet, the first finished first; or, when `per_step`
    groups in a row got one reward for every sample first, none (`equal`: those groups): nothing to learn."""
    data = state.data
    started = time.monotonic()
    untrainable_before = len(data["untrainable"])
    equal: list[str] = []
    while True:
        if producer.error is not None:
            raise LcapError(f"collection stopped: {producer.error}") from producer.error
        rows = store.fetchall(
            _COMPLETE,
            {
                "runs": producer.collect_runs(),
                "taken": sorted(_taken(state)),
                "group_size": config.collect.group_size,
                "keep_zero_variance": config.build.keep_zero_variance,
            },
        )
        untrainable = [g for g, _, ok, _ in rows if not ok]
        equal += [g for g, _, ok, same in rows if not ok and same]
        if untrainable:
            with state.lock:
                data["untrainable"] = sorted(set(data["untrainable"]) | set(untrainable))
                state.save()
            producer.advance(producer.version, _wasted(data))
        ready = [g for g, _, ok, _ in rows if ok]
        shown[0] = len(ready)
        waited = time.monotonic() - started
        if len(ready) >= per_step:
            return {"groups": ready[:per_step], "queue": len(ready), "trainer_wait_s": waited}
        if len(equal) >= per_step:
            reason = f"every group got the same reward ({len(equal)} of {len(equal)})"
            return {"groups": [], "equal": equal, "reason": reason, "queue": len(ready), "trainer_wait_s": waited}
        if len(data["untrainable"]) - untrainable_before > UNTRAINABLE_MAX * per_step:
            raise LcapError(
                f"{len(data['untrainable']) - untrainable_before} groups in a row cannot train (fewer than two "
                "rewarded episodes): look at their episodes (`lcap ui`), or collect with a larger --group-size"
            )
        with pool.ended:
            pool.ended.wait(WAKE_S)


def _build(store, config: LoopConfig, n: int, groups: Sequence[str], out: Path, versions: dict[str, int]) -> Staleness:
    build_dataset(store, round=n, out=out, options=replace(config.build, split="train"), groups=groups)
    return drop_stale(out / "samples.parquet", versions, max(versions.values()), config.options.max_staleness)


class _Background:
    """One step's held-out run, beside the next step's training (it must end before that step deploys)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, n: int, body: Callable[[], None]) -> None:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # raised in the trainer's thread by wait()
                self.error = exc

        self.thread = threading.Thread(target=run, name=f"lcap-held-out-{n}", daemon=True)
        self.thread.start()

    def wait(self, raising: bool = True) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None and raising:
            raise error


def _held_out(
    step: StepRunner, store, config: LoopConfig, n: int, s: RoundSummary, echo: Callable[[str], None]
) -> None:
    info = step(n, "eval", lambda: _evaluate(store, config, n))
    s.eval_reward = info["mean_reward"]
    echo(f"step {n}: held-out reward {num(info['mean_reward'])} ({info['rewarded']} episodes)")


def _measure(held_out: _Background, step: StepRunner, store, config: LoopConfig, n: int) -> Callable[[], dict] | None:
    """--stop-when-solved's held-out measure of the deployment step `n` kept (after the previous step's held-out run
    ends); None without --eval-tasks."""
    if not config.eval_tasks:
        return None

    def measure() -> dict:
        held_out.wait()
        return step(n, "eval", lambda: _evaluate(store, config, n))

    return measure


def _evaluate(store, config: LoopConfig, n: int) -> dict:
    assert config.eval_tasks is not None
    return collect_split(store, config, n, "eval", config.eval_tasks, config.eval_group_size)


def _record(store, run: Path, n: int, figures: dict[str, Any]) -> dict:
    store.append(
        "async_steps",
        [
            {
                "run": str(run.resolve()),
                "step": n,
                **{k: v for k, v in figures.items() if k != "staleness"},
                "staleness": json.dumps(figures["staleness"]),
                "created_at": now(),
            }
        ],
    )
    return figures


def _line(n: int, f: dict[str, Any], trained: dict, s: RoundSummary) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in f["staleness"].items()) or "-"
    return (
        f"step {n}: {f['groups']} groups (queue {f['queue']}) | staleness {hist}, dropped {f['dropped_stale']}"
        f" | waited: trainer {f['trainer_wait_s']:.0f}s, agents {f['agent_wait_s']:.0f}s"
        f" | train reward {num(s.train_reward)}"
        f" | {training_text(trained)} | deployed {s.deployed}, {f['in_flight']} episodes in flight"
        f" | {f['seconds']:.0f}s"
    )


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two staleness histograms as one, in order (versions behind, then unknown)."""
    both = {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}
    return dict(sorted(both.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)))


def _versions(state: LoopState, n: int) -> dict[str, int]:
    """Deployment name -> version for the steps before `n`: the policy the loop started on is 0, each deploy after
    it the next (a step skipped with nothing to learn deploys nothing: the policy stays, as does its version)."""
    versions = {state.data["base_deployment"]: 0}
    for k in range(1, n):
        deployed = state.done(k, "deploy")
        if deployed:
            versions[deployed["name"]] = len(versions)
    return versions


def _finished(state: LoopState, n: int, last: str) -> bool:
    """Whether step `n` is over: its `last` step recorded, the step skipped with nothing to learn, or refused
    (--max-step-kl)."""
    return state.done(n, last) is not None or state.done(n, SKIPPED) is not None or refused(state, n) is not None


def _taken(state: LoopState) -> set[str]:
    with state.lock:
        taken = set(state.data["void"]) | set(state.data["untrainable"])
        for key, info in state.data["steps"].items():
            if key.endswith(":batch"):
                taken |= set(info["groups"])
    return taken


def _wasted(data: dict) -> int:
    return len(data["void"]) + len(data["untrainable"])


def _wave_size(config: LoopConfig) -> int:
    if config.tasks_per_round:
        return config.tasks_per_round
    assert config.tasks is not None  # not --live: LoopConfig checks
    return len(load_tasks(config.tasks))
