"""`lcap train`: one GRPO round (or with --sft one SFT round) on captured samples (flags from `TrainOptions`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from lcap.cli_options import DbOption, one_line_errors, with_options
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError
from lcap.dataset import explain, lost_lines
from lcap.processes import helper_env
from lcap.train.accelerate_launch import accelerate_command
from lcap.train.options import TrainOptions


def register(cli: StageRegistry) -> None:
    """Add this stage's commands to the CLI."""
    app = cli.app
    app.command()(train)


@one_line_errors
@with_options(TrainOptions, "options")
def train(
    round: Annotated[int, typer.Option("--round", help="The round to train (its collected episodes).")],
    db: DbOption,
    run: Annotated[
        Path,
        typer.Option(
            "--run", help="Run folder: RUN/round-N/{data,adapter,config.json} (a role's: RUN/round-N/role-R/)."
        ),
    ],
    options: TrainOptions,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data", help="A samples.parquet (or its folder) instead of RUN/round-N/data (from `lcap build-dataset`)."
        ),
    ] = None,
    accelerate_config: Annotated[
        Path | None,
        typer.Option(
            "--accelerate-config",
            help="Rerun this command on every process of `accelerate launch --config_file` (DDP, FSDP, DeepSpeed; "
            "configs in scripts/accelerate/).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the accelerate command instead of running it.")
    ] = False,
    role: Annotated[
        str | None,
        typer.Option(
            "--role",
            help="Train this role's LoRA adapter alone (RUN/round-N/role-R), on `lcap build-dataset --role` samples, "
            "from its own latest adapter (the base model in its first round).",
        ),
    ] = None,
) -> None:
    """Train one GRPO round (TRL GRPOTrainer), or with --sft one SFT round (TRL SFTTrainer), on the round's captured
    samples; LoRA unless --full."""
    if accelerate_config is not None:
        _accelerate(accelerate_config, options, dry_run)
        return
    from lcap.dataset import last_report  # start-up: the builder's numpy and pyarrow, in every lcap command
    from lcap.store import Store  # start-up: duckdb
    from lcap.train.fit import is_main_process  # start-up: pyarrow
    from lcap.train.grpo import check_role, round_dir, round_samples, train_round  # start-up: pyarrow
    from lcap.train.progress import round_line  # start-up: rich
    from lcap.train.sft import sft_round  # start-up: pyarrow

    check_role(role, options)
    if is_main_process():
        built = Path(data) if data is not None else round_dir(run, round, role) / "data"
        folder = built.parent if built.suffix == ".parquet" else built
        # a build that found nothing writes no file: the store's report says why
        if not (folder / "samples.parquet").exists() and (report := last_report(Store(db), folder)):
            raise LcapError(f"round {round}: nothing to train on in {folder}: {explain(report)}")
        for line in lost_lines(round_samples(run, round, data, role).parent):
            typer.echo(line)
    trainer = sft_round if options.sft else train_round
    result = trainer(Store(db), run, round, options, data=data, progress=True, role=role)
    if is_main_process():
        typer.echo(round_line(round, result.metrics, result.output))


def _accelerate(config: Path, options: TrainOptions, dry_run: bool) -> None:
    """Rerun this same `lcap train` command line on every process of an accelerate config."""
    if options.ray is not None:
        raise LcapError("--accelerate-config and --ray are two launchers: pick one")
    processes = options.num_workers if options.num_workers > 1 else None  # 1, the default: the config's count
    command = accelerate_command(config, sys.argv[1:], processes)
    if dry_run:
        typer.echo(" ".join(command))
        return
    raise typer.Exit(subprocess.call(command, env=helper_env(os.environ)))  # its workers start without -I
