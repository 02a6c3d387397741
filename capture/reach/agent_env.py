"""How an episode's agent reaches the capture proxy: its environment (the proxy variables with the episode's
credentials, lcap's CA bundle for every client lcap knows, the JVM's options, Node's preload), a loopback port of
the episode's own for clients that cannot present credentials, its namespaces with `--transparent`, and a listener
made in its sandbox's network served as the episode's (`--sandbox`).

`CaptureProxy` (capture/proxy/server.py) makes one `AgentEnvironment` once it listens, and its `child_env`,
`episode_child` and `serve_listener` are this class's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lcap.capture.reach.jvm import java_proxy_options, java_tool_options, non_proxy_hosts, trust_store
from lcap.capture.reach.listeners import EpisodeListeners
from lcap.capture.reach.node_preload import node_options, preload_env
from lcap.capture.reach.peers import from_tree
from lcap.capture.trust.ca import ca_dir

if TYPE_CHECKING:
    from lcap.capture.reach.netns import Namespaces

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")
# Hosts of hosted LLM APIs: a NO_PROXY entry covering them would let calls bypass capture.
LLM_HOSTS = (
    "api.openai.com",
    "api.anthropic.com",
    "generativelanguage.googleapis.com",
    "openrouter.ai",
    "api.mistral.ai",
    "api.groq.com",
    "api.together.xyz",
    "api.deepseek.com",
    "api.x.ai",
)
# The API keys SDKs refuse to start without; an agent behind a routing proxy gets a placeholder where it has none.
PLACEHOLDER_KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")


def trust_env(bundle: Path, java_options: str | None = None) -> dict[str, str]:
    """The variables through which a child trusts `bundle` (lcap's CA and the system roots); the JVM's trust store
    goes after the user's own `java_options`. A client lcap learns to point at its CA goes here: `lcap doctor` runs
    each against a server with a certificate from that CA."""
    store = trust_store(bundle, ca_dir())
    return {**{name: str(bundle) for name in CA_VARS}, "JAVA_TOOL_OPTIONS": java_tool_options(java_options, store)}


@dataclass(frozen=True)
class Child:
    """How to start one episode's agent: its command line, environment, and the files it inherits."""

    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    on_start: Callable[[subprocess.Popen], None] = lambda child: None  # told the agent's process once it started


class AgentEnvironment:
    """What a running proxy gives each episode's agent: its environment, and the listeners that are its own."""

    def __init__(
        self,
        proxy_url: Callable[[str | None], str],
        port: int,
        bundle: Path,
        *,
        transparent: bool,
        routed: bool,
        listeners: EpisodeListeners,
        loop: asyncio.AbstractEventLoop,
        namespaces: Namespaces | None,
        forget: Callable[[str], None],
    ) -> None:
        """`proxy_url(episode)`: the proxy URL whose credentials write calls into `episode` (None: the bare URL);
        `port`: the proxy's; `bundle`: lcap's CA bundle; `routed`: the proxy sends calls to an `--upstream` of its
        own; `listeners`: the front, serving on `loop`; `namespaces`: the agents' with `--transparent`; `forget`:
        called with an episode once its agent exited."""
        self.proxy_url, self.port, self.bundle = proxy_url, port, bundle
        self.transparent, self.routed = transparent, routed
        self.listeners, self.loop, self.namespaces = listeners, loop, namespaces
        self.forget = forget

    def child_env(
        self, episode_id: str | None, base: Mapping[str, str] | None = None, *, jvm_port: int | None = None
    ) -> dict[str, str]:
        """The full environment of a child whose LLM calls go through this proxy as `episode_id`. JVMs are pointed
        at `jvm_port` (an episode's own port: they cannot present credentials), else at the proxy's port. With
        `--transparent` no proxy is set: the child's namespace sends everything to lcap."""
        env = dict(os.environ if base is None else base)
        if self.transparent:
            for name in PROXY_VARS:
                env.pop(name, None)
        else:
            proxy = self.proxy_url(episode_id)
            for name in PROXY_VARS:
                env[name] = proxy
        for name in ("NO_PROXY", "no_proxy"):
            if name in env:
                env[name] = _no_proxy_without_llm_hosts(env[name])
        env.update(trust_env(self.bundle, env.get("JAVA_TOOL_OPTIONS")))
        if not self.transparent:  # the JVM ignores HTTPS_PROXY: it reads properties
            env["JAVA_TOOL_OPTIONS"] += " " + java_proxy_options(
                ("127.0.0.1", jvm_port or self.port), non_proxy_hosts(env.get("NO_PROXY", env.get("no_proxy")))
            )
        env["NODE_OPTIONS"] = node_options(env.get("NODE_OPTIONS"))
        env.update(preload_env())
        if self.routed:
            # lcap routes the calls and sends the upstream its own key (or none), never the agent's: an SDK that will
            # not start without a key gets a placeholder
            for name in PLACEHOLDER_KEYS:
                env[name] = env.get(name) or "lcap-placeholder"
        env["LCAP_PROXY_URL"] = self.proxy_url(None)
        if episode_id:
            env["LCAP_EPISODE_ID"] = episode_id
        return env

    @contextlib.contextmanager
    def episode_child(
        self, episode_id: str, argv: Sequence[str], base: Mapping[str, str] | None = None
    ) -> Iterator[Child]:
        """How to run `argv` as `episode_id`'s agent, for as long as it runs: in its own namespaces with
        `--transparent`, else with the proxy's environment and a loopback port of the episode's own for JVMs.
        What the episode holds (its listeners, the heads its calls left for stitching) is released at the end of
        the block, once the agent exited."""
        if self.namespaces is not None:
            env = self.child_env(episode_id, base)
            try:
                with self.namespaces.launch(episode_id, env.get("PATH")) as launch:
                    yield Child(launch.argv(argv), env, launch.pass_fds)
            finally:
                self.forget(episode_id)
            return
        started: list[int] = []  # the agent's pid: its processes alone may use the episode's port

        def admit(listener: tuple[str, int], peer: tuple[str, int]) -> bool:
            return bool(started) and from_tree(started[0], listener, peer)

        listening = self.listeners.listen_episode(episode_id, admit=admit)
        server = asyncio.run_coroutine_threadsafe(listening, self.loop).result(30)
        try:
            port = server.sockets[0].getsockname()[1]
            env = self.child_env(episode_id, base, jvm_port=port)
            yield Child(list(argv), env, on_start=lambda child: started.append(child.pid))
        finally:
            _close_listener(server, self.loop)
            self.forget(episode_id)

    @contextlib.contextmanager
    def serve_listener(self, episode_id: str, sock: socket.socket) -> Iterator[None]:
        """Serve `sock`, a listener made in an episode's own network namespace (`--sandbox`), for the block: every
        connection on it is `episode_id`'s, no credentials needed, since nothing else can reach it."""
        listening = self.listeners.listen_episode(episode_id, sock)
        server = asyncio.run_coroutine_threadsafe(listening, self.loop).result(30)
        try:
            yield
        finally:
            _close_listener(server, self.loop)
            self.forget(episode_id)


async def _close(server: asyncio.AbstractServer) -> None:
    """Close `server` on its own loop (its sockets are the loop's), returning once they are closed."""
    server.close()


def _close_listener(server: asyncio.AbstractServer, loop: asyncio.AbstractEventLoop) -> None:
    """Close an episode's listener from another thread (on a loop that stopped, the loop closes it)."""
    with contextlib.suppress(RuntimeError, TimeoutError, CancelledError):
        asyncio.run_coroutine_threadsafe(_close(server), loop).result(30)


def _no_proxy_without_llm_hosts(value: str) -> str:
    """NO_PROXY minus entries that would let LLM calls bypass the proxy (`*`, `.openai.com`, ...)."""
    keep = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        bare = entry.lstrip("*").lstrip(".").split(":")[0].lower()
        if entry == "*" or any(host == bare or host.endswith("." + bare) for host in LLM_HOSTS):
            continue
        keep.append(entry)
    return ",".join(keep)
