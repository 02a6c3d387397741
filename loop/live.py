"""`lcap loop --live`: learn from the traffic of a serving proxy, guarded by a held-out evaluation.

The loop collects nothing to train on. Each step:

1. **batch**: waits (re-reading the store every POLL_S, at most --wait-timeout) until the store holds
   --min-samples *ready* live episodes: rewarded, never trained, not from a collect, every call served by a
   deployment within --max-staleness of the current one, in a trainable group. Their ids are recorded (store,
   then RUN/state.json), then the episodes are *adopted* by the step: their rows get round N, split `live`,
   task = their group key and a sample index, status ok, so build-dataset and every view read them as a round.
2. **build** and **train**: build-dataset of round N's `live` split; the same trainer and run layout as a loop
   round (RUN/round-N/adapter), continuing the deployment that is current (not round N-1's output: a refused
   candidate or a rollback makes those differ).
3. **eval**: the candidate adapter is hot-loaded beside the current deployment (serve/deploy.py
   `load_candidate`: routed calls do not see it) and the held-out tasks run against it through a proxy of
   their own that asks for it; **eval-current**: the same tasks against the current deployment, unless that
   deployment's score is recorded already (`scores` in RUN/state.json).
4. **promote**: the candidate becomes current (a `deployments` row) if its held-out reward >= the current
   one's - --promote-margin, and the current deployment is still the one it was compared with; else it is
   refused, with the reason in `loop_steps`, and dropped from the policy record. Steps 3 and 4 are
   loop/promotion.py's, the rule `lcap loop` follows too.

Traffic keeps flowing throughout: the serving proxy routes to the record's current deployment, which only a
promotion (or `lcap deploy --rollback`) moves; an adapter is hot-loaded, so calls in flight finish on the one
they started on. Killed anywhere, the same command resumes at the first unfinished step (as `lcap loop`).

Staleness counts deployment changes the loop has seen (`lineage` in RUN/state.json: the deployment current
when it started, then each one made current, a rollback included); a call served by a deployment the loop has
not seen keeps its episode out.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from lcap.config import LcapError
from lcap.loop.promotion import evaluate, gate, read_policy_current, verdict_text
from lcap.loop.steps import (
    SKIPPED,
    LoopConfig,
    LoopState,
    RoundSummary,
    StepRunner,
    StopAfter,
    build_step,
    skip_step,
    skipped_line,
    solved,
    train_step,
)
from lcap.policy import read_policy
from lcap.progress import Reporter
from lcap.train import round_dir, training_text

LIVE_SPLIT = "live"  # the split adopted live episodes get: build-dataset --split live reads them
POLL_S = 2.0

# Live episodes ready to train: rewarded, never adopted, not a collect's, with at least one call that has token
# ids, every call served by a deployment in $fresh. Each with its group key and the deployment that served most.
#
# The group key follows build-dataset's --advantage. GRPO's group advantage (`group`) compares episodes of one
# task: here, of one first prompt (its token ids), and a group is trainable when two or more of its episodes are
# rewarded and (unless --keep-zero-variance) their rewards differ. A baseline over the batch (`batch`, `rloo`),
# for prompts that never repeat, makes every ready episode trainable (`ready_groups`).
_READY = """
WITH live AS (
    SELECT e.episode_id, r.reward
    FROM episodes e JOIN rewards_from($source::VARCHAR) r USING (episode_id)
    WHERE e.round IS NULL AND e.labels->>'collect' IS NULL AND coalesce(e.status, 'running') IN ('running', 'ok')
      AND r.reward IS NOT NULL),
calls AS (
    SELECT t.episode_id,
           arg_min(t.prompt_token_ids, t.seq) FILTER (WHERE t.prompt_token_ids IS NOT NULL) AS first_prompt,
           bool_and(coalesce(list_contains($fresh::VARCHAR[], t.deployment), false)) AS fresh,
           count(*) FILTER (WHERE t.completion_token_ids IS NOT NULL) AS with_ids,
           mode(t.deployment) AS deployment, max(t.ended_at) AS last_call
    FROM turns t SEMI JOIN live USING (episode_id)
    WHERE t.error IS NULL AND coalesce(t.status_code, 200) < 400
    GROUP BY t.episode_id)
SELECT live.episode_id, live.reward, 'p-' || left(md5(calls.first_prompt::VARCHAR), 12) AS key,
       calls.deployment, calls.last_call
FROM live JOIN calls USING (episode_id)
WHERE calls.fresh AND calls.with_ids > 0 AND calls.first_prompt IS NOT NULL
ORDER BY calls.last_call, live.episode_id
"""

# The step adopts its batch: the episodes read as round N of the `live` split from now on (idempotent).
_ADOPT = """
UPDATE episodes SET round = b.round, split = $split, task_id = b.task, sample = b.sample, status = 'ok',
       ended_at = coalesce(episodes.ended_at, b.ended_at),
       labels = json_merge_patch(coalesce(episodes.labels, '{}'), json_object(
           'round', b.round::VARCHAR, 'split', $split, 'task', b.task, 'sample', b.sample::VARCHAR, 'live', $run))
FROM (SELECT unnest($ids::VARCHAR[]) AS episode_id, unnest($tasks::VARCHAR[]) AS task,
             unnest($samples::INTEGER[]) AS sample, unnest($ended::TIMESTAMPTZ[]) AS ended_at, $n::INTEGER AS round) b
WHERE episodes.episode_id = b.episode_id
"""

_CURRENT_PATH = "SELECT kind, path FROM deployments WHERE name = ? ORDER BY created_at DESC, rowid DESC LIMIT 1"


class _NoBatch(Exception):
    """--wait-timeout passed without enough ready episodes."""


def ready_episodes(
    store,
    fresh: list[str],
    keep_zero_variance: bool = False,
    *,
    advantage: str = "group",
    reward_source: str | None = None,
) -> list[tuple]:
    """The ready live episodes (id, reward, group key, deployment, last call) whose calls were all served by the
    deployments `fresh`, rewarded from `reward_source` (None: any), that `advantage` can learn from; the first
    finished first."""
    rows = store.fetchall(_READY, {"fresh": list(fresh), "source": reward_source})
    return ready_groups(rows, keep_zero_variance, advantage)


def ready_groups(rows: list[tuple], keep_zero_variance: bool, advantage: str = "group") -> list[tuple]:
    """The ready episodes (id, reward, key, deployment, last call) that `advantage` can learn from: under `group`,
    those in groups of one first prompt with rewards that differ; under a batch baseline, every one."""
    if advantage == "group":
        by_key: dict[str, list[tuple]] = {}
        for row in rows:
            by_key.setdefault(row[2], []).append(row)
        rows = [
            row
            for group in by_key.values()
            if len(group) >= 2 and (keep_zero_variance or max(r[1] for r in group) > min(r[1] for r in group))
            for row in group
        ]
    return sorted(rows, key=lambda r: (str(r[4]), r[0]))


def run_live_loop(
    store,
    config: LoopConfig,
    state: LoopState,
    *,
    echo: Callable[[str], None] = print,
    stop_after: tuple[int, str] | None = None,
) -> list[RoundSummary]:
    """Run (or resume) `lcap loop --live` for `config.rounds` steps; see the module's docstring."""
    if config.eval_tasks is None or not config.command:
        raise LcapError(
            "--live evaluates each candidate before promoting it: give --eval-tasks FILE, --verifier and the agent "
            "command after `--`"
        )
    if config.train.full or config.train.ray is not None or config.train.num_workers > 1:
        raise LcapError("--live trains a LoRA adapter in this process: not with --full, --ray or --num-workers")
    run = Path(config.run)
    state.data.setdefault("lineage", [])
    step = StepRunner(store, state, run, stop_after)
    first = next(
        (n for n in range(1, config.rounds + 1) if not (state.done(n, "promote") or state.done(n, SKIPPED))),
        config.rounds + 1,
    )
    summaries: list[RoundSummary] = []
    try:
        for n in range(first, config.rounds + 1):
            summaries.append(_step(store, config, state, step, n, echo))
            if summaries[-1].skipped and _stop_when_solved(store, config, state, step, n, echo):
                break
    except StopAfter:
        pass
    except _NoBatch as exc:
        echo(str(exc))
    return summaries


def _step(
    store, config: LoopConfig, state: LoopState, step: StepRunner, n: int, echo: Callable[[str], None]
) -> RoundSummary:
    t0 = time.perf_counter()
    run = Path(config.run)
    current = _observe(state)
    batch = step(n, "batch", lambda: _take_batch(store, config, state, n, current))
    adopt(store, run, n, batch["episodes"])
    out = round_dir(run, n) / "data"
    build_step(step, config, n, LIVE_SPLIT, out, echo)
    trained_from = batch["current"]
    train_options = replace(config.train, current=trained_from, mismatch_current_only=True)
    init = _policy_path(store, trained_from)
    trained = skip_step(step, n, "train", lambda: train_step(store, run, n, train_options, out, init_from=init))
    if "skipped" in trained:  # nothing to learn: no candidate, the deployment stays
        echo(skipped_line(f"step {n}", trained["skipped"]))
        return RoundSummary(round=n, skipped=trained["skipped"]["reason"])
    verdict = gate(step, config, n, trained["output"])
    if verdict["promoted"]:
        _observe(state)
    s = RoundSummary(round=n, train=trained, eval_reward=verdict["candidate_reward"])
    s.deployed = verdict["candidate"] if verdict["promoted"] else None
    s.refused = None if verdict["promoted"] else verdict["reason"]
    hist = " ".join(f"{k}:{v}" for k, v in batch["staleness"].items())
    echo(
        f"step {n}: {len(batch['episodes'])} episodes ({batch['groups']} groups) | staleness {hist}"
        f" | {training_text(trained)} | {verdict_text(verdict)} | {time.perf_counter() - t0:.0f}s"
    )
    return s


def _stop_when_solved(store, config: LoopConfig, state: LoopState, step: StepRunner, n: int, echo) -> bool:
    """After skipped step `n`: whether --stop-when-solved ends the loop (the current deployment measured again)."""
    current = read_policy_current()
    measure = functools.partial(step, n, "eval", lambda: evaluate(store, config, n, "eval", current))
    stop, said = solved(state, n, config.options.stop_when_solved, measure)
    if said:
        echo(said)
    return stop


def _observe(state: LoopState) -> str:
    """The current deployment, appended to the lineage when it is not the last one there (a promotion, a
    rollback, a deploy by hand)."""
    current = read_policy_current()
    with state.lock:
        lineage = state.data["lineage"]
        if not lineage or lineage[-1] != current:
            lineage.append(current)
            state.save()
    return current


def _fresh(lineage: list[str], max_staleness: int) -> dict[str, int]:
    """Deployment -> staleness (deployment changes since it was last current), for those within the bound."""
    last = len(lineage) - 1
    behind = {name: last - i for i, name in enumerate(lineage)}
    return {name: k for name, k in behind.items() if k <= max_staleness}


def _take_batch(store, config: LoopConfig, state: LoopState, n: int, current: str) -> dict[str, Any]:
    """`_next_batch`, shown while the step waits for traffic (lcap/progress.py: a line at least every 30 s)."""
    ready = [0]
    said = lambda: f"waiting for --min-samples {config.options.min_samples} ready episodes, {ready[0]} so far"  # noqa: E731
    with Reporter(f"step {n}", describe=said, counted=False):
        return _next_batch(store, config, state, n, current, ready)


def _next_batch(store, config: LoopConfig, state: LoopState, n: int, current: str, shown: list[int]) -> dict[str, Any]:
    """Wait for --min-samples ready episodes in trainable groups; the batch is all of them."""
    options = config.options
    started = time.monotonic()
    while True:
        fresh = _fresh(state.data["lineage"], options.max_staleness)
        rows = ready_episodes(
            store,
            list(fresh),
            config.build.keep_zero_variance,
            advantage=config.build.advantage,
            reward_source=config.build.reward_source,
        )
        shown[0] = len(rows)
        if len(rows) >= options.min_samples:
            break
        waited = time.monotonic() - started
        if options.wait_timeout and waited >= options.wait_timeout:
            raise _NoBatch(
                f"step {n}: {len(rows)} ready episodes after {waited:.0f}s, fewer than --min-samples "
                f"{options.min_samples}: stopping (the same command waits again)"
            )
        time.sleep(POLL_S)
    staleness = Counter(str(fresh.get(deployment, "?")) for _, _, _, deployment, _ in rows)
    samples: dict[str, int] = {}
    episodes = []
    for episode, _, key, _, last_call in rows:
        samples[key] = samples.get(key, -1) + 1
        episodes.append({"id": episode, "group": key, "sample": samples[key], "ended_at": str(last_call)})
    return {
        "episodes": episodes,
        "groups": len(samples),
        "staleness": dict(sorted(staleness.items())),
        "current": current,
        "waited_s": round(time.monotonic() - started, 3),
    }


def adopt(store, run: Path, n: int, episodes: list[dict[str, Any]]) -> None:
    """Make a step's batch (`{id, group, sample, ended_at}` each) round `n` of the `live` split (idempotent)."""
    store.execute(
        _ADOPT,
        {
            "ids": [e["id"] for e in episodes],
            "tasks": [e["group"] for e in episodes],
            "samples": [e["sample"] for e in episodes],
            "ended": [e["ended_at"] for e in episodes],
            "n": n,
            "split": LIVE_SPLIT,
            "run": hashlib.sha1(str(Path(run).resolve()).encode()).hexdigest()[:12],
        },
    )


def _policy_path(store, name: str) -> Path | None:
    """What training continues: the current deployment's adapter, or None for the base model."""
    record = read_policy()
    rows = store.fetchall(_CURRENT_PATH, [name])
    kind, path = rows[0] if rows else (None, None)
    if record is not None and name in record.loras:
        return Path(record.loras[name])
    if kind == "lora" and path:
        return Path(path)
    if kind == "base" or (record is not None and name == record.served_model and not record.served_as):
        return None
    raise LcapError(
        f"the current deployment {name!r} is not a LoRA adapter or the base model: --live trains adapters on the "
        "base model; deploy one (or roll back to one) first"
    )
