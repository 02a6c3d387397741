"""GRPO on captured samples: the direction of a step, LoRA, the off-policy correction, groups."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from fixtures_train import make_captured_samples, write_samples
from logps import perturbed_samples, token_logps, train_options

from lcap.store import Store
from lcap.train.grpo import prepare_round, train_round
from lcap.train.options import TrainOptions
from lcap.train.progress import round_line
from lcap.train.samples import Sample, read_samples


def model_token_logp(model, sample: Sample) -> float:
    mask = torch.tensor(sample.env_mask, dtype=torch.bool)
    return float(token_logps(model, sample)[mask].sum())


def test_step_raises_positive_and_lowers_negative_advantage(tiny_train_model, captured_samples, tmp_path):
    prepared = prepare_round(
        tmp_path / "run", 1, train_options(tiny_train_model, learning_rate=3e-3), data=captured_samples
    )
    samples = prepared.groups.real_samples
    model = prepared.trainer.model
    before = [model_token_logp(model, s) for s in samples]
    prepared.trainer.train()
    model.eval()
    after = [model_token_logp(model, s) for s in samples]
    deltas = [(a - b, s.advantage) for a, b, s in zip(after, before, samples)]
    assert {adv > 0 for _, adv in deltas} == {True, False}
    for delta, adv in deltas:
        assert (delta > 0) == (adv > 0), deltas
    assert min(abs(d) for d, _ in deltas) > 1e-4


def test_round_saves_changed_lora_and_metrics(tiny_train_model, captured_samples, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    store = Store(tmp_path / "lcap.duckdb")
    result = train_round(
        store, tmp_path / "run", 1, train_options(tiny_train_model, learning_rate=1e-3), data=captured_samples
    )
    assert result.output == tmp_path / "run" / "round-1" / "adapter"
    base = AutoModelForCausalLM.from_pretrained(tiny_train_model)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    tuned = PeftModel.from_pretrained(base, str(result.output))
    lora_b = {k: v for k, v in tuned.state_dict().items() if "lora_B" in k}
    assert lora_b and all(v.abs().max() > 0 for v in lora_b.values())  # B starts at zero: a step moved every one
    targets = {k.split(".lora_B")[0].split(".")[-1] for k in lora_b}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= targets
    assert tuned.peft_config["default"].lora_dropout == 0.0
    merged = tuned.merge_and_unload().state_dict()
    assert any(not torch.equal(merged[k], base_state[k]) for k in base_state if "proj" in k)

    row = store.fetchall(
        "SELECT round, kind, n_samples, n_groups, mean_reward, is_ratio_mean, tokens_per_s, steps FROM train_runs"
    )
    assert row == [(1, "lora", 8, 2, 0.5, pytest.approx(row[0][5]), pytest.approx(row[0][6]), 1)]
    assert 0.5 < row[0][5] < 2.0 and row[0][6] > 0
    assert (tmp_path / "run" / "round-1" / "config.json").exists()


def test_a_short_group_is_filled_with_one_token_copies_that_change_nothing(
    tiny_train_model, captured_samples, tmp_path
):
    """A group shorter than the round's largest is filled with zero-weight copies of one token each: the round trains
    as it does with full-length masked samples in their place, on fewer tokens."""
    from safetensors.torch import load_file

    rows = pq.read_table(captured_samples).to_pylist()
    dropped = ("s1-2", "s1-3")  # two of group r1-t1's four
    short = [r for r in rows if r["sample_id"] not in dropped]
    masked = [
        {**r, "env_mask": [0] * len(r["env_mask"]), "advantage": 0.0} if r["sample_id"] in dropped else r for r in rows
    ]
    runs = {}
    for name, data in (("padded", short), ("masked", masked)):
        store = Store(tmp_path / f"{name}.duckdb")
        samples = write_samples(tmp_path / name / "samples.parquet", data)
        result = train_round(
            store, tmp_path / name, 1, train_options(tiny_train_model, learning_rate=1e-3), data=samples
        )
        ((loss, tokens, padded),) = store.fetchall("SELECT loss, tokens, padded FROM train_runs")
        runs[name] = (loss, tokens, padded, load_file(result.output / "adapter_model.safetensors"))
    (loss, tokens, padded, adapter), (loss_m, tokens_m, padded_m, adapter_m) = runs["padded"], runs["masked"]
    assert (padded, padded_m) == (2, 0)
    assert tokens == sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in short) + 2 * 2 < tokens_m
    assert loss == pytest.approx(loss_m, rel=1e-4) and adapter.keys() == adapter_m.keys()
    for key in adapter:
        torch.testing.assert_close(adapter[key], adapter_m[key], rtol=1e-4, atol=1e-6)


def test_samples_left_alone_in_their_group_are_left_out_and_said_so(tiny_train_model, captured_samples, tmp_path):
    """A group that the builder's drops (truncated calls, failed episodes) left with one sample gives GRPO nothing to
    compare: the round trains without it, and its line says how many samples it left out, as the build's count of
    samples and the round's would otherwise disagree with nothing said."""
    rows = pq.read_table(captured_samples).to_pylist()
    alone = [r for r in rows if r["group_id"] != "r1-t1" or r["sample_id"] == "s1-0"]  # r1-t1 keeps one of four
    samples = write_samples(tmp_path / "data" / "samples.parquet", alone)
    store = Store(tmp_path / "lcap.duckdb")
    result = train_round(store, tmp_path / "run", 1, train_options(tiny_train_model, learning_rate=1e-3), data=samples)
    assert (result.metrics["n_samples"], result.metrics["n_groups"], result.metrics["dropped_alone"]) == (4, 1, 1)
    line = round_line(1, result.metrics, result.output)
    assert line.startswith("round 1: 4 samples in 1 group,") and line.endswith(
        f"left out: 1 sample is alone in its group (GRPO compares two or more samples of a task) -> {result.output}"
    ), line


def loss_inputs(monkeypatch) -> tuple[list[dict], list[bool]]:
    """Spies: the inputs of every loss TRL computes, as the loss left them (IS ratio included), and
    whether each log-prob forward ran with grad (False: a forward made only to score)."""
    from lcap.train.trainer import CapturedGRPOTrainer

    seen: list[dict] = []
    forwards: list[bool] = []
    compute_loss = CapturedGRPOTrainer._compute_loss
    logps = CapturedGRPOTrainer._get_per_token_logps_and_entropies

    def loss_spy(self, model, inputs):
        loss = compute_loss(self, model, inputs)
        seen.append(inputs)
        return loss

    def logps_spy(self, *args, **kwargs):
        forwards.append(torch.is_grad_enabled())
        return logps(self, *args, **kwargs)

    monkeypatch.setattr(CapturedGRPOTrainer, "_compute_loss", loss_spy)
    monkeypatch.setattr(CapturedGRPOTrainer, "_get_per_token_logps_and_entropies", logps_spy)
    return seen, forwards


def match(row_ids: torch.Tensor, samples: list[Sample]) -> Sample:
    ids = row_ids.tolist()
    return next(s for s in samples if ids[: len(s.completion_ids)] == s.completion_ids)


def first_batch(
    model_dir: Path, data: Path, tmp_path: Path, monkeypatch, is_mode: str, epochs: int = 1
) -> tuple[dict, list[bool]]:
    """Train one round on `data`: the first batch TRL computed a loss on, with its IS ratio, and
    the grad flag of every log-prob forward."""
    seen, forwards = loss_inputs(monkeypatch)
    prepared = prepare_round(
        tmp_path / "run", 1, train_options(model_dir, is_mode=is_mode, is_max=2.0, epochs=epochs), data=data
    )
    prepared.trainer.train()
    return seen[0], forwards


def scored_rows(out: dict, samples: list[Sample]):
    """Each row of a scored batch: its index, its sample, its length and its model-token mask."""
    for i in range(out["completion_ids"].shape[0]):
        s = match(out["completion_ids"][i], samples)
        yield i, s, len(s.completion_ids), torch.tensor(s.env_mask, dtype=torch.bool)


def truncated_ratio(train_logps: dict, s: Sample) -> torch.Tensor:
    return torch.exp(train_logps[s.sample_id] - torch.tensor(s.logprobs)).clamp(max=2.0)


@pytest.mark.parametrize("epochs, scoring_forwards", [(1, 0), (2, 1)])
def test_is_ratio_is_truncated_exp_of_train_minus_captured(
    tiny_train_model, captured_samples, tmp_path, monkeypatch, epochs, scoring_forwards
):
    """One epoch: the ratio comes from the loss forward, no forward only to score; more: one, at round start."""
    path, train_logps, samples = perturbed_samples(tiny_train_model, captured_samples, tmp_path / "data")
    out, forwards = first_batch(tiny_train_model, path, tmp_path, monkeypatch, "token_truncate", epochs)
    assert forwards.count(False) == scoring_forwards and forwards.count(True) == epochs
    checked = 0
    for i, s, n, mask in scored_rows(out, samples):
        ratio = out["importance_sampling_ratio"][i, :n]
        torch.testing.assert_close(ratio[mask], truncated_ratio(train_logps, s)[mask], atol=2e-4, rtol=2e-4)
        assert torch.all(ratio[~mask] == 1.0)  # env tokens: no correction, and no loss (tool_mask 0)
        assert torch.all(out["tool_mask"][i, :n][~mask] == 0)
        checked += int(mask.sum())
    assert checked > 20
    assert (ratio == 2.0).any()  # the -1.0 shift was truncated at the cap


def test_samples_without_behaviour_logprobs_get_no_correction(
    tiny_train_model, captured_samples, tmp_path, monkeypatch
):
    """Rebuilt samples (and Responses turns) carry 0.0 placeholders, not the server's logprobs: ratio 1."""
    path, train_logps, samples = perturbed_samples(tiny_train_model, captured_samples, tmp_path / "data")
    rows = pq.read_table(path).to_pylist()
    rebuilt = {rows[i]["sample_id"] for i in range(0, len(rows), 2)}
    for row in rows:
        if row["sample_id"] in rebuilt:
            row["rebuilt"] = True
            row["logprobs"] = [0.0] * len(row["logprobs"])
    path = write_samples(tmp_path / "data2" / "samples.parquet", rows)
    samples = read_samples(path)
    assert [s.behaviour for s in samples] == [s.sample_id not in rebuilt for s in samples]
    out, _ = first_batch(tiny_train_model, path, tmp_path, monkeypatch, "token_truncate")
    corrected = uncorrected = 0
    for i, s, n, mask in scored_rows(out, samples):
        ratio = out["importance_sampling_ratio"][i, :n]
        if s.behaviour:
            torch.testing.assert_close(ratio[mask], truncated_ratio(train_logps, s)[mask], atol=2e-4, rtol=2e-4)
            corrected += 1
        else:
            assert torch.all(ratio == 1.0)
            uncorrected += 1
    assert corrected and uncorrected


def test_token_mask_mode_drops_rejected_tokens_from_the_denominator(
    tiny_train_model, captured_samples, tmp_path, monkeypatch
):
    path, train_logps, samples = perturbed_samples(tiny_train_model, captured_samples, tmp_path / "data")
    out, forwards = first_batch(tiny_train_model, path, tmp_path, monkeypatch, "token_mask")
    assert forwards.count(False) == 1  # the mask modes change the loss mask: scored before the loss
    rejected = 0
    for i, s, n, mask in scored_rows(out, samples):
        ratio = torch.exp(train_logps[s.sample_id] - torch.tensor(s.logprobs))
        keep = mask & (ratio <= 2.0)
        assert torch.equal(out["tool_mask"][i, :n].bool(), keep)
        rejected += int((mask & ~keep).sum())
    assert rejected > 0
    assert int(out["num_items_in_batch"]) == int((out["completion_mask"] * out["tool_mask"]).sum())


def test_without_correction_no_ratio(tiny_train_model, captured_samples, tmp_path, monkeypatch):
    seen, _ = loss_inputs(monkeypatch)
    prepared = prepare_round(
        tmp_path / "run", 1, train_options(tiny_train_model, is_correction=False), data=captured_samples
    )
    prepared.trainer.train()
    assert "importance_sampling_ratio" not in seen[0]


def padded_batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompt + completion ids as TRL lays them out: prompts left-padded, completions right-padded."""
    p_len = max(len(s.prompt_ids) for s in samples)
    c_len = max(len(s.completion_ids) for s in samples)
    ids = torch.zeros(len(samples), p_len + c_len, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, p_len - len(s.prompt_ids) : p_len + len(s.completion_ids)] = torch.tensor(
            s.prompt_ids + s.completion_ids
        )
        attn[i, p_len - len(s.prompt_ids) : p_len + len(s.completion_ids)] = 1
    return ids, attn, c_len


def test_cpu_logps_from_the_plain_lm_head_equal_trls_fused_head(
    tiny_train_model, captured_samples, tmp_path, monkeypatch
):
    """On CPU the trainer scores completions with the model's LM head, not TRL's fused head: same numbers, in
    padded micro-batches while their attention is small, each sample alone without a mask past that (a masked,
    padded batch takes SDPA's quadratic-memory kernel)."""
    import trl.trainer.utils as trl_utils
    from trl import GRPOTrainer

    from lcap.train import trainer as lcap_trainer

    prepared = prepare_round(tmp_path / "run", 1, train_options(tiny_train_model), data=captured_samples)
    trainer, samples = prepared.trainer, prepared.groups.real_samples
    ids, attn, c_len = padded_batch(samples)
    fused_calls: list[int] = []
    apply = trl_utils._ChunkedLogProbFunction.apply
    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", lambda *a: fused_calls.append(1) or apply(*a))

    def scored(get_logps) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Log-probs, entropies and the LoRA gradients of their masked sum."""
        trainer.model.zero_grad()
        logps, entropies, _ = get_logps(trainer, trainer.model, ids, attn, c_len, batch_size=3, compute_entropy=True)
        (logps * attn[:, -c_len:]).sum().backward()
        return (
            logps.detach(),
            entropies.detach(),
            [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad],
        )

    calls: list[tuple[int, bool]] = []  # (rows, masked) of each forward of ours
    hook = trainer.model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append((kwargs["input_ids"].size(0), kwargs.get("attention_mask") is not None)),
        with_kwargs=True,
    )
    batched = scored(type(trainer)._get_per_token_logps_and_entropies)
    assert [rows for rows, _ in calls] == [min(3, len(samples) - i) for i in range(0, len(samples), 3)]
    assert all(masked for _, masked in calls)  # small samples: padded, masked micro-batches of batch_size
    calls.clear()
    monkeypatch.setattr(lcap_trainer, "PADDED_ATTENTION_BYTES", 0)
    alone = scored(type(trainer)._get_per_token_logps_and_entropies)
    hook.remove()
    assert not fused_calls
    # past the bound, one sample per forward, unpadded and unmasked: SDPA's causal kernel, memory linear in the length
    assert calls == [(1, False)] * len(samples)
    trl_own = scored(GRPOTrainer._get_per_token_logps_and_entropies)
    assert fused_calls
    for ours in (batched, alone):
        torch.testing.assert_close(ours[0], trl_own[0])  # log-probs, 0 at padding like TRL's
        torch.testing.assert_close(ours[1], trl_own[1])  # entropies
        assert any(g.abs().max() > 0 for g in ours[2])
        torch.testing.assert_close(ours[2], trl_own[2])  # gradients
    model = trainer.model.eval()
    for i, s in enumerate(samples):
        torch.testing.assert_close(alone[0][i, : len(s.completion_ids)], token_logps(model, s), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting, expected", [(None, False), (True, True)])
def test_activation_checkpointing_off_on_cpu_unless_asked(
    tiny_train_model, captured_samples, tmp_path, setting, expected
):
    """Checkpointing trades a second forward for memory: worth it on a GPU, not on CPU (the default there)."""
    prepared = prepare_round(
        tmp_path / "run",
        1,
        train_options(tiny_train_model, activation_checkpointing=setting, max_steps=1),
        data=captured_samples,
    )
    prepared.trainer.train()
    assert prepared.trainer.model.get_base_model().is_activation_checkpointing is expected


@pytest.mark.parametrize("is_mode", ["token_truncate", "token_mask"])  # lcap's IS figures, then TRL's own
def test_a_step_with_no_token_has_no_figures_and_no_warning(tiny_train_model, captured_samples, tmp_path, is_mode):
    """Issue #38: one of two steps trains on a group masked whole (cut by the token limit, --truncated mask). Its IS
    ratio is no figure (the round's min was 0, its mean halved), and the TensorBoard callback gets no None."""
    import logging

    rows = pq.read_table(captured_samples).to_pylist()
    first = rows[0]["group_id"]
    for row in rows:
        if row["group_id"] == first:
            row.update(env_mask=[0] * len(row["env_mask"]), truncated=True)
    data = write_samples(tmp_path / "data" / "samples.parquet", rows)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        options = TrainOptions(base_model=str(tiny_train_model), batch_size=4, is_mode=is_mode)  # to TensorBoard
        prepared = prepare_round(tmp_path / "run", 1, options, data=data)
        prepared.trainer.train()
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    steps = [h for h in prepared.trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    ratios = [h["sampling/importance_sampling_ratio/min"] for h in steps]
    assert ratios.count(None) == 1 and 0 not in ratios, ratios
    assert not [m for m in said if "attempting to log a value" in m], said


def test_the_builders_advantage_is_trained_as_is_not_recentred_per_group(tiny_train_model, tmp_path):
    """A batch baseline (`build-dataset --advantage batch`) can give one layout group advantages that are all
    positive; TRL's group centring would turn half of them negative. Every sample's log-prob must rise."""
    source = make_captured_samples(tiny_train_model, tmp_path / "src", n_groups=1, group_size=4, multi_turn=False)
    rows = pq.read_table(source).to_pylist()
    for row, advantage in zip(rows, (1.0, 0.6, 0.3, 0.2)):
        row.update(advantage=advantage, group_id="train/batch/0")
    data = write_samples(tmp_path / "data" / "samples.parquet", rows)
    prepared = prepare_round(tmp_path / "run", 1, train_options(tiny_train_model, learning_rate=3e-3), data=data)
    samples = prepared.groups.real_samples
    model = prepared.trainer.model
    before = [model_token_logp(model, s) for s in samples]
    prepared.trainer.train()
    model.eval()
    after = [model_token_logp(model, s) for s in samples]
    assert all(a > b for a, b in zip(after, before)), list(zip(after, before, [s.advantage for s in samples]))


@pytest.mark.parametrize(
    ("loss_type", "sample_weight", "weighted"),
    [("grpo", "episode", True), ("grpo", "sample", False), ("dapo", "episode", False)],
)
def test_the_samples_weight_scales_a_per_sequence_loss(
    tiny_train_model, captured_samples, tmp_path, monkeypatch, loss_type, sample_weight, weighted
):
    """`--sample-weight episode`: under the per-sequence loss (grpo) each sample's advantage reaching the loss is its
    builder's advantage times its `weight`, and a group of weight 0 moves nothing; `sample` and the token-level
    losses (dapo), which already count an episode's tokens once however it splits, train the advantage as built."""
    from safetensors.torch import load_file

    rows = pq.read_table(captured_samples).to_pylist()
    first = rows[0]["group_id"]
    for row in rows:
        row["weight"] = 0.0 if row["group_id"] == first else 0.5
    data = write_samples(tmp_path / "data" / "samples.parquet", rows)
    seen, _ = loss_inputs(monkeypatch)
    options = train_options(
        tiny_train_model, learning_rate=1e-3, batch_size=4, loss_type=loss_type, sample_weight=sample_weight
    )
    result = train_round(Store(tmp_path / "lcap.duckdb"), tmp_path / "run", 1, options, data=data)

    groups = {r["group_id"] for r in rows}
    expected = [
        [r["advantage"] * (r["weight"] if weighted else 1.0) for r in rows if r["group_id"] == g] for g in groups
    ]
    reached = [inputs["advantages"].flatten().tolist() for inputs in seen]  # one group per step
    rounded = lambda groups: sorted(sorted(round(a, 6) + 0.0 for a in g) for g in groups)  # noqa: E731 (+0.0: no -0.0)
    assert rounded(reached) == rounded(expected)
    assert any(a == 0 for step in reached for a in step) == weighted
    lora_b = {k: v for k, v in load_file(result.output / "adapter_model.safetensors").items() if "lora_B" in k}
    assert lora_b and any(v.abs().max() > 0 for v in lora_b.values())  # the second group, weight 0.5, trained
