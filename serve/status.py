"""`lcap status`'s section of the policy server: each recorded vLLM replica, whether it answers, and what it serves
now, for the default role and each role with a deployment of its own."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime

from lcap.policy import read_policy
from lcap.serve.health import PolicyHealth, probe
from lcap.status import Section, View, age, section


@section("policy")
def policy(view: View) -> Section:
    s = Section(
        "policy server",
        [
            "replica",
            "url",
            "pid",
            "state",
            "up",
            "base model",
            "current deployment",
            "roles' deployments",
            "LoRAs loaded",
        ],
        empty="none recorded (`lcap serve --model M` starts one)",
    )
    record = read_policy()
    if record is None:
        s.data = None
        return s
    health = probe(record, timeout=1.0)
    try:
        up = age(view.now - datetime.fromisoformat(record.started_at).timestamp())
    except ValueError:
        up = "-"
    loras = ", ".join(record.loras) or "-"
    for replica in health.replicas:
        r = replica.replica
        if not replica.alive:
            state = "not running (stale record)"
            s.notes.append(
                f"{_named(health, r.name)}its process {r.pid} is gone: `lcap serve --stop` clears the record"
            )
        elif not replica.healthy or replica.error:
            state = f"not answering ({replica.error or 'unhealthy'})"
            s.notes.append(f"{_named(health, r.name)}see {r.log_path}")
        elif r.draining:
            state = "draining (a full checkpoint rolls out)"
        else:
            state = "healthy"
        current = replica.serving + ("" if replica.serves_current or not replica.healthy else " (NOT loaded)")
        roles = ", ".join(
            f"{role}: {name}" + ("" if name in replica.models or not replica.healthy else " (NOT loaded)")
            for role, name in sorted(record.roles.items())
        )
        who = str(r.pid) if r.pid is not None else f"Ray {r.node or '?'}"
        s.rows.append([r.name, r.url, who, state, up, record.base_model, current, roles or "-", loras])
    s.data = {
        **asdict(record),
        "role_deployments": record.role_deployments(),
        "alive": health.alive,
        "healthy": health.healthy,
        "models": health.models,
        "replicas_healthy": sum(r.healthy for r in health.replicas),
    }
    return s


def _named(health: PolicyHealth, name: str) -> str:
    return "" if len(health.replicas) == 1 else f"{name}: "
