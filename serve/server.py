"""`lcap serve`: run vLLM's OpenAI server on the policy, as one replica or several, and record it for the other commands.

Each replica is one vLLM server with LoRA enabled and runtime adapter loading allowed: `lcap deploy` hot-loads each
new round's adapter without restarting anything. A local replica also runs in vLLM's dev mode, so that `lcap deploy`
can reload a full checkpoint into it in place (serve/reload.py). Local replicas are processes of their own process
group (so stopping one also stops its engine workers) on 127.0.0.1, from the interpreter of lcap's vLLM venv; on a
GPU machine each gets its own GPUs. Under `--ray` each replica is a Ray actor that runs vLLM on its node
(serve/ray_replicas.py). A local replica starts through vllm_plugin/launch.py, which adds lcap's policy endpoints
(exact tokens in every dialect, stitched prompts, request adaptation: vllm_plugin/lcap_policy); a Ray replica starts
the same way behind vllm_guard.py, which requires its key on every path but /health. The record (`lcap.policy`) is
written only once every replica's /health answers, so a reader that finds one can send requests.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from lcap.capture import has_endpoints
from lcap.config import LcapError, lcap_home
from lcap.policy import PolicyServer, Replica, bearer, clear_policy, policy_lock, publish, read_policy
from lcap.processes import alive, kill_group
from lcap.serve.options import ServeOptions
from lcap.serve.ray_replicas import RayReplicas, new_key
from lcap.serve.vllm_env import has_gpu
from lcap.serve.vllm_process import (
    HEALTH_TIMEOUT_S,
    TOOL_PARSER,
    VllmSpec,
    gpus_per_server,
    healthy,
    launch,
    listen_socket,
    load_lora_over_http,
    resolve_python,
    served_name_for,
    tail,
    wait_healthy,
)
from lcap.store import Store, now

HOST = "127.0.0.1"  # local replicas listen on loopback only

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
                visible = devices[i] if devices is not None else None
                with listen_socket(HOST, port + i if port else 0) as listener:
                    replica_port = listener.getsockname()[1]
                    log = _replica_log(log_path, i, replica_port)
                    proc = launch(spec, python=self.python, listener=listener, log_path=log, env=_replica_env(visible))
                url = f"http://{HOST}:{replica_port}"
                started.append((proc, url, log))
                replicas.append(Replica(name=name, url=url, pid=proc.pid, log_path=str(log), devices=visible))
            wait_healthy(started, spec.timeout, progress)
        except BaseException:
            for proc, _, _ in started:
                kill_group(proc.pid, grace=30)
            raise
        return replicas

    def restart(self, replica: Replica, spec: VllmSpec) -> Replica:
        """Stop the replica and start `spec` in its place, on the same port, with the same GPUs."""
        self.stop(replica)
        port = int(replica.url.rsplit(":", 1)[1])
        log = Path(replica.log_path or lcap_home() / "logs" / f"vllm-{port}.log")
        with listen_socket(HOST, port) as listener:
            proc = launch(spec, python=self.python, listener=listener, log_path=log, env=_replica_env(replica.devices))
        try:
            wait_healthy([(proc, replica.url, log)], spec.timeout)
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


def _replica_env(devices: str | None) -> dict[str, str]:
    """This process's environment, with the replica's GPUs (`devices`) as the only ones visible when it has its own."""
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def _replica_log(log_path: Path | None, index: int, port: int) -> Path:
    if log_path is None:
        return lcap_home() / "logs" / f"vllm-{port}.log"
    return log_path if index == 0 else log_path.with_name(f"{log_path.stem}.r{index}{log_path.suffix}")


def _device_slices(replicas: int, per_replica: float | None, extra_args: Sequence[str]) -> list[str] | None:
    """Each local replica's CUDA_VISIBLE_DEVICES: its own GPUs, in order. None: one replica, or no GPU here."""
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
    lora: bool = True,
) -> PolicyServer:
    """Start `replicas` vLLM servers on `model`, wait until all are healthy, record them (and, with `store`, the
    'base' deployment). `endpoint_env`: the options of lcap's endpoints (default: ServeOptions' defaults)."""
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
    spec = VllmSpec(
        model, served_name, python, tool_parser, tuple(extra_args), timeout, tuple(endpoint_env.items()), lora
    )
    if ray is not None:
        ray_backend = RayReplicas(ray, python)  # joins the cluster: an unreachable one is an error before anything
        key_file = new_key()
        key = key_file.read_text().strip()
        started = ray_backend.start(names, spec, key, gpus_per_replica)
        python_recorded = python or ""
    else:
        python_recorded = resolve_python(python)
        spec = replace(spec, python=python_recorded)
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
            lora=lora,
        )
        publish(record)
    except BaseException:  # servers that no record names would run on, unseen by `lcap serve --stop`
        for replica in started:
            backend.stop(replica, 30)
        raise
    if store is not None:
        row = {"name": served_name, "path": model, "base_model": model, "kind": "base", "round": None}
        store.append("deployments", [{**row, "created_at": now()}])
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
        role_deployments=record.role_deployments(),
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
