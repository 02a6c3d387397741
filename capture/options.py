"""The capture proxy's options (`lcap proxy`, collect's proxy, `CaptureProxy`): each default and help, written once.

Every limit has a default sized for real agents (long prompts, long streams, many connections) and an
answer the agent can read: the status code of each is in its help, and the user guide's "Limits and security" (docs/guide.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lcap.capture.proxy.roles import parse_role_by
from lcap.capture.storage.spool import SPOOL_BACKLOG_BYTES
from lcap.cli_options import option
from lcap.config import LcapError

MiB = 1 << 20


def transparent_option() -> bool:
    """`--transparent`, one definition for `lcap proxy` and `lcap collect`."""
    return option(
        False,
        flag="--transparent",
        help="Run the agent in network and mount namespaces of its own where every TCP connection it makes goes "
        "to lcap, proxy settings or not (Linux; root or user namespaces, and iptables).",
    )


def sandbox_option() -> bool:
    """`--sandbox`, one definition for `lcap proxy` and `lcap collect` (capture/sandbox.py)."""
    return option(
        False,
        flag="--sandbox",
        help="Run the agent (each episode's, in collect) in a bubblewrap sandbox of its own (Linux, root, the "
        "bubblewrap package, cgroups v1): a tmpfs workspace with the task's files (lcap proxy: a copy of the current "
        "folder), of the host only the system folders (/etc without its secrets), its command's and --sandbox-share, "
        "read-only, a private /tmp, the host's nobody, its own PID and network namespaces whose only reachable address is the capture proxy, and the "
        "limits below; collect's --timeout is its wall time.",
    )


def sandbox_memory_option() -> int:
    return option(2048, help="With --sandbox: MiB of memory an episode's processes may use.")


def sandbox_pids_option() -> int:
    return option(256, help="With --sandbox: processes and threads an episode may have at once.")


def sandbox_disk_option() -> int:
    return option(1024, help="With --sandbox: MiB an episode may write (its workspace; its $TMPDIR too).")


def keep_workspaces_option() -> bool:
    return option(
        False,
        flag="--keep-workspaces",
        help="With --sandbox: keep each episode's workspace on disk after it ended (default: removed once verified).",
    )


def sandbox_share_option() -> tuple[str, ...]:
    return option(
        (),
        help="With --sandbox: a folder (or file) of the host the agent sees read-only at its own path, beyond the "
        "system folders, its command's and its workspace; repeatable.",
    )


@dataclass(frozen=True)
class SandboxLimits:
    """What `--sandbox` allows one episode (the flags above)."""

    memory_mb: int
    pids: int
    disk_mb: int
    keep_workspaces: bool = False
    shares: tuple[Path, ...] = ()


@dataclass(frozen=True)
class ProxyOptions:
    """Where the proxy listens, where it sends the LLM calls it captures, and what it accepts."""

    upstream: str | None = option(None, help="Send LLM calls to this server instead (URL, or 'policy').")
    model: str | None = option(None, help="Ask the upstream for this model instead of the agent's.")
    token_ids: bool | None = option(
        None,
        flag="--token-ids/--no-token-ids",
        help="Ask vLLM for token ids and logprobs (default: when the upstream is vLLM).",
    )
    host: str = option("127.0.0.1", help="Listen address. A non-loopback one requires episode credentials.")
    port: int = option(0, help="Listen port (0: a free one).")
    transparent: bool = transparent_option()
    sandbox: bool = sandbox_option()
    sandbox_memory: int = sandbox_memory_option()
    sandbox_pids: int = sandbox_pids_option()
    sandbox_disk: int = sandbox_disk_option()
    keep_workspaces: bool = keep_workspaces_option()
    sandbox_share: tuple[str, ...] = sandbox_share_option()
    require_credentials: bool | None = option(
        None,
        flag="--require-credentials/--anonymous",
        help="Refuse calls without valid episode credentials (407); --anonymous stores them unattributed instead "
        "(default: required, except for --serve on a loopback address).",
    )
    allow_private: bool = option(
        False,
        flag="--allow-private",
        help="On a non-loopback --host or with --sandbox, still connect to loopback, link-local and private addresses "
        "(refused with 403 otherwise).",
    )
    # --- what the proxy accepts from agents ---
    max_head_bytes: int = option(
        64 * 1024, help="Largest request head (431 past it), and largest answer head from an upstream (502 past it)."
    )
    max_body_bytes: int = option(
        64 * MiB,
        help="Largest LLM request body, and largest answer lcap holds whole, as sent and as decoded (gzip, deflate, "
        "br, zstd): 413, or 502 for an answer; on a Responses WebSocket, the largest message either side may send, "
        "inflated (closed with 1009).",
    )
    head_timeout: float = option(
        30.0,
        help="Seconds to receive a request head once it has begun (408), an upstream's answer head once its first "
        "byte came (504), and a connection's first request while it has proved no episode (closed).",
    )
    body_timeout: float = option(120.0, help="Seconds to receive a request body after its head (408).")
    idle_timeout: float = option(120.0, help="Seconds an agent's kept-alive connection may wait for its next request.")
    max_connections: int = option(
        1024, help="Agent connections open at once, in total (503 past it; lowered to fit the open-file limit)."
    )
    max_client_connections: int = option(
        256,
        help="Agent connections open at once from one address that have proved no episode yet (past it, that "
        "address's oldest idle one is closed, else 503).",
    )
    max_episode_connections: int = option(
        256,
        help="Agent connections open at once of one episode (past it, the episode's oldest idle one is closed, "
        "else 503).",
    )
    max_stream_resets: int = option(
        100,
        help="HTTP/2 streams an agent may reset within any second on one connection (past it the connection is "
        "closed: GOAWAY, ENHANCE_YOUR_CALM; 0: no bound).",
    )
    # --- upstreams ---
    connect_timeout: float = option(30.0, help="Seconds to connect to an upstream (504).")
    first_byte_timeout: float = option(
        600.0, help="Seconds from sending a call to the first byte of its answer (504): long prompts take long."
    )
    stream_idle_timeout: float = option(
        300.0, help="Seconds an answer may pause between two reads before the call is cut (504 if nothing was sent)."
    )
    # --- the policy route (lcap's endpoints on the policy server: `lcap serve`) ---
    stitch: bool = option(
        True,
        help="Give the policy the exact ids of a conversation's earlier turns (stitched prompts) when a call "
        "extends one; --no-stitch renders every prompt from the messages.",
    )
    adapt: bool = option(
        True,
        help="Adapt what the policy server would refuse (token limits past its context, provider-only fields), "
        "recorded per turn; --no-adapt sends requests as the agent wrote them.",
    )
    stitch_memory: int = option(
        256 * MiB, help="Bytes of earlier turns' ids kept for stitching, all conversations together (oldest go)."
    )
    hold_timeout: float = option(
        600.0,
        help="Seconds a call may wait while every policy replica restarts (a full-checkpoint deploy drains and "
        "restarts vLLM) for one to serve again; past it the agent gets a 503 and an error turn is stored. The "
        "default covers a drain and a vLLM start (`lcap serve --timeout`).",
    )
    max_held_calls: int = option(
        512, help="Calls waiting at once for a restarting policy replica (--hold-timeout); past it a 503 at once."
    )
    temperature: float | None = option(
        None,
        help="Sampling temperature of every call on the policy route, whatever the agent sends (0: greedy); the "
        "policy server applies it and records the change per turn. Default: the agent's own.",
    )
    max_spool_backlog: int = option(
        SPOOL_BACKLOG_BYTES,
        help="Bytes of finished turns held in memory while the spool's disk refuses writes (full, over quota); "
        "written in order once it takes them again. Past it a turn is lost, counted and logged; the agent's "
        "answer is never held back.",
    )
    # --- sessions of a long-running proxy (capture/proxy/sessions.py) ---
    session_header: str = option(
        "X-Lcap-Session",
        help="Header whose value names a call's session (its episode, scoped to the call's upstream credential) "
        "when it carries no episode credentials; never sent upstream ('' turns it off).",
    )
    role_by: tuple[str, ...] = option(
        (),
        help="A call's role when it has no X-Lcap-Role header: model:NAME=ROLE (the agent asked for model NAME), "
        "system:REGEX=ROLE (its system prompt matches REGEX) or thread (the episode's first conversation is 'main', "
        "its others 'subagent'); the first that matches wins, else 'default'. Repeatable; stored as turns.role.",
    )
    role_models: tuple[tuple[str, str], ...] = option(
        (),
        cli=False,
        help="(role, adapter) pins with --upstream policy: each role's calls ask for that adapter, loaded beside the "
        "deployments, instead of the role's deployment (how `lcap loop --per-role` evaluates a round's candidates).",
    )
    conversations: bool | None = option(
        None,
        flag="--conversations/--no-conversations",
        help="Attribute a call without credentials or session header by its Responses previous_response_id, else "
        "its conversation (a new episode per message prefix not seen before) (default: on for --serve).",
    )
    # --- the reward endpoint of `lcap proxy --serve` (capture/proxy/rewards_api.py) ---
    rewards_host: str = option(
        "127.0.0.1", help="Address of the reward endpoint of --serve (POST /lcap/v1/rewards); loopback by default."
    )
    rewards_port: int | None = option(
        None, help="Port of the reward endpoint (default: a free one for --serve, none otherwise; -1: none)."
    )
    max_pending_rewards: int = option(256, help="Rewards waiting to be stored at once (429 past it).")
    max_reward_bytes: int = option(64 * 1024, help="Largest reward request body (413 past it).")
    implicit_reward: str | None = option(
        None,
        help="With --serve: judge the user's next message in each session as feedback on the assistant turn before "
        "it and store it as a reward of source 'implicit': 'judge:RUBRIC.md [lcap judge-live flags]', run as "
        "`lcap judge-live` beside the proxy and stopped with it.",
    )
    # --- state kept between calls ---
    max_certs: int = option(1000, help="TLS certificates kept for intercepted hosts (least recently used go).")
    max_episodes: int = option(
        100_000, help="Idle episodes whose call numbering is kept (least recently used go; see docs/guide.md)."
    )

    def __post_init__(self) -> None:
        parse_role_by(self.role_by)  # a rule lcap cannot read is refused before anything starts


def sandbox_limits(options: Any) -> SandboxLimits | None:
    """The --sandbox limits of `options` (ProxyOptions, CollectOptions or RescoreOptions: they take the flags above;
    rescore's, whose verifiers' workspaces are never kept, no --keep-workspaces), or None."""
    if not options.sandbox:
        return None
    if min(options.sandbox_memory, options.sandbox_pids, options.sandbox_disk) < 1:
        raise LcapError("--sandbox-memory, --sandbox-pids and --sandbox-disk must be at least 1")
    shares = tuple(Path(p).resolve() for p in options.sandbox_share)
    missing = [str(p) for p in shares if not p.exists()]
    if missing:
        raise LcapError(f"--sandbox-share: no such file or folder: {missing[0]}")
    return SandboxLimits(
        options.sandbox_memory,
        options.sandbox_pids,
        options.sandbox_disk,
        getattr(options, "keep_workspaces", False),
        shares,
    )


# The flags `lcap collect` and `lcap loop` take from ProxyOptions (their proxy's other settings are the defaults).
POLICY_ROUTE_FLAGS = ("stitch", "adapt", "stitch_memory", "hold_timeout", "max_held_calls", "role_by", "temperature")
NOT_POLICY_ROUTE_FLAGS = tuple(f for f in ProxyOptions.__dataclass_fields__ if f not in POLICY_ROUTE_FLAGS)
