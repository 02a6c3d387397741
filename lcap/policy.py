"""The record of the running policy server, shared by every stage.

`lcap serve` writes it when vLLM is healthy and `lcap deploy` updates `current`; the proxy's
`--upstream policy` reads it (again whenever the file changes) so that a new deployment reroutes
new calls without restarting the proxy or the agents.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lcap.config import lcap_home


@dataclass
class PolicyServer:
    url: str  # base URL of vLLM's OpenAI server, e.g. http://127.0.0.1:8000
    pid: int
    base_model: str  # the model path or name vLLM was started on
    served_model: str  # the name vLLM serves the base model under
    current: str  # the deployment every routed call asks for (base or a LoRA name)
    log_path: str
    python: str  # interpreter that runs vLLM
    started_at: str
    loras: dict[str, str] = field(default_factory=dict)  # served LoRA name -> adapter path
    lcap_endpoints: bool = False  # vLLM runs with lcap's policy endpoints (exact tokens, stitching, adaptation)


def record_path() -> Path:
    return Path(os.environ.get("LCAP_POLICY_RECORD") or lcap_home() / "policy.json")


def read_policy() -> PolicyServer | None:
    path = record_path()
    try:
        return PolicyServer(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def write_policy(server: PolicyServer) -> None:
    """Replace the record atomically, so a reader never sees half a file."""
    path = record_path()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(server), indent=2))
    tmp.replace(path)


def clear_policy() -> None:
    record_path().unlink(missing_ok=True)
