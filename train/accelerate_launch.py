"""`lcap train --accelerate-config CONFIG`: the same command line, rerun on every process of an accelerate launch.

`accelerate launch` starts the processes (torchrun for DDP and FSDP, DeepSpeed's launcher for ZeRO)
and each runs `python -m lcap train ...` without the launch flags: `fit_round` takes its share of
every batch, rank 0 writes the adapter, config.json and the store. The configs lcap ships are in
scripts/accelerate/ (DDP, FSDP, DeepSpeed ZeRO-2 and ZeRO-3); `--num-workers` sets their process
count, the other launch settings (machines, rank, main process address) stay accelerate's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lcap.config import LcapError
from lcap.processes import python_helper

# Flags of `lcap train` that the launched processes must not see again.
LAUNCH_FLAGS = ("--accelerate-config", "--num-workers")
LAUNCH_SWITCHES = ("--dry-run",)


def load_config(path: Path) -> dict:
    """CONFIG as accelerate's own loader reads it; an unreadable or invalid one is a one-line error."""
    from accelerate.commands.config.config_args import load_config_from_file  # the train extra

    if not Path(path).is_file():
        raise LcapError(f"no accelerate config at {path}")
    try:
        return load_config_from_file(str(path)).to_dict()
    except Exception as exc:  # accelerate raises ValueError, KeyError, TypeError or YAML errors
        raise LcapError(f"accelerate config {path}: {type(exc).__name__}: {exc}") from None


def accelerate_command(config: Path, argv: list[str], num_processes: int | None = None) -> list[str]:
    """The `accelerate launch` command that reruns `lcap train ARGV` (launch flags removed) on every process."""
    load_config(config)
    launch = [*python_helper(sys.executable, "-m", "accelerate.commands.launch"), "--config_file", str(config)]
    if num_processes is not None:
        launch += ["--num_processes", str(num_processes)]
    return [*launch, "-m", "lcap", *without_launch_flags(argv)]


def without_launch_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_FLAGS:
            skip = True
        elif arg not in LAUNCH_SWITCHES and not arg.startswith(tuple(f"{f}=" for f in LAUNCH_FLAGS)):
            out.append(arg)
    return out
