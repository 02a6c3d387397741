"""`lcap serve`: run vLLM's OpenAI server on the policy, as one replica or several, and record it for the other commands.

Each replica is one vLLM server with LoRA enabled and runtime adapter loading allowed: `lcap deploy`
hot-loads each new round's adapter without restarting anything. A local replica also runs in vLLM's dev
mode, so that `lcap deploy` can reload a full checkpoint into it in place (serve/reload.py). Local replicas are processes of
their own process group (so stopping one also stops its engine workers) on 127.0.0.1, from the
interpreter of lcap's vLLM venv; on a GPU machine each gets its own GPUs. Under `--ray` each
replica is a Ray actor that runs vLLM on its node (serve/ray_replicas.py). A local
replica starts through vllm_plugin/launch.py, which adds lcap's policy endpoints (exact tokens in
every dialect, stitched prompts, request adaptation: vllm_plugin/lcap_policy); a Ray replica starts the
same way behind vllm_guard.py, which requires its key on every path but /health. The record
(`lcap.policy`) is written only once every replica's /health answers, so a reader that finds one
can send requests.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from lcap.capture.routing.policy_wire import has_endpoints
from lcap.config import LcapError, lcap_home
from lcap.policy import PolicyServer, Replica, bearer, clear_policy, policy_lock, read_policy, write_policy
from lcap.processes import alive, kill_group, python_helper
from lcap.store import Store, now

MAX_LORA_RANK = 64  # vLLM's default is 16; adapters of rank 32/64 are common. Allowed: 8, 16, 32, 64, 128...
MAX_LORAS = 2  # adapters resident per batch: the new deployment and the one still finishing calls
TOOL_PARSER = "hermes"  # <tool_call>{json}</tool_call>: the tiny model's template and Qwen2.5/3's
HEALTH_TIMEOUT_S = 2.0
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
        length = int(_flag_value(extra_args, "--max-model-len") or config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 1
    return max(1, math.ceil(per_token * length * 1.25 / (1 << 30)))


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in a vLLM argument list."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


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
) -> list[str]:
    """vLLM's OpenAI server on `model` with lcap's policy endpoints (LAUNCHER); `guarded`: behind the replica key
    on every path but /health (GUARD, which then runs LAUNCHER), for a replica reachable from the network."""
    start = python_helper(python, str(GUARD if guarded else LAUNCHER))
    cmd = [
        *start,
        "--model",
        model,
        "--served-model-name",
        served_name,
        "--host",
        host,
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
        "--worker-extension-cls",
        RELOAD_EXTENSION,
    ]
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
    port: int,
    log_path: Path,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    key: str | None = None,
) -> subprocess.Popen:
    """Start one vLLM server in a process group of its own, its output appended to `log_path`: the one way lcap
    starts vLLM, for local and Ray replicas alike. `key`: every path but /health requires it (the server listens
    where the network reaches it); it goes in the environment, never on the command line, which `ps` shows.
    A server on loopback runs in vLLM's dev mode (in-place weight reloads); one on another address never does."""
    from lcap.serve.vllm_env import has_gpu

    gpu = has_gpu() and (env or os.environ).get("CUDA_VISIBLE_DEVICES") != ""
    env = dict(env or os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", **dict(spec.endpoint_env))
    env.pop(KEY_VARIABLE, None)
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
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


KEY_VARIABLE = "LCAP_REPLICA_KEY"  # what vllm_guard.py reads the key from
DEV_MODE_VARIABLE = "VLLM_SERVER_DEV_MODE"
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def wait_healthy(servers: Sequence[tuple[subprocess.Popen, str, Path]], timeout: float, progress: bool | None) -> None:
    """Wait until every (process, url, log) answers /health; LcapError (with the log's last lines) when one exits
    or `timeout` passes first."""
    show = sys.stderr.isatty() if progress is None else progress
    status = None
    if show:
        from rich.console import Console

        status = Console(stderr=True).status("starting vLLM")
        status.start()
    started = time.monotonic()
    waiting = list(servers)
    try:
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
            elapsed = time.monotonic() - started
            if elapsed > timeout:
                _, _, log_path = waiting[0]
                raise LcapError(
                    f"vLLM was not healthy after {timeout:.0f}s; last lines of {log_path}:\n{tail(log_path)}"
                )
            if status is not None:
                ready = f"{len(servers) - len(waiting)}/{len(servers)} ready, " if len(servers) > 1 else ""
                status.update(f"starting vLLM: {ready}{elapsed:.0f}s  {tail(waiting[0][2], 1)[-100:]}")
            time.sleep(0.5)
    finally:
        if status is not None:
            status.stop()


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# --- local replicas -----------------------------------------------------------------------------


class LocalReplicas:
    """Replicas as processes on this machine, each in a process group of its own, listening on 127.0.0.1."""

    def __init__(self, python: str) -> None:
        self.python = python

    def start(
        self,
        names: Sequence[str],
        spec: VllmSpec,
        *,
        port: int | None = None,
        log_path: Path | None = None,
        gpus_per_replica: float | None = None,
        progress: bool | None = None,
    ) -> list[Replica]:
        """Start one server per name (replica i on `port`+i when given) and wait until all are healthy."""
        devices = _device_slices(len(names), gpus_per_replica, spec.extra_args)
        started: list[tuple[subprocess.Popen, str, Path]] = []
        replicas = []
        try:
            for i, name in enumerate(names):
                replica_port = port + i if port else free_port()
                log = _replica_log(log_path, i, replica_port)
                env = dict(os.environ)
                if devices is not None:
                    env["CUDA_VISIBLE_DEVICES"] = devices[i]
                proc = launch(spec, python=self.python, port=replica_port, log_path=log, env=env)
                url = f"http://127.0.0.1:{replica_port}"
                started.append((proc, url, log))
                replicas.append(
                    Replica(
                        name=name,
                        url=url,
                        pid=proc.pid,
                        log_path=str(log),
                        devices=devices[i] if devices is not None else None,
                    )
                )
            wait_healthy(started, spec.timeout, progress)
        except BaseException:
            for proc, _, _ in started:
                kill_group(proc.pid, grace=30)
            raise
        return replicas

    def restart(self, replica: Replica, spec: VllmSpec) -> Replica:
        """Stop the replica and start `spec` in its place, on the same port, with the same GPUs."""
        self.stop(replica)
        env = dict(os.environ)
        if replica.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = replica.devices
        port = int(replica.url.rsplit(":", 1)[1])
        log = Path(replica.log_path or lcap_home() / "logs" / f"vllm-{port}.log")
        proc = launch(spec, python=self.python, port=port, log_path=log, env=env)
        try:
            wait_healthy([(proc, replica.url, log)], spec.timeout, progress=False)
        except BaseException:
            kill_group(proc.pid, grace=30)
            raise
        return replace(replica, pid=proc.pid, log_path=str(log))

    def stop(self, replica: Replica, timeout: float = 30) -> None:
        if replica.pid is not None:
            kill_group(replica.pid, grace=timeout)

    def alive(self, replica: Replica) -> bool:
        return replica.pid is not None and alive(replica.pid)

    def load_lora(self, replica: Replica, name: str, path: Path, key: str | None) -> None:
        load_lora_over_http(replica.url, name, path, key)

    def log_tail(self, replica: Replica) -> str:
        return tail(Path(replica.log_path))


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


def _replica_log(log_path: Path | None, index: int, port: int) -> Path:
    if log_path is None:
        return lcap_home() / "logs" / f"vllm-{port}.log"
    return log_path if index == 0 else log_path.with_name(f"{log_path.stem}.r{index}{log_path.suffix}")


def _device_slices(replicas: int, per_replica: float | None, extra_args: Sequence[str]) -> list[str] | None:
    """Each local replica's CUDA_VISIBLE_DEVICES: its own GPUs, in order. None: one replica, or no GPU here."""
    from lcap.serve.vllm_env import has_gpu

    if replicas == 1 or not has_gpu():
        return None
    per = gpus_per_server(extra_args) if per_replica is None else per_replica
    if per != int(per) or per < 1:
        raise LcapError(f"--gpus-per-replica {per}: local replicas each take whole GPUs (fractions need --ray)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d for d in visible.split(",") if d.strip()]
    else:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        devices = [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]
    need = replicas * int(per)
    if need > len(devices):
        raise LcapError(
            f"{replicas} replicas x {int(per)} GPUs need {need} GPUs; this machine has {len(devices)} "
            "(fewer --replicas, or --ray to use a cluster's)"
        )
    return [",".join(devices[i * int(per) : (i + 1) * int(per)]) for i in range(replicas)]


# --- the policy server --------------------------------------------------------------------------


def replicas_of(record: PolicyServer):
    """The backend that runs the record's replicas: local processes, or Ray actors."""
    if record.ray_address is not None:
        from lcap.serve.ray_replicas import RayReplicas

        return RayReplicas(record.ray_address, record.python or None)
    return LocalReplicas(record.python)


def start_server(
    model: str,
    *,
    replicas: int = 1,
    port: int | None = None,
    python: str | None = None,
    served_name: str | None = None,
    log_path: Path | None = None,
    timeout: float = 300,
    tool_parser: str | None = TOOL_PARSER,
    extra_args: Sequence[str] = (),
    ray: str | None = None,
    gpus_per_replica: float | None = None,
    store: Store | None = None,
    progress: bool | None = None,
    endpoint_env: dict[str, str] | None = None,
) -> PolicyServer:
    """Start `replicas` vLLM servers on `model`, wait until all are healthy, record them (and, with `store`, the
    'base' deployment). `endpoint_env`: the options of lcap's endpoints (default: ServeOptions' defaults)."""
    from lcap.serve.options import ServeOptions

    endpoint_env = ServeOptions().endpoint_env() if endpoint_env is None else endpoint_env
    running = read_policy()
    if running is not None and _any_alive(running):
        raise LcapError(
            f"a policy server is already running at {running.url} ({len(running.replicas)} replicas): "
            "`lcap serve --stop` first"
        )
    if Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())
    served_name = served_name or served_name_for(model)
    gpus_per_server(extra_args)  # a malformed parallel size is an error before anything starts
    names = [f"r{i}" for i in range(replicas)]
    key_file = key = None
    if ray is not None:
        from lcap.serve.ray_replicas import RayReplicas, new_key

        ray_backend = RayReplicas(ray, python)  # joins the cluster: an unreachable one is an error before anything
        key_file = new_key()
        key = key_file.read_text().strip()
        spec = VllmSpec(
            model, served_name, python, tool_parser, tuple(extra_args), timeout, tuple(endpoint_env.items())
        )
        started = ray_backend.start(names, spec, key, gpus_per_replica)
        python_recorded = python or ""
    else:
        python_recorded = resolve_python(python)
        spec = VllmSpec(
            model, served_name, python_recorded, tool_parser, tuple(extra_args), timeout, tuple(endpoint_env.items())
        )
        started = LocalReplicas(python_recorded).start(
            names, spec, port=port, log_path=log_path, gpus_per_replica=gpus_per_replica, progress=progress
        )
    backend = ray_backend if ray is not None else LocalReplicas(python_recorded)
    try:
        record = PolicyServer(
            url=started[0].url,
            pid=started[0].pid,
            base_model=model,
            served_model=served_name,
            current=served_name,
            log_path=started[0].log_path,
            python=python_recorded,
            started_at=now().isoformat(),
            loras={},
            replicas=started,
            vllm_args=list(extra_args),
            tool_parser=tool_parser,
            ray_address=ray,
            api_key_file=str(key_file) if key_file else None,
            lcap_endpoints=has_endpoints(started[0].url, key=key),
            endpoint_env=endpoint_env,
        )
        write_policy(record)
    except BaseException:  # servers that no record names would run on, unseen by `lcap serve --stop`
        for replica in started:
            backend.stop(replica, 30)
        raise
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
    """Stop every replica of the recorded server and remove the record; returns what was stopped."""
    with policy_lock():
        record = read_policy()
        if record is None:
            return None
        backend = replicas_of(record)
        for replica in record.replicas:
            backend.stop(replica, timeout)
        clear_policy()
        if record.api_key_file:
            Path(record.api_key_file).unlink(missing_ok=True)
        return record


def server_status() -> dict | None:
    """The record plus, per replica, whether it runs and /health answers; None when nothing is recorded."""
    record = read_policy()
    if record is None:
        return None
    backend = replicas_of(record)
    replicas = []
    for replica in record.replicas:
        state = {**asdict(replica), "alive": backend.alive(replica), "healthy": healthy(replica.url)}
        state["in_flight"] = in_flight(replica.url, record.api_key()) if state["healthy"] else None
        replicas.append(state)
    out = {key: value for key, value in asdict(record).items() if key != "replicas"}
    out.update(
        alive=all(r["alive"] for r in replicas),
        healthy=all(r["healthy"] for r in replicas),
        replicas_healthy=sum(r["healthy"] for r in replicas),
        replicas=replicas,
    )
    return out


_GAUGE = re.compile(rb"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.M)


def in_flight(url: str, key: str | None) -> int | None:
    """Requests a server is running or holding, from its Prometheus metrics; None when it does not say."""
    headers = bearer(key)
    try:
        answer = httpx.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT_S, headers=headers, trust_env=False)
    except httpx.HTTPError:
        return None
    values = _GAUGE.findall(answer.content) if answer.status_code == 200 else []
    return int(sum(float(v) for v in values)) if values else None


def _any_alive(record: PolicyServer) -> bool:
    if record.ray_address is not None:
        return any(healthy(r.url) for r in record.replicas)
    return any(r.pid is not None and alive(r.pid) for r in record.replicas)
