"""A real Ray cluster for the tests: `ray start --head --block` in its own process group, on free ports.

Other runs on this machine may hold Ray's fixed default ports (client server 10001, dashboard 8265,
dashboard agent 52365), so no port is left to its default: the head's GCS, the dashboard and each node's agent
are given port 0 and bind a free one themselves (the head's port is read from what `ray start` prints). Ray
refuses port 0 for its client server: its port is bound here first and held (`reserved_port`), which gRPC's
SO_REUSEPORT lets Ray's server share. The cluster is stopped by killing its process group: `ray stop` would
stop every Ray cluster on the machine.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


@contextmanager
def reserved_port() -> Iterator[int]:
    """A loopback port held bound with SO_REUSEPORT while the block runs: no other bind to port 0 is given it, and
    a server that binds it with SO_REUSEPORT too (gRPC's, as Ray's client server does) can take it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port held bound and never listening while the block runs: a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextmanager
def ray_head(log: Path, num_cpus: int = 2, env: Mapping[str, str] = {}) -> Iterator[str]:
    """A one-node Ray cluster with NUM_CPUS CPUs; yields its address (host:port). `env` adds to the environment of
    its processes (Ray's RAY_* settings, what its workers inherit)."""
    command = ["--head", "--port", "0", "--num-cpus", str(num_cpus), "--include-dashboard", "false"]
    command += ["--dashboard-port", "0"]
    with reserved_port() as client_port, ray_node([*command, "--ray-client-server-port", str(client_port)], log, env):
        joined = re.search(r"ray start --address='[^':]+:(\d+)'", log.read_text())
        if joined is None:
            raise RuntimeError(f"ray start did not say the head's address: {log.read_text()[-2000:]}")
        yield f"127.0.0.1:{joined.group(1)}"


@contextmanager
def ray_worker(address: str, log: Path, num_cpus: int = 1, env: Mapping[str, str] = {}) -> Iterator[subprocess.Popen]:
    """One more node of the cluster at ADDRESS; yields its `ray start --block` process, the leader of the node's
    process group (killing the group is losing the node)."""
    with ray_node(["--address", address, "--num-cpus", str(num_cpus)], log, env) as proc:
        yield proc


@contextmanager
def ray_node(args: list[str], log: Path, env: Mapping[str, str]) -> Iterator[subprocess.Popen]:
    ray = Path(sys.executable).parent / "ray"
    command = [str(ray), "start", "--block", *args, "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    command += ["--dashboard-agent-listen-port", "0"]
    environ = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"--block" not in log.read_bytes():  # `ray start` logs it once the node is up
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL the node's process group: a test's cluster keeps nothing, and Ray's daemons take SIGTERM as a
    request they answer in their own time (docs/benchmarks.md, the test suite's time)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=STOP_TIMEOUT_S)


# Ray's memory monitor kills the cluster's newest workers once the machine's memory is 95% used, whoever uses it:
# on a machine shared with other runs' vLLM servers that is a test's episode runner or a node proxy.
NO_OOM_KILLER = {"RAY_memory_monitor_refresh_ms": "0"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory) -> Iterator[str]:
    """A 2-CPU Ray cluster shared by a file's tests; its address. Stopped when the file ends: an idle cluster's
    daemons keep using CPU, which a session-long one would take from every later file on its worker."""
    with ray_head(tmp_path_factory.mktemp("ray") / "head.log", num_cpus=2, env=NO_OOM_KILLER) as address:
        yield address
