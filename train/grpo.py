"""One GRPO round on captured samples: `lcap train --round N --run RUN`.

Layout of a run folder, one sub-folder per round:

    RUN/run.json                  the base model the run was started on
    RUN/round-N/data/             the dataset this round trained on (samples.parquet, from build_dataset)
    RUN/round-N/adapter/          the LoRA adapter (default) or RUN/round-N/checkpoint/ (--full)
    RUN/round-N/config.json       every option, resolved paths, library versions
    RUN/round-N/trainer/runs/     TRL's tensorboard logs (offline)

Each round continues the policy of the round before it (its adapter or checkpoint), so round N's
output is exactly what `lcap deploy` serves for round N+1's collection.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lcap.config import LcapError
from lcap.train.options import TrainOptions

if TYPE_CHECKING:
    from lcap.train.mismatch import Mismatch


@dataclass
class TrainResult:
    round: int
    output: Path
    kind: str
    metrics: dict[str, Any] = field(default_factory=dict)


def round_dir(run: Path, round: int) -> Path:
    return Path(run) / f"round-{round}"


def round_output(run: Path, round: int) -> Path | None:
    """The adapter or checkpoint a finished round left, or None."""
    for name in ("adapter", "checkpoint"):
        path = round_dir(run, round) / name
        if (path / "adapter_config.json").exists() or (path / "config.json").exists():
            return path
    return None


def resolve_base_model(run: Path, base_model: str | None) -> str:
    """The run's base model: the flag, else RUN/run.json, else the policy server's; recorded in RUN/run.json."""
    run_json = Path(run) / "run.json"
    recorded = json.loads(run_json.read_text()) if run_json.exists() else {}
    if base_model is None:
        base_model = recorded.get("base_model")
    if base_model is None:
        from lcap.policy import read_policy

        policy = read_policy()
        base_model = policy.base_model if policy else None
    if base_model is None:
        raise LcapError("no base model: pass --model, or start the policy server (`lcap serve`) first")
    if recorded.get("base_model") not in (None, base_model):
        raise LcapError(f"run {run} was started on {recorded['base_model']}, not {base_model}")
    if not recorded:
        run_json.parent.mkdir(parents=True, exist_ok=True)
        run_json.write_text(json.dumps({"base_model": base_model}, indent=2))
    return base_model


def round_samples(run: Path, round: int, data: Path | None) -> Path:
    """The samples file this round trains on: --data, else RUN/round-N/data/samples.parquet (from build-dataset)."""
    if data is not None:
        path = Path(data)
        return path if path.suffix == ".parquet" else path / "samples.parquet"
    out = round_dir(run, round) / "data"
    if not (out / "samples.parquet").exists():
        raise LcapError(
            f"round {round} has no dataset in {out}: run `lcap build-dataset --round {round} --out {out}` "
            "first (or pass --data)"
        )
    return out / "samples.parquet"


def accelerate_command(config: str, argv: list[str]) -> list[str]:
    """The `accelerate launch` command that reruns `lcap train ARGV` on every process of CONFIG."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "lcap", *argv]


@dataclass
class PreparedRound:
    trainer: Any
    groups: Any
    base_model: str
    init_from: Path | None
    kind: str
    samples_path: Path
    current: str | None
    batch: int


def prepare_round(run: Path, round: int, options: TrainOptions, data: Path | None = None) -> PreparedRound:
    """Everything up to `trainer.train()`: the samples as groups, the policy, the TRL trainer."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from lcap.train.samples import make_groups, read_samples
    from lcap.train.trainer import CapturedGRPOTrainer, captured_advantage, captured_rollout

    run = Path(run)
    base_model = resolve_base_model(run, options.base_model)
    samples_path = round_samples(run, round, data)
    current = options.current
    if current is None:
        from lcap.policy import read_policy

        policy = read_policy()
        current = policy.current if policy else None
    groups = make_groups(
        read_samples(samples_path), group_size=options.group_size, stale=options.stale, current=current
    )
    if not groups.groups:
        raise LcapError(f"round {round}: no group with two or more usable samples in {samples_path}")
    size = groups.size
    batch = options.batch_size or 2 * size
    batch = max(size, math.ceil(batch / size) * size)
    batch = min(batch, len(groups.groups) * size)  # a round with few usable groups still makes one step
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

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    init_from = round_output(run, round - 1) if round > 1 else None
    out_dir = round_dir(run, round)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model, peft_config, kind = _load_policy(base_model, init_from, options, dtype)

    args = GRPOConfig(
        output_dir=str(out_dir / "trainer"),
        use_cpu=not on_gpu,
        bf16=on_gpu,
        activation_checkpointing=on_gpu
        if options.activation_checkpointing is None
        else options.activation_checkpointing,
        learning_rate=options.learning_rate,
        beta=options.beta,
        loss_type=options.loss_type,
        max_steps=max_steps,
        steps_per_generation=steps_per_generation,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=options.grad_accum,
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
        report_to=options.report_to,
        logging_steps=options.logging_steps,
        save_strategy="no",
        seed=options.seed,
        shuffle_dataset=True,
        log_completions=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = CapturedGRPOTrainer(
        model=model,
        reward_funcs=[captured_advantage],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": list(groups.groups)}),
        processing_class=tokenizer,
        peft_config=peft_config,
        rollout_func=captured_rollout(groups),
        off_policy_correction=options.is_correction,
    )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts go to TensorBoard and train_runs, not the terminal
    return PreparedRound(trainer, groups, base_model, init_from, kind, samples_path, current, batch)


def train_round(
    store,
    run: Path,
    round: int,
    options: TrainOptions = TrainOptions(),
    *,
    data: Path | None = None,
    progress: bool = False,
) -> TrainResult:
    """Train round `round` on its captured samples; write the adapter/checkpoint, config and metrics."""
    import torch
    from transformers.utils.logging import disable_progress_bar

    from lcap.store import now

    disable_progress_bar()  # transformers' bars over loading and saving weights; the round has its own bar
    run = Path(run)
    started_at = now()
    p = prepare_round(run, round, options, data)
    if progress:
        from lcap.train.progress import step_progress

        p.trainer.add_callback(step_progress(f"train round {round}"))
    trainer, groups, kind = p.trainer, p.groups, p.kind
    out_dir = round_dir(run, round)
    mismatch = guard_round(p, run, round, options)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    output = out_dir / ("checkpoint" if kind == "full" else "adapter")
    trainer.save_model(str(output))
    if kind == "full":
        trainer.processing_class.save_pretrained(str(output))

    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in groups.samples)
    passes = (
        trainer.state.global_step * p.batch * trainer.args.gradient_accumulation_steps / max(len(groups.samples), 1)
    )
    # (with epochs > 1, +1 no-grad forward per sample for the old/IS logps, not counted: tokens/s is training tokens)
    metrics = _round_metrics(trainer.state.log_history)
    metrics.update(mismatch.metrics())
    metrics.update(
        n_samples=len(groups.real_samples),
        n_groups=len(groups.groups),
        group_size=groups.size,
        dropped_stale=groups.dropped_stale,
        padded=groups.padded,
        mean_reward=groups.mean_reward(),
        tokens=int(tokens * passes),
        train_seconds=seconds,
        tokens_per_s=tokens * passes / seconds if seconds else None,
        steps=trainer.state.global_step,
    )
    config = {
        "round": round,
        "base_model": p.base_model,
        "init_from": str(p.init_from) if p.init_from else None,
        "output": str(output),
        "kind": kind,
        "samples": str(p.samples_path),
        "current": p.current,
        "options": asdict(options),
        "trl": _version("trl"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "torch": torch.__version__,
        "device": str(trainer.accelerator.device),
        "mismatch": mismatch.details(),
    }
    if trainer.accelerator.is_main_process:
        (out_dir / "config.json").write_text(json.dumps({**config, "metrics": metrics}, indent=2, default=str))
        row = {
            "run": str(run.resolve()),
            "round": round,
            "started_at": started_at,
            "ended_at": now(),
            "base_model": p.base_model,
            "init_from": config["init_from"],
            "output": str(output),
            "kind": kind,
            "config": json.dumps(config, default=str),
            "mismatch": json.dumps(mismatch.details()),
        }
        row.update(metrics)  # each metric is a column of train_runs (lcap.schema): a new one needs its column
        store.append("train_runs", [row])
    return TrainResult(round=round, output=output, kind=kind, metrics=metrics)


def guard_round(p: PreparedRound, run: Path, round: int, options: TrainOptions) -> Mismatch:
    """The mismatch guard (lcap.train.mismatch): measure the round's starting policy against the captured
    logprobs, write RUN/round-N/mismatch.json, and stop the round with a one-line error past the limit."""
    from lcap.train.mismatch import check_mismatch, measure_mismatch

    mismatch = measure_mismatch(
        p.trainer, p.groups.real_samples, per_deployment=options.mismatch_samples, seed=options.seed
    )
    path = round_dir(run, round) / "mismatch.json"
    if p.trainer.accelerator.is_main_process:
        path.write_text(json.dumps({"limit": options.mismatch_max, "deployments": mismatch.details()}, indent=2))
    policy = str(p.init_from) if p.init_from else f"the base model {p.base_model}"
    check_mismatch(mismatch, options.mismatch_max, round=round, policy=policy, details=str(path))
    return mismatch


def _load_policy(base_model: str, init_from: Path | None, options: TrainOptions, dtype):
    """The model to train: the previous round's policy when there is one, else the base."""
    from transformers import AutoModelForCausalLM

    if options.full:
        source = str(init_from) if init_from and init_from.name == "checkpoint" else base_model
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype), None, "full"
    from peft import LoraConfig, PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if init_from is not None and init_from.name == "adapter":
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


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
