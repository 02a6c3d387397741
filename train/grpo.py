"""One GRPO round on captured samples: `lcap train --round N --run RUN`.

Layout of a run folder, one sub-folder per round:

    RUN/run.json                  the base model the run was started on
    RUN/round-N/data/             the dataset this round trained on (samples.parquet, from build_dataset)
    RUN/round-N/adapter/          the LoRA adapter (default) or RUN/round-N/checkpoint/ (--full)
    RUN/round-N/config.json       every option, resolved paths, library versions
    RUN/round-N/trainer/runs/     TRL's tensorboard logs (offline)
    RUN/round-N/role-R/           with --role R: that role's round, the same layout (data/, adapter/, config.json,
                                  trainer/): its samples are `lcap build-dataset --role R`'s, its adapter R's own

Each round continues the policy of the round before it (its adapter or checkpoint), so round N's
output is exactly what `lcap deploy` serves for round N+1's collection. A role's round continues that role's latest
adapter of an earlier round (a role can miss rounds, and starts from the base model in its first), never another
role's nor the run's single-role adapter; full fine-tuning makes one checkpoint for every role, so it takes no role.
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
    ROLE_FOLDER,
    FittedRound,
    PreparedRound,
    RoundInputs,
    check_trainable,
    fit_round,
    is_main_process,
    prepare,
    read_report,
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


def round_dir(run: Path, round: int, role: str | None = None) -> Path:
    """RUN/round-N, or with `role` RUN/round-N/role-R, where that role's round keeps its data, adapter and config."""
    path = Path(run) / f"round-{round}"
    if role is None:
        return path
    if not role or role.strip() != role or any(c in role for c in "/\\\0") or role in (".", ".."):
        raise LcapError(f"--role {role!r}: a role names one folder of the run (RUN/round-N/role-R)")
    return path / f"{ROLE_FOLDER}{role}"


def round_output(run: Path, round: int, role: str | None = None) -> Path | None:
    """The adapter or checkpoint a finished round (of `role`) left, or None."""
    for name in ("adapter", "checkpoint"):
        path = round_dir(run, round, role) / name
        if (path / "adapter_config.json").exists() or (path / "config.json").exists():
            return path
    return None


def role_output(run: Path, round: int, role: str) -> Path | None:
    """Role `role`'s adapter from the latest round before `round` that trained it, or None (its first round)."""
    for earlier in range(round - 1, 0, -1):
        if (output := round_output(run, earlier, role)) is not None:
            return output
    return None


def check_role(role: str | None, options: TrainOptions) -> None:
    """A round of one role trains that role's LoRA adapter: full fine-tuning has one checkpoint for every role."""
    if role is not None and options.full:
        raise LcapError("--role with --full: full fine-tuning stays single-role (one checkpoint serves every role)")


def check_role_samples(samples: Path, role: str) -> None:
    """Role `role`'s round trains on samples `lcap build-dataset --role` built of that role's calls, and no others:
    its report.json (beside them) says so."""
    report = read_report(Path(samples).parent)
    if report is not None and report.get("role") == role:
        return
    if report is None:
        found = "has no build-dataset report.json beside it to say which role it holds"
    elif report.get("role") is None:
        found = "was built of every role's calls"
    else:
        found = f"was built of role {report['role']}'s calls"
    raise LcapError(f"--role {role}: {samples} {found}: build it with `lcap build-dataset --role {role}`")


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


def round_samples(run: Path, round: int, data: Path | None, role: str | None = None) -> Path:
    """The samples file this round trains on: --data, else RUN/round-N/data/samples.parquet (from build-dataset);
    with `role`, RUN/round-N/role-R/data/samples.parquet."""
    if data is not None:
        path = Path(data)
        return path if path.suffix == ".parquet" else path / "samples.parquet"
    out = round_dir(run, round, role) / "data"
    if not (out / "samples.parquet").exists():
        of_role = "" if role is None else f" --role {role}"
        raise LcapError(
            f"round {round}{'' if role is None else f' role {role}'} has no dataset in {out}: run "
            f"`lcap build-dataset --round {round}{of_role} --out {out}` first (or pass --data)"
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
    role: str | None = None,
) -> RoundInputs:
    """`init_from`: the adapter or checkpoint the round continues (None: the base model), where it is not the
    previous round's (`lcap loop --live` continues the deployment that is current, which a refused candidate or a
    rollback makes another than round N-1's). `role`: a round of that role alone (its samples, its adapter)."""
    run = Path(run)
    if round < 1:
        raise LcapError(f"--round must be 1 or more, not {round}")
    check_role(role, options)
    base_model = resolve_base_model(run, options.base_model)
    samples = round_samples(run, round, data, role)
    if role is not None:
        check_role_samples(samples, role)
    current = options.current
    if current is None:  # the deployment serving this round's calls now: the role's own, where it has one
        policy = read_policy()
        current = policy.deployment_of(role) if policy else None
    if isinstance(init_from, PreviousRound) and role is not None:
        init_from = role_output(run, round, role)
    elif isinstance(init_from, PreviousRound):
        init_from = round_output(run, round - 1) if round > 1 else None
        if round > 1 and init_from is None:
            raise LcapError(
                f"round {round} continues round {round - 1}'s policy, and {round_dir(run, round - 1)} has no adapter "
                f"or checkpoint: train round {round - 1} first, or train these samples as --round 1 of a new --run"
            )
    return RoundInputs(base_model=base_model, samples=samples, init_from=init_from, current=current)


def prepare_round(
    run: Path, round: int, options: TrainOptions, data: Path | None = None, role: str | None = None
) -> PreparedRound:
    """Everything up to `trainer.train()`: the samples as groups, the policy, the TRL trainer."""
    return prepare(round_inputs(run, round, options, data, role=role), round_dir(run, round, role), options)


def train_round(
    store,
    run: Path,
    round: int,
    options: TrainOptions = TrainOptions(),
    *,
    data: Path | None = None,
    progress: bool = False,
    init_from: Path | PreviousRound | None = PREVIOUS_ROUND,
    role: str | None = None,
) -> TrainResult:
    """Train round `round` on its captured samples; write the adapter/checkpoint, config and metrics.

    Here (alone, or as one process of an `accelerate launch`), or on a Ray cluster with `options.ray`.
    `init_from`: what the round continues, when not the previous round's output (`round_inputs`).
    `role`: train role R's adapter alone, in RUN/round-N/role-R, from R's samples and R's previous adapter.
    """
    run = Path(run)
    started_at = now()
    inputs = round_inputs(run, round, options, data, init_from, role)
    out_dir = round_dir(run, round, role)
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
        record_round(store, run, round, inputs, fitted, options, started_at, role)
    return TrainResult(round=round, output=fitted.output, kind=fitted.kind, metrics=fitted.metrics)


def record_round(
    store,
    run: Path,
    round: int,
    inputs: RoundInputs,
    fitted: FittedRound,
    options: TrainOptions,
    started_at: Any,
    role: str | None = None,
) -> None:
    """RUN/round-N/config.json (a role's: RUN/round-N/role-R/config.json) and the round's train_runs row (the role
    in its config), written once: by rank 0, or by the Ray driver."""
    import torch  # the train extra

    config = {
        "round": round,
        "role": role,
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
    (round_dir(run, round, role) / "config.json").write_text(config_json)
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
