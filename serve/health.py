"""How the recorded policy server is doing, asked the way a client would (for `lcap doctor` and `lcap status`):
its process, /health, the models it serves, and whether it can hot-load a LoRA. Every request is bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lcap.policy import PolicyServer
from lcap.processes import alive


@dataclass
class PolicyHealth:
    record: PolicyServer
    alive: bool
    healthy: bool
    models: list[str] = field(default_factory=list)  # ids /v1/models lists (base and loaded LoRAs)
    error: str | None = None  # why /health or /v1/models did not answer
    lora_flag: bool | None = None  # --enable-lora on its command line (None: not readable)
    lora_route: bool | None = None  # POST /v1/load_lora_adapter exists (None: not asked)

    @property
    def serves_current(self) -> bool:
        return self.record.current in self.models


def probe(record: PolicyServer, *, timeout: float = 3.0, lora: bool = False) -> PolicyHealth:
    """The recorded server's state; with `lora`, also whether runtime LoRA loading is on (a request vLLM
    refuses as malformed when the route exists: nothing is loaded)."""
    health = PolicyHealth(record, alive=alive(record.pid), healthy=False)
    try:
        with httpx.Client(base_url=record.url, timeout=timeout, trust_env=False) as client:
            health.healthy = client.get("/health").status_code == 200
            listed = client.get("/v1/models").json().get("data") or []
            health.models = [m["id"] for m in listed if isinstance(m, dict) and "id" in m]
            if lora:
                health.lora_route = client.post("/v1/load_lora_adapter", json={}).status_code != 404
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        health.error = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
    if lora:
        health.lora_flag = _has_flag(record.pid, "--enable-lora")
    return health


def _has_flag(pid: int, flag: str) -> bool | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return flag.encode() in argv
