"""The options of a training round, GRPO or SFT (`lcap train`, `lcap loop`): each flag's default and help, written
once."""

from __future__ import annotations

from dataclasses import dataclass

from lcap.cli_options import option
from lcap.config import LcapError

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# The mismatch guard's default limit, KL per token. benchmarks/bench_mismatch.py measures the right deployment
# (float32 on both sides, as on a CPU) and the failures the guard must catch on the tiny model; the limit leaves room for
# the bf16 kernels of a GPU, where vLLM and the trainer differ more (docs/architecture.md, "Train").
MISMATCH_MAX = 0.02
# A round's least trainable tokens: below it the round is refused, not trained on (nearly) nothing and deployed.
MIN_TOKENS = 1


@dataclass(frozen=True)
class TrainOptions:
    """Every knob of a GRPO round: `lcap train` and `lcap loop` read their flags, defaults and help from here."""

    base_model: str | None = option(
        None, flag="--model", help="Base model (HF path or name); default: the run's, else the policy server's."
    )
    full: bool = option(False, flag="--full", help="Full fine-tuning instead of a LoRA adapter.")
    sft: bool = option(
        False,
        flag="--sft",
        help="Supervised fine-tuning (TRL SFTTrainer) on `lcap build-dataset --format sft` samples instead of GRPO: "
        "cross-entropy on the captured ids where env_mask is 1 (the model's tokens), nothing else; the GRPO flags "
        "(loss, clip, importance sampling, mismatch guard) do not apply.",
    )
    loss_type: str = option("dapo", help=f"TRL loss: {', '.join(LOSS_TYPES)}.")
    sample_weight: str = option(
        "episode",
        help="episode: every episode weighs the same in the loss however many samples it split into (the "
        "samples' `weight`, 1/k, scales their advantages under the per-sequence losses grpo and sapo; the "
        "token-level losses already count an episode's tokens once). sample: each sample weighs 1.",
    )
    learning_rate: float = option(1e-5, flag="--lr", help="Learning rate.")
    beta: float = option(0.0, help="KL coefficient against the base model (0: no reference pass).")
    epochs: int = option(
        1, help="Passes over the round's samples, all clipped against the round's starting policy (TRL num_iterations)."
    )
    batch_size: int = option(
        0, help="Samples per optimiser step, whole groups (0: two groups; --sft: any samples, 0: eight)."
    )
    grad_accum: int = option(1, help="Gradient accumulation steps.")
    max_steps: int = option(-1, help="Stop after this many optimiser steps (-1: epochs decide).")
    epsilon: float = option(0.2, help="PPO clip range below 1 (and above, unless --epsilon-high).")
    epsilon_high: float | None = option(None, help="PPO clip range above 1 (default: --epsilon).")
    group_size: int | None = option(
        None, cli=False, help="Samples per GRPO group (default: the largest captured group)."
    )
    stale: str = option("correct", help="Samples from an older deployment: correct (importance sampling) or drop.")
    current: str | None = option(None, help="The deployment being trained (default: the policy server's current).")
    is_correction: bool = option(
        True, flag="--is/--no-is", help="Correct for the policy that served the samples (importance sampling)."
    )
    is_mode: str = option("token_truncate", help=f"Importance-sampling mode: {', '.join(IS_MODES)} (TRL).")
    is_max: float | None = option(2.0, help="Importance-ratio cap (truncate) or upper bound (mask).")
    is_min: float | None = option(None, help="Importance-ratio lower bound (mask modes).")
    min_tokens: int = option(
        MIN_TOKENS,
        help="Refuse to train a round with fewer trainable tokens than this (`lcap loop` skips the round: nothing to "
        "learn): completion tokens with loss mask 1 in samples with a nonzero advantage.",
    )
    mismatch_max: float = option(
        MISMATCH_MAX,
        help="Stop a round before its first step when, for a deployment that served its samples, the trainer's "
        "log-probs of the captured tokens are further from vLLM's than this KL per token (k3 estimate): the served "
        "model is not the one being trained. 0: never stop (still measured).",
    )
    mismatch_current_only: bool = option(
        False,
        cli=False,
        help="Hold only the deployment being trained (`current`) to --mismatch-max; the others are measured and "
        "recorded (`lcap loop --async`: an older deployment's KL includes the drift of the steps since it served).",
    )
    mismatch_samples: int = option(
        32, help="Samples per deployment the mismatch check scores with one no-grad forward (0: all)."
    )
    step_kl_samples: int = option(
        8,
        help="Samples the step KL scores after training, with the trained weights, of the deployment that served them "
        "(one no-grad forward: how far the round moved the policy; `lcap loop --max-step-kl` reads it). 0: not "
        "measured.",
    )
    lora_r: int = option(16, help="LoRA rank.")
    lora_alpha: int = option(32, help="LoRA alpha.")
    lora_target: str = option("all-linear", help="LoRA target modules (PEFT target_modules).")
    activation_checkpointing: bool | None = option(
        None,
        flag="--activation-checkpointing/--no-activation-checkpointing",
        help="Recompute activations in the backward pass (default: on a GPU, where memory is the limit; off on CPU).",
    )
    ray: str | None = option(
        None,
        help="Train on a Ray cluster with Ray Train (`lcap loop`: also collect on it): its address, `auto` (the "
        "cluster this machine belongs to, or RAY_ADDRESS), or `local` (start one for this command).",
    )
    num_workers: int = option(
        1,
        help="Training processes, each on its share of every batch (the batch stays --batch-size): Ray Train "
        "workers with --ray, or accelerate processes with --accelerate-config (default there: the config's).",
    )
    use_gpu: bool = option(False, flag="--use-gpu", help="One GPU per Ray Train worker (NCCL); else CPU (gloo).")
    cpus_per_worker: int = option(1, help="CPUs per Ray Train worker (its torch threads).")
    seed: int = option(0, help="Seed of the sample order and of LoRA's initialisation.")
    report_to: str = option("tensorboard", help="TRL report_to: tensorboard (offline), none, wandb...")
    logging_steps: int = option(1, cli=False, help="Optimiser steps between TRL's log records.")

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise LcapError(f"unknown --loss-type {self.loss_type!r}: use {', '.join(LOSS_TYPES)}")
        if self.sample_weight not in ("episode", "sample"):
            raise LcapError(f"--sample-weight must be episode or sample, not {self.sample_weight!r}")
        if self.is_mode not in IS_MODES:
            raise LcapError(f"unknown --is-mode {self.is_mode!r}: use {', '.join(IS_MODES)}")
        if self.stale not in ("correct", "drop"):
            raise LcapError(f"unknown --stale {self.stale!r}: use correct or drop")
        if self.num_workers < 1 or self.cpus_per_worker < 1:
            raise LcapError("--num-workers and --cpus-per-worker must be 1 or more")
        if self.use_gpu and self.ray is None:
            raise LcapError(
                "--use-gpu places Ray Train workers on GPUs: add --ray ADDRESS (accelerate's config picks its own)"
            )
        if self.full and self.ray is not None:
            raise LcapError(
                "--full with --ray: Ray ships the round's output back to this machine, which suits LoRA adapters, "
                "not full checkpoints; train those with --accelerate-config on a shared file system"
            )
        if self.min_tokens < 1:
            raise LcapError("--min-tokens must be 1 or more (a round with no trainable token trains nothing)")
        if self.sft and self.ray is not None:
            raise LcapError("--sft with --ray is not supported: train SFT rounds here or with --accelerate-config")
        if self.mismatch_max < 0 or self.mismatch_samples < 0 or self.step_kl_samples < 0:
            raise LcapError("--mismatch-max, --mismatch-samples and --step-kl-samples must be 0 or more")
