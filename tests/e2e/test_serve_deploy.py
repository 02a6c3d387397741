"""`lcap serve --status` and `lcap deploy` on the real vLLM CPU server: LoRA hot-load, full checkpoint reloaded in
place (calls streaming through the proxy meanwhile), full-checkpoint restart."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from fixtures_capture import turns
from fixtures_vllm import hf_logprobs, perturbed_checkpoint, watching_record
from policy_agents import Agents, policy_proxy
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
    from lcap.serve.deploy import deploy_policy

    store = Store(tmp_path / "lcap.duckdb")
    base = completion_ids(vllm_policy.url, vllm_policy.served_model)

    name = deploy_policy(tiny_lora, round=1, store=store)
    record = read_policy()
    assert name.startswith("policy-r1-") and record.current == name
    assert record.loras[name] == str(tiny_lora.resolve()) and record.pid == vllm_policy.record.pid
    assert completion_ids(vllm_policy.url, name) != base
    assert completion_ids(vllm_policy.url, vllm_policy.served_model) == base  # the base is still served as-is

    # The CLI path, under a chosen name: the record moves on, both adapters stay servable.
    result = CliRunner().invoke(
        app, ["deploy", str(tiny_lora), "--name", "policy-cli", "--round", "1", "--db", str(tmp_path / "lcap.duckdb")]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "policy-cli" and read_policy().current == "policy-cli"
    assert completion_ids(vllm_policy.url, "policy-cli") == completion_ids(vllm_policy.url, name)
    assert store.fetchall("SELECT name, path, base_model, kind, round FROM deployments ORDER BY created_at") == [
        (name, str(tiny_lora.resolve()), str(vllm_policy.model_dir.resolve()), "lora", 1),
        ("policy-cli", str(tiny_lora.resolve()), str(vllm_policy.model_dir.resolve()), "lora", 1),  # a known round
    ]

    # Deploying a name vLLM already holds (a resumed loop whose record was reset) replaces it in place.
    vllm_policy.use_base()
    assert deploy_policy(tiny_lora, name=name) == name and read_policy().current == name
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


def test_full_checkpoint_reloads_in_place_while_calls_stream(vllm_policy, tmp_path):
    """A checkpoint with other weights and the same config deploys in place while agents stream calls through the
    proxy: the same vLLM process, no call fails, and every turn is labelled with the deployment whose weights
    served it (its captured logprobs are the label's model's, scored by transformers, and not the other's),
    including calls sent while the replica was paused for the reload, which vLLM held and served afterwards."""
    from transformers import AutoModelForCausalLM

    from lcap.serve.deploy import deploy_policy

    before = read_policy()
    base = vllm_policy.served_model
    checkpoint = perturbed_checkpoint(vllm_policy.model_dir, tmp_path / "round-1" / "checkpoint")
    db = tmp_path / "lcap.duckdb"
    try:
        with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=3, stream_every=1, max_tokens=24) as agents:
            agents.wait_for(6)
            with watching_record(lambda record: record.replicas[0].serving(record), every=0.01) as states:
                name = deploy_policy(checkpoint, name="tiny-r1", round=1, store=Store(db), drain_timeout=120)
            agents.wait_for(6)
        after = read_policy()
        assert name == "tiny-r1" and after.current == name and after.served_name(name) == base
        assert after.pid == before.pid and after.served_model == base  # the same server: no restart
        assert after.base_model == str(checkpoint.resolve()) and not after.loras
        failed = [c for c in agents.calls if not c["ok"]]
        assert not failed, failed[:3]
        rows = turns(db)
        assert all(r["status_code"] == 200 and r["token_source"] == "vllm" for r in rows)
        assert {r["deployment"] for r in rows} == {base, name} and {r["model_served"] for r in rows} == {base}

        models = {
            label: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for label, path in ((base, vllm_policy.model_dir), (name, checkpoint))
        }
        for row in rows:
            served = row["completion_logprobs"]
            error = {
                label: max(
                    abs(a - b)
                    for a, b in zip(
                        hf_logprobs(model, row["prompt_token_ids"], row["completion_token_ids"]), served, strict=True
                    )
                )
                for label, model in models.items()
            }
            other = name if row["deployment"] == base else base
            assert error[row["deployment"]] < 1e-3 < error[other], (row["deployment"], row["started_at"], error)
        # Calls sent before the switch and served after it (held by the pause) are labelled with the new weights.
        switched = min((t for t, serving in states if serving == name), default=None)
        assert switched and any(r["deployment"] == name and r["started_at"].timestamp() < switched for r in rows), (
            "no call was held by the pause: the test did not exercise it"
        )
        rows = Store(db).fetchall("SELECT name, path, kind, round FROM deployments")
        assert rows == [(name, str(checkpoint.resolve()), "full", 1)]
    finally:  # the tests that follow expect the tiny model's own weights
        deploy_policy(vllm_policy.model_dir, name=base)
    record = read_policy()
    assert record.pid == before.pid and record.base_model == str(vllm_policy.model_dir.resolve())


def test_a_failed_reload_resumes_and_a_changed_config_restarts_vllm(vllm_policy, tmp_path, caplog):
    """A reload vLLM refuses (weights that do not fit the model) raises and leaves the replica resumed, not paused
    (vLLM's failed reload leaves it unable to serve: the deploy then restarts it). A checkpoint whose config.json
    differs cannot be reloaded in place: vLLM restarts on it, and one log line says why. That checkpoint is the
    tiny model with a key vLLM ignores, under the same name, so the session's server serves the same policy again
    to the tests that follow."""
    from safetensors.torch import save_file

    from lcap.serve.reload import ReloadError, can_reload, reload_in_place

    before = read_policy()
    base = completion_ids(vllm_policy.url, vllm_policy.served_model)
    broken = tmp_path / "broken"
    shutil.copytree(vllm_policy.model_dir, broken)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, broken / "model.safetensors")
    switched: list[int] = []
    with pytest.raises(ReloadError, match="lcap_reload_weights"):
        reload_in_place(vllm_policy.url, None, broken, drain_timeout=60, switch=lambda: switched.append(1), name="r0")
    assert not switched and can_reload(vllm_policy.url, None) is None  # resumed, not paused

    checkpoint = tmp_path / "round-3" / "checkpoint"
    shutil.copytree(vllm_policy.model_dir, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "lcap_test_marker": 1}))
    caplog.set_level(logging.WARNING, logger="lcap.serve")

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
    why = [r.getMessage() for r in caplog.records if "by restarting vLLM" in r.getMessage()]
    assert why == [
        f"lcap: deploying {checkpoint.resolve()} by restarting vLLM: its config.json differs from the "
        "running model's (lcap_test_marker)"
    ], why
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
