"""`lcap deploy --rollback`: make an earlier deployment current again, in one command.

The earlier deployment comes from the store's `deployments` table: one named, the latest of a round, or by default
the one the current deployment replaced when it was deployed (for a deployment made current by a rollback, when it
was first deployed: rolling back twice walks two deployments back), or the base model the server runs when the store
has nothing before (a server started with another --db). What the replicas still serve is made current at once: a
LoRA adapter the record lists, the base model or full checkpoint whose weights are the running ones (with an adapter
on top now). Anything else is deployed again as `lcap deploy` would, under its old name: an adapter hot-loaded, a
full checkpoint reloaded in place (or restarted on), a merged adapter merged again (or its merge reused). Calls in
flight finish on what they started on. The rollback is a new `deployments` row: the restored deployment's name, path
and kind, with `rollback_of` naming the deployment it took out of service.

`--role R` rolls back role R only (its rows of `deployments`), leaving every other role's deployment as it is: R's
earlier adapter becomes its deployment again in one record write, or, before R's first deployment, R is served by
the default role's deployment again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE, policy_lock, publish, read_policy
from lcap.serve.deploy import (
    deploy_policy,
    deploy_roles,
    make_current,
    record_deployment,
    running_policy,
    servable,
    weights_of,
)
from lcap.store import Store

FOLLOWS_DEFAULT = "default"  # the kind of a role's row that puts it back on the default role's deployment
_ROWS = """
SELECT name, path, kind, round, rollback_of IS NOT NULL AS is_rollback
FROM deployments WHERE coalesce(role, 'default') = $role ORDER BY created_at, rowid
"""


@dataclass(frozen=True)
class Earlier:
    """A deployment of the store to roll back to."""

    name: str
    path: str
    kind: str  # base | lora | full | merged (`path`: the adapter merged)
    round: int | None


def rollback(
    store: Store,
    name: str | None = None,
    *,
    round: int | None = None,
    drain_timeout: float = 600.0,
    restart: bool = False,
    role: str = DEFAULT_ROLE,
) -> tuple[str, str]:
    """Make an earlier deployment current again (`name`, the latest of `round`, or the one before the current);
    returns (the deployment now current, the one it replaced). `role`: roll back that role's deployment only."""
    if role != DEFAULT_ROLE:
        return rollback_role(store, role, name, round=round)
    record = running_policy()
    current = record.current
    target = earlier_deployment(store, current, name=name, round=round, served_model=record.served_model)
    if target.name == current:
        raise LcapError(f"{target.name} is the current deployment already: nothing to roll back")
    running = str(Path(record.base_model))
    same_weights = (
        target.kind in ("base", "full", "merged") and str(Path(weights_of(target.kind, target.path))) == running
    )
    if servable(record, target.name) and (target.kind == "lora" or same_weights):
        record = make_current(target.name)
    else:
        path = Path(target.path)
        if not path.exists():
            raise LcapError(f"{target.name}'s {target.kind} {path} is gone: it cannot be deployed again")
        merge = target.kind == "merged"
        deploy_policy(path, name=target.name, drain_timeout=drain_timeout, restart=restart, merge=merge)
        record = read_policy() or record
    record_deployment(store, record, target.name, target.path, target.kind, target.round, rollback_of=current)
    return target.name, current


def rollback_role(store: Store, role: str, name: str | None = None, *, round: int | None = None) -> tuple[str, str]:
    """Roll back `role` alone: its earlier adapter (`name`, the latest of `round`, or the one before its current)
    becomes its deployment again, or, with none before, the default role's deployment serves it again. Returns (what
    now serves the role, the deployment it replaced)."""
    record = running_policy()
    current = record.roles.get(role)
    if current is None:
        raise LcapError(f"role {role!r} has no deployment of its own (the default's serves it): nothing to roll back")
    try:
        target: Earlier | None = earlier_deployment(store, current, name=name, round=round, role=role)
    except NothingBefore:
        target = None  # before the role's first deployment: the default's served it
    if target is not None and target.kind == FOLLOWS_DEFAULT:
        target = None
    if target is not None and target.name == current:
        raise LcapError(f"{target.name} is role {role}'s deployment already: nothing to roll back")
    if target is None or servable(record, target.name):
        with policy_lock():
            record = running_policy()
            if target is None:
                record.roles.pop(role, None)
            else:
                record.roles[role] = target.name
            publish(record)
    else:
        path = Path(target.path)
        if not path.exists():
            raise LcapError(f"{target.name}'s {target.kind} {path} is gone: it cannot be deployed again")
        deploy_roles({role: path}, name=target.name)
    if target is None:
        record_deployment(store, record, record.current, "", FOLLOWS_DEFAULT, None, rollback_of=current, role=role)
        return f"{record.current} (the default role's)", current
    record_deployment(store, record, target.name, target.path, target.kind, target.round, current, role=role)
    return target.name, current


class NothingBefore(LcapError):
    """The store has no deployment before the current one."""


def earlier_deployment(
    store: Store,
    current: str,
    *,
    name: str | None = None,
    round: int | None = None,
    served_model: str | None = None,
    role: str = DEFAULT_ROLE,
) -> Earlier:
    """The deployment a rollback restores: `name`'s latest row, the latest deployment of `round`, or the one
    deployed before `current`'s latest deployment (rollback rows skipped); a one-line error naming what is known
    when there is none."""
    if name is not None and round is not None:
        raise LcapError("--rollback takes a deployment NAME or --round N, not both")
    history = [(Earlier(n, p, k, r), again) for n, p, k, r, again in store.fetchall(_ROWS, {"role": role})]
    rows = [row for row, _ in history]
    deployed = [row for row, again in history if not again]
    if name is not None:
        found = [row for row in rows if row.name == name]
        if found:
            return found[-1]
        if name == served_model:  # the base model of a server started with another --db
            record = read_policy()
            if record is not None and not record.served_as:
                return Earlier(name, record.base_model, "base", None)
        raise LcapError(f"no deployment {name!r}{_of(role)} in this store: {_known(deployed)}")
    if round is not None:
        found = [row for row in deployed if row.round == round]
        if not found:
            raise LcapError(f"no deployment of round {round}{_of(role)} in this store: {_known(deployed)}")
        return found[-1]
    positions = [i for i, (row, again) in enumerate(history) if row.name == current and not again]
    if not positions:
        raise LcapError(
            f"the current deployment {current!r} is not in this store's deployments (another --db?): "
            f"name the one to restore, {_known(deployed)}"
        )
    before = [row for row in rows[: positions[-1]] if row.name != current]
    if before:
        return before[-1]
    record = read_policy() if role == DEFAULT_ROLE else None  # another role's first adapter: the default's before
    if record is not None and record.served_model != current and not record.served_as:
        return Earlier(record.served_model, record.base_model, "base", None)  # the server started on it, another --db
    raise NothingBefore(f"no deployment before {current!r}{_of(role)} in this store: {_known(deployed)}")


def _of(role: str) -> str:
    return "" if role == DEFAULT_ROLE else f" of role {role}"


def _known(rows: list[Earlier]) -> str:
    names = list(dict.fromkeys(row.name for row in reversed(rows)))
    if not names:
        return "it has none"
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f'it has {shown} (`lcap sql "SELECT * FROM deployments"`)'
