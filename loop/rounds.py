"""`lcap loop`: collect -> build-dataset -> train -> deploy, round after round, resumable.

Every finished step is written to RUN/state.json (atomically) before the next one starts, and
mirrored in the store's `loop_steps` table for SQL. Run the same command again after a kill and
it continues at the first unfinished step: collect resumes itself (finished episodes are kept),
build and train are redone from their inputs, and the last deployed adapter is deployed again if
the policy server no longer serves it (e.g. it was restarted).

Round numbering: round N's samples are collected with the policy deployed last (round 1 with the
base), train on them, and deploy the result. With --eval-tasks the held-out tasks run before round 1
(`eval` of round 0, the base policy), and each round's adapter is a candidate (loop/promotion.py, the
live loop's rule): loaded beside the current deployment, evaluated on the held-out tasks by name, and
deployed only if it is no worse than the current one by more than --promote-margin; a refused round
is kept in the run folder, deploys nothing, and the next round trains from the deployment that stays.
A full checkpoint (--full) cannot be served beside the policy: it is deployed, then evaluated.

With --live, loop/live.py runs the steps instead: trained on a serving proxy's rewarded traffic, each candidate
evaluated before it is promoted.

With --per-role, loop/roles.py trains each round's roles an adapter each and deploys them at once; with
--eval-tasks the round's adapters are one candidate of the same gate (each role's calls pinned to its adapter),
promoted together or refused together.

With --sft-data, round 1 is an SFT round (train on those supervised samples, deploy, eval) and the --rounds RL
rounds are 2, 3, ...: the first of them collects with the SFT policy.
"""

import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lcap.capture import ensure_node_capture
from lcap.config import LcapError
from lcap.display import num
from lcap.loop.live import run_live_loop
from lcap.loop.overlap import run_async_loop
from lcap.loop.promotion import follow, gate, guard_step, read_current, refused_text, remember, verdict_text
from lcap.loop.roles import deploy_trained, train_roles
from lcap.loop.steps import (
    SKIPPED,
    LoopConfig,
    LoopState,
    RoundSummary,
    StepRunner,
    StopAfter,
    build_step,
    collect_split,
    continued,
    deploy_step,
    few_groups,
    round_tasks,
    sft_step,
    skip_step,
    skipped_line,
    solved,
    train_step,
)
from lcap.policy import read_policy
from lcap.ray_cluster import connect
from lcap.serve import check_lora_rank, deploy_policy, deploy_roles
from lcap.train import resolve_base_model, round_dir, training_text


def run_loop(
    store, config: LoopConfig, *, echo: Callable[[str], None] = print, stop_after: tuple[int, str] | None = None
) -> list[RoundSummary]:
    """Run (or resume) the loop; `stop_after=(round, step)` ends it there (tests use it to stage a kill)."""
    run = Path(config.run)
    state = LoopState(run, config.key())
    if config.command and not config.collect.transparent:  # a Node agent never runs uncaptured, in any round
        ensure_node_capture(config.command)
    policy = read_policy()
    if policy is None:
        raise LcapError("no policy server is running: start one with `lcap serve --model M` (or run `lcap demo`)")
    resolve_base_model(run, config.train.base_model or policy.base_model)
    if not config.train.full and not config.options.deploy_merge:  # a round's adapter the server cannot load fails now
        check_lora_rank(policy, config.train.lora_r, "--lora-r")
    if config.train.ray is not None:  # an unreachable cluster fails now, not after the first collect
        connect(config.train.ray)
    elif config.train.num_workers > 1:
        raise LcapError(f"--num-workers {config.train.num_workers} trains on a Ray cluster: add --ray ADDRESS")
    (run / "loop.json").write_text(json.dumps({**asdict(config), "key": config.key()}, indent=2, default=str))
    _redeploy_if_lost(state, store, echo)
    if config.eval_tasks and not config.options.live and (config.options.overlap or not gated(config)):
        flag = "--async" if config.options.overlap else "--deploy-merge" if config.options.deploy_merge else "--full"
        echo(
            f"note: {flag} deploys each round before its held-out evaluation (no --promote-margin gate: only one "
            "adapter of the synchronous loop is evaluated first)"
        )
    if config.options.live:
        return run_live_loop(store, config, state, echo=echo, stop_after=stop_after)
    if config.options.overlap:
        return run_async_loop(store, config, state, policy.current, echo=echo, stop_after=stop_after)

    step = StepRunner(store, state, run, stop_after)
    if config.train.ray is None:
        return _rounds(store, config, step, echo, None)
    from lcap.dataset import NodeProxies  # the ray extra

    with NodeProxies(store) as node_proxies:  # started by the first collect, serving every collect of the loop
        return _rounds(store, config, step, echo, node_proxies)


def _rounds(
    store, config: LoopConfig, step: StepRunner, echo: Callable[[str], None], node_proxies: Any
) -> list[RoundSummary]:
    """The synchronous loop's rounds; `node_proxies`: with --ray, the Ray node proxies of all its collects."""

    def collect_step(round: int, split: str, tasks: Path, group_size: int) -> dict:
        return collect_split(store, config, round, split, tasks, group_size, node_proxies)

    run = Path(config.run)
    eval_tasks = config.eval_tasks
    summaries: list[RoundSummary] = []
    try:
        if eval_tasks:
            base = read_current(config.options.per_role)  # with --per-role: every role's deployment
            info = step(
                0, "eval", lambda: {**collect_step(0, "eval", eval_tasks, config.eval_group_size), "deployment": base}
            )
            if info.get("deployment"):  # what a candidate is compared with until one is promoted
                remember(step.state, info["deployment"], info["mean_reward"], 0)
            echo(f"round 0 (base policy): held-out reward {num(info['mean_reward'])} ({info['rewarded']} episodes)")
            summaries.append(RoundSummary(round=0, eval_reward=info["mean_reward"]))
        first = 1
        if config.options.sft_data:
            summaries.append(_sft_round(store, config, step, collect_step, echo, node_proxies))
            first = 2
        for n in range(first, first + config.rounds):
            t0 = time.perf_counter()
            s = RoundSummary(round=n)
            tasks = round_tasks(config, n)
            got = step(n, "collect", lambda: collect_step(n, "train", tasks, config.collect.group_size))
            s.train_reward = got["mean_reward"]
            if config.options.per_role:
                said = _per_role(step, config, collect_step, s, echo, node_proxies)
            else:
                data = round_dir(run, n) / "data"
                build_step(step, config, n, "train", data, echo)
                said = _train_deploy_eval(
                    step,
                    config,
                    collect_step,
                    s,
                    lambda: train_step(store, run, n, config.train, data, continued(step.state, n)),
                    echo,
                    node_proxies,
                )
            summaries.append(s)
            if said is None:  # nothing to learn: skipped, the deployment stays
                if _stop_when_solved(step, config, collect_step, n, echo):
                    break
                continue
            echo(
                f"round {n}: train reward {num(s.train_reward)} ({got['rewarded']} episodes){said}"
                f" | {time.perf_counter() - t0:.0f}s"
            )
    except StopAfter:
        pass
    return summaries


def _sft_round(
    store, config: LoopConfig, step: StepRunner, collect_step, echo: Callable[[str], None], node_proxies: Any
) -> RoundSummary:
    """Round 1 of `--sft-data`: SFT on the given samples, then deployed (with --eval-tasks, promoted or refused on
    the held-out tasks as any round)."""
    t0 = time.perf_counter()
    run = Path(config.run)
    data = Path(config.options.sft_data or "")
    s = RoundSummary(round=1)
    train = functools.partial(sft_step, store, run, 1, config.train, data)
    said = _train_deploy_eval(step, config, collect_step, s, train, echo, node_proxies)
    echo(f"round 1 (sft on {data}): {s.train['n_samples']} samples{said} | {time.perf_counter() - t0:.0f}s")
    return s


def _train_deploy_eval(
    step: StepRunner,
    config: LoopConfig,
    collect_step,
    s: RoundSummary,
    train: Callable[[], dict],
    echo: Callable[[str], None],
    node_proxies: Any,
) -> str | None:
    """A round's training (`train`), then its candidate promoted or refused on the held-out tasks (with
    --eval-tasks; a full checkpoint: deployed, then evaluated) or deployed, recorded in `s`; what its line says of
    them (None: the round had nothing to learn and was skipped, its one line printed)."""
    n = s.round
    s.train = skip_step(step, n, "train", train)
    if "skipped" in s.train:
        s.skipped = s.train["skipped"]["reason"]
        echo(skipped_line(f"round {n}", s.train["skipped"]))
        return None
    if warning := few_groups(f"round {n}", s.train, config.options.min_groups):
        echo(warning)
    if gated(config):
        verdict = gate(step, config, n, s.train["output"], node_proxies)
        s.eval_reward = verdict.get("candidate_reward")
        if verdict["promoted"]:  # the `deploy` step every resume and reader looks for
            s.deployed = step(n, "deploy", lambda: follow(verdict))["name"]
        else:
            s.refused = verdict["reason"]
        return f" | {verdict_text(verdict)} | {training_text(s.train)}"
    if (refused := guard_step(step, config, n, s.train)) is not None:
        s.refused = refused["reason"]
        return f" | {refused_text(refused)} | {training_text(s.train)}"
    merge = config.options.deploy_merge
    s.deployed = step(n, "deploy", lambda: deploy_step(step.store, s.train["output"], n, merge))["name"]
    held_out = _held_out(step, config, collect_step, s)
    return f"{held_out} | {training_text(s.train)} | deployed {s.deployed}"


def _per_role(
    step: StepRunner, config: LoopConfig, collect_step, s: RoundSummary, echo: Callable[[str], None], node_proxies: Any
) -> str | None:
    """A round of --per-role (loop/roles.py): every role trained (one line each), then their adapters deployed at
    once, or with --eval-tasks promoted at once or refused together (loop/promotion.py), recorded in `s`; what the
    round's line says of them (None: no role had anything to learn, the round was skipped)."""
    n = s.round
    trained = train_roles(step, config, n, echo)
    s.train = trained
    if not trained:
        s.skipped = (step.state.done(n, SKIPPED) or {}).get("reason")
        return None
    if not gated(config):
        if (refused := guard_step(step, config, n, trained)) is not None:
            s.refused = refused["reason"]
            return f" | {refused_text(refused)}"
        s.roles = deploy_trained(step, n, trained)
        s.deployed = ", ".join(f"{role} {name}" for role, name in s.roles.items())
        return f"{_held_out(step, config, collect_step, s)} | deployed {s.deployed}"
    verdict = gate(step, config, n, {role: record["output"] for role, record in trained.items()}, node_proxies)
    s.eval_reward = verdict.get("candidate_reward")
    if verdict["promoted"]:  # the `deploy` step every resume (and _redeploy_if_lost) reads each role's from
        deployed = step(n, "deploy", lambda: follow(verdict))["roles"]
        s.roles = {role: info["name"] for role, info in deployed.items()}
        s.deployed = ", ".join(f"{role} {name}" for role, name in s.roles.items())
    else:
        s.refused = verdict["reason"]
    return f" | {verdict_text(verdict)}"


def _held_out(step: StepRunner, config: LoopConfig, collect_step, s: RoundSummary) -> str:
    """With --eval-tasks, round `s`'s deployment evaluated on the held-out tasks (recorded in `s`); what the round's
    line says of it."""
    if not config.eval_tasks:
        return ""
    n, tasks = s.round, config.eval_tasks
    s.eval_reward = step(n, "eval", lambda: collect_step(n, "eval", tasks, config.eval_group_size))["mean_reward"]
    return f" | held-out {num(s.eval_reward)}"


def gated(config: LoopConfig) -> bool:
    """Whether a round's policy is promoted on held-out evidence before it is deployed: with --eval-tasks, for an
    adapter, or --per-role's adapters together (a full checkpoint replaces the served weights, so it can only be
    evaluated once deployed; so can a merged deploy's, --deploy-merge)."""
    return config.eval_tasks is not None and not config.train.full and not config.options.deploy_merge


def _stop_when_solved(step: StepRunner, config: LoopConfig, collect_step, n: int, echo: Callable[[str], None]) -> bool:
    """After skipped round `n`: whether --stop-when-solved ends the loop (the held-out tasks run again to tell)."""
    eval_tasks = config.eval_tasks
    held_out = (
        (lambda: step(n, "eval", lambda: collect_step(n, "eval", eval_tasks, config.eval_group_size)))
        if eval_tasks
        else None
    )
    stop, line = solved(step.state, n, config.options.stop_when_solved, held_out)
    if line:
        echo(line)
    return stop


def _redeploy_if_lost(state: LoopState, store, echo) -> None:
    if roles := state.deployed_roles():  # --per-role: each role's latest adapter of the loop
        _redeploy_roles_if_lost(roles, store, echo)
        return
    last = state.last_deployed()
    policy = read_policy()
    if last and policy and policy.current != last["name"]:
        echo(f"policy server serves {policy.current}, not {last['name']}: deploying {last['path']} again")
        deploy_policy(Path(last["path"]), name=last["name"], store=store, merge=last.get("merged", False))


def _redeploy_roles_if_lost(roles: dict[str, dict], store, echo) -> None:
    """--per-role: the roles whose loop deployment the policy server no longer serves (e.g. it was restarted)
    deployed again, those of one round at once (a role's deployment is named by its adapter's files and round, so
    it gets its own name again)."""
    policy = read_policy()
    lost = {role: info for role, info in roles.items() if policy and policy.deployment_of(role) != info["name"]}
    if not lost:
        return
    said = ", ".join(f"{role} {info['name']}" for role, info in lost.items())
    echo(f"policy server does not serve {said}: deploying them again")
    for n in sorted({info["round"] for info in lost.values()}):
        adapters = {role: Path(info["path"]) for role, info in lost.items() if info["round"] == n}
        deploy_roles(adapters, round=n, store=store)
