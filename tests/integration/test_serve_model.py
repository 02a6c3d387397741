"""`lcap init-model` and the failure paths of `lcap serve` / `lcap deploy` (no vLLM start needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from fixtures_vllm import record_dead_server
from typer.testing import CliRunner

from lcap.cli import app
from lcap.config import LcapError
from lcap.policy import PolicyServer, write_policy
from lcap.serve import vllm_process
from lcap.serve.deploy import deploy_policy
from lcap.serve.options import ServeOptions
from lcap.serve.vllm_process import MAX_LORA_RANK, VllmSpec, launch
from lcap.train.options import TrainOptions


def test_serve_reports_the_log_when_vllm_dies_on_start(tmp_path, monkeypatch):
    """An interpreter without vllm dies at once: the error carries the log's last lines."""
    import sys

    from lcap.config import LcapError
    from lcap.policy import read_policy
    from lcap.serve.server import start_server

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    with pytest.raises(LcapError) as caught:
        start_server(str(tmp_path), python=sys.executable, log_path=tmp_path / "vllm.log", timeout=60)
    assert "exited with code" in str(caught.value) and "No module named 'vllm'" in str(caught.value)
    assert read_policy() is None


def test_servers_no_record_names_are_stopped(tmp_path, monkeypatch):
    """A start whose record cannot be written (a full disk, a missing folder) stops the servers it started: none is
    left running where `lcap serve --stop` would never find it. (A process group stands in for vLLM.)"""
    from lcap.policy import Replica
    from lcap.serve import server

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    leaders: list[subprocess.Popen] = []

    def start(self, names, spec, **_):
        leaders.extend(subprocess.Popen(["sleep", "300"], start_new_session=True) for _ in names)
        return [Replica(name, "http://127.0.0.1:9", pid=p.pid) for name, p in zip(names, leaders)]

    def refuse(record) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(server.LocalReplicas, "start", start)
    monkeypatch.setattr(server, "resolve_python", lambda python: sys.executable)
    monkeypatch.setattr(server, "publish", refuse)
    with pytest.raises(OSError, match="No space left"):
        server.start_server(str(tmp_path), replicas=2)
    assert len(leaders) == 2 and all(p.wait(timeout=30) is not None for p in leaders)


def test_a_lone_replica_drains_and_is_not_left_draining_when_it_cannot_start_again(tmp_path, monkeypatch):
    """A `--restart` deploy of one replica marks it draining first (the proxies hold its calls meanwhile); when
    neither the checkpoint nor the previous policy starts (here an interpreter without vLLM, which dies at once)
    the deploy fails and no replica stays draining: the proxies would hold calls for a server not coming back.
    (A process group stands in for the running vLLM.)"""
    from fixtures_vllm import watching_record

    from lcap import policy
    from lcap.config import LcapError
    from lcap.policy import read_policy
    from lcap.serve import deploy

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    monkeypatch.setenv("LCAP_HOME", str(tmp_path))
    monkeypatch.setattr(policy, "PUBLISH_WAIT_S", 0.0)
    running = subprocess.Popen(["sleep", "300"], start_new_session=True)
    record_dead_server(pid=running.pid)
    record = read_policy()
    record.python = sys.executable
    write_policy(record)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    try:
        with (
            watching_record(lambda record: record.replicas[0].draining, every=0.01) as states,
            pytest.raises(LcapError, match="did not start again on 'm' either"),
        ):
            deploy.deploy_policy(checkpoint, name="m2", restart=True, drain_timeout=5)
    finally:
        running.kill()
        running.wait()
    assert any(draining for _, draining in states)
    assert not read_policy().replicas[0].draining


def test_vllm_env_rejects_a_venv_without_vllm_and_reuses_a_stamped_one(tmp_path, monkeypatch):
    import sys

    from lcap.serve import vllm_env

    monkeypatch.setenv("LCAP_HOME", str(tmp_path))
    (tmp_path / "vllm-venv" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (tmp_path / "vllm-venv" / "bin" / "python").symlink_to(sys.executable)  # this python has no vllm
    assert vllm_env.working_vllm_python() is None
    assert not (tmp_path / "vllm-venv" / ".lcap-vllm-ok").exists()
    # a venv stamped as importing vllm is returned without running anything (no install, no import)
    python = tmp_path / "vllm-venv" / "bin" / "python"
    (tmp_path / "vllm-venv" / ".lcap-vllm-ok").write_text(vllm_env._fingerprint(python))
    monkeypatch.setattr(vllm_env.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert vllm_env.ensure_vllm_env() == str(python)
    # installing or removing a package changes the fingerprint, so the stamp stops counting
    (tmp_path / "vllm-venv" / "lib" / "python3.11" / "site-packages" / "new_pkg").mkdir()
    assert (tmp_path / "vllm-venv" / ".lcap-vllm-ok").read_text() != vllm_env._fingerprint(python)


def test_serve_stop_ends_the_whole_process_group(tmp_path, monkeypatch):
    """vLLM's engine runs in child processes: --stop must end the group, not only the leader (a shell and its sleeps here)."""
    import os
    import subprocess
    import time

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300; wait"], start_new_session=True)
    time.sleep(0.2)
    record_dead_server(pid=leader.pid)
    result = CliRunner().invoke(app, ["serve", "--stop"])
    assert result.exit_code == 0 and f"stopped policy server http://127.0.0.1:9 (pid {leader.pid})" in result.output
    assert leader.poll() is not None and not (tmp_path / "policy.json").exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(leader.pid, 0)
    assert CliRunner().invoke(app, ["serve", "--stop"]).output.strip() == "no policy server was running"


def test_local_replicas_each_get_their_own_gpus(tmp_path, monkeypatch):
    """Fake `nvidia-smi` (no GPU here): replica i gets GPUs [i*per, (i+1)*per); too few GPUs is an error."""
    from lcap.config import LcapError
    from lcap.serve import vllm_env
    from lcap.serve.server import _device_slices

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\nfor i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    vllm_env.has_gpu.cache_clear()
    try:
        assert _device_slices(1, None, []) is None  # one replica: vLLM's own choice, as before
        assert _device_slices(4, None, []) == ["0", "1", "2", "3"]
        assert _device_slices(2, None, ["-tp", "2"]) == ["0,1", "2,3"]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
        assert _device_slices(2, 1, []) == ["5", "7"]
        with pytest.raises(LcapError, match="need 4 GPUs; this machine has 2"):
            _device_slices(2, None, ["--tensor-parallel-size", "2"])
        with pytest.raises(LcapError, match="whole GPUs"):
            _device_slices(2, 0.5, [])
    finally:
        vllm_env.has_gpu.cache_clear()


def test_serve_refuses_bad_replica_options_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    monkeypatch.setenv("LCAP_HOME", str(tmp_path))
    runner = CliRunner()
    for args, message in (
        (["--replicas", "0"], "--replicas 0: at least 1"),
        (["--ray", "auto", "--port", "8000"], "--port is for local replicas"),
        (["--ray", "127.0.0.1:1"], "no Ray cluster at 127.0.0.1:1"),
    ):
        result = runner.invoke(app, ["serve", "-m", str(tmp_path), *args, "--db", str(tmp_path / "s.duckdb")])
        assert result.exit_code == 2 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "policy.key").exists() and not (tmp_path / "policy.json").exists()


def test_a_second_policy_change_waits_then_names_the_holder(tmp_path, monkeypatch):
    from lcap.config import LcapError
    from lcap.policy import policy_lock

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from lcap.policy import policy_lock\nwith policy_lock():\n print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(LcapError, match=f"another lcap \\(pid {holder.pid}\\)"), policy_lock(wait=0.5):
            pass
        assert 0.5 <= time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait()
    with policy_lock(wait=5):  # free again once its holder is gone
        pass


def test_a_taken_port_is_refused_before_vllm_starts(tmp_path, monkeypatch):
    """`lcap serve --port P` where P is taken: one line naming the port, and no server left behind."""
    from lcap.serve.vllm_process import listen_socket

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))  # not a server the machine's home runs
    monkeypatch.setenv("LCAP_HOME", str(tmp_path))
    with listen_socket("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        done = CliRunner().invoke(app, ["serve", "--model", "unused", "--port", str(port), "--python", sys.executable])
    assert done.exit_code != 0
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in done.output


def test_vllm_dev_mode_runs_only_on_loopback(tmp_path, monkeypatch):
    """The dev-mode endpoints (/pause, /collective_rpc) that in-place reloads use are not guarded by vLLM's API key:
    a replica gets them on 127.0.0.1 only, never on an address the network reaches, even when asked to. Either way
    the server is handed the socket lcap bound for it."""
    from lcap.serve.vllm_process import VllmSpec, launch, listen_socket

    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\nenv > "$(dirname "$0")/env-$LCAP_TEST_RUN"\n'
        'readlink /proc/$$/fd/$LCAP_LISTEN_FD > "$(dirname "$0")/fd-$LCAP_TEST_RUN"\n'
    )
    fake.chmod(0o755)
    spec = VllmSpec(str(tmp_path), "tiny", None, None, (), 60)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    for run, host, key in (("local", "127.0.0.1", None), ("ray", "0.0.0.0", "k-1")):
        env = dict(os.environ, LCAP_TEST_RUN=run, **({"VLLM_SERVER_DEV_MODE": "1"} if key else {}))
        with listen_socket(host) as listener:
            launch(spec, python=str(fake), listener=listener, log_path=tmp_path / "log", env=env, key=key).wait(30)
    assert "VLLM_SERVER_DEV_MODE=1" in (tmp_path / "env-local").read_text().splitlines()
    assert "VLLM_SERVER_DEV_MODE" not in (tmp_path / "env-ray").read_text()
    for run in ("local", "ray"):  # the server inherits the socket lcap bound for it
        assert (tmp_path / f"fd-{run}").read_text().startswith("socket:[")


def test_a_deploy_checks_the_adapters_rank_against_the_servers_own_limit(tmp_path, monkeypatch):
    """The server reserves LoRA slots of `--max-lora-rank` (lcap's default: the trainer's default rank; a larger one
    given after `--`): an adapter of a larger rank is refused with the flag that serves it, before any replica is
    asked; one within the server's own limit goes on to the replicas (here a closed port)."""
    assert TrainOptions().lora_r <= MAX_LORA_RANK  # what `lcap train` makes by default, every server takes
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2 * MAX_LORA_RANK}))

    def record(*vllm_args: str) -> None:
        write_policy(PolicyServer("http://127.0.0.1:9", None, "m", "m", "m", "", "", "", vllm_args=list(vllm_args)))

    record()
    with pytest.raises(
        LcapError, match=f"rank {2 * MAX_LORA_RANK}; the server allows at most {MAX_LORA_RANK}"
    ) as refused:
        deploy_policy(adapter)
    assert f"-- --max-lora-rank {2 * MAX_LORA_RANK}" in str(refused.value)
    record("--max-lora-rank", str(4 * MAX_LORA_RANK))
    with pytest.raises(Exception) as failed:
        deploy_policy(adapter)
    assert "allows at most" not in str(failed.value)


class _Listener:
    """What `launch` asks of its listening socket (none is opened: only the environment it starts vLLM with is read)."""

    def getsockname(self):
        return ("127.0.0.1", 8765)

    def fileno(self):
        return 99


@pytest.mark.parametrize("threads", [None, 3])
def test_cpu_threads_reach_the_servers_environment(tmp_path, monkeypatch, threads):
    """`lcap serve --cpu-threads N`: every vLLM server on CPU runs with N OpenMP threads, unpinned, over an
    OMP_NUM_THREADS inherited from lcap's own environment (the demo sets 1); without it the inherited one stays."""
    started: list[dict] = []
    monkeypatch.setattr(vllm_process, "has_gpu", lambda: False)
    monkeypatch.setattr(vllm_process, "cpu_kv_cache_gib", lambda *a: 1)
    monkeypatch.setattr(vllm_process.subprocess, "Popen", lambda cmd, **kw: started.append(kw))  # no process here
    env = ServeOptions(model="m", cpu_threads=threads).endpoint_env()
    spec = VllmSpec("m", "m", None, None, (), 1.0, tuple(env.items()))
    launch(spec, python="python", listener=_Listener(), log_path=tmp_path / "log", env={"OMP_NUM_THREADS": "1"})
    server_env = started[0]["env"]
    if threads is None:
        assert server_env["OMP_NUM_THREADS"] == "1" and "VLLM_CPU_OMP_THREADS_BIND" not in server_env
    else:
        assert server_env["OMP_NUM_THREADS"] == "3" and server_env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
