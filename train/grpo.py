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
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from lcap.config import LcapError
from lcap.policy import read_policy
from lcap.store import now
from lcap.train.fit import (
    FittedRound,
    PreparedRound,
    RoundInputs,
    check_trainable,
    fit_round,
    is_main_process,
    prepare,
    world_size,
)
from lcap.train.options import TrainOptions
from lcap.train.ray_train import fit_on_ray


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


class PreviousRound:
    """`init_from`'s default: continue the previous round's output (the base model for round 1)."""


PREVIOUS_ROUND = PreviousRound()


def round_inputs(
    run: Path,
    round: int,
    options: TrainOptions,
    data: Path | None = None,
    init_from: Path | PreviousRound | None = PREVIOUS_ROUND,
) -> RoundInputs:
    """`init_from`: the adapter or checkpoint the round continues (None: the base model), where it is not the
    previous round's (`lcap loop --live` continues the deployment that is current, which a refused candidate or a
    rollback makes another than round N-1's)."""
    run = Path(run)
    if round < 1:
        raise LcapError(f"--round must be 1 or more, not {round}")
    base_model = resolve_base_model(run, options.base_model)
    samples = round_samples(run, round, data)
    current = options.current
    if current is None:
        policy = read_policy()
        current = policy.current if policy else None
    if isinstance(init_from, PreviousRound):
        init_from = round_output(run, round - 1) if round > 1 else None
        if round > 1 and init_from is None:
            raise LcapError(
                f"round {round} continues round {round - 1}'s policy, and {round_dir(run, round - 1)} has no adapter "
                f"or checkpoint: train round {round - 1} first, or train these samples as --round 1 of a new --run"
            )
    return RoundInputs(base_model=base_model, samples=samples, init_from=init_from, current=current)


def prepare_round(run: Path, round: int, options: TrainOptions, data: Path | None = None) -> PreparedRound:
    """Everything up to `trainer.train()`: the samples as groups, the policy, the TRL trainer."""
    return prepare(round_inputs(run, round, options, data), round_dir(run, round), options)


def train_round(
    store,
    run: Path,
    round: int,
    options: TrainOptions = TrainOptions(),
    *,
    data: Path | None = None,
    progress: bool = False,
    init_from: Path | PreviousRound | None = PREVIOUS_ROUND,
) -> TrainResult:
    """Train round `round` on its captured samples; write the adapter/checkpoint, config and metrics.

    Here (alone, or as one process of an `accelerate launch`), or on a Ray cluster with `options.ray`.
    `init_from`: what the round continues, when not the previous round's output (`round_inputs`).
    """
    run = Path(run)
    started_at = now()
    inputs = round_inputs(run, round, options, data, init_from)
    out_dir = round_dir(run, round)
    check_trainable(inputs, out_dir, options)  # here, before a Ray or accelerate worker loads a model
    if options.ray is not None:
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
    import torch  # the train extra

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


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None
