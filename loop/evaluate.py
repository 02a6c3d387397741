"""`lcap eval`: deployments side by side on one task set, each through a collect whose proxy sends every call to
that deployment (the path `lcap loop --live` evaluates a candidate by), with the right answers, the mean reward,
pass@k and a 95% interval.

An episode that crashed, timed out or was never rewarded counts as reward 0 and wrong: it stays in the
denominator. "Right" is a reward of at least 1 (a verifier's full marks). The episodes stay in the store, each
deployment's collect a round of split `compare` of its own (the store's next; never a loop's `eval` rounds, which
a loop's held-out figures and its resume read), labelled `eval` (the evaluation's label) and `deployment`; the
summary is printed and, with `--out`, written as JSON.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lcap.capture import ProxyOptions
from lcap.config import LcapError
from lcap.dataset import CollectOptions, collect_episodes
from lcap.display import num
from lcap.loop.options import EvalOptions
from lcap.policy import PolicyServer, read_policy
from lcap.serve import forget_candidate, load_candidate

SPLIT = "compare"
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval

# Per task of one collect: samples, right ones, and the sum of rewards (an unrewarded episode is 0).
TASKS_SQL = """
SELECT task_id, count(*) AS n, count(*) FILTER (WHERE reward >= 1) AS c, sum(coalesce(reward, 0)) AS total,
       bool_and(reward IS NULL OR reward IN (0, 1)) AS binary
FROM episode_summary WHERE collect_run = ? AND round = ? AND split = 'compare' GROUP BY task_id ORDER BY task_id
"""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task from n samples of which c are right (Chen et al. 2021, arXiv 2107.03374):
    1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without replacement hold a right one."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{k} of {c} right in {n} samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (Wilson 1927): unlike the normal one it stays inside [0, 1] and
    is not empty at 0 or n successes."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def normal_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """mean +- z standard errors: the interval of a mean reward that is not 0/1."""
    n = len(values)
    if n < 2:
        return (math.nan, math.nan)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return (mean - z * sd / math.sqrt(n), mean + z * sd / math.sqrt(n))


@dataclass(frozen=True)
class EvalRow:
    """One deployment's figures on the task set."""

    deployment: str
    collect_run: str
    round: int  # its collect's round of split `compare`
    tasks: int
    episodes: int
    right: float  # share of episodes with reward >= 1
    mean_reward: float
    pass_at_k: float  # mean over tasks
    k: int
    low: float  # the 95% interval of the mean reward (Wilson when every reward is 0 or 1)
    high: float
    interval: str  # "wilson" or "normal"


def summarise(store, deployment: str, collect_run: str, round: int, k: int) -> EvalRow:
    """The figures of one deployment's collect, from the store."""
    rows = store.fetchall(TASKS_SQL, [collect_run, round])
    if not rows:
        raise LcapError(f"the evaluation of {deployment} stored no episode (collect {collect_run})")
    n = sum(r[1] for r in rows)
    c = sum(r[2] for r in rows)
    total = sum(r[3] for r in rows)
    binary = all(r[4] for r in rows)
    if binary:
        low, high = wilson(c, n)
    else:
        rewards = [v for (v,) in store.fetchall(_REWARDS_SQL, [collect_run, round])]
        low, high = normal_interval(rewards)
    passes = [pass_at_k(r[1], r[2], min(k, r[1])) for r in rows]
    return EvalRow(
        deployment,
        collect_run,
        round,
        len(rows),
        n,
        c / n,
        total / n,
        sum(passes) / len(passes),
        k,
        low,
        high,
        "wilson" if binary else "normal",
    )


_REWARDS_SQL = (
    "SELECT coalesce(reward, 0) FROM episode_summary WHERE collect_run = ? AND round = ? AND split = 'compare'"
)


def _served(record: PolicyServer, name: str) -> bool:
    """Whether a call that asks for `name` reaches it now (the base model only while no full checkpoint replaced
    its weights in place)."""
    return name in record.loras or (name == record.served_model and not record.served_as)


def _pin(store, record: PolicyServer, name: str) -> tuple[str | None, bool]:
    """(the model the collect asks for, whether it was loaded here for this evaluation): the current deployment is
    routed as is; another one the replicas serve is asked for by name; an earlier LoRA deployment of the store is
    loaded beside the current one."""
    if name == record.current:
        return None, False
    if _served(record, name):
        return name, False
    rows = store.fetchall(
        "SELECT path, round FROM deployments WHERE name = ? AND kind = 'lora' ORDER BY created_at DESC LIMIT 1", [name]
    )
    if not rows:
        served = sorted({record.current, *record.loras} | ({record.served_model} if not record.served_as else set()))
        raise LcapError(
            f"--deployment {name}: neither served now ({', '.join(served)}) nor a LoRA deployment of the store"
        )
    return load_candidate(Path(rows[0][0]), round=rows[0][1]), True


def run_eval(
    store,
    *,
    tasks: Path,
    command: list[str],
    options: EvalOptions,
    collect: CollectOptions,
    proxy: ProxyOptions,
    echo: Callable[[str], None],
) -> list[EvalRow]:
    """Evaluate each deployment (default: the current one) in turn on `tasks`, `options.samples` samples each.
    LcapError, once every deployment's figures are out, when one had no episode finish ok (an agent that cannot run
    scores 0 everywhere: its figures would say nothing of the deployment)."""
    record = read_policy()
    if record is None:
        raise LcapError("no policy server: `lcap serve --model M` first")
    label = options.label or time.strftime("eval-%Y%m%d-%H%M%S")
    rows, none_ok = [], []
    for name in options.deployments or (record.current,):
        model, loaded = _pin(store, record, name)
        round = store.fetchall("SELECT coalesce(max(round), 0) + 1 FROM episodes WHERE split = ?", [SPLIT])[0][0]
        try:
            result = collect_episodes(
                store,
                tasks=tasks,
                command=command,
                options=replace(
                    collect, group_size=options.samples, round=round, split=SPLIT, upstream="policy", model=model
                ),
                labels={"eval": label, "deployment": name},
                proxy_options=proxy,
            )
        finally:
            if loaded and model is not None:
                forget_candidate(model)
        rows.append(summarise(store, name, result.run_id, round, options.samples))
        echo(f"[eval] {name}: {result.episodes} episodes, {result.failed} failed (collect {result.run_id})")
        if result.failed and not result.finished:
            none_ok.append(f"{name} ({result.failed} failed)")
    echo(table(rows, proxy.temperature))
    if options.out is not None:
        summary = {"label": label, "tasks": str(tasks), "temperature": proxy.temperature, "rows": rows}
        options.out.write_text(json.dumps(summary, default=plain, indent=2) + "\n")
    if none_ok:
        raise LcapError(
            f"eval: no episode of {', '.join(none_ok)} finished ok: see the failures above (the agent, not the "
            "deployment, is what failed; its figures count every episode as wrong)"
        )
    return rows


def plain(row: EvalRow) -> dict:
    """A row as JSON: a figure over too few episodes (NaN) is null."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.__dict__.items()}


def table(rows: Sequence[EvalRow], temperature: float | None) -> str:
    """The side-by-side table."""
    heading = f"temperature {temperature:g}" if temperature is not None else "the agent's temperature"
    lines = [
        f"lcap eval ({heading}): mean reward with its 95% interval",
        f"{'deployment':<32} {'tasks':>5} {'episodes':>8} {'right':>6} {'reward':>6} {'95% interval':>15} "
        f"{'pass@k':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.deployment:<32} {r.tasks:>5} {r.episodes:>8} {num(r.right):>6} {num(r.mean_reward):>6} "
            f"{'[' + num(r.low) + ', ' + num(r.high) + ']':>15} {num(r.pass_at_k):>6}@{r.k}"
        )
    return "\n".join(lines)
