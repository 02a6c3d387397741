"""Start LiteLLM's proxy (its gateway server) as the side-by-side row of the proxy benchmark.

LiteLLM lives in its own venv (``LITELLM_VENV``, default ``~/.lcap/litellm-venv``, made with
``python3.11 -m venv`` and ``pip install 'litellm[proxy]==1.108.7'``) because its pins clash with
lcap's. To keep the comparison fair it runs in the lightest set-up LiteLLM documents, so the row
measures its request path and nothing we chose to switch on: one uvicorn worker (uvloop, its
default CLI path; the machine has 2 cores and the load generator needs one), no database and no
Redis, ``disable_spend_logs`` and ``disable_error_logs``, ``callbacks: []`` and ``num_retries: 0``
(as in LiteLLM's own benchmark config), ``set_verbose: False`` and ``LITELLM_LOG=ERROR`` (no
per-request access log), ``LITELLM_MODE=PRODUCTION`` (no ``.env`` loading) and
``LITELLM_LOCAL_MODEL_COST_MAP=True`` (no cost-map download at start-up; there is no internet
here). It keeps a master key, because LiteLLM refuses to start without one outside "local
development"; clients send it as ``HEADERS`` (auth checks it against config, no DB; about 10% of
its per-request CPU here). What stays unequal favours LiteLLM: it stores nothing, while lcap
writes every turn to DuckDB, and clients reach it as a base URL, not through an intercepting proxy.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import httpx

LITELLM_VENV = Path(os.environ.get("LITELLM_VENV", Path.home() / ".lcap" / "litellm-venv"))
MODEL = "gpt-4o-mini"
MASTER_KEY = f"sk-{secrets.token_hex(32)}"
HEADERS = {"Authorization": f"Bearer {MASTER_KEY}"}


def available() -> bool:
    """True when the LiteLLM venv exists with the proxy's console script (installed by litellm)."""
    return LITELLM_VENV.joinpath("bin", "litellm").is_file()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_config(upstream_url: str, workdir: Path) -> Path:
    """LiteLLM reads YAML; JSON is YAML, so the stdlib writes it."""
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": upstream_url.rstrip("/") + "/v1",
                    "api_key": "upstream-placeholder",
                },
            }
        ],
        "litellm_settings": {"set_verbose": False, "callbacks": [], "num_retries": 0, "request_timeout": 60},
        "general_settings": {"master_key": MASTER_KEY, "disable_spend_logs": True, "disable_error_logs": True},
    }
    path = workdir / "litellm_config.yaml"
    path.write_text(json.dumps(config, indent=2))
    return path


def _environment() -> dict[str, str]:
    drop = (
        "DATABASE_URL",
        "LITELLM_MASTER_KEY",
        "REDIS_HOST",
        "REDIS_URL",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    )
    env = {key: value for key, value in os.environ.items() if key not in drop}
    env.update(
        LITELLM_LOG="ERROR",
        LITELLM_MODE="PRODUCTION",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        NO_PROXY="127.0.0.1,localhost",
    )
    return env


def _wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"litellm exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health/liveliness", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_litellm(proc)
    raise RuntimeError(f"litellm did not answer within {timeout:.0f} s: {log.read_text()[-2000:]}")


def start_litellm(upstream_url: str, workdir: Path, *, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """Start LiteLLM's proxy in front of `upstream_url` (an OpenAI-compatible server's root).

    Returns the process and the URL a client posts chat completions to, with model
    ``gpt-4o-mini`` and ``HEADERS`` (without them LiteLLM 1.108.7 answers 500, not 401: its auth
    error path imports ``prisma``, which ``litellm[proxy]`` does not install). Its output goes to
    ``workdir/litellm.log``.
    """
    port = _free_port()
    config = _write_config(upstream_url, workdir)
    log = workdir / "litellm.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [
                str(LITELLM_VENV / "bin" / "litellm"),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            env=_environment(),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base, log, timeout)
    return proc, f"{base}/v1/chat/completions"


def stop_litellm(proc: subprocess.Popen) -> None:
    """Stop LiteLLM (with one worker, uvicorn serves in this one process)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
