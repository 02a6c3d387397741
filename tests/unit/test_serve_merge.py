"""`lcap deploy --merge`'s merge (serve/merge.py) and its refusals: the merged checkpoint scores as the adapter on its
base does, it is written whole and reused, and every deploy that could serve other weights than the ones named is
refused in one line before anything changes. (The deploy itself, on the real vLLM server: e2e/test_serve_merge.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from fixtures_vllm import make_lora
from typer.testing import CliRunner

from lcap.cli import app
from lcap.config import LcapError
from lcap.policy import PolicyServer, read_policy, write_policy
from lcap.serve.merge import MARKER, merge_adapter, merged_path, root_base
from lcap.serve.same_model import difference


def _record(base: Path | str, roles: dict[str, str] | None = None) -> PolicyServer:
    return PolicyServer("http://127.0.0.1:8123", None, str(base), "m", "m", "", "py", "", roles=roles or {})


@pytest.fixture(scope="module")
def merge_model(tmp_path_factory) -> Path:
    """A random two-layer Qwen2 model (no tokenizer to train: the merge never reads one), with a tokenizer setting
    the merge must copy."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    out = tmp_path_factory.mktemp("merge-model") / "tiny"
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return out


@pytest.fixture
def adapter(merge_model, tmp_path) -> Path:
    return make_lora(merge_model, tmp_path / "round-1" / "adapter", seed=3, rank=4)


def test_the_merge_scores_as_the_adapter_on_its_base_and_reloads_in_place(merge_model, adapter, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = merge_adapter(adapter, str(merge_model))
    assert out == merged_path(adapter) == adapter.parent / "adapter-merged"
    assert [p.name for p in adapter.parent.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    assert json.loads((out / MARKER).read_text())["base"] == str(merge_model)
    assert root_base(str(out)) == str(merge_model) and root_base(str(merge_model)) == str(merge_model)
    assert difference(out, merge_model, merge_model) is None  # only the weights' values changed

    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    base = AutoModelForCausalLM.from_pretrained(merge_model, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(ids).logits
        peft = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert torch.allclose(merged, peft, atol=1e-4) and not torch.allclose(merged, plain, atol=1e-2)

    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert merge_adapter(adapter, str(merge_model)) == out and weights.stat().st_mtime_ns == stamp  # reused
    make_lora(merge_model, adapter, seed=4, rank=4)  # retrained: merged again, in place of the old merge
    merge_adapter(adapter, str(merge_model))
    assert weights.stat().st_mtime_ns != stamp
    assert sorted(p.name for p in adapter.parent.iterdir()) == ["adapter", "adapter-merged"]
    assert (out / "tokenizer_config.json").read_text() == (merge_model / "tokenizer_config.json").read_text()


def test_a_merged_deploy_is_refused_in_one_line_where_it_would_serve_other_weights(
    record_env, merge_model, adapter, tmp_path
):
    from lcap.serve.deploy import deploy_policy

    write_policy(_record(merge_model, roles={"planner": "lora-a"}))
    with pytest.raises(LcapError, match=r"roles planner have adapters of their own: one merged weight set cannot"):
        deploy_policy(adapter, merge=True)

    write_policy(_record(tmp_path / "another-base"))
    with pytest.raises(LcapError, match=rf"trained on {merge_model}, but the policy server serves .*another-base"):
        deploy_policy(adapter, merge=True)

    write_policy(_record(merge_model))
    with pytest.raises(LcapError, match=r"is not a LoRA adapter .*--merge merges an adapter"):
        deploy_policy(merge_model, merge=True)

    # A server running a merge: the adapter's base is the merge's base; a hot-loaded adapter would sit on the merge.
    merged = merge_adapter(adapter, str(merge_model))
    write_policy(_record(merged))
    with pytest.raises(LcapError, match=r"runs merged weights .*deploy it with --merge"):
        deploy_policy(adapter)
    assert read_policy() == _record(merged)  # nothing changed

    for args, why in (
        (["--merge", "--role", "planner", str(adapter)], "--merge deploys one weight set for every role"),
        (["--merge", "--rollback"], "--rollback restores a deployment as it was deployed"),
    ):
        result = CliRunner().invoke(app, ["deploy", *args, "--db", str(tmp_path / "lcap.duckdb")])
        assert result.exit_code == 2 and why in result.output, result.output


def test_loop_deploy_merge_deploys_each_round_merged_before_its_held_out_run(tmp_path, record_env, monkeypatch):
    from lcap.dataset.options import CollectOptions
    from lcap.loop import rounds, steps
    from lcap.loop.options import LoopOptions
    from lcap.loop.steps import LoopConfig, LoopState
    from lcap.train.options import TrainOptions

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t0"}\n')
    merged = LoopConfig(
        run=tmp_path / "run",
        rounds=1,
        tasks=tasks,
        command=["agent"],
        collect=CollectOptions(group_size=2),
        eval_tasks=tasks,
        options=LoopOptions(deploy_merge=True),
    )
    assert not rounds.gated(merged) and rounds.gated(dataclasses.replace(merged, options=LoopOptions()))
    for bad in ({"overlap": True}, {"live": True}, {"per_role": True}):
        with pytest.raises(LcapError, match=r"^--deploy-merge deploys a synchronous round's one adapter"):
            LoopOptions(deploy_merge=True, **bad)
    with pytest.raises(LcapError, match=r"^--deploy-merge merges a round's LoRA adapter"):
        dataclasses.replace(merged, train=TrainOptions(full=True))

    deployed: list[tuple] = []  # deploy_policy merges and reloads in vLLM: the real one runs in the e2e test

    def fake(path, *, name=None, round=None, store=None, merge=False) -> str:
        deployed.append((path, name, merge))
        return "d1"

    monkeypatch.setattr(steps, "deploy_policy", fake)
    monkeypatch.setattr(rounds, "deploy_policy", fake)
    info = steps.deploy_step(None, "/r1/adapter", 1, merge=True)
    assert info == {"name": "d1", "path": "/r1/adapter", "merged": True}
    state = LoopState(tmp_path / "run", "k")
    state.finish(1, "deploy", info)
    write_policy(_record("/m"))  # the server lost it (restarted on the base): a resume deploys it merged again
    rounds._redeploy_if_lost(state, None, lambda line: None)
    assert deployed == [(Path("/r1/adapter"), None, True), (Path("/r1/adapter"), "d1", True)]


def test_a_server_without_lora_starts_vllm_without_it_and_refuses_every_hot_load(record_env, adapter):
    from lcap.serve.deploy import deploy_policy, load_candidate
    from lcap.serve.vllm_process import VllmSpec, server_command

    with_lora = server_command("/py", "/m", port=1, served_name="m", gpu=False)
    assert "--enable-lora" in with_lora
    assert not {"--enable-lora", "--max-lora-rank", "--max-loras"} & set(
        server_command("/py", "/m", port=1, served_name="m", gpu=False, lora=False)
    )
    record = _record(adapter.parent)
    assert record.lora and VllmSpec.of(record).lora  # a record from before --no-lora: LoRA on
    record.lora = False
    write_policy(record)
    assert read_policy().lora is False and VllmSpec.of(read_policy()).lora is False  # a restart keeps it off
    for deploy in (deploy_policy, load_candidate):
        with pytest.raises(LcapError, match=r"runs without LoRA \(`lcap serve --no-lora`\).*`lcap deploy --merge`"):
            deploy(adapter)
    assert read_policy() == record  # nothing changed


def test_the_demos_greedy_control_leaves_the_base_out_once_merged_weights_replaced_it(
    tmp_path, record_env, monkeypatch
):
    from lcap.dataset.options import CollectOptions
    from lcap.loop.demo import control
    from lcap.loop.steps import LoopConfig
    from lcap.store import Store

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t0"}\n')
    config = LoopConfig(
        run=tmp_path / "run", rounds=1, tasks=tasks, command=["agent"], collect=CollectOptions(), eval_tasks=tasks
    )
    asked: list[tuple[str, ...]] = []  # run_eval collects episodes through vLLM: the demo's e2e test runs it
    monkeypatch.setattr(control, "run_eval", lambda store, *, options, **kw: asked.append(options.deployments))
    record = _record("/m")
    record.current = "policy-r1-abc"
    write_policy(record)
    lines: list[str] = []
    store = Store(tmp_path / "lcap.duckdb")
    control.run_greedy(store, config, lines.append)
    record.current, record.served_as = "policy-merged-r1-abc", {"policy-merged-r1-abc": "m"}
    write_policy(record)
    control.run_greedy(store, config, lines.append)
    assert asked == [("m", "policy-r1-abc"), ("policy-merged-r1-abc",)]
    assert "the base model's weights no longer serve" in lines[-2]


def test_the_demos_greedy_control_asks_the_base_before_merged_deploys_replace_it(tmp_path, record_env, monkeypatch):
    """A merged demo evaluates the base model at temperature 0 before its loop, while the base weights still serve;
    a demo resumed past round 1's merged deploy cannot, and asks nothing then."""
    from lcap.dataset.options import CollectOptions
    from lcap.loop.demo import control
    from lcap.loop.steps import LoopConfig
    from lcap.store import Store

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t0"}\n')
    config = LoopConfig(
        run=tmp_path / "run", rounds=1, tasks=tasks, command=["agent"], collect=CollectOptions(), eval_tasks=tasks
    )
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(control, "run_eval", lambda store, *, options, **kw: asked.append(options.deployments))
    record = _record("/m")
    write_policy(record)
    store = Store(tmp_path / "lcap.duckdb")
    control.run_greedy(store, config, print, base_only=True)
    record.current, record.served_as = "policy-merged-r1-abc", {"policy-merged-r1-abc": "m"}
    write_policy(record)
    control.run_greedy(store, config, print, base_only=True)
    assert asked == [("m",)]


def test_the_demo_deploys_merged_on_cpu_where_its_loop_has_one_adapter_a_round(monkeypatch):
    """On CPU the demo serves each round merged (vLLM without LoRA decodes several times faster); a loop that needs
    adapters beside the base weights keeps hot-loading them, and so does a GPU."""
    from dataclasses import replace

    from lcap.loop.demo import runner
    from lcap.loop.options import LoopOptions

    monkeypatch.setattr(runner, "has_gpu", lambda: False)
    plain = LoopOptions()
    assert runner.deploys_merged(plain)
    assert not runner.deploys_merged(plain, reward="judge")  # the judge is the base weights
    for needs_adapters in (replace(plain, overlap=True), replace(plain, live=True), replace(plain, per_role=True)):
        assert not runner.deploys_merged(needs_adapters)
    monkeypatch.setattr(runner, "has_gpu", lambda: True)
    assert not runner.deploys_merged(plain)
