"""`lcap deploy --merge` on the session's real vLLM CPU server: a random, non-zero LoRA merged into the running tiny
model's weights and reloaded in place; the calls after it are labelled with the merged deployment, the mismatch guard
of the round that continues the adapter passes against what vLLM served (and stops when vLLM served another
adapter's merge), and `--rollback` serves the base's weights again."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fixtures_capture import turns
from fixtures_vllm import make_lora, served_samples
from logps import train_options
from policy_agents import Agents, policy_proxy
from typer.testing import CliRunner

from lcap.cli import app
from lcap.config import LcapError
from lcap.policy import read_policy
from lcap.serve import record_deployment
from lcap.store import Store
from lcap.train.fit import guard_round
from lcap.train.grpo import prepare_round
from lcap.train.options import MISMATCH_MAX

pytestmark = pytest.mark.vllm

PROMPT = [{"role": "user", "content": "What is 2 + 2? Answer with the number."}]


def greedy(url: str, model: str) -> tuple[list[int], list[float]]:
    """A greedy completion's token ids and the logprobs vLLM served them with."""
    body = {
        "model": model,
        "messages": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def lcap_deploy(*args: str) -> str:
    result = CliRunner().invoke(app, ["deploy", *args])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_merged_deploy_serves_the_adapter_passes_the_guard_and_rolls_back(vllm_policy, tmp_path):
    record = read_policy()
    pid, running, served = record.pid, Path(record.base_model), vllm_policy.served_model
    db = tmp_path / "lcap.duckdb"
    store = Store(db)
    record_deployment(store, record, served, str(running), "base", None)  # what `lcap serve` records
    run = tmp_path / "run"
    adapter = make_lora(running, run / "round-1" / "adapter", seed=3)
    base_ids, base_logps = greedy(vllm_policy.url, served)
    try:
        name = lcap_deploy(str(adapter), "--merge", "--round", "1", "--db", str(db))
        after = read_policy()
        merged = adapter.with_name("adapter-merged")
        assert name.startswith("policy-merged-r1-") and after.current == name and after.pid == pid  # no restart
        assert after.served_name(name) == served and after.base_model == str(merged) and not after.loras
        assert json.loads((merged / "lcap-merge.json").read_text())["base"] == str(running)
        assert store.fetchall("SELECT name, path, kind, round FROM deployments ORDER BY created_at")[1:] == [
            (name, str(adapter.resolve()), "merged", 1)
        ]
        assert greedy(vllm_policy.url, served)[1] != base_logps

        # The calls after it are labelled with the merged deployment.
        with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=1, max_tokens=8) as agents:
            agents.wait_for(2)
        assert {r["deployment"] for r in turns(db)} == {name}

        # Round 2 continues the adapter; vLLM served its merge: the guard finds no mismatch.
        data = served_samples(vllm_policy.url, served, tmp_path / "data", deployment=name)
        prepared = prepare_round(run, 2, train_options(running), data)
        (measured,) = guard_round(prepared, train_options(running)).deployments
        assert measured.deployment == name and measured.samples == 16 and measured.kl < MISMATCH_MAX / 100
        # Another adapter's merge served those samples: the guard stops the round.
        other = tmp_path / "other"
        make_lora(running, other / "round-1" / "adapter", seed=4)
        with pytest.raises(LcapError, match=f"deployment '{name}'"):
            guard_round(prepare_round(other, 2, train_options(running), data), train_options(running))

        restored = lcap_deploy("--rollback", "--db", str(db))
        assert restored.startswith(f"{served} (rolled back from {name})")
        back = read_policy()
        assert back.current == served and back.base_model == str(running) and back.pid == pid
        ids, logps = greedy(vllm_policy.url, served)
        assert ids == base_ids and logps == pytest.approx(base_logps, abs=1e-4)
    finally:  # the tests that follow expect the running model's own weights
        if read_policy().base_model != str(running):
            from lcap.serve import deploy_policy

            deploy_policy(running, name=served)
