"""Run vLLM's OpenAI server with every path but /health behind a bearer key: a replica reachable from the network.

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; /invocations (the same inference as
/v1), /tokenize, /pause, /sleep, /collective_rpc and the rest stay open. A Ray replica listens on its
node's address, so lcap starts it through this script with the interpreter of the vLLM venv
(`python -I vllm_guard.py ARGS`, serve/vllm_process.py `launch`): the key comes from LCAP_REPLICA_KEY (never
the command line, which `ps` shows), the middleware is registered as an importable module, and the
server then starts as a local replica's does, through vllm_plugin/launch.py (vLLM with lcap's policy
endpoints, which the middleware guards like every other path). It imports nothing from lcap: the vLLM
venv does not have lcap.
"""

from __future__ import annotations

import hmac
import os
import runpy
import sys
import types
from typing import Any

MODULE = "lcap_vllm_guard"
OPEN_PATHS = frozenset({"/health"})  # what lcap's probes and `lcap serve --status` read without the key
REFUSAL = b'{"error": "lcap: this policy replica needs its key (Authorization: Bearer ...)"}'
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_plugin", "launch.py")


class RequireKey:
    """Pure ASGI middleware: a request without `Authorization: Bearer <key>` gets a 401, a WebSocket is closed."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.expected = f"Bearer {os.environ['LCAP_REPLICA_KEY']}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN_PATHS:
            given = next((value for name, value in scope.get("headers") or () if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                fields = [(b"content-type", b"application/json"), (b"content-length", str(len(REFUSAL)).encode())]
                await send({"type": "http.response.start", "status": 401, "headers": fields})
                await send({"type": "http.response.body", "body": REFUSAL})
                return
        await self.app(scope, receive, send)


def main() -> None:
    if not os.environ.get("LCAP_REPLICA_KEY"):
        sys.exit("lcap: LCAP_REPLICA_KEY is not set: refusing to serve without a key")
    module = types.ModuleType(MODULE)
    module.RequireKey = RequireKey  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    sys.argv = [LAUNCHER, *sys.argv[1:], "--middleware", f"{MODULE}.RequireKey"]
    runpy.run_path(LAUNCHER, run_name="__main__")


if __name__ == "__main__":
    main()
