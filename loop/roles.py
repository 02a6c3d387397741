"""`lcap loop --per-role`: each round trains every role of the agent an adapter of its own, then deploys them all
at once.

After a round's collect, the roles with a successful call in its training episodes (`turns.role`) are listed from
the store (step `roles`, so a resumed round trains the same ones). Each role gets its own build (step `build:ROLE`,
RUN/round-N/role-R/data, `build-dataset --role R`'s samples) and training (step `train:ROLE`, R's adapter in
RUN/round-N/role-R/adapter, continuing R's adapter the loop deployed last); a role with nothing to learn is recorded
as `skipped:ROLE` and keeps its deployment. Then one deploy (step `deploy`) makes every trained role's adapter its
role's deployment atomically (serve's `deploy_roles`, what `lcap deploy --role A=P --role B=Q` does) and records
each. With --eval-tasks the round's adapters are first one candidate of the promotion gate (loop/promotion.py):
evaluated together, then deployed together in that one write, or refused together (no `deploy` step: every role
keeps its deployment, and the next round trains each from it). A killed loop resumes at the first unfinished step:
finished roles are neither built nor trained again. A round where no role trained is the round's `skipped`, as in
the single-role loop.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lcap.config import LcapError
from lcap.loop.steps import (
    SKIPPED,
    LoopConfig,
    StepRunner,
    build_step,
    deploy_roles_step,
    few_groups,
    role_continued,
    role_step,
    skip_step,
    skipped_line,
    train_step,
)
from lcap.policy import read_policy
from lcap.train import round_dir, training_text

# The roles with a successful call (`turn_tokens`: the calls a build reads) in a round's episodes of a split.
_ROUND_ROLES = """
SELECT DISTINCT turn_role(role) AS role FROM turns
WHERE turn_id IN (
    SELECT turn_id FROM turn_tokens
    WHERE episode_id IN (SELECT episode_id FROM episode_summary WHERE round = $round AND split = $split))
ORDER BY role
"""


def round_roles(store, n: int, split: str = "train") -> list[str]:
    """The roles with a successful call in round `n`'s episodes of `split`, sorted: the roles its build can read."""
    return [r[0] for r in store.fetchall(_ROUND_ROLES, {"round": n, "split": split})]


def train_roles(step: StepRunner, config: LoopConfig, n: int, echo: Callable[[str], None]) -> dict[str, dict]:
    """Round `n`'s roles, each built and trained (or skipped with its one line) once: role -> its training record,
    for the roles trained. No role trained: the round is recorded as `skipped` (its reasons, every role's deployment
    kept)."""
    roles = step(n, "roles", lambda: {"roles": round_roles(step.store, n)})["roles"]
    if not roles:
        raise LcapError(f"round {n}: no successful call in its training episodes, so no role to train")
    trained: dict[str, dict] = {}
    reasons: list[str] = []
    for role in roles:
        record = _train_role(step, config, n, role, echo)
        if "skipped" in record:
            reasons.append(f"{role}: {record['skipped']['reason']}")
        else:
            trained[role] = record
    if not trained and step.state.done(n, SKIPPED) is None:
        policy = read_policy()
        kept = ", ".join(f"{r} {d}" for r, d in policy.role_deployments().items()) if policy else None
        step(n, SKIPPED, lambda: {"reason": "; ".join(reasons), "kept": kept})
    return trained


def _train_role(step: StepRunner, config: LoopConfig, n: int, role: str, echo: Callable[[str], None]) -> dict:
    """Role `role`'s build and training of round `n` (its one line said): the training's record, or `{"skipped":
    ...}` when the role had nothing to learn."""
    run = Path(config.run)
    data = round_dir(run, n, role) / "data"
    build_step(step, config, n, "train", data, echo, role)
    what = f"round {n} role {role}"
    record = skip_step(
        step,
        n,
        role_step("train", role),
        lambda: train_step(step.store, run, n, config.train, data, role_continued(step.state, n, role), role),
        role,
    )
    if "skipped" in record:
        echo(skipped_line(what, record["skipped"]))
        return record
    if warning := few_groups(what, record, config.options.min_groups):
        echo(warning)
    echo(f"{what}: {training_text(record)} | {record['output']}")
    return record


def deploy_trained(step: StepRunner, n: int, trained: dict[str, dict]) -> dict[str, str]:
    """One atomic deploy of every role's adapter trained in round `n` (step `deploy`): role -> its deployment."""
    outputs = {role: record["output"] for role, record in trained.items()}
    deployed = step(n, "deploy", lambda: deploy_roles_step(step.store, outputs, n))
    return {role: info["name"] for role, info in deployed["roles"].items()}
