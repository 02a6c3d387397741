"""The record of the running policy server, shared by every stage.

`lcap serve` writes it when every replica is healthy and `lcap deploy` updates `current` (and, for a full checkpoint
reloaded in place, maps the new deployment to the name vLLM keeps serving it under); the proxy's
`--upstream policy` reads it (again whenever the file changes) so that a new deployment reroutes
new calls without restarting the proxy or the agents.

`publish` is the one way a process changes the record: it replaces the file atomically and returns once every
reader routes by it. Readers do not acknowledge a record (a proxy may run on another host, and one that routes
nothing reads nothing); instead each looks at the record's `version` at most `REFRESH_S` before it routes a
call (capture/routing/routes.py), so a writer that waits `PUBLISH_WAIT_S` knows that any call routed from then
on is routed by what it wrote. The policy is served by one or more replicas
(`lcap serve --replicas N`), each a vLLM server of its own; the proxy sends each episode to one of
them (capture/proxy/calls.py `Router`). A record written before replicas existed describes one server:
it reads as one replica, `r0`.

Roles (capture/proxy/roles.py: which of an agent's jobs made a call) each have a deployment: `roles` maps a role to
the LoRA adapter that serves its calls, and a role not in it (`default` among them) is served by `current`. A record
written before roles has none: every role is served by `current`, as every call was. A deploy of several roles is
one `publish`, so no call is routed by half of it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lcap.config import lcap_home
from lcap.files import atomic_write
from lcap.locks import file_lock

REFRESH_S = 0.5  # a reader looks at the record's version again at most this long before it routes a call
# publish's wait: every reader's next look, and a margin for a look under way (its thread waiting for the reader's lock)
PUBLISH_WAIT_S = 2 * REFRESH_S
DEFAULT_ROLE = "default"  # the role of a call no X-Lcap-Role header or --role-by rule gave one; `current` serves it


@dataclass
class Replica:
    """One vLLM server of the policy."""

    name: str  # r0, r1, ...: stable across restarts; each turn stores the replica that served it
    url: str  # base URL of its OpenAI server
    pid: int | None = None  # the process group lcap started it in; None when a Ray actor runs it
    log_path: str = ""  # on the node that runs it
    current: str | None = None  # what calls routed here ask for while a full checkpoint rolls out; None: the record's
    draining: bool = False  # out of the rotation (a full checkpoint replaces it); all draining: proxies hold calls
    devices: str | None = None  # local: the CUDA_VISIBLE_DEVICES it runs with (None: lcap's own)
    actor: str | None = None  # Ray: the named actor that runs and supervises it
    node: str | None = None  # Ray: the address of its node

    def serving(self, record: PolicyServer, role: str | None = None) -> str:
        """The deployment a call of `role` routed to this replica asks for: the role's own adapter, else what
        serves the default role here."""
        return record.roles.get(role or DEFAULT_ROLE) or self.current or record.current


@dataclass
class PolicyServer:
    url: str  # base URL of the first replica's OpenAI server, e.g. http://127.0.0.1:8000
    pid: int | None  # the first replica's process group (None under Ray)
    base_model: str  # the model path or name vLLM was started on
    served_model: str  # the name vLLM serves the base model under
    current: str  # the deployment every routed call asks for (base or a LoRA name)
    log_path: str
    python: str  # interpreter that runs vLLM
    started_at: str
    loras: dict[str, str] = field(default_factory=dict)  # served LoRA name -> adapter path
    lcap_endpoints: bool = False  # vLLM runs with lcap's policy endpoints (exact tokens, stitching, adaptation)
    replicas: list[Replica] = field(default_factory=list)
    vllm_args: list[str] = field(default_factory=list)  # the extra vLLM arguments every replica runs with
    tool_parser: str | None = "hermes"  # records from before this field were all started with hermes
    ray_address: str | None = None  # the Ray cluster the replicas run on; None: local processes
    api_key_file: str | None = None  # replicas reachable from the network require the key in this file
    endpoint_env: dict[str, str] = field(default_factory=dict)  # the options lcap's endpoints run with
    # deployment -> the name vLLM serves it under, for a full checkpoint reloaded in place (vLLM keeps the name it
    # started with); a deployment not here is served under its own name
    served_as: dict[str, str] = field(default_factory=dict)
    # role -> the deployment (a served LoRA name) its calls ask for, for each role with one of its own; every other
    # role, `default` included, is served by `current`. Records from before roles have none.
    roles: dict[str, str] = field(default_factory=dict)
    # whether the replicas run vLLM's LoRA support (`lcap serve --no-lora`: they do not, and adapters deploy merged)
    lora: bool = True

    def __post_init__(self) -> None:
        self.roles = {role: name for role, name in self.roles.items() if role != DEFAULT_ROLE}  # default: `current`
        self.replicas = [r if isinstance(r, Replica) else Replica(**r) for r in self.replicas]
        if not self.replicas:  # a record of one server, from before replicas
            self.replicas = [Replica(name="r0", url=self.url, pid=self.pid, log_path=self.log_path)]

    def replica(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(name)

    def deployment_of(self, role: str | None) -> str:
        """The deployment that serves `role`'s calls: its own, else `current` (the default role's)."""
        return self.roles.get(role or DEFAULT_ROLE) or self.current

    def role_deployments(self) -> dict[str, str]:
        """Every role with a deployment, `default` first: role -> the deployment that serves its calls."""
        return {DEFAULT_ROLE: self.current, **dict(sorted(self.roles.items()))}

    def in_use(self) -> set[str]:
        """The deployments some role's calls are routed to now."""
        return {self.current, *self.roles.values(), *(r.current for r in self.replicas if r.current)}

    def served_name(self, deployment: str) -> str:
        """The model name a call for `deployment` asks vLLM for."""
        return self.served_as.get(deployment, deployment)

    def api_key(self) -> str | None:
        return Path(self.api_key_file).read_text().strip() if self.api_key_file else None


def bearer(key: str | None) -> dict[str, str]:
    """The header that authenticates to a policy server started with `key` (none without a key)."""
    return {"authorization": f"Bearer {key}"} if key else {}


def record_path() -> Path:
    return Path(os.environ.get("LCAP_POLICY_RECORD") or lcap_home() / "policy.json")


def read_policy() -> PolicyServer | None:
    path = record_path()
    try:
        return PolicyServer(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def record_version() -> tuple[int, int, int] | None:
    """What a reader compares to see that the record changed (None: there is none). The inode too: each write
    replaces the file, and two writes within one tick of the clock share a mtime."""
    try:
        stat = os.stat(record_path())
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def publish(server: PolicyServer) -> None:
    """Make `server` the record, and return once every reader routes by it: written atomically (`write_policy`),
    then `PUBLISH_WAIT_S`, by which time every reader has looked at its version again before routing a call."""
    write_policy(server)
    time.sleep(PUBLISH_WAIT_S)


def write_policy(server: PolicyServer) -> None:
    """Replace the record atomically, so a reader never sees half a file, creating its folder if it is missing; the
    file is the user's alone. Returns at once: what changes the running policy calls `publish`."""
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    first = server.replicas[0]
    server.url, server.pid, server.log_path = first.url, first.pid, first.log_path
    atomic_write(path, json.dumps(asdict(server), indent=2), mode=0o600)


def clear_policy() -> None:
    record_path().unlink(missing_ok=True)


@contextmanager
def policy_lock(wait: float = 10.0) -> Iterator[None]:
    """Held by whatever changes the running policy (`lcap deploy`, `lcap serve`): one at a time, so two deploys
    never interleave their steps on the replicas or their writes of the record. Waits up to `wait` seconds for
    another holder (a rolling deploy can take minutes), then says who holds it."""
    with file_lock(record_path().with_suffix(".lock"), wait=wait, doing="changing the policy server (a deploy?)"):
        yield
