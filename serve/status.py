"""`lcap status`'s section of the policy server: the recorded vLLM, whether it answers, and what it serves now."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime

from lcap.policy import read_policy
from lcap.serve.health import probe
from lcap.status import Section, View, age, section


@section("policy")
def policy(view: View) -> Section:
    s = Section(
        "policy server",
        ["url", "pid", "state", "up", "base model", "current deployment", "LoRAs loaded"],
        empty="none recorded (`lcap serve --model M` starts one)",
    )
    record = read_policy()
    if record is None:
        s.data = None
        return s
    health = probe(record, timeout=1.0)
    if not health.alive:
        state = "not running (stale record)"
        s.notes.append(f"its process {record.pid} is gone: `lcap serve --stop` clears the record")
    elif not health.healthy:
        state = f"not answering ({health.error or 'unhealthy'})"
        s.notes.append(f"see {record.log_path}")
    else:
        state = "healthy"
    try:
        up = age(view.now - datetime.fromisoformat(record.started_at).timestamp())
    except ValueError:
        up = "-"
    current = record.current + ("" if health.serves_current or not health.healthy else " (NOT loaded)")
    s.rows = [[record.url, str(record.pid), state, up, record.base_model, current, ", ".join(record.loras) or "-"]]
    s.data = {**asdict(record), "alive": health.alive, "healthy": health.healthy, "models": health.models}
    return s
