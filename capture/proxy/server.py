"""The capture proxy, in its own thread: its start (the upstream, the port, the limits), its parts and its stop.

`CaptureProxy` is used by `lcap proxy` (one child, one episode) and by collect (one proxy, many
concurrent episodes told apart by the proxy URL's credentials). Agents connect to the front
(capture/proxy/front.py), which serves plain HTTP/1.1 LLM calls itself and hands everything else to an
embedded mitmproxy on a loopback port. Only the mitmproxy addons lcap needs are loaded (proxy
server, layer selection, TLS). What each agent is given to reach it (its environment, its own listeners,
its namespaces with `--transparent`) is capture/reach/agent_env.py's; lcap's CA is capture/trust/ca.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mitmproxy.options import Options

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.addon import CaptureAddon
from lcap.capture.proxy.announce import Announcer, command_line
from lcap.capture.proxy.calls import Calls
from lcap.capture.proxy.front import Front
from lcap.capture.proxy.memory import MemoryTrimmer
from lcap.capture.proxy.mitm_guards import (
    FrontOnly,
    Limits,
    PrivateDestinations,
    bounded_lru,
    eager_tasks,
    install_body_limits,
    install_http1_guards,
    install_reset_limit,
    install_websocket_limits,
    quiet_tls_config,
    skip_debug_checks,
)
from lcap.capture.proxy.rewards_api import KnownEpisodes, RewardEndpoint
from lcap.capture.proxy.roles import parse_role_by
from lcap.capture.proxy.sessions import EpisodeRows, Sessions, session_floor
from lcap.capture.reach.agent_env import AgentEnvironment, Child
from lcap.capture.reach.jvm import trust_store
from lcap.capture.reach.names import Names
from lcap.capture.routing.policy_wire import has_endpoints
from lcap.capture.routing.routes import Router, parse_upstream
from lcap.capture.routing.stitching import ConversationHeads
from lcap.capture.storage.writer import TurnSink, TurnWriter, WriterReport
from lcap.capture.trust.ca import CA_BASENAME, ca_bundle, ca_dir, ensure_ca
from lcap.capture.trust.certs import LeafCerts
from lcap.capture.trust.credentials import EpisodeKeys, ProxyRecord, remove_record
from lcap.capture.trust.destinations import Destinations, is_loopback_host, restricts
from lcap.config import LcapError
from lcap.policy import bearer, read_policy, record_path
from lcap.store import Store

try:
    import uvloop
except ImportError:  # Windows: uvloop is a dependency everywhere else
    uvloop = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from lcap.capture.reach.netns import Namespaces

log = logging.getLogger("lcap.capture")


def probe_models(base_url: str, timeout: float = 5.0, *, key: str | None = None) -> list[dict]:
    """GET {upstream}/v1/models; LcapError when the upstream cannot be reached."""
    import httpx  # start-up: httpx, asked of an upstream only

    route = parse_upstream(base_url, None)
    url = f"{route.scheme}://{route.host}:{route.port}{route.base_path or '/v1'}/models"
    try:
        resp = httpx.get(url, timeout=timeout, trust_env=False, headers=bearer(key))
    except httpx.HTTPError as exc:
        raise LcapError(f"upstream {base_url} is unreachable: {exc.__class__.__name__}: {exc}") from None
    try:
        data = resp.json().get("data") or []
    except ValueError:
        data = []
    return [m for m in data if isinstance(m, dict)]


class CaptureProxy:
    """An in-process mitmproxy that logs every LLM call passing through it as a turn in `store`."""

    def __init__(
        self,
        store: Store | None,
        options: ProxyOptions = ProxyOptions(),
        *,
        writer: TurnSink | None = None,
        policy_key: str | None = None,
        announce: bool = True,
    ) -> None:
        """`store` receives the turns through a writer process; a proxy on a Ray node has no store, and hands its
        turns to `writer` instead (an Outbox the collect driver empties). `policy_key`: the policy replicas' key,
        held in memory, in place of the record's key file (a Ray node's proxy: that file is on the driver's machine).
        `announce`: write the proxy's record (`lcap episode new`, `lcap status`); a judge's own proxy writes none."""
        if writer is None:
            if store is None:
                raise ValueError("CaptureProxy needs a store or a writer")
            writer = TurnWriter(store, max_backlog=options.max_spool_backlog)
        self.store = store
        self.options = options
        self.policy_key = policy_key
        self.announce = announce
        self.token_ids = options.token_ids  # resolved at start(): on when the upstream is vLLM
        self.lcap_endpoints = False  # resolved at start() for a fixed --upstream URL (the policy record says it)
        self.keys = EpisodeKeys.new()  # this run's key: episode secrets are worthless to any other proxy
        self.exposed = not is_loopback_host(options.host)
        self.require_credentials = options.require_credentials is not False
        self.max_connections = options.max_connections  # lowered at start() to fit the open-file limit
        self.port: int | None = None
        self.front: Front | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the proxy thread's event loop, once started
        self.limits = Limits(options)  # lcap's limits in its mitmproxy; counts the HTTP/2 connections it closed
        self._record: ProxyRecord | None = None
        self._announcer: Announcer | None = None
        self.writer: TurnSink = writer
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: str | None = None
        self._master: Any = None
        self._calls: Calls | None = None
        self._router: Router | None = None  # the calls' router: the mitmproxy guard asks it, the stop closes it
        self._episode_rows: EpisodeRows | None = None
        self._known = KnownEpisodes(options.max_episodes)
        self.rewards: RewardEndpoint | None = None
        self._bundle: Path | None = None
        self._java_store: Path | None = None
        self.names = Names()  # names lcap's DNS answered for namespaces (`--transparent`)
        self.namespaces: Namespaces | None = None
        self.agents: AgentEnvironment | None = None  # what each episode's agent is given, once the proxy listens

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self._port()}"

    # --- start / stop ------------------------------------------------------------------------

    def start(self) -> None:
        """Check the CA, the upstream and the port, then listen. Returns once the proxy accepts connections."""
        if self.exposed and not self.require_credentials:
            raise LcapError(f"--host {self.options.host} is reachable from the network: --anonymous is refused there")
        if self.options.transparent:
            from lcap.capture.reach.netns import missing  # transparent mode only

            if lacking := missing():
                raise LcapError(f"--transparent needs {lacking}; the default mode (without --transparent) still works")
        self._bundle = ca_bundle()
        self._java_store = trust_store(self._bundle, ca_dir())
        self.token_ids = self._resolve_token_ids()
        if self.options.port:
            _check_port_free(self.options.host, self.options.port)
        self.max_connections = _fit_open_files(self.options.max_connections)
        if self.store is not None:
            with self.store.connect():  # the schema exists from the start: `lcap sql` works before the first turn
                pass
        router = Router(
            self.options.upstream,
            self.options.model,
            lcap_endpoints=self.lcap_endpoints,
            policy_key=self.policy_key,
            role_models=dict(self.options.role_models),
        )
        if self.store is not None:
            self._episode_rows = EpisodeRows(self.store)
            self._episode_rows.start()
        calls = self._make_calls(router)
        self._calls = calls
        self._router = router
        self.writer.start()
        self._thread = threading.Thread(target=self._serve, args=(calls, router), name="lcap-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self._error:
            self.writer.stop()
            raise LcapError(self._error or "the capture proxy did not start within 60 s")
        assert self.port is not None
        if self.options.transparent:
            try:
                self._start_namespaces()
            except BaseException:
                self.stop()
                raise
        assert self.front is not None and self.loop is not None and self._bundle is not None
        self.agents = AgentEnvironment(
            self.proxy_url,
            self.port,
            self._bundle,
            transparent=self.options.transparent,
            routed=self.options.upstream is not None,
            listeners=self.front,
            loop=self.loop,
            namespaces=self.namespaces,
            forget=self._forget,
        )
        self._start_rewards()
        self._announce()
        if self.exposed:
            log.warning(
                "lcap: warning: the proxy listens on %s:%d, reachable from the network: every call needs episode "
                "credentials, and %s",
                self.options.host,
                self.port,
                "loopback, link-local and private destinations are allowed (--allow-private)"
                if self.options.allow_private
                else "loopback, link-local and private destinations are refused",
            )

    def _make_calls(self, router: Router) -> Calls:
        """What both transports do with a call, set up from the options."""
        sessions = Sessions(
            header=self.options.session_header,
            conversations=bool(self.options.conversations),
            limit=self.options.max_episodes,
            opened=self._opened,
        )
        return Calls(
            self.writer,
            router,
            token_ids=bool(self.token_ids),
            upstream_api_key=os.environ.get("LCAP_UPSTREAM_API_KEY"),
            keys=self.keys,
            require_credentials=self.require_credentials,
            max_episodes=self.options.max_episodes,
            max_body_bytes=self.options.max_body_bytes,
            stitch=self.options.stitch,
            adapt=self.options.adapt,
            temperature=self.options.temperature,
            heads=ConversationHeads(self.options.stitch_memory),
            hold_timeout=self.options.hold_timeout,
            max_held=self.options.max_held_calls,
            sessions=sessions,
            session_floor=session_floor(self.store) if self.store is not None and self.options.session_header else 0,
            role_by=parse_role_by(self.options.role_by),
        )

    def _start_rewards(self) -> None:
        """The reward endpoint of `--serve`, when asked for (a proxy with a store only)."""
        if self.store is None or self.options.rewards_port is None or self.options.rewards_port < 0:
            return
        self.rewards = RewardEndpoint(
            self.store,
            secrets.token_urlsafe(32),
            host=self.options.rewards_host,
            port=self.options.rewards_port,
            max_pending=self.options.max_pending_rewards,
            max_body=self.options.max_reward_bytes,
            settle=self._episode_rows.settle if self._episode_rows is not None else (lambda: None),
            known=self._known,
        )
        try:
            self.rewards.start()
        except BaseException:
            self.stop()
            raise

    def _announce(self) -> None:
        """The proxy's record, for `lcap episode new` and `lcap status` (a node's proxy has none: its collect
        driver's is the one), announced while it runs."""
        if self.store is None or not self.announce:
            return
        assert self.port is not None
        self._record = ProxyRecord(
            os.getpid(),
            self.options.host,
            self.port,
            self.keys.key.hex(),
            str(self.store.path),
            started_at=time.time(),
            command=command_line(),
            upstream=self.options.upstream,
            spool=str(self.writer.spool_directory) if self.writer.spool_directory else None,
            rewards_url=self.rewards.url if self.rewards is not None else None,
            reward_token=self.rewards.token if self.rewards is not None else None,
        )
        self._announcer = Announcer(self._record, self.counters)
        self._announcer.start()

    def _start_namespaces(self) -> None:
        from lcap.capture.reach.dns import Resolver  # transparent mode only
        from lcap.capture.reach.netns import Namespaces, certs_mirror

        assert self.front is not None and self.loop is not None and self._bundle and self._java_store
        resolver = Resolver(self.names, stand_ins=lambda: self.options.upstream is not None)
        mirror = certs_mirror(ca_dir() / "trust", self._bundle, self._java_store, ensure_ca())
        self.namespaces = Namespaces(
            self.front, resolver, self.loop, bundle=self._bundle, store=self._java_store, mirror=mirror
        )
        self.namespaces.check()

    def _resolve_token_ids(self) -> bool:
        upstream = self.options.upstream
        if upstream is None:
            if self.token_ids:
                raise LcapError("--token-ids needs --upstream (a vLLM server, or 'policy')")
            return False
        if upstream == "policy":
            record = read_policy()
            if record is None:
                raise LcapError(f"--upstream policy: no policy server record at {record_path()} (run `lcap serve`)")
            key = self.policy_key if self.policy_key is not None else record.api_key()
            errors = []
            for replica in record.replicas:  # one replica that answers is enough: the router skips the others
                try:
                    probe_models(replica.url, key=key)
                    break
                except LcapError as exc:
                    errors.append(str(exc))
            else:
                raise LcapError("; ".join(errors))
            return True if self.token_ids is None else self.token_ids
        try:
            parse_upstream(upstream, None)
        except ValueError as exc:
            raise LcapError(f"bad --upstream: {exc}") from None
        key = os.environ.get("LCAP_UPSTREAM_API_KEY")  # what calls to it carry (capture/proxy/calls.py)
        models = probe_models(upstream, key=key)
        vllm = any(m.get("owned_by") == "vllm" for m in models)
        self.lcap_endpoints = vllm and has_endpoints(upstream, key=key)
        if self.token_ids is None:
            return vllm
        return self.token_ids

    def _opened(self, episode: str, labels: dict[str, str]) -> None:
        """A session's episode: its row goes to the store, and the reward endpoint knows it at once."""
        self._known.add(episode, labels)
        if self._episode_rows is not None:
            self._episode_rows.put(episode, labels)

    def _serve(self, calls: Calls, router: Router) -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self._main(calls, router))
        except Exception as exc:  # start-up failures end here; later ones are logged by mitmproxy
            self._error = self._error or f"capture proxy failed: {exc}"
            self._ready.set()

    async def _main(self, calls: Calls, router: Router) -> None:
        skip_debug_checks()
        # start-up: mitmproxy's master and addons, which only a running proxy needs
        from mitmproxy.addons import next_layer, proxyserver
        from mitmproxy.master import Master

        opts = Options()
        master = Master(opts)
        front_only = FrontOnly({})
        destinations = Destinations(
            restricted=restricts(
                exposed=self.exposed, sandboxed=self.options.sandbox, allow_private=self.options.allow_private
            ),
            timeout=self.options.connect_timeout,
        )

        server = proxyserver.Proxyserver()
        addon = CaptureAddon(calls, self.options, server, front_only.episode)
        master.addons.add(
            front_only,
            server,
            next_layer.NextLayer(),
            quiet_tls_config(),
            PrivateDestinations(destinations, router),
            self.limits,
            addon,
        )
        install_body_limits(addon.body_limit)
        install_http1_guards()
        install_websocket_limits()
        install_reset_limit()
        opts.update(  # mitmproxy listens on loopback only: agents reach it through the front (capture/proxy/front.py)
            confdir=str(ca_dir()),
            listen_host="127.0.0.1",
            listen_port=0,
            mode=["regular"],
            connection_strategy="lazy",
            upstream_cert=False,
            stream_large_bodies=None,
        )
        bounded_lru(master.addons.get("tlsconfig").certstore, self.options.max_certs)
        self._master = master
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(_loop_exception)  # kept through asyncio.run's shutdown
        with eager_tasks():
            if not await server.setup_servers() or not server.listen_addrs():
                self._error = "mitmproxy cannot listen on a loopback port"
                self._ready.set()
                return
            front = Front(
                calls,
                server.listen_addrs()[0][1],
                LeafCerts(ca_dir(), CA_BASENAME, self.options.max_certs),
                replace(self.options, max_connections=self.max_connections),
                destinations,
                handoff_ports=front_only.ports,
                names=self.names,
            )
            self.front = front
            try:
                self.port = await front.start(self.options.host, self.options.port)
            except OSError as exc:
                self._error = f"cannot listen on {self.options.host}:{self.options.port}: {exc.strerror or exc}"
                self._ready.set()
                await server.servers.update([])
                return
            await master.running()
            trimmer = MemoryTrimmer()
            trimmer.start(self.loop)
            self._ready.set()
            try:
                await master.should_exit.wait()
            finally:
                trimmer.stop()
                await front.close()
                await server.servers.update([])
                await master.done()

    def counters(self) -> dict[str, Any]:
        """What this proxy is doing now, as its record tells `lcap status`: calls and episodes (in flight), agent
        connections, credentials refused, HTTP/2 connections closed for resetting streams, session rows not written yet, and where its turns are (spooled, stored,
        the writer process)."""
        out: dict[str, Any] = dict(self._calls.counts()) if self._calls is not None else {}
        out["connections"] = self.front.admission.open if self.front is not None else 0
        out["connections_shed"] = self.front.admission.shed if self.front is not None else 0
        out["refused_credentials"] = self.keys.refused
        out["stream_reset_floods"] = self.limits.reset_floods  # HTTP/2 connections closed by --max-stream-resets
        if self._episode_rows is not None:  # sessions' episode rows: writes tried again, rows never stored
            out["episode_rows_failed_writes"] = self._episode_rows.failed_writes
            out["episode_rows_dropped"] = self._episode_rows.dropped
        out.update(self.writer.counters())
        return out

    def flush(self, episode_id: str | None = None, *, timeout: float = 30.0) -> bool:
        """Block until the calls in flight (of `episode_id`, or all) are finished and every finished turn is
        in the store. Collect calls it when an episode's child exits, before reading that episode's turns."""
        deadline = time.monotonic() + timeout
        return self._wait_idle(episode_id, deadline) and self.writer.flush(max(0.0, deadline - time.monotonic()))

    def _wait_idle(self, episode_id: str | None, deadline: float) -> bool:
        calls = self._calls
        while calls is not None and calls.busy(episode_id, any_episode=episode_id is None):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self, *, drain: float = 10.0) -> WriterReport | None:
        """Let the calls in flight finish (for up to `drain` seconds), stop accepting calls and write every
        finished turn to the store; returns what became of the turns (None if the proxy never started)."""
        if self._master is not None and self._thread is not None:
            self._wait_idle(None, time.monotonic() + drain)
            self._master.shutdown()
            self._thread.join(10)
        self._thread = None
        if self._router is not None:
            self._router.close()
        if self.rewards is not None:
            self.rewards.stop()
            self.rewards = None
        if self._episode_rows is not None:
            self._episode_rows.stop()
        if self._announcer is not None:
            self._announcer.stop()
            self._announcer = None
        if self._record is not None:
            remove_record(self._record)
            self._record = None
        return self.writer.finish()

    def __enter__(self) -> CaptureProxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the agents ---------------------------------------------------------------------------

    def proxy_url(self, episode_id: str | None) -> str:
        """The proxy URL whose credentials write calls into `episode_id` (`http://EPISODE:SECRET@host:port`)."""
        if not episode_id:
            return self.url
        return self.keys.proxy_url(episode_id, self.options.host, self._port())

    def episode_header(self, episode_id: str) -> str:
        """The value of an `X-Lcap-Episode` header that writes a request into `episode_id`."""
        return self.keys.pair(episode_id)

    def child_env(
        self, episode_id: str | None, base: Mapping[str, str] | None = None, *, jvm_port: int | None = None
    ) -> dict[str, str]:
        """The full environment of a child whose LLM calls go through this proxy as `episode_id`
        (`AgentEnvironment.child_env`)."""
        return self._agents().child_env(episode_id, base, jvm_port=jvm_port)

    def episode_child(
        self, episode_id: str, argv: Sequence[str], base: Mapping[str, str] | None = None
    ) -> AbstractContextManager[Child]:
        """How to run `argv` as `episode_id`'s agent, for as long as it runs (`AgentEnvironment.episode_child`)."""
        return self._agents().episode_child(episode_id, argv, base)

    def serve_listener(self, episode_id: str, sock: socket.socket) -> AbstractContextManager[None]:
        """Serve `sock`, a listener made in an episode's own network namespace, as `episode_id`'s for the block
        (`AgentEnvironment.serve_listener`)."""
        return self._agents().serve_listener(episode_id, sock)

    def _agents(self) -> AgentEnvironment:
        if self.agents is None:
            raise LcapError("the capture proxy is not started")
        return self.agents

    def _port(self) -> int:
        if self.port is None:
            raise LcapError("the capture proxy is not started")
        return self.port

    def _forget(self, episode_id: str) -> None:
        if self._calls is not None:
            self._calls.forget(episode_id)


def _loop_factory():
    """uvloop where it is installed (a dependency except on Windows): a leaner event loop under every call."""
    return None if uvloop is None else uvloop.new_event_loop


def _loop_exception(loop, context) -> None:
    """Connections still open when the proxy stops are cancelled: not an error worth a traceback."""
    exc = context.get("exception")
    if isinstance(exc, (asyncio.CancelledError, ConnectionError)):
        return
    log.error("lcap proxy: %s", context.get("message"), exc_info=exc)


def _fit_open_files(wanted: int) -> int:
    """The connection limit the open-file limit allows: the soft limit is raised to the hard one, and each agent
    connection may hold up to `FDS_PER_CONNECTION` files (agent, upstream, and both ends of a hand-off)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            soft = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    except (ValueError, OSError):
        return wanted
    fitting = max(1, (soft - FDS_RESERVED) // FDS_PER_CONNECTION)
    if fitting < wanted:
        log.warning(
            "lcap: at most %d agent connections fit the open-file limit (%d); --max-connections %d is lowered",
            fitting,
            soft,
            wanted,
        )
    return min(wanted, fitting)


FDS_PER_CONNECTION = 4
FDS_RESERVED = 64  # the writer's pipe, the spool, DuckDB, mitmproxy's listener, logs


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LcapError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
