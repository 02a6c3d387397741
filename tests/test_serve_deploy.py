"""`lcap deploy` on the real vLLM CPU server: LoRA hot-load, and `lcap serve` + full-checkpoint restart via the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from lcap.cli import app
from lcap.policy import read_policy
from lcap.store import Store

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "What is 2 + 2? Answer with the number."}]


def completion_ids(url: str, model: str) -> list[int]:
    body = {"model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert answer["model"] == model, answer
    return answer["choices"][0]["token_ids"]


def test_deploy_lora_hot_loads_it_as_the_current_policy(vllm_policy, tiny_lora, tmp_path):
    from lcap.train.deploy import deploy

    store = Store(tmp_path / "lcap.duckdb")
    base = completion_ids(vllm_policy.url, vllm_policy.served_model)

    name = deploy(tiny_lora, round=1, store=store)
    record = read_policy()
    assert name.startswith("policy-r1-") and record.current == name
    assert record.loras[name] == str(tiny_lora.resolve()) and record.pid == vllm_policy.record.pid
    assert completion_ids(vllm_policy.url, name) != base
    assert completion_ids(vllm_policy.url, vllm_policy.served_model) == base  # the base is still served as-is

    # The CLI path, under a chosen name: the record moves on, both adapters stay servable.
    result = CliRunner().invoke(app, ["deploy", str(tiny_lora), "--name", "policy-cli", "--round", "2", "--db", str(tmp_path / "lcap.duckdb")])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "policy-cli" and read_policy().current == "policy-cli"
    assert completion_ids(vllm_policy.url, "policy-cli") == completion_ids(vllm_policy.url, name)
    assert store.fetchall("SELECT name, path, base_model, kind, round FROM deployments ORDER BY created_at") == [
        (name, str(tiny_lora.resolve()), str(vllm_policy.model_dir.resolve()), "lora", 1),
        ("policy-cli", str(tiny_lora.resolve()), str(vllm_policy.model_dir.resolve()), "lora", 2),
    ]

    # Deploying a name vLLM already holds (a resumed loop whose record was reset) replaces it in place.
    vllm_policy.use_base()
    assert deploy(tiny_lora, name=name) == name and read_policy().current == name
    assert completion_ids(vllm_policy.url, name) != base


def test_lcap_serve_status_full_deploy_and_stop(vllm_server, tmp_path):
    """The CLI's own start path (second vLLM), a full checkpoint that restarts it on the same port, then --stop."""
    from lcap.train.tiny_model import init_model

    home = tmp_path / "home"
    home.mkdir()
    venv = Path(vllm_server.python).parent.parent
    if venv.name == "vllm-venv":
        (home / "vllm-venv").symlink_to(venv, target_is_directory=True)
    env = dict(os.environ, LCAP_HOME=str(home), LCAP_POLICY_RECORD=str(home / "policy.json"))
    lcap = [str(Path(sys.executable).parent / "lcap")]
    db = str(tmp_path / "lcap.duckdb")

    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([*lcap, *args], env=env, capture_output=True, text=True, timeout=timeout)

    started = run("serve", "--model", str(vllm_server.model_dir), "--name", "base", "--db", db)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        assert "policy server ready at http://127.0.0.1:" in started.stdout
        status = json.loads(run("serve", "--status").stdout)
        assert status["running"] and status["healthy"] and status["current"] == "base"
        url, pid = status["url"], status["pid"]
        assert completion_ids(url, "base")

        checkpoint = init_model(tmp_path / "round-3", seed=3)
        deployed = run("deploy", str(checkpoint), "--round", "3", "--db", db)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        name = deployed.stdout.strip()
        status = json.loads(run("serve", "--status").stdout)
        assert status["healthy"] and status["url"] == url and status["pid"] != pid
        assert status["current"] == status["served_model"] == name and status["base_model"] == str(checkpoint.resolve())
        assert completion_ids(url, name)
        rows = Store(db).fetchall("SELECT name, kind, round FROM deployments ORDER BY created_at")
        assert rows == [("base", "base", None), (name, "full", 3)]
    finally:
        stopped = run("serve", "--stop", timeout=120)
    assert stopped.returncode == 0 and "stopped policy server" in stopped.stdout
    assert not (home / "policy.json").exists()
    status = run("serve", "--status")
    assert status.returncode == 1 and json.loads(status.stdout) == {"running": False}
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
