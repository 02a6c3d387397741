"""`lcap serve --status` and `lcap deploy` on the real vLLM CPU server: LoRA hot-load, full-checkpoint restart."""

from __future__ import annotations

import json
import os
import shutil
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
    from lcap.serve.deploy import deploy

    store = Store(tmp_path / "lcap.duckdb")
    base = completion_ids(vllm_policy.url, vllm_policy.served_model)

    name = deploy(tiny_lora, round=1, store=store)
    record = read_policy()
    assert name.startswith("policy-r1-") and record.current == name
    assert record.loras[name] == str(tiny_lora.resolve()) and record.pid == vllm_policy.record.pid
    assert completion_ids(vllm_policy.url, name) != base
    assert completion_ids(vllm_policy.url, vllm_policy.served_model) == base  # the base is still served as-is

    # The CLI path, under a chosen name: the record moves on, both adapters stay servable.
    result = CliRunner().invoke(
        app, ["deploy", str(tiny_lora), "--name", "policy-cli", "--round", "2", "--db", str(tmp_path / "lcap.duckdb")]
    )
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


def test_lcap_serve_status_reports_the_running_server(vllm_server):
    """The session's server was started by `lcap serve` (see fixtures_vllm): its record, health and base row."""
    status = subprocess.run(
        [str(Path(sys.executable).parent / "lcap"), "serve", "--status"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["running"] and state["healthy"] and state["alive"]
    assert state["url"] == vllm_server.url and state["served_model"] == "tiny"
    assert Path(state["log_path"]).is_file() and "--enable-lora" in Path(state["log_path"]).read_text()
    rows = Store(vllm_server.lcap_home / "serve.duckdb").fetchall("SELECT name, path, kind, round FROM deployments")
    assert rows == [("tiny", str(vllm_server.model_dir.resolve()), "base", None)]


def test_deploy_full_checkpoint_restarts_vllm_on_the_same_url(vllm_policy, tmp_path):
    """A full checkpoint restarts vLLM on it. The checkpoint is an exact copy of the tiny model under the same
    name, so the session's server keeps serving the same policy to the tests that follow."""
    before = read_policy()
    base = completion_ids(vllm_policy.url, vllm_policy.served_model)
    checkpoint = tmp_path / "round-3" / "checkpoint"
    shutil.copytree(vllm_policy.model_dir, checkpoint)

    result = CliRunner().invoke(
        app,
        [
            "deploy",
            str(checkpoint),
            "--name",
            vllm_policy.served_model,
            "--round",
            "3",
            "--db",
            str(tmp_path / "lcap.duckdb"),
        ],
    )
    assert result.exit_code == 0, result.output
    after = read_policy()
    vllm_policy.record = after
    assert after.pid != before.pid and after.url == before.url
    assert (
        after.base_model == str(checkpoint.resolve())
        and after.current == after.served_model == vllm_policy.served_model
    )
    with pytest.raises(ProcessLookupError):
        os.killpg(before.pid, 0)
    models = httpx.get(f"{after.url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(vllm_policy.served_model, str(checkpoint.resolve()))]
    assert completion_ids(after.url, vllm_policy.served_model) == base  # same weights, same greedy answer
    rows = Store(tmp_path / "lcap.duckdb").fetchall("SELECT name, path, base_model, kind, round FROM deployments")
    assert rows == [(vllm_policy.served_model, str(checkpoint.resolve()), str(checkpoint.resolve()), "full", 3)]
