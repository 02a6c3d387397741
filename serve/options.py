"""The serve stage's options: `lcap serve`, `lcap deploy`, and the tiny model `lcap init-model` makes (each default
and help, written once)."""

from __future__ import annotations

from dataclasses import dataclass

from lcap.capture import ROLE_NAME
from lcap.cli_options import option
from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE

RESPONSES_MAX_ENV = "LCAP_RESPONSES_MAX"
RESPONSES_MAX_AGE_ENV = "LCAP_RESPONSES_MAX_AGE"
RESPONSES_MAX_BYTES_ENV = "LCAP_RESPONSES_MAX_BYTES"
# vLLM's CPU backend: OpenMP threads per model worker, and its own pinning ("nobind": leave placement to the OS,
# since a user who caps the threads shares the machine and vLLM's default binds the workers to whole NUMA nodes).
CPU_THREADS_ENV = "OMP_NUM_THREADS"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class TinyModelOptions:
    """A random-init Qwen2-style policy with a locally trained tokenizer: the same options give the same bytes."""

    seed: int = option(0, help="Random seed: same seed and sizes, same bytes.")
    hidden_size: int = option(128, help="Hidden size (head_dim = hidden / heads must be >= 32, vLLM's CPU attention).")
    num_layers: int = option(2, flag="--layers", help="Transformer layers.")
    num_heads: int = option(2, flag="--heads", help="Attention heads.")
    num_kv_heads: int | None = option(None, flag="--kv-heads", help="Key/value heads (default: --heads).")
    intermediate_size: int | None = option(None, help="MLP width (default: twice the hidden size).")
    vocab_size: int = option(2048, help="Largest tokenizer vocabulary to train.")
    max_position_embeddings: int = option(
        65536,
        flag="--context",
        help="Context length in tokens (positions); `lcap serve` serves the model at it. Harnesses such as Codex "
        "send prompts past 16k tokens.",
    )
    max_new_tokens: int = option(
        256,
        help="Longest answer to a request that names no limit (generation_config.json, which vLLM follows): "
        "the random model rarely stops by itself, and some harnesses (Codex CLI) never set a limit.",
    )

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise LcapError(
                f"hidden size {self.hidden_size} / {self.num_heads} heads must be a whole head_dim >= 32 "
                "(vLLM's CPU attention)"
            )
        if self.num_heads % (self.num_kv_heads or self.num_heads):
            raise LcapError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} kv heads")


@dataclass(frozen=True)
class ServeOptions:
    """The policy server: vLLM on the model, as one replica or several (local processes, or Ray actors)."""

    model: str | None = option(None, flag="--model,-m", help="HF model name or path to serve.")
    name: str | None = option(None, help="Name to serve the base model under (default: its directory name).")
    replicas: int = option(
        1, help="vLLM servers of the policy: the proxy sends each episode to one of them (sticky by episode)."
    )
    port: int | None = option(
        None, help="Port on 127.0.0.1 of the first local replica; replica i listens on PORT+i (default: free ones)."
    )
    python: str | None = option(
        None, help="Interpreter with vllm (default: lcap's vLLM venv, else `vllm` on PATH); on each node under --ray."
    )
    tool_parser: str = option("hermes", help="vLLM tool-call parser, or 'none'.")
    timeout: float = option(600.0, help="Seconds to wait for each replica's /health.")
    ray: str | None = option(
        None,
        help="Run the replicas on this Ray cluster (host:port, ray://host:port, or 'auto' for RAY_ADDRESS), "
        "one actor per replica on a node with the GPUs it needs.",
    )
    gpus_per_replica: float | None = option(
        None,
        help="GPUs each replica holds (default: the tensor x pipeline x data parallel size in the vLLM arguments); "
        "0 runs vLLM on CPU.",
    )
    responses_max: int = option(
        1024,
        help="Responses each replica keeps so that a later call can continue one by previous_response_id (Codex CLI "
        "over its WebSocket); past it the oldest go, and a call naming one gets a 404 that says so. 0 keeps none.",
    )
    responses_max_age: float = option(
        3600.0, help="Seconds a kept response can be continued by previous_response_id before it goes."
    )
    responses_max_bytes: int = option(
        256 << 20,
        help="Bytes the kept responses may hold in all, per replica (their items as JSON, each shared item once, and "
        "their exact ids); past it the oldest go.",
    )
    cpu_threads: int | None = option(
        None,
        help="CPU threads each replica decodes with on vLLM's CPU backend (OMP_NUM_THREADS, unpinned), for a machine "
        "shared with the agents or other users (default: vLLM's own, one per core it binds; OMP_NUM_THREADS set "
        "in lcap's environment is otherwise passed through).",
    )

    no_lora: bool = option(
        False,
        flag="--no-lora",
        help="Start vLLM without LoRA support: it decodes at the base model's speed, and adapters can only be deployed "
        "merged into the weights (`lcap deploy --merge`, `lcap loop --deploy-merge`).",
    )

    def endpoint_env(self) -> dict[str, str]:
        """What each replica's environment gets from these options, kept in the policy record so that a restart
        (a deploy) keeps it: what lcap's policy endpoints read (serve/vllm_plugin/lcap_policy/responses_store.py
        names the same variables; a test compares them) and, with --cpu-threads, vLLM's CPU thread count."""
        threads = {} if self.cpu_threads is None else {CPU_THREADS_ENV: str(self.cpu_threads), CPU_BIND_ENV: "nobind"}
        return {
            RESPONSES_MAX_ENV: str(self.responses_max),
            RESPONSES_MAX_AGE_ENV: repr(float(self.responses_max_age)),
            RESPONSES_MAX_BYTES_ENV: str(self.responses_max_bytes),
            **threads,
        }

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise LcapError(f"--replicas {self.replicas}: at least 1")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise LcapError(f"--gpus-per-replica {self.gpus_per_replica}: not negative")
        if self.ray is not None and self.port is not None:
            raise LcapError("--port is for local replicas: under --ray each replica takes a free port on its node")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise LcapError(f"--cpu-threads {self.cpu_threads}: at least 1")
        if self.responses_max < 0 or not self.responses_max_age > 0 or self.responses_max_bytes < 0:
            raise LcapError(
                "--responses-max and --responses-max-bytes must be at least 0 and --responses-max-age positive"
            )


@dataclass(frozen=True)
class DeployOptions:
    """How `lcap deploy` makes a checkpoint the policy on every replica."""

    name: str | None = option(None, help="Served name (default: policy-r{round}-{hash}).")
    round: int | None = option(
        None, help="Training round that produced it; with --rollback, restore that round's latest deployment."
    )
    drain_timeout: float = option(
        600.0,
        help="A full checkpoint replaces the replicas one at a time: seconds to wait for one's calls in flight to "
        "finish before it reloads (they then finish on the new weights) or restarts (they fail) anyway.",
    )
    restart: bool = option(
        False,
        flag="--restart",
        help="Restart vLLM on a full checkpoint even when it could reload it in place (same config and tokenizer).",
    )
    merge: bool = option(
        False,
        flag="--merge",
        help="Merge the LoRA adapter into its base weights (written beside it, ADAPTER-merged) and deploy them as a "
        "full checkpoint, reloaded in place: decodes at the base's speed, where a hot-loaded adapter slows every "
        "call (a small model on a CPU). Not while roles have adapters of their own.",
    )
    rollback: bool = option(
        False,
        flag="--rollback",
        help="Make an earlier deployment of the store current again: NAME, the latest of --round N, or by default "
        "the one the current deployment replaced; recorded as a new deployments row (rollback_of).",
    )
    role: tuple[str, ...] = option(
        (),
        help="The agent's role to deploy for (default: the default role, `current`): --role R PATH makes the adapter "
        "R's deployment; --role A=PATH --role B=PATH deploys several roles at once (one record write: no call sees "
        "half of it); with --rollback, roll back role R only.",
    )

    def targets(self, path: str | None) -> dict[str, str | None]:
        """role -> what to deploy for it (a path; with --rollback, a NAME or None), from --role and PATH."""
        return deploy_targets(self.role, path, rollback=self.rollback)


def deploy_targets(roles: tuple[str, ...], path: str | None, *, rollback: bool = False) -> dict[str, str | None]:
    """role -> PATH from `lcap deploy`'s arguments: PATH alone (the default role), --role R PATH, or --role R=PATH
    repeated (no PATH); one-line errors for any other mix."""
    if not roles:
        return {DEFAULT_ROLE: path}
    pairs = [role.partition("=") for role in roles]
    named = [(role, value) for role, sep, value in pairs if sep]
    if named and len(named) < len(roles):
        raise LcapError("give either --role R with PATH, or --role R=PATH for each role, not both")
    if not named:
        if len(roles) > 1:
            raise LcapError("several roles at once: give each its adapter, --role A=PATH --role B=PATH")
        targets: dict[str, str | None] = {roles[0]: path}
    else:
        if rollback:
            raise LcapError("--rollback rolls back one role: --rollback --role R [NAME]")
        if path is not None:
            raise LcapError(f"{path}: with --role R=PATH every adapter is given with its role, not as PATH")
        targets = {}
        for role, value in named:
            if role in targets:
                raise LcapError(f"--role {role} is given twice")
            if not value:
                raise LcapError(f"--role {role}=: give the adapter to deploy for {role}")
            targets[role] = value
    for role in targets:
        if not ROLE_NAME.fullmatch(role):
            raise LcapError(f"--role {role!r}: a role is 1-64 letters, digits, '_', '.' or '-'")
    return targets
