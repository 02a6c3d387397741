"""One SFT round on supervised samples: `lcap train --sft --round N --run RUN`.

The samples are `lcap build-dataset --format sft`'s, already tokenised: a teacher's calls re-rendered with the
student's template, the policy's own calls with their captured ids. TRL's `SFTTrainer` trains on those ids as they
are (no chat template applied again): the labels are the completion's ids where `env_mask` is 1 (the tokens the
model produced) and -100 everywhere else (prompt, tool results, template tokens between calls), so the loss is the
mean cross-entropy of the model's own tokens only.

A round writes the run layout of a GRPO round (grpo.py) and its train_runs row, so `lcap deploy` serves it and the
next round, GRPO or SFT, continues from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lcap.config import LcapError
from lcap.store import now
from lcap.train.fit import (
    FittedRound,
    RoundInputs,
    is_main_process,
    quiet_training,
    round_name,
    round_policy,
    throughput,
    train_and_save,
    trainer_args,
    world_size,
)
from lcap.train.grpo import TrainResult, record_round, round_dir, round_inputs
from lcap.train.options import TrainOptions
from lcap.train.progress import step_progress
from lcap.train.samples import Sample, read_samples

IGNORE = -100  # the label transformers' cross-entropy leaves out

DEFAULT_BATCH = 8
# The most one forward's logits may hold (rows x longest sample x vocabulary, float32): past it a step's samples go
# through in micro-batches whose gradients accumulate, so a step's memory does not grow with its batch.
LOGITS_BYTES = 128 << 20


def micro_batch(rows: int, longest: int, vocab: int, budget: int) -> int:
    """The largest divisor of `rows` (a step's samples on one process) whose logits fit in `budget` bytes; 1 at
    least."""
    fits = max(1, budget // max(1, longest * vocab * 4))
    return max(d for d in range(1, rows + 1) if rows % d == 0 and d <= fits)


def sft_example(sample: Sample) -> dict[str, list[int]]:
    """A sample as SFTTrainer's pre-tokenised row: all its ids, and labels on the model's own tokens only."""
    labels = [IGNORE] * len(sample.prompt_ids) + [
        token if mask else IGNORE for token, mask in zip(sample.completion_ids, sample.env_mask, strict=True)
    ]
    return {"input_ids": list(sample.prompt_ids) + list(sample.completion_ids), "labels": labels}


@dataclass
class PreparedSft:
    trainer: Any
    samples: list[Sample]  # the ones with a token to learn
    skipped: int  # samples with no masked-in token
    kind: str
    out_dir: Path


def prepare_sft(inputs: RoundInputs, out_dir: Path, options: TrainOptions) -> PreparedSft:
    """Everything up to `trainer.train()`: the samples as labelled ids, the policy, TRL's SFTTrainer."""
    # the train extra
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    every = read_samples(inputs.samples)
    samples = [s for s in every if any(s.env_mask)]
    where = round_name(out_dir)
    if not samples:
        shown = inputs.shown(out_dir).samples
        raise LcapError(
            f"{where}: no sample in {shown} has a token the model produced (env_mask 1) to learn "
            f"({len(every)} samples): build it with `lcap build-dataset --format sft`"
        )
    processes = world_size()
    batch = options.batch_size or DEFAULT_BATCH
    batch = max(processes, min(batch, math.ceil(len(samples) / processes) * processes))
    batch = math.ceil(batch / processes) * processes
    steps_per_epoch = math.ceil(len(samples) / (batch * options.grad_accum))
    max_steps = steps_per_epoch * options.epochs
    if options.max_steps > 0:
        max_steps = min(max_steps, options.max_steps)

    policy = round_policy(inputs, out_dir, options)
    rows = batch // processes
    longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    micro = micro_batch(rows, longest, policy.model.config.vocab_size, LOGITS_BYTES)
    shared = trainer_args(out_dir, options, policy.on_gpu)
    args = SFTConfig(
        **{**shared, "gradient_accumulation_steps": shared["gradient_accumulation_steps"] * (rows // micro)},
        max_steps=max_steps,
        per_device_train_batch_size=micro,
        max_length=None,  # the captured ids as they are: a cut sample would lose its last tokens' labels
        dataset_kwargs={"skip_prepare_dataset": True},  # ids and labels are ready; no template, no truncation
    )
    trainer = SFTTrainer(
        model=policy.model,
        args=args,
        train_dataset=Dataset.from_list([sft_example(s) for s in samples]),
        processing_class=policy.tokenizer,
        peft_config=policy.peft_config,
    )
    trainer.remove_callback(PrinterCallback)
    return PreparedSft(trainer, samples, len(every) - len(samples), policy.kind, out_dir)


def fit_sft(inputs: RoundInputs, out_dir: Path, options: TrainOptions, *, progress: bool = False) -> FittedRound:
    """Train the SFT round in this process; rank 0 saves the adapter or checkpoint in OUT_DIR as GRPO's does."""
    quiet_training()
    p = prepare_sft(inputs, out_dir, options)
    p.trainer.add_callback(step_progress(f"train {round_name(out_dir)} (sft)", show=progress))
    trainer = p.trainer
    output, seconds = train_and_save(trainer, out_dir, p.kind)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and not math.isnan(h["loss"])]
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in p.samples)
    passes = trainer.state.global_step * trainer.args.per_device_train_batch_size * trainer.accelerator.num_processes
    passes = passes * trainer.args.gradient_accumulation_steps / len(p.samples)
    metrics: dict[str, Any] = dict(
        n_samples=len(p.samples),
        mean_reward=sum(s.reward for s in p.samples) / len(p.samples),
        loss=sum(losses) / len(losses) if losses else None,
        **throughput(trainer, tokens, passes, seconds),
    )
    # no mismatch figures: the guard compares served logprobs with the trainer's; a teacher's calls have none of ours
    return FittedRound.of(trainer, output, p.kind, metrics, [])


def sft_round(
    store,
    run: Path,
    round: int,
    options: TrainOptions = TrainOptions(sft=True),
    *,
    data: Path | None = None,
    progress: bool = False,
    role: str | None = None,
) -> TrainResult:
    """Train round `round` with SFT on its samples (RUN/round-N/data or `data`); record it as a GRPO round is.
    `role`: role R's adapter alone, in RUN/round-N/role-R, as a GRPO round of a role."""
    if options.ray is not None:
        raise LcapError("--sft with --ray is not supported: train SFT rounds here or with --accelerate-config")
    run = Path(run)
    started_at = now()
    inputs = round_inputs(run, round, options, data, role=role)
    fitted = fit_sft(inputs, round_dir(run, round, role), options, progress=progress)
    if is_main_process():
        record_round(store, run, round, inputs, fitted, options, started_at, role)
    return TrainResult(round=round, output=fitted.output, kind=fitted.kind, metrics=fitted.metrics)
