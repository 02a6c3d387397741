"""Start vLLM's OpenAI server with lcap's endpoints (run by `lcap serve` with vLLM's interpreter, `python -I`).

vLLM finds endpoint plugins through entry points and loads only those VLLM_PLUGINS names. This
script puts its own folder (the `lcap_policy` package and its `.dist-info`) first on the path and
names `lcap` in VLLM_PLUGINS; when VLLM_PLUGINS was not set, it also names every other plugin
installed, so that setting it does not turn off plugins vLLM would have loaded anyway.

The server listens on the socket lcap bound for it (inherited, its descriptor in LCAP_LISTEN_FD): vLLM's
`create_server_socket` is replaced by one that returns it, so the port lcap chose can't be taken meanwhile.

With LCAP_FORK_ENGINE=1 (lcap sets it on CPU, where the model runs inside the engine-core process) that process
is forked from the API server, as vLLM does on GPUs, instead of spawned: vLLM's CPU platform asks for spawn, which
imports vLLM and torch a second time. The API server loads no model; the engine core sets its OpenMP threads up
itself, after the fork.
"""

import os
import runpy
import socket
import sys
from importlib.metadata import entry_points

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins", "vllm.stat_logger_plugins")


def main() -> None:
    sys.path.insert(0, HERE)
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        names = {ep.name for group in GROUPS for ep in entry_points(group=group)}
    else:
        names = {name for name in allowed.split(",") if name}
    os.environ["VLLM_PLUGINS"] = ",".join(sorted(names | {"lcap"}))
    serve_on_inherited_socket()
    fork_engine_core()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def serve_on_inherited_socket() -> None:
    fd = os.environ.pop("LCAP_LISTEN_FD", None)
    if fd is None:
        return
    from vllm.entrypoints.launchers import launcher  # after VLLM_PLUGINS is set: importing vLLM reads it

    if not hasattr(launcher, "create_server_socket"):
        sys.exit("lcap: vLLM's launcher has no create_server_socket to hand lcap's socket to (vLLM 0.32 has it)")
    sock = socket.socket(fileno=int(fd))
    launcher.create_server_socket = lambda addr, *, reuse_port: sock


def fork_engine_core() -> None:
    if os.environ.pop("LCAP_FORK_ENGINE", None) != "1":
        return
    import multiprocessing

    from vllm.v1.engine import utils

    if not hasattr(utils, "get_mp_context"):
        sys.exit("lcap: vLLM's engine launcher has no get_mp_context to fork the engine core by (vLLM 0.32 has it)")
    utils.get_mp_context = lambda: multiprocessing.get_context("fork")


if __name__ == "__main__":
    main()
