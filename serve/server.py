"""`lcap serve`: run vLLM's OpenAI server on the policy and record it for the other commands.

vLLM runs in its own process group (so stopping it also stops its engine workers), from the
interpreter of its own venv, with LoRA enabled and runtime adapter loading allowed: `lcap deploy`
hot-loads each new round's adapter without restarting anything. It starts through
vllm_plugin/launch.py, which adds lcap's policy endpoints (exact tokens in every dialect, stitched
prompts, request adaptation: vllm_plugin/lcap_policy). The record (`lcap.policy`) is written only
once /health answers, so a reader that finds one can send requests.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import httpx

from lcap.config import LcapError, lcap_home
from lcap.policy import PolicyServer, clear_policy, read_policy, write_policy
from lcap.processes import alive, kill_group, python_helper
from lcap.store import Store, now

LAUNCHER = Path(__file__).resolve().parent / "vllm_plugin" / "launch.py"  # vLLM with lcap's policy endpoints
MAX_LORA_RANK = 64  # vLLM's default is 16; adapters of rank 32/64 are common. Allowed: 8, 16, 32, 64, 128...
MAX_LORAS = 2  # adapters resident per batch: the new deployment and the one still finishing calls
TOOL_PARSER = "hermes"  # <tool_call>{json}</tool_call>: the tiny model's template and Qwen2.5/3's


def resolve_python(python: str | None = None) -> str:
    """The interpreter that runs vLLM: `--python`, else lcap's vLLM venv, else a `vllm` on PATH, else install."""
    from lcap.serve.vllm_env import ensure_vllm_env, working_vllm_python

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


def server_command(
    python: str,
    model: str,
    *,
    port: int,
    served_name: str,
    gpu: bool,
    tool_parser: str | None = TOOL_PARSER,
    extra_args: Sequence[str] = (),
) -> list[str]:
    cmd = [
        *python_helper(python, str(LAUNCHER)),
        "--model",
        model,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # GPU: the checkpoint's dtype (bf16 for fp32 weights); CPU: fp32, the path vLLM's CPU backend tests.
        "--dtype",
        "auto" if gpu else "float32",
        "--enable-lora",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--max-loras",
        str(MAX_LORAS),
    ]
    if tool_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    return cmd + list(extra_args)


def start_server(
    model: str,
    *,
    port: int | None = None,
    python: str | None = None,
    served_name: str | None = None,
    log_path: Path | None = None,
    timeout: float = 300,
    tool_parser: str | None = TOOL_PARSER,
    extra_args: Sequence[str] = (),
    store: Store | None = None,
    progress: bool | None = None,
) -> PolicyServer:
    """Start vLLM on `model`, wait until it is healthy, record it (and, with `store`, its 'base' deployment)."""
    from lcap.serve.vllm_env import has_gpu

    running = read_policy()
    if running and alive(running.pid):
        raise LcapError(
            f"a policy server is already running at {running.url} (pid {running.pid}): `lcap serve --stop` first"
        )
    if Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    python = resolve_python(python)
    port = port or _free_port()
    served_name = served_name or served_name_for(model)
    gpu = has_gpu()
    log_path = Path(log_path or lcap_home() / "logs" / f"vllm-{port}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    if not gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default would reserve a large share of RAM
        # The model worker runs inside the engine-core process (`uni` executor) instead of a third process
        # that pays vLLM's and torch's import again: a faster start-up (benchmarks/bench_serve_start.py
        # measures it). CPU serving is for small models: one worker is all it uses.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "--distributed-executor-backend" not in extra_args:
            extra_args = [*extra_args, "--distributed-executor-backend", "uni"]
    cmd = server_command(
        python, model, port=port, served_name=served_name, gpu=gpu, tool_parser=tool_parser, extra_args=extra_args
    )
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log_path, timeout, progress)
    except BaseException:
        kill_group(proc.pid, grace=30)
        raise
    record = PolicyServer(
        url=url,
        pid=proc.pid,
        base_model=model,
        served_model=served_name,
        current=served_name,
        log_path=str(log_path),
        python=python,
        started_at=now().isoformat(),
        loras={},
        lcap_endpoints=_has_lcap_endpoints(url),
    )
    write_policy(record)
    if store is not None:
        store.append(
            "deployments",
            [
                {
                    "name": served_name,
                    "path": model,
                    "base_model": model,
                    "kind": "base",
                    "round": None,
                    "created_at": now(),
                }
            ],
        )
    return record


def stop_server(timeout: float = 30) -> PolicyServer | None:
    """Stop the recorded server (its whole process group) and remove the record; returns what was stopped."""
    record = read_policy()
    if record is None:
        return None
    kill_group(record.pid, grace=timeout)
    clear_policy()
    return record


def server_status() -> dict | None:
    """The record plus whether its process is alive and /health answers; None when nothing is recorded."""
    record = read_policy()
    if record is None:
        return None
    return {**asdict(record), "alive": alive(record.pid), "healthy": _healthy(record.url)}


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float, progress: bool | None) -> None:
    import sys

    show = sys.stderr.isatty() if progress is None else progress
    status = None
    if show:
        from rich.console import Console

        status = Console(stderr=True).status(f"starting vLLM ({log_path})")
        status.start()
    started = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise LcapError(
                    f"vLLM exited with code {proc.returncode} while starting; last lines of {log_path}:\n{_tail(log_path)}"
                )
            if _healthy(url):
                return
            elapsed = time.monotonic() - started
            if elapsed > timeout:
                raise LcapError(
                    f"vLLM was not healthy after {timeout:.0f}s; last lines of {log_path}:\n{_tail(log_path)}"
                )
            if status is not None:
                last = _tail(log_path, 1)[-100:]
                status.update(f"starting vLLM: {elapsed:.0f}s  {last}")
            time.sleep(0.5)
    finally:
        if status is not None:
            status.stop()


def _has_lcap_endpoints(url: str) -> bool:
    """The launcher loads lcap's endpoints; this checks that vLLM did (a `--python` vLLM of another version may
    not load them: the policy route then works as on any vLLM)."""
    try:
        return httpx.get(f"{url}/lcap/v1/info", timeout=5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_bytes()[-16384:].decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
