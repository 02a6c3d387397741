"""Promotion on held-out evidence: the one rule `lcap loop` and `lcap loop --live` both follow.

A trained round's adapter is a *candidate*: hot-loaded beside the current deployment (serve's `load_candidate`:
routed calls do not see it) and evaluated on the held-out tasks through a proxy that asks for it by name. It becomes
current only if its held-out mean reward is at least the current deployment's minus --promote-margin
(`refusal`), and the current deployment is still the one it was compared with. A refused candidate is dropped
from the policy record; its round stays in the run folder and in `loop_steps` (step `promote`, `promoted` false,
the reason with both figures), and the current deployment keeps serving (and is what the next round trains from).

The current deployment's held-out figure is measured once per deployment and kept (`scores` in RUN/state.json,
by deployment name): the loop's round-0 evaluation, each promoted candidate's own, or a step `eval-current` when
the current deployment has none (a deploy by hand, a rollback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lcap.config import LcapError
from lcap.display import num
from lcap.loop.steps import LoopConfig, LoopState, StepRunner, collect_split
from lcap.policy import read_policy
from lcap.serve import deploy_policy, forget_candidate, load_candidate, make_current, record_deployment


def read_policy_current() -> str:
    """The policy record's current deployment; LcapError when the policy server is gone."""
    record = read_policy()
    if record is None:
        raise LcapError("the policy server stopped (its record is gone): start it again and rerun the loop")
    return record.current


def refusal(reward: float | None, current_reward: float | None, margin: float) -> str | None:
    """Why a candidate of held-out mean reward `reward` may not replace a deployment of `current_reward`, or None
    when it may: it is promoted when reward >= current_reward - margin."""
    if reward is None or current_reward is None:
        return "no held-out episode was rewarded (" + ("candidate" if reward is None else "current") + ")"
    if reward >= current_reward - margin:
        return None
    return f"held-out reward {num(reward)} < {num(current_reward)} - margin {margin:g}"


def scores(state: LoopState) -> dict[str, dict[str, Any]]:
    """Deployment name -> its held-out figure (`mean_reward`, the `round` that measured it), kept in the state."""
    with state.lock:
        return state.data.setdefault("scores", {})


def remember(state: LoopState, name: str, reward: float | None, n: int) -> None:
    """Keep deployment `name`'s held-out figure (measured in round `n`); the first figure of a name stays."""
    with state.lock:
        known = scores(state)
        if name not in known:
            known[name] = {"mean_reward": reward, "round": n}
            state.save()


def evaluate(store, config: LoopConfig, n: int, split: str, name: str | None, node_proxies: Any = None) -> dict:
    """The held-out tasks against deployment `name`: asked for by name when it is a loaded adapter (a promotion
    during the run does not change what is measured), else through the record's current deployment."""
    assert config.eval_tasks is not None
    record = read_policy()
    pinned = name if record is not None and name in record.loras else None
    return {
        **collect_split(store, config, n, split, config.eval_tasks, config.eval_group_size, node_proxies, model=pinned),
        "deployment": name,
    }


def evaluate_candidate(store, config: LoopConfig, n: int, output: str, node_proxies: Any = None) -> dict:
    """Load round `n`'s adapter beside the current deployment (again, after a resume: the same name) and run the
    held-out tasks against it."""
    name = load_candidate(Path(output), round=n)
    return {**evaluate(store, config, n, "eval", name, node_proxies), "name": name, "path": output}


def current_figure(step: StepRunner, config: LoopConfig, n: int, node_proxies: Any = None) -> tuple[str, float | None]:
    """The current deployment and its held-out figure: the one kept, else measured now (step `eval-current`)."""
    against = read_policy_current()
    if against not in scores(step.state):
        measured = step(
            n, "eval-current", lambda: evaluate(step.store, config, n, "eval-current", against, node_proxies)
        )
        against = measured["deployment"]  # after a resume: the deployment the recorded step measured
        remember(step.state, against, measured["mean_reward"], n)
    return against, scores(step.state)[against]["mean_reward"]


def promote(
    store, config: LoopConfig, n: int, candidate: dict, against: str, current_reward: float | None, output: str
) -> dict:
    """Make the candidate current (and its `deployments` row) if `refusal` lets it and `against` is still current;
    else drop it from the record. The verdict, with both figures and the reason of a refusal."""
    margin = config.options.promote_margin
    reward = candidate["mean_reward"]
    base = {
        "candidate": candidate["name"],
        "candidate_reward": reward,
        "current": against,
        "current_reward": current_reward,
        "margin": margin,
        "train_output": output,
        "mean_reward": reward,
    }
    why = refusal(reward, current_reward, margin)
    now_current = read_policy_current()
    if why is None and now_current != against:
        why = f"the current deployment changed to {now_current} during the evaluation (a rollback?)"
    if why is None:
        record = make_current(candidate["name"])
        record_deployment(store, record, candidate["name"], candidate["path"], "lora", n)
        return {**base, "promoted": True}
    forget_candidate(candidate["name"])
    return {**base, "promoted": False, "reason": why}


def gate(step: StepRunner, config: LoopConfig, n: int, output: str, node_proxies: Any = None) -> dict:
    """Round `n`'s candidate (the adapter in `output`) evaluated, compared with the current deployment and promoted
    or refused, each part a recorded step (`eval`, `eval-current` when needed, `promote`): the verdict. A round
    whose verdict is recorded (a resume) is that verdict: nothing is loaded or measured again."""
    store = step.store
    verdict = step.state.done(n, "promote")
    if verdict is None:
        candidate = step(n, "eval", lambda: evaluate_candidate(store, config, n, output, node_proxies))
        against, current_reward = current_figure(step, config, n, node_proxies)
        verdict = step(n, "promote", lambda: promote(store, config, n, candidate, against, current_reward, output))
    if verdict["promoted"]:
        remember(step.state, verdict["candidate"], verdict["candidate_reward"], n)
    return verdict


def verdict_text(verdict: dict) -> str:
    """What a round's line says of its verdict: both figures, then the deployment made current or the refusal."""
    figures = f"held-out {num(verdict['candidate_reward'])} vs {verdict['current']} {num(verdict['current_reward'])}"
    if verdict["promoted"]:
        return f"{figures} | promoted {verdict['candidate']}"
    return f"{figures} | refused: {verdict['reason']}; {verdict['current']} stays"


def follow(verdict: dict) -> dict:
    """After a promotion: the promoted candidate current (it is, unless a resume found the record elsewhere: then
    made current again, or deployed again when the server no longer serves it). The `deploy` step's record."""
    name, path = verdict["candidate"], verdict["train_output"]
    record = read_policy()
    if record is None or record.current != name:
        if record is not None and name in record.loras:
            make_current(name)
        else:
            deploy_policy(Path(path), name=name)
    return {"name": name, "path": path, "promoted": True}
