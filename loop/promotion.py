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

`lcap loop --per-role` follows the same rule with a round's adapters, one per role it trained, as one candidate:
held-out success is an episode's, and its calls are every role's. Each adapter is loaded beside the deployments and
the held-out tasks run through a proxy that pins each trained role's calls to its candidate (the roles it did not
train keep their deployments). The current deployment it is compared with is every role's at once (`roles_key`:
"base; planner=p1, solver=s1"), so a figure is kept per combination. Promoted, all the candidates become their roles'
deployments in one record write (`make_roles_current`, the atomic multi-role deploy's); refused, none does, each is
dropped from the record, and the `promote` step names each role's refused candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lcap.config import LcapError
from lcap.display import num
from lcap.loop.steps import LoopConfig, LoopState, StepRunner, collect_split
from lcap.policy import DEFAULT_ROLE, PolicyServer, read_policy
from lcap.serve import (
    deploy_policy,
    deploy_roles,
    forget_candidate,
    load_candidate,
    make_current,
    make_roles_current,
    record_deployment,
)

# A round's candidate: one adapter (its path), or with --per-role one per role it trained (role -> path).
Candidate = str | Mapping[str, str]


def _running() -> PolicyServer:
    record = read_policy()
    if record is None:
        raise LcapError("the policy server stopped (its record is gone): start it again and rerun the loop")
    return record


def read_policy_current() -> str:
    """The policy record's current deployment; LcapError when the policy server is gone."""
    return _running().current


def roles_key(current: str, roles: Mapping[str, str]) -> str:
    """What a --per-role gate calls the deployments a candidate is compared with: the default role's, then each
    role's own ("base; planner=p1, solver=s1"; "base" alone when no role has one)."""
    own = ", ".join(f"{role}={name}" for role, name in sorted(roles.items()) if role != DEFAULT_ROLE)
    return f"{current}; {own}" if own else current


def read_current(per_role: bool) -> str:
    """The current deployment as a gate names it: the record's `current`, or (`per_role`) every role's."""
    record = _running()
    return roles_key(record.current, record.roles) if per_role else record.current


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


def evaluate(
    store,
    config: LoopConfig,
    n: int,
    split: str,
    name: str | None,
    node_proxies: Any = None,
    role_models: dict[str, str] | None = None,
) -> dict:
    """The held-out tasks against deployment `name`: asked for by name when it is a loaded adapter (a promotion
    during the run does not change what is measured), else through the record's current deployment, with each role
    of `role_models` pinned to its adapter."""
    assert config.eval_tasks is not None
    record = read_policy()
    pinned = name if record is not None and name in record.loras else None
    tasks, group_size = config.eval_tasks, config.eval_group_size
    return {
        **collect_split(
            store, config, n, split, tasks, group_size, node_proxies, model=pinned, role_models=role_models
        ),
        "deployment": name,
    }


def evaluate_candidate(store, config: LoopConfig, n: int, output: Candidate, node_proxies: Any = None) -> dict:
    """Load round `n`'s adapter (with --per-role, each role's) beside the current deployment (again, after a resume:
    the same name) and run the held-out tasks against it."""
    if isinstance(output, str):
        name = load_candidate(Path(output), round=n)
        return {**evaluate(store, config, n, "eval", name, node_proxies), "name": name, "path": output}
    names = {role: load_candidate(Path(path), round=n, role=role) for role, path in sorted(output.items())}
    record = _running()
    name = roles_key(names.get(DEFAULT_ROLE, record.current), {**record.roles, **names})
    roles = {role: {"name": served, "path": output[role], "round": n} for role, served in names.items()}
    return {**evaluate(store, config, n, "eval", name, node_proxies, names), "name": name, "roles": roles}


def current_figure(
    step: StepRunner, config: LoopConfig, n: int, node_proxies: Any = None, per_role: bool = False
) -> tuple[str, float | None]:
    """The current deployment (`per_role`: every role's) and its held-out figure: the one kept, else measured now
    (step `eval-current`)."""
    against = read_current(per_role)
    if against not in scores(step.state):
        measured = step(
            n, "eval-current", lambda: evaluate(step.store, config, n, "eval-current", against, node_proxies)
        )
        against = measured["deployment"]  # after a resume: the deployment the recorded step measured
        remember(step.state, against, measured["mean_reward"], n)
    return against, scores(step.state)[against]["mean_reward"]


def promote(
    store, config: LoopConfig, n: int, candidate: dict, against: str, current_reward: float | None, output: Candidate
) -> dict:
    """Make the candidate current (with --per-role, each role's adapter its role's, at once; and their `deployments`
    rows) if `refusal` lets it and `against` is still current; else drop it (each) from the record. The verdict, with
    both figures, the reason of a refusal and, with --per-role, each role's candidate (`roles`)."""
    margin = config.options.promote_margin
    reward = candidate["mean_reward"]
    roles: dict[str, dict] | None = candidate.get("roles")
    base = {
        "candidate": candidate["name"],
        "candidate_reward": reward,
        "current": against,
        "current_reward": current_reward,
        "margin": margin,
        "train_output": output,
        "mean_reward": reward,
        **({"roles": roles} if roles is not None else {}),
    }
    why = refusal(reward, current_reward, margin)
    now_current = read_current(roles is not None)
    if why is None and now_current != against:
        why = f"the current deployment changed to {now_current} during the evaluation (a rollback?)"
    if why is None:
        if roles is None:
            record = make_current(candidate["name"])
            record_deployment(store, record, candidate["name"], candidate["path"], "lora", n)
        else:
            record = make_roles_current({role: info["name"] for role, info in roles.items()})
            for role, info in roles.items():
                record_deployment(store, record, info["name"], info["path"], "lora", n, role=role)
        return {**base, "promoted": True}
    for name in [info["name"] for info in roles.values()] if roles is not None else [candidate["name"]]:
        forget_candidate(name)
    return {**base, "promoted": False, "reason": why}


def step_refusal(trained: dict, limit: float) -> str | None:
    """Why --max-step-kl `limit` refuses a round deployed without held-out evidence: its training (`trained`: the
    round's record, or with --per-role role -> its record) moved the policy further than `limit` KL per token from
    the deployment that served its samples (`step_kl`, lcap.train). None: deploy it (no limit, within it, or a round
    not measured, such as an SFT round)."""
    one = isinstance(trained.get("output"), str)  # a round's record; else --per-role's role -> record
    moved = {None: trained.get("step_kl")} if one else {r: t.get("step_kl") for r, t in trained.items()}
    far = {role: kl for role, kl in moved.items() if limit and kl is not None and not kl <= limit}  # NaN: too far
    if not far:
        return None
    role, kl = max(far.items(), key=lambda kv: kv[1])
    whose = "training" if role is None else f"role {role}'s training"
    return f"{whose} moved the policy by KL {kl:.2g} per token, over --max-step-kl {limit:g}"


def guard_step(step: StepRunner, config: LoopConfig, n: int, trained: dict) -> dict | None:
    """Round `n`'s refusal by --max-step-kl, for a round deployed without held-out evidence (an --async step, or a
    synchronous round without a gate): recorded once as step `promote` with `promoted` false, as a gate's refusal,
    so a resume and `lcap status` read it. None: deploy the round (a round already deployed, as a resume after its
    deploy finds it, included: a refusal only ever comes before the deploy)."""
    if step.state.done(n, "deploy") is not None:
        return None
    verdict = step.state.done(n, "promote")
    if verdict is None:
        why = step_refusal(trained, config.options.max_step_kl)
        if why is None:
            return None
        current = read_current(config.options.per_role)
        verdict = step(n, "promote", lambda: {"promoted": False, "reason": why, "current": current})
    return None if verdict["promoted"] else verdict


def refused_text(verdict: dict) -> str:
    """What a round's line says of a refusal: why, and the deployment that stays."""
    return f"refused: {verdict['reason']}; {verdict['current']} stays"


def gate(step: StepRunner, config: LoopConfig, n: int, output: Candidate, node_proxies: Any = None) -> dict:
    """Round `n`'s candidate (the adapter in `output`; with --per-role, role -> its adapter) evaluated, compared with
    the current deployment and promoted or refused, each part a recorded step (`eval`, `eval-current` when needed,
    `promote`): the verdict. A round whose verdict is recorded (a resume) is that verdict: nothing is loaded or
    measured again."""
    store = step.store
    verdict = step.state.done(n, "promote")
    if verdict is None:
        candidate = step(n, "eval", lambda: evaluate_candidate(store, config, n, output, node_proxies))
        per_role = not isinstance(output, str)
        against, current_reward = current_figure(step, config, n, node_proxies, per_role)
        verdict = step(n, "promote", lambda: promote(store, config, n, candidate, against, current_reward, output))
    if verdict["promoted"]:
        remember(step.state, verdict["candidate"], verdict["candidate_reward"], n)
    return verdict


def verdict_text(verdict: dict) -> str:
    """What a round's line says of its verdict: both figures, then the deployment made current or the refusal."""
    if "candidate_reward" not in verdict:  # refused by --max-step-kl before any held-out run (then ungated)
        return refused_text(verdict)
    figures = f"held-out {num(verdict['candidate_reward'])} vs {verdict['current']} {num(verdict['current_reward'])}"
    if verdict["promoted"]:
        roles = verdict.get("roles")
        promoted = (
            ", ".join(f"{role} {info['name']}" for role, info in roles.items()) if roles else verdict["candidate"]
        )
        return f"{figures} | promoted {promoted}"
    return f"{figures} | {refused_text(verdict)}"


def follow(verdict: dict) -> dict:
    """After a promotion: the promoted candidate current (it is, unless a resume found the record elsewhere: then
    made current again, or deployed again when the server no longer serves it). The `deploy` step's record (with
    --per-role, each role's deployment under `roles`, as an ungated round's deploy records them)."""
    if (roles := verdict.get("roles")) is not None:
        return _follow_roles(roles)
    name, path = verdict["candidate"], verdict["train_output"]
    record = read_policy()
    if record is None or record.current != name:
        if record is not None and name in record.loras:
            make_current(name)
        else:
            deploy_policy(Path(path), name=name)
    return {"name": name, "path": path, "promoted": True}


def _follow_roles(roles: dict[str, dict]) -> dict:
    """`follow` for a --per-role candidate: every role's adapter its role's deployment (made so again at once, or
    deployed again under the same names when the server no longer serves them)."""
    names = {role: info["name"] for role, info in roles.items()}
    record = read_policy()
    if record is None or any(record.deployment_of(role) != name for role, name in names.items()):
        if record is not None and all(name in record.loras for name in names.values()):
            make_roles_current(names)
        else:  # under the names `load_candidate` gave them: each adapter and its round (the one round's) name it
            n = next(iter(roles.values()))["round"]
            deploy_roles({role: Path(info["path"]) for role, info in roles.items()}, round=n)
    return {"roles": roles, "promoted": True}
