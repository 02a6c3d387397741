"""`lcap train --role R` on the tiny model and real TRL: each role's adapter is trained on its own calls' tokens only
(issue 52), in its own folder, from its own previous adapter, and training one role leaves another's adapter file
byte-identical. The build and its per-role baseline: tests/unit/test_dataset_roles.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fixtures_dataset import StoreBuilder
from fixtures_train import sample_from_model
from logps import train_options

from lcap.dataset.build.builder import build_dataset
from lcap.dataset.options import BuildOptions
from lcap.store import Store
from lcap.train.grpo import prepare_round, round_dir, train_round

ROLES = ("planner", "solver")


@pytest.fixture(scope="module")
def two_role_store(tiny_train_model, tmp_path_factory) -> Store:
    """Round 1: two tasks, four episodes each; every episode has one planner call and one solver call, sampled from
    the tiny model with its own logprobs (each on a prompt of its own); rewards 1, 0, 1, 0 (shifted per task)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_train_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_train_model).eval()
    store = Store(tmp_path_factory.mktemp("roles") / "lcap.duckdb")
    builder = StoreBuilder(store)
    for g in range(2):
        for k in range(4):
            turns = []
            for r, role in enumerate(ROLES):
                prompt, completion, logprobs = sample_from_model(
                    model, tokenizer, f"{role} {g}: alpha beta", max_new_tokens=6, seed=100 * g + 10 * k + r
                )
                turns.append(
                    {
                        "prompt_token_ids": prompt,
                        "completion_token_ids": completion,
                        "completion_logprobs": logprobs,
                        "role": role,
                        "deployment": "base",
                    }
                )
            builder.episode(f"t{g}-{k}", task=f"t{g}", sample=k, reward=float((k + g) % 2 == 0), turns=turns)
    return store


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def test_each_roles_adapter_trains_on_its_own_tokens_and_leaves_the_others(two_role_store, tiny_train_model, tmp_path):
    store, run = two_role_store, tmp_path / "run"
    calls = {
        (episode, role): (prompt, completion)
        for episode, role, prompt, completion in store.fetchall(
            "SELECT episode_id, role, prompt_token_ids, completion_token_ids FROM turns"
        )
    }
    for role in ROLES:
        build_dataset(store, round=1, out=round_dir(run, 1, role) / "data", options=BuildOptions(), role=role)
    options = train_options(tiny_train_model, learning_rate=1e-3)

    # the loss mask as the trainer reads it: role R's samples hold R's completion tokens, and nothing of another role
    prepared = prepare_round(run, 1, options, role="planner")
    samples = prepared.groups.real_samples
    assert len(samples) == 8
    for s in samples:
        prompt, completion = calls[(s.sample_id.split("#")[0], "planner")]
        assert s.prompt_ids == prompt
        assert [t for t, m in zip(s.completion_ids, s.env_mask, strict=True) if m] == completion
    del prepared

    solver = train_round(store, run, 1, options, role="solver")
    assert solver.output == run / "round-1" / "role-solver" / "adapter"
    solver_files = _files(solver.output)
    assert "adapter_model.safetensors" in solver_files

    planner = train_round(store, run, 1, options, role="planner")
    assert planner.output == run / "round-1" / "role-planner" / "adapter"
    assert _files(solver.output) == solver_files  # training the planner left the solver's adapter as it was
    planner_1 = _files(planner.output)
    assert planner_1["adapter_model.safetensors"] != solver_files["adapter_model.safetensors"]

    # the planner's next round continues the planner's adapter; the solver's is still untouched
    again = train_round(store, run, 2, options, role="planner", data=round_dir(run, 1, "planner") / "data")
    config = json.loads((run / "round-2" / "role-planner" / "config.json").read_text())
    assert (config["role"], config["init_from"]) == ("planner", str(planner.output))
    assert _files(again.output)["adapter_model.safetensors"] != planner_1["adapter_model.safetensors"]
    assert _files(solver.output) == solver_files
    assert not (run / "round-1" / "adapter").exists()  # no single-role adapter was written
    rows = store.fetchall("SELECT round, config->>'role', output FROM train_runs ORDER BY started_at")
    assert rows == [
        (1, "solver", str(solver.output)),
        (1, "planner", str(planner.output)),
        (2, "planner", str(again.output)),
    ]
