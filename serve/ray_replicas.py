"""Policy replicas on a Ray cluster (`lcap serve --replicas N --ray ADDRESS`): one actor per replica.

Each replica is a detached, named Ray actor that holds the GPUs its vLLM server uses (`num_gpus`:
tensor x pipeline x data parallel size, or `--gpus-per-replica`), so Ray places it on a node that
has them (replicas spread over nodes where they can). The actor starts vLLM on its node's address
and supervises it: a server that exits is started again (at most `MAX_RESTARTS` times) with every
adapter it held loaded back before it counts as serving. The proxy's probes check that the
deployment calls ask for is listed, so no call reaches a restarted server before its adapters.

The server is reachable from the network, so it requires a key on every path but /health
(serve/vllm_guard.py): a random key made by `lcap serve`, kept in a 0600 file next to the record
(LCAP_HOME/policy.key), sent by the proxy and by `lcap deploy`. LoRA adapters travel to the nodes
through Ray's object store (no shared file system needed); a full checkpoint and the base model must
be readable on every node (a shared file system, or a Hugging Face model name). Every node runs
lcap and vLLM from the same paths as the head (the image in scripts/k8s does).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lcap.config import LcapError, lcap_home
from lcap.policy import Replica
from lcap.processes import kill_group
from lcap.ray_cluster import connect
from lcap.serve.vllm_process import (
    VllmSpec,
    gpus_per_server,
    launch,
    listen_socket,
    load_lora_over_http,
    resolve_python,
    tail,
    wait_healthy,
)

NAMESPACE = "lcap"
PLACEMENT_TIMEOUT_S = 300.0  # for Ray to find a node with the replica's GPUs (and start a worker there)
CALL_TIMEOUT_S = 60.0  # an actor's quick methods (alive, stop, log tail)
MAX_RESTARTS = 3  # of one replica's vLLM, after it exited on its own
WATCH_INTERVAL_S = 1.0


def new_key() -> Path:
    """A fresh random key for the replicas, in LCAP_HOME/policy.key (0600)."""
    path = lcap_home() / "policy.key"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_urlsafe(32).encode())
    finally:
        os.close(fd)
    return path


class ReplicaActor:
    """Runs one vLLM server on the node Ray placed it on (decorated with `ray.remote` where it is started)."""

    def __init__(self, name: str) -> None:
        import ray  # the ray extra

        self.name = name
        self.host = _node_address(ray)
        self.dir = Path(tempfile.mkdtemp(prefix=f"lcap-replica-{name}-"))
        self.log = self.dir / "vllm.log"
        self.port = 0
        self.key = ""
        self.spec: VllmSpec | None = None
        self.proc: Any = None
        self.loras: dict[str, Path] = {}
        self.restarts = 0
        self.stopping = False
        self.lock = threading.RLock()
        self.watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def where(self) -> str:
        """The node's address: answers once Ray placed the actor."""
        return self.host

    def start(self, spec: VllmSpec, key: str) -> dict:
        with self.lock:
            self.spec, self.key = spec, key
            self.port = 0
            self._launch()
            if self.watcher is None:
                self.watcher = threading.Thread(target=self._watch, name="lcap-replica-watch", daemon=True)
                self.watcher.start()
            return self.describe()

    def restart(self, spec: VllmSpec) -> dict:
        """Serve `spec` (a full checkpoint) instead, on the same port; adapters of the previous model are dropped."""
        with self.lock:
            self._kill()
            self.loras.clear()
            self.spec = spec
            self._launch()
            return self.describe()

    def load_lora(self, name: str, files: dict[str, bytes]) -> None:
        """Write the adapter's files on this node and hot-load them under `name` (again after any restart)."""
        with self.lock:
            target = self.dir / "loras" / name
            shutil.rmtree(target, ignore_errors=True)
            for relative, data in files.items():
                path = (target / relative).resolve()
                if not path.is_relative_to(target.resolve()):
                    raise LcapError(f"adapter file {relative!r} is outside the adapter")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            load_lora_over_http(self.url, name, target, self.key)
            self.loras[name] = target

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> dict:
        return {
            "url": self.url,
            "node": self.host,
            "log_path": str(self.log),
            "restarts": self.restarts,
            "alive": self.alive(),
            "pid": self.proc.pid if self.proc is not None else None,  # on the node
            "loras": sorted(self.loras),
        }

    def log_tail(self) -> str:
        return tail(self.log)

    def stop(self) -> None:
        self.stopping = True
        with self.lock:
            self._kill()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _launch(self) -> None:
        assert self.spec is not None
        python = resolve_python(self.spec.python or None)
        with listen_socket(self.host, self.port) as listener:
            self.port = listener.getsockname()[1]
            self.proc = launch(self.spec, python=python, listener=listener, log_path=self.log, key=self.key)
        try:
            wait_healthy([(self.proc, self.url, self.log)], self.spec.timeout, progress=False)
            for name, path in self.loras.items():
                load_lora_over_http(self.url, name, path, self.key)
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        if self.proc is not None:
            kill_group(self.proc.pid, grace=30)
            self.proc = None

    def _watch(self) -> None:
        """Start vLLM again when it exited on its own; at most `MAX_RESTARTS` times."""
        while not self.stopping:
            time.sleep(WATCH_INTERVAL_S)
            with self.lock:
                proc = self.proc
                if self.stopping or proc is None or proc.poll() is None or self.restarts >= MAX_RESTARTS:
                    continue
                self.restarts += 1
                kill_group(proc.pid, grace=5)  # what is left of its process group
                with open(self.log, "ab") as log:
                    log.write(f"\nlcap: vLLM exited with code {proc.returncode}: restart {self.restarts}\n".encode())
                try:
                    self._launch()
                except Exception as exc:  # counted; the next round tries again until MAX_RESTARTS
                    with open(self.log, "ab") as log:
                        log.write(f"lcap: restart {self.restarts} failed: {exc}\n".encode())
                    self.proc = proc


class RayReplicas:
    """The replicas of a policy as Ray actors: start, restart, stop, hot-load adapters, from the driver."""

    def __init__(self, address: str, python: str | None) -> None:
        connect(address)
        self.address = address
        self.python = python
        self._adapters: dict[str, Any] = {}  # adapter path -> its files in Ray's object store

    def start(
        self, names: Sequence[str], spec: VllmSpec, key: str, gpus_per_replica: float | None = None
    ) -> list[Replica]:
        import ray  # the ray extra

        gpus = float(gpus_per_server(spec.extra_args)) if gpus_per_replica is None else gpus_per_replica
        actor_class = ray.remote(ReplicaActor)
        tag = secrets.token_hex(3)
        actor_names = {name: f"lcap-replica-{tag}-{name}" for name in names}
        actors: dict[str, Any] = {
            name: actor_class.options(
                name=actor_names[name],
                namespace=NAMESPACE,
                lifetime="detached",  # the replicas outlive `lcap serve`, which returns once they serve
                max_restarts=0,  # a lost node's replica is out of the rotation; the record keeps the rest
                max_concurrency=4,  # alive/log_tail answer while a start or restart runs
                num_cpus=1,
                num_gpus=gpus,
                scheduling_strategy="SPREAD",
            ).remote(name)
            for name in names
        }
        try:
            pending = {actor.where.remote(): name for name, actor in actors.items()}
            ready, waiting = ray.wait(list(pending), num_returns=len(pending), timeout=PLACEMENT_TIMEOUT_S)
            if waiting:
                unplaced = sorted(pending[ref] for ref in waiting)
                raise LcapError(
                    f"Ray placed no node for replicas {', '.join(unplaced)} within {PLACEMENT_TIMEOUT_S:.0f}s: each "
                    f"needs {gpus:g} GPUs and 1 CPU free on one node (`ray status`; --gpus-per-replica)"
                )
            ray.get(ready)
            started = self._get({name: actor.start.remote(spec, key) for name, actor in actors.items()}, spec.timeout)
        except BaseException:
            for actor in actors.values():
                _kill(actor)
            raise
        return [
            Replica(name=name, url=info["url"], log_path=info["log_path"], actor=actor_names[name], node=info["node"])
            for name, info in started.items()
        ]

    def restart(self, replica: Replica, spec: VllmSpec) -> Replica:
        info = self._get({replica.name: self._actor(replica).restart.remote(spec)}, spec.timeout)[replica.name]
        return replace(replica, url=info["url"], log_path=info["log_path"], node=info["node"])

    def load_lora(self, replica: Replica, name: str, path: Path, key: str | None) -> None:
        import ray  # the ray extra

        files = self._adapters.get(str(path))
        if files is None:
            data = {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}
            files = self._adapters[str(path)] = ray.put(data)
        self._get({replica.name: self._actor(replica).load_lora.remote(name, files)}, 600)

    def stop(self, replica: Replica, timeout: float = 30) -> None:
        import ray  # the ray extra

        try:
            actor = self._actor(replica)
        except LcapError:
            return
        with contextlib.suppress(Exception):  # a lost node, or a stuck actor: it is killed all the same
            ray.get(actor.stop.remote(), timeout=timeout + CALL_TIMEOUT_S)
        _kill(actor)

    def alive(self, replica: Replica) -> bool:
        import ray  # the ray extra

        try:
            return bool(ray.get(self._actor(replica).alive.remote(), timeout=CALL_TIMEOUT_S))
        except Exception:
            return False

    def log_tail(self, replica: Replica) -> str:
        import ray  # the ray extra

        try:
            return str(ray.get(self._actor(replica).log_tail.remote(), timeout=CALL_TIMEOUT_S))
        except Exception as exc:
            return f"(no log: {exc.__class__.__name__})"

    def _actor(self, replica: Replica) -> Any:
        import ray  # the ray extra

        try:
            return ray.get_actor(replica.actor or "", namespace=NAMESPACE)
        except ValueError:
            raise LcapError(
                f"replica {replica.name}: no Ray actor {replica.actor!r} on {self.address} (its node was lost?)"
            ) from None

    @staticmethod
    def _get(calls: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The results of actor calls by replica name; the first failure as an LcapError naming its replica."""
        import ray  # the ray extra

        out = {}
        deadline = time.monotonic() + timeout + CALL_TIMEOUT_S
        for name, ref in calls.items():
            try:
                out[name] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise LcapError(f"replica {name}: no answer within {timeout + CALL_TIMEOUT_S:.0f}s") from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, Exception) else exc
                raise LcapError(f"replica {name}: {cause}") from None
            except ray.exceptions.RayActorError as exc:
                raise LcapError(f"replica {name}: its actor died ({exc.__class__.__name__})") from None
        return out


def _node_address(ray: Any) -> str:
    """The address the cluster knows this node by (`ray start --node-ip-address`); in a worker process,
    `ray.util.get_node_ip_address()` guesses one from the route to a public address instead."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def _kill(actor: Any) -> None:
    import ray  # the ray extra

    with contextlib.suppress(Exception):  # already gone
        ray.kill(actor)
