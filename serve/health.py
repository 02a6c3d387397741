"""How the recorded policy server is doing, asked the way a client would (for `lcap doctor` and `lcap status`):
each replica's process, /health, the models it serves, and whether it can hot-load a LoRA. Every request is
bounded. A replica behind a key (`lcap serve --ray`) is asked with the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lcap.policy import PolicyServer, Replica, bearer
from lcap.processes import alive


@dataclass
class ReplicaHealth:
    replica: Replica
    serving: str  # the deployment calls routed to it ask for
    alive: bool  # its process runs (a Ray replica, on another node: it answered at all)
    healthy: bool
    models: list[str] = field(default_factory=list)  # ids /v1/models lists (base and loaded LoRAs)
    error: str | None = None  # why /health or /v1/models did not answer
    lora_flag: bool | None = None  # --enable-lora on its command line (None: not readable here)
    lora_route: bool | None = None  # POST /v1/load_lora_adapter exists (None: not asked)

    @property
    def label(self) -> str:
        """How messages name it: its process (or actor) and address."""
        r = self.replica
        who = f"pid {r.pid}" if r.pid is not None else f"Ray actor {r.actor}"
        return f"{who}, {r.url}"

    @property
    def serves_current(self) -> bool:
        return self.serving in self.models


@dataclass
class PolicyHealth:
    record: PolicyServer
    replicas: list[ReplicaHealth]

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.replicas)

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.replicas)

    @property
    def models(self) -> list[str]:
        """The ids every replica lists."""
        first, *others = self.replicas
        return [m for m in first.models if all(m in r.models for r in others)]

    @property
    def lora_flag(self) -> bool | None:
        return _all(r.lora_flag for r in self.replicas)

    @property
    def lora_route(self) -> bool | None:
        return _all(r.lora_route for r in self.replicas)


def probe(record: PolicyServer, *, timeout: float = 3.0, lora: bool = False) -> PolicyHealth:
    """Every replica's state; with `lora`, also whether runtime LoRA loading is on (a request vLLM refuses as
    malformed when the route exists: nothing is loaded)."""
    try:
        key = record.api_key()
    except OSError:
        key = None  # the replicas then answer 401, which says what is wrong
    headers = bearer(key)
    return PolicyHealth(record, [_probe(record, r, headers, timeout, lora) for r in record.replicas])


def _probe(record: PolicyServer, replica: Replica, headers: dict, timeout: float, lora: bool) -> ReplicaHealth:
    local = replica.pid is not None
    running = replica.pid is not None and alive(replica.pid)
    health = ReplicaHealth(replica, replica.serving(record), alive=running, healthy=False)
    try:
        with httpx.Client(base_url=replica.url, timeout=timeout, trust_env=False, headers=headers) as client:
            health.healthy = client.get("/health").status_code == 200
            health.alive = health.alive or not local
            listed = client.get("/v1/models").raise_for_status().json().get("data") or []
            health.models = [m["id"] for m in listed if isinstance(m, dict) and "id" in m]
            if lora:
                health.lora_route = client.post("/v1/load_lora_adapter", json={}).status_code != 404
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        health.error = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
    if lora and replica.pid is not None:
        health.lora_flag = _has_flag(replica.pid, "--enable-lora")
    return health


def _all(values) -> bool | None:
    values = list(values)
    if False in values:
        return False
    return None if None in values else True


def _has_flag(pid: int, flag: str) -> bool | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return flag.encode() in argv
