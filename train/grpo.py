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
import os
import time
import warnings
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
    if not recorded and is_main_process():
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


def nothing_to_train(where: str, samples_path: Path, samples: list, groups: Any, current: str | None) -> str:
    """Why a round has no group GRPO can train on: build-dataset's losses (from the report.json beside the samples)
    and the trainer's own (stale samples dropped, samples alone in their group), with what changes each."""
    from lcap.dataset.build.explain import Cause, explain, plural

    report_path = Path(samples_path).parent / "report.json"
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        report = None
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
    if groups.dropped_small:
        extra.append(
            Cause(
                f"{plural(groups.dropped_small, 'sample')} "
                f"{'is alone in its group' if groups.dropped_small == 1 else 'are alone in their groups'} "
                "(GRPO compares two or more samples of a task)",
                "undo what left them alone, or collect with a larger --group-size",
            )
        )
    n_groups = len({s.group_id for s in samples})
    head = (
        f"{where}: no group with two or more usable samples in {samples_path} "
        f"({plural(n_samples, 'sample')} in {plural(n_groups, 'group')})"
    )
    if report is None and not extra:
        return f"{head}: no report.json beside it says why (build it with `lcap build-dataset`)"
    return f"{head}: {explain(report, extra=extra)}"


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


def round_inputs(run: Path, round: int, options: TrainOptions, data: Path | None = None) -> RoundInputs:
    run = Path(run)
    base_model = resolve_base_model(run, options.base_model)
    samples = round_samples(run, round, data)
    current = options.current
    if current is None:
        from lcap.policy import read_policy

        policy = read_policy()
        current = policy.current if policy else None
    init_from = round_output(run, round - 1) if round > 1 else None
    return RoundInputs(base_model=base_model, samples=samples, init_from=init_from, current=current)


@dataclass
class PreparedRound:
    trainer: Any
    groups: Any
    inputs: RoundInputs
    kind: str
    batch: int  # samples per optimiser step, all processes together
    out_dir: Path


def prepare_round(run: Path, round: int, options: TrainOptions, data: Path | None = None) -> PreparedRound:
    """Everything up to `trainer.train()`: the samples as groups, the policy, the TRL trainer."""
    return prepare(round_inputs(run, round, options, data), round_dir(run, round), options)


def prepare(inputs: RoundInputs, out_dir: Path, options: TrainOptions) -> PreparedRound:
    """The round's trainer in this process; with several processes, each trains on its share of every batch.

    The batch (`--batch-size` samples, whole groups) is the same for any number of processes: each one
    takes `batch / processes` consecutive samples of it, and DDP averages their gradients, so one process
    and N take the same optimiser steps on the same samples (tests/test_train_distributed.py).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from lcap.train.samples import make_groups, read_samples
    from lcap.train.trainer import CapturedGRPOTrainer, captured_advantage, captured_rollout

    samples = read_samples(inputs.samples)
    groups = make_groups(samples, group_size=options.group_size, stale=options.stale, current=inputs.current)
    if not groups.groups:
        raise LcapError(
            nothing_to_train(
                out_dir.name.replace("-", " "), inputs.shown(out_dir).samples, samples, groups, inputs.current
            )
        )
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

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(inputs.base_model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model, peft_config, kind = _load_policy(inputs.base_model, inputs.init_from, options, dtype)

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
        per_device_train_batch_size=batch // processes,
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
        ddp_find_unused_parameters=False,  # every trainable parameter takes part in every forward
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
    if trainer.accelerator.num_processes != processes:
        raise RuntimeError(
            f"accelerate sees {trainer.accelerator.num_processes} processes, the launcher WORLD_SIZE={processes}"
        )
    trainer.remove_callback(PrinterCallback)  # its per-step dicts go to TensorBoard and train_runs, not the terminal
    return PreparedRound(trainer, groups, inputs, kind, batch, out_dir)


@dataclass
class FittedRound:
    """What training a round left on rank 0: its adapter or checkpoint and its figures."""

    output: Path
    kind: str
    metrics: dict[str, Any]
    device: str
    processes: int
    mismatch: list[dict[str, Any]]  # the guard's figures per deployment (lcap.train.mismatch)


def fit_round(inputs: RoundInputs, out_dir: Path, options: TrainOptions, *, progress: bool = False) -> FittedRound:
    """Train the round in this process (one of `world_size()`); rank 0 saves the adapter or checkpoint in OUT_DIR."""
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # transformers' bars over loading and saving weights; the round has its own bar
    # TRL reads a property transformers deprecated: a warning the user can do nothing about, amid the round's line
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    p = prepare(inputs, out_dir, options)
    mismatch = guard_round(p, options)
    if progress:
        from lcap.train.progress import step_progress

        p.trainer.add_callback(step_progress(f"train {out_dir.name.replace('-', ' ')}"))
    trainer, groups, kind = p.trainer, p.groups, p.kind
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    output = out_dir / ("checkpoint" if kind == "full" else "adapter")
    trainer.save_model(str(output))  # every process calls it (a collective under FSDP and ZeRO-3); rank 0 writes
    if kind == "full" and trainer.accelerator.is_main_process:
        trainer.processing_class.save_pretrained(str(output))

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
        padded=groups.padded,
        mean_reward=groups.mean_reward(),
        tokens=int(tokens * passes),
        train_seconds=seconds,
        tokens_per_s=tokens * passes / seconds if seconds else None,
        steps=trainer.state.global_step,
    )
    metrics.update(mismatch.metrics())
    return FittedRound(
        output=output,
        kind=kind,
        metrics=metrics,
        device=str(trainer.accelerator.device),
        processes=trainer.accelerator.num_processes,
        mismatch=mismatch.details(),
    )


def train_round(
    store,
    run: Path,
    round: int,
    options: TrainOptions = TrainOptions(),
    *,
    data: Path | None = None,
    progress: bool = False,
) -> TrainResult:
    """Train round `round` on its captured samples; write the adapter/checkpoint, config and metrics.

    Here (alone, or as one process of an `accelerate launch`), or on a Ray cluster with `options.ray`.
    """
    from lcap.store import now

    run = Path(run)
    started_at = now()
    inputs = round_inputs(run, round, options, data)
    out_dir = round_dir(run, round)
    if options.ray is not None:
        from lcap.train.ray_train import fit_on_ray

        fitted = fit_on_ray(inputs, out_dir, options)
    else:
        if options.num_workers > 1 and world_size() == 1:
            raise LcapError(
                f"--num-workers {options.num_workers} needs a cluster: --ray ADDRESS (Ray Train), "
                "or --accelerate-config (accelerate launch)"
            )
        fitted = fit_round(inputs, out_dir, options, progress=progress)
    if is_main_process():
        record_round(store, run, round, inputs, fitted, options, started_at)
    return TrainResult(round=round, output=fitted.output, kind=fitted.kind, metrics=fitted.metrics)


def record_round(
    store, run: Path, round: int, inputs: RoundInputs, fitted: FittedRound, options: TrainOptions, started_at: Any
) -> None:
    """RUN/round-N/config.json and the round's train_runs row, written once: by rank 0, or by the Ray driver."""
    import torch

    from lcap.store import now

    config = {
        "round": round,
        "base_model": inputs.base_model,
        "init_from": str(inputs.init_from) if inputs.init_from else None,
        "output": str(fitted.output),
        "kind": fitted.kind,
        "samples": str(inputs.samples),
        "current": inputs.current,
        "options": asdict(options),
        "trl": _version("trl"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "torch": torch.__version__,
        "device": fitted.device,
        "processes": fitted.processes,
        "mismatch": fitted.mismatch,
    }
    config_json = json.dumps({**config, "metrics": fitted.metrics}, indent=2, default=str)
    (round_dir(run, round) / "config.json").write_text(config_json)
    row = {
        "run": str(Path(run).resolve()),
        "round": round,
        "started_at": started_at,
        "ended_at": now(),
        "base_model": inputs.base_model,
        "init_from": config["init_from"],
        "output": str(fitted.output),
        "kind": fitted.kind,
        "config": json.dumps(config, default=str),
        "mismatch": json.dumps(fitted.mismatch),
    }
    row.update(fitted.metrics)  # each metric is a column of train_runs (lcap.schema): a new one needs its column
    store.append("train_runs", [row])


def guard_round(p: PreparedRound, options: TrainOptions) -> Mismatch:
    """The mismatch guard (lcap.train.mismatch): measure the round's starting policy against the captured
    logprobs, write OUT_DIR/mismatch.json, and stop the round with a one-line error past the limit."""
    from lcap.train.mismatch import check_mismatch, measure_mismatch

    mismatch = measure_mismatch(
        p.trainer,
        p.groups.real_samples,
        per_deployment=options.mismatch_samples,
        seed=options.seed,
        held=p.inputs.current if options.mismatch_current_only else None,
    )
    path = p.out_dir / "mismatch.json"
    if p.trainer.accelerator.is_main_process:
        report = {"limit": options.mismatch_max, "held": mismatch.held, "unchecked": mismatch.unchecked()}
        path.write_text(json.dumps({**report, "deployments": mismatch.details()}, indent=2))
    shown = p.inputs.shown(p.out_dir)
    policy = str(shown.init_from) if shown.init_from else f"the base model {p.inputs.base_model}"
    where = p.out_dir.name.replace("-", " ")
    check_mismatch(mismatch, options.mismatch_max, where=where, policy=policy, details=str(shown.round_dir / path.name))
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
