"""Training one round in this process: the samples as GRPO groups, the policy (LoRA or full), TRL's trainer, the
mismatch guard, and the round's figures.

`lcap train` runs it here, or as each worker of a Ray Train run (ray_train.py); grpo.py resolves a round's inputs
and records what it left.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lcap.config import LcapError
from lcap.dataset import Cause, explain, plural
from lcap.files import atomic_write
from lcap.noise import quiet_noise
from lcap.progress import Reporter
from lcap.train.mismatch import Mismatch, check_mismatch, measure_mismatch, pick_samples
from lcap.train.options import TrainOptions
from lcap.train.progress import alone_text, step_progress
from lcap.train.samples import Groups, TokenCount, count_tokens, make_groups, read_samples, weighted


class NothingToLearn(LcapError):
    """A round whose episodes ran well but teach nothing: every group got the same reward, or fewer trainable tokens
    than --min-tokens. `lcap train` refuses it (exit 2, as any LcapError); `lcap loop` records the round as skipped
    and goes on with the deployment it has. `reason`: the short cause the loop prints."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def equal_rewards(report: Any) -> str | None:
    """The reason "every group got the same reward (8 of 8)" when build-dataset's report (report.json's dict) found
    groups and each had two or more rewarded samples with one reward (GRPO learns nothing from it); else None."""
    groups = (report or {}).get("groups") or {}
    total, equal = groups.get("total", 0), groups.get("zero_variance", 0)  # groups of two or more, singletons apart
    if total and equal == total and not (report.get("options") or {}).get("keep_zero_variance"):
        return f"every group got the same reward ({equal} of {total})"
    return None


def read_report(data: Path) -> dict | None:
    """build-dataset's report.json in the folder `data`, or None when there is none to read."""
    try:
        report = json.loads((Path(data) / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def nothing_to_train(where: str, samples_path: Path, samples: list, groups: Any, current: str | None) -> str:
    """Why a round has no group GRPO can train on: build-dataset's losses (from the report.json beside the samples)
    and the trainer's own (stale samples dropped, samples alone in their group), with what changes each."""
    report = read_report(Path(samples_path).parent)
    n_samples = len(samples)
    extra = []
    if groups.dropped_stale:
        extra.append(
            Cause(
                f"{groups.dropped_stale} of {n_samples} samples were served by another deployment than {current} and "
                "dropped (--stale drop)",
                "train with --stale correct (importance-corrected, the default)",
            )
        )
    if groups.dropped_alone:
        extra.append(
            Cause(alone_text(groups.dropped_alone), "undo what left them alone, or collect with a larger --group-size")
        )
    n_groups = len({s.group_id for s in samples})
    head = (
        f"{where}: no group with two or more usable samples in {samples_path} "
        f"({plural(n_samples, 'sample')} in {plural(n_groups, 'group')})"
    )
    if report is None and not extra:
        return f"{head}: no report.json beside it says why (build it with `lcap build-dataset`)"
    return f"{head}: {explain(report, extra=extra)}"


def too_few_tokens(where: str, count: TokenCount, minimum: int) -> str | None:
    """Why a round must not be trained: fewer trainable tokens than `minimum` (--min-tokens), each cause counted
    with what changes it; None when it has enough."""
    if count.trainable >= minimum:
        return None
    found = []
    if count.truncated:
        found.append(
            Cause(
                f"{count.truncated} of {count.samples} samples hit the token limit and every token of theirs is "
                "masked (build-dataset --truncated mask)",
                "raise the agent's max_tokens, or build with --truncated keep",
            )
        )
    if count.zero_variance:
        found.append(
            Cause(
                f"{count.zero_variance} of {count.samples} samples have advantage 0 (every sample of their group got "
                "the same reward, kept by --keep-zero-variance)",
                "a larger --group-size, tasks of mixed difficulty or a graded verifier",
            )
        )
    if count.masked:
        found.append(
            Cause(
                f"{count.masked} of {count.samples} samples have every completion token masked (tool or environment "
                "tokens)",
                "see their env_mask in samples.parquet",
            )
        )
    why = "; ".join(str(c) for c in found) or f"{count.samples} samples give {count.trainable} tokens in all"
    return (
        f"{where}: not trained: {plural(count.trainable, 'trainable token')}, fewer than --min-tokens {minimum}: "
        f"{why}; --min-tokens N changes the minimum"
    )


def check_trainable(inputs: RoundInputs, out_dir: Path, options: TrainOptions) -> Groups:
    """The round's samples as GRPO groups, or a one-line error when it has no usable group or too few trainable
    tokens (before any model is loaded: a round that would train on nothing is neither trained nor deployed)."""
    samples = weighted(read_samples(inputs.samples), options.sample_weight, options.loss_type)
    groups = make_groups(samples, group_size=options.group_size, stale=options.stale, current=inputs.current)
    where = round_name(out_dir)
    if not groups.groups:
        message = nothing_to_train(where, inputs.shown(out_dir).samples, samples, groups, inputs.current)
        equal = equal_rewards(read_report(Path(inputs.samples).parent))
        if equal and not groups.dropped_stale and not groups.dropped_alone:
            raise NothingToLearn(message, equal)
        raise LcapError(message)
    count = count_tokens(groups.samples)
    refusal = too_few_tokens(where, count, options.min_tokens)
    if refusal:
        raise NothingToLearn(
            refusal, f"{plural(count.trainable, 'trainable token')}, fewer than --min-tokens {options.min_tokens}"
        )
    return groups


ROLE_FOLDER = "role-"  # RUN/round-N/role-R: role R's round (grpo.py's layout)


def round_folder(out_dir: Path) -> str:
    """The folder of the round written to `out_dir`, under its run: round-3, or round-3/role-planner for a role's."""
    return f"{out_dir.parent.name}/{out_dir.name}" if out_dir.name.startswith(ROLE_FOLDER) else out_dir.name


def round_name(out_dir: Path) -> str:
    """How messages name the round written to `out_dir` (RUN/round-3: "round 3"; RUN/round-3/role-planner:
    "round 3 role planner")."""
    round, _, role = round_folder(out_dir).partition(f"/{ROLE_FOLDER}")
    return round.replace("-", " ") + (f" role {role}" if role else "")


def world_size() -> int:
    """The training processes this one belongs to, as its launcher (torchrun, accelerate, DeepSpeed, Ray Train) said."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Rank 0 of a launch, or a process launched alone: the one that writes the run folder and the store."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass(frozen=True)
class UserPaths:
    """Where the user finds a round's inputs and files when it trains on copies of them elsewhere (a Ray worker's
    scratch folder, gone by the time anyone reads the error): what errors name."""

    samples: Path
    init_from: Path | None
    round_dir: Path  # RUN/round-N on the machine `lcap train` runs on


@dataclass(frozen=True)
class RoundInputs:
    """What a round trains from, resolved once where the command runs; a Ray worker gets these, not the run folder."""

    base_model: str
    samples: Path
    init_from: Path | None  # the previous round's adapter or checkpoint
    current: str | None  # the deployment being trained (samples another one served are stale)
    user_paths: UserPaths | None = None  # None: these paths are the user's own

    def shown(self, out_dir: Path) -> UserPaths:
        """The paths to name to the user for these inputs and a round written to `out_dir`."""
        return self.user_paths or UserPaths(self.samples, self.init_from, out_dir)


@dataclass
class PreparedRound:
    trainer: Any
    groups: Any
    inputs: RoundInputs
    kind: str
    batch: int  # samples per optimiser step, all processes together
    out_dir: Path


def prepare(inputs: RoundInputs, out_dir: Path, options: TrainOptions) -> PreparedRound:
    """The round's trainer in this process; with several processes, each trains on its share of every batch.

    The batch (`--batch-size` samples, whole groups) is the same for any number of processes: each one
    takes `batch / processes` consecutive samples of it, and DDP averages their gradients, so one process
    and N take the same optimiser steps on the same samples (tests/e2e/test_train_distributed.py).
    """
    # the train extra
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from lcap.train.trainer import CapturedGRPOTrainer, captured_advantage, captured_rollout

    groups = check_trainable(inputs, out_dir, options)
    size = groups.size
    processes = world_size()
    # A batch is whole groups (an advantage is a group's), split evenly over the processes: DDP's average of
    # their gradients is the batch's gradient only when every process holds as many samples.
    unit = math.lcm(size, processes)
    batch = options.batch_size or 2 * size
    batch = max(unit, math.ceil(batch / unit) * unit)
    batch = min(batch, math.ceil(len(groups.groups) * size / unit) * unit)  # few usable groups still make a step
    # The group count is padded (zero-weight groups) to whole optimiser steps.
    groups.pad_to_multiple(batch // size * options.grad_accum)
    micro_batches = len(groups.groups) * size // batch
    if options.epochs > 1:
        # PPO-style passes: the whole round is one TRL "generation". Old logps are taken once, from the
        # policy the round starts from, so PPO's clip bounds the drift over every step and pass of the
        # round, and the IS ratio compares that policy with the captured behaviour logprobs.
        steps_per_generation = micro_batches
    else:
        # Each sample is trained on once: every optimiser step is its own TRL "generation" (TRL's
        # default). PPO's ratio is 1, and the truncated IS ratio of the step's own policy against the
        # behaviour logprobs corrects for the deployment that served the samples and for the round's
        # earlier steps; it comes from the loss forward, no extra pass (trainer.py, departure 4).
        steps_per_generation = options.grad_accum
    max_steps = micro_batches * options.epochs // options.grad_accum
    if options.max_steps > 0:
        max_steps = min(max_steps, options.max_steps)

    policy = round_policy(inputs, out_dir, options)
    args = GRPOConfig(
        **trainer_args(out_dir, options, policy.on_gpu),
        beta=options.beta,
        loss_type=options.loss_type,
        max_steps=max_steps,
        steps_per_generation=steps_per_generation,
        per_device_train_batch_size=batch // processes,
        num_generations=size,
        num_iterations=options.epochs,
        epsilon=options.epsilon,
        epsilon_high=options.epsilon_high,
        scale_rewards="none",
        vllm_importance_sampling_correction=options.is_correction,
        vllm_importance_sampling_mode=options.is_mode,
        vllm_importance_sampling_clip_max=options.is_max,
        vllm_importance_sampling_clip_min=options.is_min,
        max_completion_length=max(len(s.completion_ids) for s in groups.samples),
        shuffle_dataset=True,
        log_completions=False,
    )
    trainer = CapturedGRPOTrainer(
        model=policy.model,
        reward_funcs=[captured_advantage],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": list(groups.groups)}),
        processing_class=policy.tokenizer,
        peft_config=policy.peft_config,
        rollout_func=captured_rollout(groups),
        off_policy_correction=options.is_correction,
    )
    if trainer.accelerator.num_processes != processes:
        raise RuntimeError(
            f"accelerate sees {trainer.accelerator.num_processes} processes, the launcher WORLD_SIZE={processes}"
        )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts go to TensorBoard and train_runs, not the terminal
    return PreparedRound(trainer, groups, inputs, policy.kind, batch, out_dir)


@dataclass
class FittedRound:
    """What training a round left on rank 0: its adapter or checkpoint and its figures."""

    output: Path
    kind: str
    metrics: dict[str, Any]
    device: str
    processes: int
    mismatch: list[dict[str, Any]]  # the guard's figures per deployment (lcap.train.mismatch)

    @classmethod
    def of(cls, trainer: Any, output: Path, kind: str, metrics: dict[str, Any], mismatch: list) -> FittedRound:
        """What `trainer` left in `output`, with the device and processes it trained on."""
        device, processes = str(trainer.accelerator.device), trainer.accelerator.num_processes
        return cls(output, kind, metrics, device, processes, mismatch)


def fit_round(inputs: RoundInputs, out_dir: Path, options: TrainOptions, *, progress: bool = False) -> FittedRound:
    """Train the round in this process (one of `world_size()`); rank 0 saves the adapter or checkpoint in OUT_DIR."""
    quiet_training()
    shown = Reporter(f"train {round_name(out_dir)}", show=progress, counted=False, doing="loading the policy")
    with shown if is_main_process() else nullcontext():  # lines at rank 0 only
        p = prepare(inputs, out_dir, options)
        shown.step("measuring the starting policy against the served logprobs (the mismatch guard)")
        mismatch = guard_round(p, options)
        shown.doing = "ready: training"
    p.trainer.add_callback(step_progress(f"train {round_name(out_dir)}", show=progress))
    trainer, groups = p.trainer, p.groups
    output, seconds = train_and_save(trainer, out_dir, p.kind)
    shown = Reporter(f"train {round_name(out_dir)}", show=progress, counted=False, doing="measuring its step KL")
    with shown if is_main_process() and options.step_kl_samples else nullcontext():
        moved = step_kl(p, options)

    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in groups.samples)
    passes = (
        trainer.state.global_step * p.batch * trainer.args.gradient_accumulation_steps / max(len(groups.samples), 1)
    )
    # (with epochs > 1, +1 no-grad forward per sample for the old/IS logps, not counted: tokens/s is training tokens)
    metrics = _round_metrics(trainer.state.log_history)
    metrics.update(
        n_samples=len(groups.real_samples),
        n_groups=len(groups.groups),
        group_size=groups.size,
        dropped_stale=groups.dropped_stale,
        dropped_alone=groups.dropped_alone,
        padded=groups.padded,
        mean_reward=groups.mean_reward(),
        **throughput(trainer, tokens, passes, seconds),
    )
    metrics.update(mismatch.metrics(), step_kl=moved)
    return FittedRound.of(trainer, output, p.kind, metrics, mismatch.details())


def quiet_training() -> None:
    """No transformers bars over loading and saving weights (the round has its own bar), nor library noise."""
    from transformers.utils.logging import disable_progress_bar  # the train extra

    disable_progress_bar()
    quiet_noise()


def train_and_save(trainer: Any, out_dir: Path, kind: str) -> tuple[Path, float]:
    """Train, then save the adapter or checkpoint (`kind` full) in OUT_DIR: (where it went, seconds trained)."""
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    output = out_dir / ("checkpoint" if kind == "full" else "adapter")
    trainer.save_model(str(output))  # every process calls it (a collective under FSDP and ZeRO-3); rank 0 writes
    if kind == "full" and trainer.accelerator.is_main_process:
        trainer.processing_class.save_pretrained(str(output))
    return output, seconds


def throughput(trainer: Any, tokens: int, passes: float, seconds: float) -> dict[str, Any]:
    """A round's last figures: the tokens trained on (`tokens` over `passes` passes), time, rate and steps."""
    return dict(
        tokens=int(tokens * passes),
        train_seconds=seconds,
        tokens_per_s=tokens * passes / seconds if seconds else None,
        steps=trainer.state.global_step,
    )


def guard_round(p: PreparedRound, options: TrainOptions) -> Mismatch:
    """The mismatch guard (lcap.train.mismatch): measure the round's starting policy against the captured
    logprobs, write OUT_DIR/mismatch.json, and stop the round with a one-line error past the limit."""
    mismatch = measure_mismatch(
        p.trainer,
        p.groups.real_samples,
        per_deployment=options.mismatch_samples,
        seed=options.seed,
        held=p.inputs.current if options.mismatch_current_only else None,
    )
    path = p.out_dir / "mismatch.json"
    # Every process writes it, whole or not at all: on Ray each worker has a folder of its own, and the driver
    # gets the figures from whichever worker's error reaches it first.
    report = {"limit": options.mismatch_max, "held": mismatch.held, "unchecked": mismatch.unchecked()}
    atomic_write(path, json.dumps({**report, "deployments": mismatch.details()}, indent=2))
    shown = p.inputs.shown(p.out_dir)
    policy = str(shown.init_from) if shown.init_from else f"the base model {p.inputs.base_model}"
    where = round_name(p.out_dir)
    check_mismatch(mismatch, options.mismatch_max, where=where, policy=policy, details=str(shown.round_dir / path.name))
    return mismatch


def step_kl(p: PreparedRound, options: TrainOptions) -> float | None:
    """How far the round moved the policy: the mismatch guard's measure taken again with the trained weights, on
    --step-kl-samples samples of the deployment being trained (`current`), or, where the round has none of its
    samples (or `current` is unknown), of each deployment, the worst (its KL includes the drift since it served).
    Its KL(served || trained) per token is the round's step: None when not measured (--step-kl-samples 0) or no
    sample has a model token with served logprobs; inf when the trained weights score none of them (NaN)."""
    if not options.step_kl_samples:
        return None
    held = p.inputs.current
    samples = [s for s in p.groups.real_samples if s.deployment == held] or p.groups.real_samples
    picked = pick_samples(samples, options.step_kl_samples, options.seed)
    if not picked:
        return None
    moved = measure_mismatch(p.trainer, samples, per_deployment=options.step_kl_samples, seed=options.seed)
    worst = moved.worst
    return worst.kl if worst else math.inf


@dataclass
class RoundPolicy:
    """What a GRPO or an SFT round trains: the model, its LoRA config (None: ready as it is), its kind (lora or
    full), its tokenizer, and whether it is on a GPU (bf16 there, fp32 on a CPU)."""

    model: Any
    peft_config: Any
    kind: str
    tokenizer: Any
    on_gpu: bool


def round_policy(inputs: RoundInputs, out_dir: Path, options: TrainOptions) -> RoundPolicy:
    """The round's policy, loaded alike for GRPO and SFT rounds; `out_dir` made."""
    import torch  # the train extra
    from transformers import AutoTokenizer

    on_gpu = torch.cuda.is_available()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(inputs.base_model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model, peft_config, kind = load_policy(inputs.base_model, inputs.init_from, options, dtype)
    return RoundPolicy(model, peft_config, kind, tokenizer, on_gpu)


def trainer_args(out_dir: Path, options: TrainOptions, on_gpu: bool) -> dict[str, Any]:
    """The TrainingArguments a GRPO and an SFT round share."""
    return dict(
        output_dir=str(out_dir / "trainer"),
        use_cpu=not on_gpu,
        bf16=on_gpu,
        activation_checkpointing=on_gpu
        if options.activation_checkpointing is None
        else options.activation_checkpointing,
        learning_rate=options.learning_rate,
        gradient_accumulation_steps=options.grad_accum,
        report_to=options.report_to,
        logging_steps=options.logging_steps,
        save_strategy="no",
        seed=options.seed,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # every trainable parameter takes part in every forward
        disable_tqdm=True,
    )


def load_policy(base_model: str, init_from: Path | None, options: TrainOptions, dtype):
    """The model to train: the previous round's policy when there is one, else the base; with its LoRA config
    (None: the model is ready as it is) and its kind, lora or full."""
    from transformers import AutoModelForCausalLM  # the train extra

    if options.full:
        source = str(init_from) if init_from and init_from.name == "checkpoint" else base_model
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype), None, "full"
    from peft import LoraConfig, PeftModel  # the train extra

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if init_from is not None and (init_from.name == "adapter" or (init_from / "adapter_config.json").is_file()):
        return PeftModel.from_pretrained(base, str(init_from), is_trainable=True), None, "lora"
    config = LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        lora_dropout=0.0,
        target_modules=options.lora_target,
        task_type="CAUSAL_LM",
    )
    return base, config, "lora"


def _round_metrics(history: list[dict[str, Any]]) -> dict[str, float | None]:
    """Average TRL's per-step logs into one row: loss, KL, IS ratio, clip fraction, entropy."""
    keys = {
        "loss": "loss",
        "kl": "kl",
        "entropy": "entropy",
        "clip_fraction": "clip_ratio/region_mean",
        "is_ratio_mean": "sampling/importance_sampling_ratio/mean",
        "is_ratio_min": "sampling/importance_sampling_ratio/min",
        "is_ratio_max": "sampling/importance_sampling_ratio/max",
    }
    out: dict[str, float | None] = {}
    for name, key in keys.items():
        values = [h[key] for h in history if key in h and h[key] is not None and not math.isnan(h[key])]
        if not values:
            out[name] = None
        elif name == "is_ratio_min":
            out[name] = min(values)
        elif name == "is_ratio_max":
            out[name] = max(values)
        else:
            out[name] = sum(values) / len(values)
    return out
