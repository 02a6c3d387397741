"""GRPO's groups: short groups padded, stale samples dropped or kept (training: tests/e2e/test_train_grpo.py)."""

from __future__ import annotations

import math

from lcap.train.samples import Sample, make_groups


def sample(gid: str, k: int, deployment: str = "r1", reward: float = 0.0) -> Sample:
    return Sample(
        sample_id=f"{gid}-{k}",
        group_id=gid,
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-1.0, -1.0],
        env_mask=[1, 1],
        reward=reward,
        advantage=reward - 0.5,
        deployment=deployment,
    )


def test_groups_pad_short_groups_and_drop_or_keep_stale():
    samples = [sample("a", k, reward=k % 2) for k in range(4)] + [
        sample("b", 0, "r0"),
        sample("b", 1),
        sample("b", 2, "r0"),
        sample("c", 0),
    ]
    groups = make_groups(samples, stale="correct", current="r1")
    assert groups.size == 4 and set(groups.groups) == {"a", "b"} and groups.dropped_alone == 1
    padded = [s for s in groups.groups["b"] if s.padding]
    assert len(padded) == 1 and padded[0].advantage == 0.0 and set(padded[0].env_mask) == {0}

    dropped = make_groups(samples, stale="drop", current="r1")
    assert dropped.dropped_stale == 2 and set(dropped.groups) == {"a"}  # b keeps one sample: no signal
    assert math.isclose(dropped.mean_reward(), 0.5)


def test_token_count_names_each_cause_and_the_refusal_its_flag():
    from dataclasses import replace

    from lcap.train.fit import too_few_tokens
    from lcap.train.samples import count_tokens

    trainable = [sample("a", k, reward=k % 2) for k in range(2)]
    truncated = [replace(sample("b", k, reward=k % 2), env_mask=[0, 0], truncated=True) for k in range(3)]
    zero = [replace(sample("c", k), advantage=0.0) for k in range(2)]
    masked = [replace(sample("d", 0), env_mask=[0, 0])]
    count = count_tokens(trainable + truncated + zero + masked + [trainable[0].pad_copy()])
    assert (count.trainable, count.samples, count.truncated, count.zero_variance, count.masked) == (4, 8, 3, 2, 1)
    assert too_few_tokens("round 2", count, 4) is None
    line = too_few_tokens("round 2", count, 5)
    assert line is not None and line.startswith("round 2: not trained: 4 trainable tokens, fewer than --min-tokens 5")
    assert "3 of 8 samples hit the token limit" in line and "2 of 8 samples have advantage 0" in line
    assert "1 of 8 samples have every completion token masked" in line and line.endswith("changes the minimum")


class _OneProcess:
    def gather(self, t):
        return t.reshape(1)


def test_importance_ratio_figures_over_no_token_are_nan_not_zero():
    """A step whose every token is masked has no IS ratio: NaN (left out of the round's mean, shown `-`), not 0."""
    from collections import defaultdict

    import torch

    from lcap.display import num
    from lcap.train.fit import _round_metrics
    from lcap.train.trainer import CapturedGRPOTrainer

    trainer = CapturedGRPOTrainer.__new__(CapturedGRPOTrainer)
    trainer._metrics = {"train": defaultdict(list)}
    trainer.accelerator = _OneProcess()
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = None, 2.0
    logps = torch.full((2, 3), -1.0)
    for mask in (torch.ones(2, 3), torch.zeros(2, 3)):  # a step with tokens (ratio 1), then one with none
        trainer._truncated_is_ratio(logps, {"completion_mask": mask, "sampling_per_token_logps": logps.clone()})
    figures = trainer._metrics["train"]
    assert figures["sampling/importance_sampling_ratio/mean"][0] == 1.0
    assert math.isnan(figures["sampling/importance_sampling_ratio/mean"][1])
    history = [{k: v[i] for k, v in figures.items()} for i in range(2)]
    metrics = _round_metrics(history)
    assert (metrics["is_ratio_mean"], metrics["is_ratio_min"], metrics["is_ratio_max"]) == (1.0, 1.0, 1.0)
    assert num(math.nan) == "-" and num(_round_metrics(history[1:])["is_ratio_mean"]) == "-"


def test_callbacks_are_not_given_figures_that_do_not_exist():
    """TRL logs a figure over no value as None; transformers' TensorBoard callback warned of each, every round."""
    import logging
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import CallbackHandler

    from lcap.train.trainer import _without_none

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    board = TensorBoardCallback.__new__(TensorBoardCallback)  # its writer: what it was given, no event files
    written: list[str] = []
    board.tb_writer = SimpleNamespace(add_scalar=lambda k, v, step: written.append(k), flush=lambda: None)
    try:
        callbacks = CallbackHandler([board], None, None, None, None)
        logs = {"loss": 0.5, "sampling/importance_sampling_ratio/mean": None}
        _without_none(callbacks.on_log)(None, TrainerState(), TrainerControl(), dict(logs))
        assert written == ["train/loss"] and not [m for m in said if "attempting to log a value" in m], said
        callbacks.on_log(None, TrainerState(), TrainerControl(), dict(logs))  # unwrapped: the warning this removes
        assert [m for m in said if "attempting to log a value" in m]
    finally:
        logger.removeHandler(handler)
