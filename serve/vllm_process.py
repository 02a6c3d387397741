"""One vLLM server process, the way lcap starts every one: its command line (vLLM with lcap's policy endpoints,
LoRA enabled), its launch in a process group of its own, the wait for /health, and hot-loading an adapter.

Local replicas (server.py) and Ray replicas (ray_replicas.py, on their nodes) both run their servers through it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from lcap.config import LcapError
from lcap.display import printable
from lcap.policy import PolicyServer, bearer
from lcap.processes import python_helper
from lcap.progress import Reporter
from lcap.serve.vllm_env import ensure_vllm_env, has_gpu, working_vllm_python

MAX_LORA_RANK = 16  # the trainer's default rank; every slot of a larger rank slows all decoding
MAX_LORAS = 2  # adapters resident per batch: the new deployment and the one still finishing calls
TOOL_PARSER = "hermes"  # <tool_call>{json}</tool_call>: the tiny model's template and Qwen2.5/3's
HEALTH_TIMEOUT_S = 2.0
FORK_ENGINE_VARIABLE = "LCAP_FORK_ENGINE"  # 1: vllm_plugin/launch.py forks vLLM's engine core instead of spawning it
_PARALLEL_FLAGS = {  # vLLM's flags whose product is the GPUs one server uses
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
}


@dataclass(frozen=True)
class VllmSpec:
    """What every replica of a policy runs."""

    model: str
    served_name: str
    python: str | None  # None: lcap's vLLM venv, else a `vllm` on PATH (found on each replica's node)
    tool_parser: str | None
    extra_args: tuple[str, ...]  # the user's vLLM arguments, passed through
    timeout: float  # seconds to wait for /health
    endpoint_env: tuple[tuple[str, str], ...] = ()  # the options of lcap's endpoints (ServeOptions.endpoint_env)
    lora: bool = True  # vLLM's LoRA support on (`lcap serve --no-lora`: off)

    @classmethod
    def of(cls, record: PolicyServer, timeout: float = 600.0) -> VllmSpec:
        """The spec the record's replicas run."""
        return cls(
            record.base_model,
            record.served_model,
            record.python,
            record.tool_parser,
            tuple(record.vllm_args),
            timeout,
            tuple(record.endpoint_env.items()),
            record.lora,
        )


def cpu_kv_cache_gib(model: str, extra_args: Sequence[str] = ()) -> int:
    """GiB of KV cache for vLLM's CPU backend: 1, or more when one sequence at the served length needs more.

    vLLM serves a model at its config's length unless `--max-model-len` says otherwise, and refuses to start
    when the KV cache cannot hold one sequence that long; on CPU the cache is float32. A model named on a hub
    (no local config) gets 1 GiB: set VLLM_CPU_KVCACHE_SPACE or pass `--max-model-len` for a larger one.
    """
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 4
        length = int(flag_value(extra_args, "--max-model-len") or config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 1
    return max(1, math.ceil(per_token * length * 1.25 / (1 << 30)))


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in a vLLM argument list."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def resolve_python(python: str | None = None) -> str:
    """The interpreter that runs vLLM: `--python`, else lcap's vLLM venv, else a `vllm` on PATH, else install."""
    if python:
        found = shutil.which(python) or (python if Path(python).exists() else None)
        if not found:
            raise LcapError(f"no python at {python}")
        return os.path.abspath(found)  # not resolve(): a venv's python is a symlink that must stay one
    if found := working_vllm_python():
        return found
    if script := shutil.which("vllm"):
        first = Path(script).read_bytes().split(b"\n", 1)[0].decode(errors="replace")
        if first.startswith("#!") and Path(first[2:].strip()).exists():
            return first[2:].strip()
    return ensure_vllm_env()


def served_name_for(model: str) -> str:
    """The name the base model is served under: its directory name or the HF repo's last part."""
    return Path(model.rstrip("/")).name or "policy-base"


def gpus_per_server(extra_args: Sequence[str]) -> int:
    """The GPUs one vLLM server takes: tensor x pipeline x data parallel size, as its arguments say."""
    sizes = {"tp": 1, "pp": 1, "dp": 1}
    args = list(extra_args)
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in _PARALLEL_FLAGS:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            if not value.isdigit() or int(value) < 1:
                raise LcapError(f"vLLM argument {flag}: expected a positive whole number, not {value!r}")
            sizes[_PARALLEL_FLAGS[flag]] = int(value)
    return sizes["tp"] * sizes["pp"] * sizes["dp"]


def server_command(
    python: str,
    model: str,
    *,
    port: int,
    served_name: str,
    gpu: bool,
    host: str = "127.0.0.1",
    tool_parser: str | None = TOOL_PARSER,
    extra_args: Sequence[str] = (),
    guarded: bool = False,
    lora: bool = True,
) -> list[str]:
    """vLLM's OpenAI server on `model` with lcap's policy endpoints (LAUNCHER); `guarded`: behind the replica key
    on every path but /health (GUARD, which then runs LAUNCHER), for a replica reachable from the network."""
    start = python_helper(python, str(GUARD if guarded else LAUNCHER))
    cmd = [*start, "--model", model, "--served-model-name", served_name, "--host", host, "--port", str(port)]
    # GPU: the checkpoint's dtype (bf16 for fp32 weights); CPU: fp32, the path vLLM's CPU backend tests.
    cmd += ["--dtype", "auto" if gpu else "float32"]
    if lora:  # off (`lcap serve --no-lora`), vLLM runs none of its LoRA kernels: adapters are deployed merged
        cmd += ["--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", str(MAX_LORAS)]
    cmd += ["--worker-extension-cls", RELOAD_EXTENSION]
    if tool_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    return cmd + list(extra_args)


RELOAD_EXTENSION = "lcap_policy.reload.ReloadExtension"  # the worker method serve/reload.py calls
LAUNCHER = Path(__file__).resolve().parent / "vllm_plugin" / "launch.py"  # vLLM with lcap's policy endpoints
GUARD = Path(__file__).resolve().parent / "vllm_guard.py"  # the key check, in front of LAUNCHER


def launch(
    spec: VllmSpec,
    *,
    python: str,
    listener: socket.socket,
    log_path: Path,
    env: dict[str, str] | None = None,
    key: str | None = None,
) -> subprocess.Popen:
    """Start one vLLM server in a process group of its own, serving on `listener` (`listen_socket`), its output
    appended to `log_path`: the one way lcap starts vLLM, for local and Ray replicas alike. `key`: every path but
    /health requires it (the server listens where the network reaches it); it goes in the environment, never on
    the command line, which `ps` shows. A server on loopback runs in vLLM's dev mode (in-place weight reloads);
    one on another address never does. The caller closes its copy of `listener` once this returns."""
    host, port = listener.getsockname()[:2]
    gpu = has_gpu() and (env or os.environ).get("CUDA_VISIBLE_DEVICES") != ""
    env = dict(env or os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", **dict(spec.endpoint_env))
    env.pop(KEY_VARIABLE, None)
    env[LISTEN_FD_VARIABLE] = str(listener.fileno())
    if host in LOOPBACK:  # /pause, /resume, /collective_rpc: for a full checkpoint reloaded in place (serve/reload.py)
        env.setdefault(DEV_MODE_VARIABLE, "1")
    else:  # vLLM's --api-key would not guard them, and /collective_rpc calls any worker method
        env.pop(DEV_MODE_VARIABLE, None)
    if key:
        env[KEY_VARIABLE] = key
    extra_args = list(spec.extra_args)
    if not gpu:
        # GiB; vLLM's default would reserve a large share of RAM, too little would refuse the model's own length.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib(spec.model, extra_args)))
        # The model worker runs inside the engine-core process (`uni` executor) instead of a third process
        # that pays vLLM's and torch's import again: a faster start-up (benchmarks/bench_serve_start.py
        # measures it). CPU serving is for small models: one worker is all it uses.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "--distributed-executor-backend" not in extra_args:
            extra_args += ["--distributed-executor-backend", "uni"]
            # ...and that engine-core process forked from the API server, not spawned (vllm_plugin/launch.py).
            env.setdefault(FORK_ENGINE_VARIABLE, "1")
    cmd = server_command(
        python,
        spec.model,
        port=port,
        host=host,
        served_name=spec.served_name,
        gpu=gpu,
        tool_parser=spec.tool_parser,
        extra_args=extra_args,
        guarded=bool(key),
        lora=spec.lora,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(listener.fileno(),),
        )


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host`:`port` (0: a port the kernel picks) for `launch` to hand to vLLM, so that
    no other process can take the port between its choice and the server's start. Until vLLM accepts, connections
    wait in its backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        raise LcapError(f"cannot serve on {host}:{port}: {exc.strerror}") from None
    return sock


KEY_VARIABLE = "LCAP_REPLICA_KEY"  # what vllm_guard.py reads the key from
LISTEN_FD_VARIABLE = "LCAP_LISTEN_FD"  # the inherited socket vllm_plugin/launch.py serves on
DEV_MODE_VARIABLE = "VLLM_SERVER_DEV_MODE"
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def wait_healthy(
    servers: Sequence[tuple[subprocess.Popen, str, Path]], timeout: float, progress: bool | None = None
) -> None:
    """Wait until every (process, url, log) answers /health; LcapError (with the log's last lines) when one exits
    or `timeout` passes first. Shown as it waits (lcap/progress.py; `progress`: the bar, else lines, None: whichever
    stderr is): the replicas ready and the last line of vLLM's log."""
    waiting = list(servers)

    def said() -> str:
        ready = f"{len(servers) - len(waiting)}/{len(servers)} ready, " if len(servers) > 1 else ""
        return f"{ready}{log_news(waiting[0][2])}" if waiting else f"{len(servers)} healthy"

    started = time.monotonic()
    with Reporter("starting vLLM", describe=said, show=progress, counted=False) as shown:
        while waiting:
            for proc, url, log_path in list(waiting):
                if proc.poll() is not None:
                    raise LcapError(
                        f"vLLM exited with code {proc.returncode} while starting; last lines of {log_path}:\n"
                        f"{tail(log_path)}"
                    )
                if healthy(url):
                    waiting.remove((proc, url, log_path))
            if not waiting:
                return
            if time.monotonic() - started > timeout:
                _, _, log_path = waiting[0]
                raise LcapError(
                    f"vLLM was not healthy after {timeout:.0f}s; last lines of {log_path}:\n{tail(log_path)}"
                )
            shown.refresh()
            time.sleep(0.5)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_bytes()[-16384:].decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


# What vLLM puts before each message: "(EngineCore pid=30683) INFO 12-07 09:59:49 [cpu_model_runner.py:68] ".
_VLLM_LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] ")
NEWS_CHARS = 80


def log_news(path: Path) -> str:
    """The last line of a vLLM log as a progress line's words: its message without vLLM's prefix, cut at its end
    to NEWS_CHARS, control characters escaped; nothing while the log's last line is `launch`'s command."""
    line = _VLLM_LOG_PREFIX.sub("", tail(path, 1).strip())
    if line.startswith("$ "):
        return ""
    return printable(line if len(line) <= NEWS_CHARS else line[: NEWS_CHARS - 1] + "…")


def load_lora_over_http(url: str, name: str, path: Path | str, key: str | None) -> None:
    """Hot-load the adapter at `path` (on the server's machine) under `name`; LcapError when vLLM refuses it."""
    # In place: deploying a name again (a resumed loop, or a retrained adapter under a fixed name) replaces it.
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
    headers = bearer(key)
    try:
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=600, headers=headers, trust_env=False)
    except httpx.HTTPError as exc:
        raise LcapError(
            f"policy server at {url} did not answer ({exc}): is it running? `lcap serve --status`"
        ) from None
    if response.status_code != 200:
        raise LcapError(f"vLLM at {url} refused adapter {path} ({response.status_code}): {error_text(response)}")


def error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str((body.get("error") or {}).get("message") or body)
    except (ValueError, AttributeError):
        return response.text[:500]
