"""The mitmproxy internals lcap patches or reads are there in the installed mitmproxy (and in h11 and wsproto, whose
internals the patches reach through it): an upgrade fails here, naming what to port, before a guard silently stops
guarding. All of them are in capture/proxy/mitm_guards.py: no other module touches them."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from lcap.noise import quiet_noise

ROOT = Path(__file__).resolve().parents[2]
HTTP = "mitmproxy.proxy.layers.http"

# Objects lcap replaces, wraps or calls, by `module:qualified.name`, with what uses them.
NAMES = {
    f"{HTTP}:HttpStream.check_body_size": "mitm_guards.install_body_limits replaces it",
    f"{HTTP}:HttpRequestHeadersHook": "mitm_guards.install_body_limits",
    f"{HTTP}:HttpResponseHeadersHook": "mitm_guards.install_body_limits",
    f"{HTTP}:HttpErrorHook": "mitm_guards.install_body_limits",
    f"{HTTP}:SendHttp": "mitm_guards.install_body_limits",
    f"{HTTP}:ReceiveHttp": "mitm_guards.install_http1_guards",
    f"{HTTP}:ResponseProtocolError": "mitm_guards",
    f"{HTTP}:RequestProtocolError": "mitm_guards",
    f"{HTTP}._http1:ChunkedReader": "mitm_guards.install_http1_guards replaces make_body_reader's reader",
    f"{HTTP}._http1:make_error_response": "mitm_guards.install_http1_guards",
    f"{HTTP}._http1:Http1Client.read_headers": "mitm_guards.install_http1_guards wraps it",
    f"{HTTP}._http1:Http1Server.read_headers": "mitm_guards.install_http1_guards wraps it",
    f"{HTTP}._http1:Http1Connection.read_body": "mitm_guards.install_http1_guards wraps it for Http1Server",
    f"{HTTP}._http2:Http2Server.handle_h2_event": "mitm_guards.install_reset_limit wraps it",
    f"{HTTP}._http2:Http2Server._handle_event": "mitm_guards.install_reset_limit wraps it (an agent's bytes sliced)",
    f"{HTTP}._http2:Http2Server.protocol_error": "mitm_guards.install_reset_limit",
    f"{HTTP}._http2:Http2Connection.is_closed": "mitm_guards.install_reset_limit",
    "mitmproxy.proxy.commands:StartHook": "mitm_guards.StreamResetFloodHook",
    "h2.connection:ConnectionState.CLOSED": "mitm_guards.install_reset_limit",
    "mitmproxy.proxy.layers.websocket:WebsocketLayer.start": "mitm_guards.install_websocket_limits overrides it",
    "mitmproxy.proxy.layers.websocket:WebsocketLayer._handle_event": "mitm_guards.install_websocket_limits",
    "mitmproxy.net.http.http1:expected_http_body_size": "mitm_guards.install_body_limits",
    "mitmproxy.proxy.utils:expect": "mitm_guards.install_websocket_limits",
    "mitmproxy.proxy.layers.tls:parse_client_hello": "mitm_guards.read_client_hello (the front's tunnels)",
    "mitmproxy.optmanager:_Option.current": "mitm_guards.skip_debug_checks replaces it",
    "mitmproxy.optmanager:unset": "mitm_guards.skip_debug_checks",
    "mitmproxy.http:MessageData.__post_init__": "mitm_guards.skip_debug_checks replaces it",
    "mitmproxy.addons.tlsconfig:TlsConfig.running": "mitm_guards.quiet_tls_config overrides it",
    "mitmproxy.addons.proxyserver:Proxyserver": "mitm_guards.connection_of",
    "mitmproxy.proxy.server:ConnectionHandler.close_connection": "mitm_guards.cut_upstream",
    "mitmproxy.certs:CertStore.STORE_CAP": "mitm_guards.bounded_lru (the certificate cache) sets it",
    "mitmproxy.certs:CertStore.get_cert": "mitm_guards.bounded_lru wraps it",
    "mitmproxy.utils.asyncio_utils:set_eager_task_factory": "mitm_guards.eager_tasks",
    "h11._readers:ChunkedReader.__call__": "mitm_guards.install_http1_guards subclasses it",
    "h11._receivebuffer:ReceiveBuffer.maybe_extract_lines": "mitm_guards.install_http1_guards",
    "wsproto.extensions:PerMessageDeflate.frame_inbound_payload_data": "mitm_guards.install_websocket_limits",
    "wsproto.connection:Connection.events": "mitm_guards.install_websocket_limits wraps it",
}

# Attributes lcap reads or sets on instances, found as `self.<name>` in their class's source (read from the file:
# the classes and methods lcap patched at run time, by an earlier test in this process, are not mitmproxy's).
STATE = {
    f"{HTTP}:HttpStream": (
        "flow",
        "context",
        "stream_id",
        "request_body_buf",
        "response_body_buf",
        "client_state",
        "server_state",
    ),
    f"{HTTP}._http1:Http1Connection": ("buf", "state", "request", "response", "stream_id", "conn"),
    f"{HTTP}._http2:Http2Connection": ("h2_conn", "streams", "context", "conn"),
    "h2.connection:H2Connection": ("state_machine",),
    "mitmproxy.proxy.layers.websocket:WebsocketLayer": ("client_ws", "server_ws"),
    "mitmproxy.addons.proxyserver:Proxyserver": ("connections",),
    "mitmproxy.proxy.server:ConnectionHandler": ("transports",),
    "mitmproxy.certs:CertStore": ("expire_queue",),
    "mitmproxy.optmanager:_Option": ("value", "_default"),
    "h11._readers:ChunkedReader": ("_bytes_in_chunk",),
    "h11._receivebuffer:ReceiveBuffer": ("_data",),
    "wsproto.connection:Connection": ("_proto",),
    "wsproto.extensions:PerMessageDeflate": ("_inbound_compressed", "_inbound_is_compressible", "_decompressor"),
}

# Methods lcap replaces with functions of its own: the parameters they must still take, in order.
SIGNATURES = {
    f"{HTTP}:HttpStream.check_body_size": ("self", "request"),
    f"{HTTP}._http1:Http1Client.read_headers": ("self", "event"),
    f"{HTTP}._http1:Http1Server.read_headers": ("self", "event"),
    f"{HTTP}._http1:Http1Connection.read_body": ("self", "event"),
    f"{HTTP}._http2:Http2Server.handle_h2_event": ("self", "event"),
    f"{HTTP}._http2:Http2Server._handle_event": ("self", "event"),
    f"{HTTP}._http2:Http2Connection.protocol_error": ("self", "message", "error_code"),
    "mitmproxy.optmanager:_Option.current": ("self",),
    "mitmproxy.proxy.layers.tls:parse_client_hello": ("data",),
}


def _resolve(where: str):
    module, _, name = where.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _definition(where: str) -> ast.AST:
    """The class or function `where` names, as its module's file defines it."""
    module, _, name = where.partition(":")
    node: ast.AST = ast.parse(inspect.getsource(importlib.import_module(module)))
    for part in name.split("."):
        node = next(
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == part
        )
    return node


def drift(names=NAMES, state=STATE, signatures=SIGNATURES) -> list[str]:
    quiet_noise()  # mitmproxy's addons import ldap3 and passlib, which warn as they are imported
    problems = []
    for where, use in names.items():
        try:
            _resolve(where)
        except (ImportError, AttributeError):
            problems.append(f"{where} is gone ({use})")
    for where, attributes in state.items():
        try:
            source = ast.unparse(_definition(where))
        except (ImportError, StopIteration):
            problems.append(f"{where} is gone")
            continue
        problems += [f"{where} no longer has self.{a}" for a in attributes if f"self.{a}" not in source]
    for where, params in signatures.items():
        try:
            function = _definition(where)
        except (ImportError, StopIteration):
            problems.append(f"{where} is gone")
            continue
        assert isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef), where
        have = tuple(a.arg for a in function.args.posonlyargs + function.args.args)
        if have != params:
            problems.append(f"{where} takes {have}, lcap's replacement takes {params}")
    return problems


def _upgrade(what: str) -> str:
    return (
        f"mitmproxy {version('mitmproxy')} (h11 {version('h11')}, wsproto {version('wsproto')}) {what}: port the "
        "patches (capture/proxy/mitm_guards.py), run tests/integration/test_capture_*.py, then "
        "raise pyproject's mitmproxy bound"
    )


def test_the_installed_mitmproxy_has_every_internal_lcap_patches():
    problems = drift()
    assert not problems, _upgrade("changed what lcap patches: " + "; ".join(problems))


def test_the_patches_reach_mitmproxy_where_it_looks_them_up():
    """The HTTP layer finds the WebSocket layer, and the HTTP/1 layer its chunked reader, by module attribute at
    run time: that is why replacing them there takes effect."""
    http_layer = inspect.getsource(importlib.import_module(HTTP))
    http1 = inspect.getsource(importlib.import_module(f"{HTTP}._http1"))
    assert "websocket.WebsocketLayer(" in http_layer, _upgrade("no longer makes websocket.WebsocketLayer by name")
    assert "ChunkedReader(" in http1, _upgrade("no longer makes its ChunkedReader by module name")


def test_protocol_errors_still_carry_the_http_status_lcap_answers_with():
    """install_body_limits and install_http1_guards answer 413, 431, 502 and 504 through mitmproxy's protocol
    errors, whose code is an HTTP status in mitmproxy 11 (mitmproxy 12 asserts an ErrorCode there)."""
    http = importlib.import_module(HTTP)
    for error, status in ((http.ResponseProtocolError, 413), (http.RequestProtocolError, 502)):
        try:
            made = error(1, "lcap: over the limit", status)
        except AssertionError:
            made = None
        assert made is not None and made.code == status, _upgrade(f"refuses {error.__name__}(code={status})")


def test_drift_names_a_lost_name_a_lost_attribute_and_a_changed_signature():
    """The check can fail: names that are not there are reported, one line each."""
    problems = drift(
        {f"{HTTP}:HttpStream.check_body_sizes": "a use"},
        {"mitmproxy.certs:CertStore": ("expire_queues",)},
        {f"{HTTP}:HttpStream.check_body_size": ("self", "request", "limit")},
    )
    assert problems == [
        f"{HTTP}:HttpStream.check_body_sizes is gone (a use)",
        "mitmproxy.certs:CertStore no longer has self.expire_queues",
        f"{HTTP}:HttpStream.check_body_size takes ('self', 'request'), lcap's replacement takes "
        "('self', 'request', 'limit')",
    ]


def test_pyproject_bounds_mitmproxy_and_the_installed_one_is_within():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = {"python_version": f"{sys.version_info.major}.{sys.version_info.minor}"}
    requirements = [Requirement(d) for d in dependencies if Requirement(d).name == "mitmproxy"]
    assert requirements
    for requirement in requirements:
        assert any(s.operator in ("<", "<=", "==", "~=") for s in requirement.specifier), f"{requirement}: no bound"
    mine = [r for r in requirements if r.marker is None or r.marker.evaluate(env)]
    assert len(mine) == 1 and mine[0].specifier.contains(version("mitmproxy")), _upgrade(f"is not {mine}")


# What only mitm_guards.py may touch. Modules: mitmproxy's proxy layers and server, its options' machinery, its
# utilities and wire helpers, the TLS addon lcap overrides, and the protocol libraries under them (lcap's own use
# of wsproto's public CloseReason, and of mitmproxy's public addons, master, flows, certs and tls, stays allowed).
INTERNAL_MODULES = (
    "mitmproxy.proxy",
    "mitmproxy.optmanager",
    "mitmproxy.utils",
    "mitmproxy.net",
    "mitmproxy.addons.tlsconfig",
    "h11",
    "h2",
    "wsproto.extensions",
    "wsproto.connection",
)
# Attributes of mitmproxy's objects that are not its API: the instance state and private names lcap reads or sets
# (MessageData: whose __post_init__ skip_debug_checks replaces, a name too common to look for itself).
INTERNAL_ATTRIBUTES = frozenset(
    {"STORE_CAP", "expire_queue", "transports", "close_connection", "MessageData", "_Option", "parse_client_hello"}
    | {a for attributes in STATE.values() for a in attributes if a.startswith("_")}
)
PRODUCT = ("lcap", "capture", "dataset", "train", "serve", "loop", "ui")


def touches(source: str) -> list[str]:
    """Where `source` imports one of mitmproxy's internal modules or private names, or reads or sets an internal
    attribute, one line each."""
    found = []

    def internal(module: str) -> bool:
        if module.split(".")[0] not in ("mitmproxy", "h11", "h2", "wsproto"):
            return False
        return any(p.startswith("_") for p in module.split(".")) or any(
            module == m or module.startswith(m + ".") for m in INTERNAL_MODULES
        )

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if internal(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [
                f"{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if internal(node.module) or internal(f"{node.module}.{a.name}")
            ]
        elif isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


@pytest.mark.parametrize(
    "path",
    sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py") if "vllm_plugin" not in p.parts),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_only_mitm_guards_touches_mitmproxys_internals(path):
    if path == ROOT / "capture/proxy/mitm_guards.py":
        return
    found = touches(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} touches mitmproxy's internals {found}: go through mitm_guards.py"


def test_touches_sees_an_internal_import_a_private_name_and_an_internal_attribute():
    """The check can fail: each way of reaching into mitmproxy is found; its public API is not."""
    source = (
        "from mitmproxy.proxy.layers.tls import parse_client_hello\n"
        "from mitmproxy import optmanager\n"
        "from h11._readers import ChunkedReader\n"
        "import mitmproxy.utils.asyncio_utils\n"
        "from mitmproxy.http import HTTPFlow\n"
        "from mitmproxy.addons import proxyserver\n"
        "from wsproto.frame_protocol import CloseReason\n"
        "handler.close_connection(flow.server_conn)\n"
        "store.STORE_CAP = 5\n"
    )
    assert touches(source) == [
        "1: from mitmproxy.proxy.layers.tls import parse_client_hello",
        "2: from mitmproxy import optmanager",
        "3: from h11._readers import ChunkedReader",
        "4: import mitmproxy.utils.asyncio_utils",
        "8: .close_connection",
        "9: .STORE_CAP",
    ]
