"""What a person sees while a round trains: a progress bar over optimiser steps, then one line.

TRL's per-step log records go to TensorBoard (`RUN/round-N/trainer/runs`) and, averaged, to the
`train_runs` table; the terminal gets a bar and the round's summary, never the raw dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lcap.display import num, small


def training_text(metrics: dict[str, Any]) -> str:
    """A round's training figures in one line (shared by `lcap train` and the loop's round line)."""
    if "n_groups" not in metrics:  # an SFT round (sft.py): no groups, clip, importance sampling or guard
        return f"sft loss {num(metrics.get('loss'), 4)} | {num(metrics.get('tokens_per_s'), 0)} tok/s"
    return (
        f"loss {num(metrics.get('loss'), 4)} | KL {num(metrics.get('kl'))} | IS ratio {num(metrics.get('is_ratio_mean'))}"
        f" | clip {num(metrics.get('clip_fraction'))} | {num(metrics.get('tokens_per_s'), 0)} tok/s"
        f" | train/serve KL {small(metrics.get('mismatch_kl'))}{_unchecked(metrics)}"
    )


def _unchecked(metrics: dict[str, Any]) -> str:
    held = metrics.get("mismatch_held")
    return f" (no sample of {held}: not checked)" if held and metrics.get("mismatch_kl") is None else ""


def round_line(round: int, metrics: dict[str, Any], output: Path) -> str:
    if "n_groups" not in metrics:
        return f"round {round}: {metrics['n_samples']} sft samples | {training_text(metrics)} -> {output}"
    return (
        f"round {round}: {metrics['n_samples']} samples in {metrics['n_groups']} groups, "
        f"mean reward {num(metrics.get('mean_reward'))} | {training_text(metrics)} -> {output}"
    )


def step_progress(label: str) -> Any:
    """A TrainerCallback that draws a rich progress bar over the round's optimiser steps (main process only)."""
    from transformers import TrainerCallback  # the train extra

    class StepProgress(TrainerCallback):
        def __init__(self, label: str) -> None:
            self.label = label
            self._bar: Any = None
            self._task: Any = None

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            self._bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=state.max_steps)

        def on_step_end(self, args, state, control, **kwargs):
            if self._bar is not None:
                self._bar.update(self._task, completed=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self._bar is not None and logs and "loss" in logs:
                self._bar.update(self._task, description=f"loss {logs['loss']:.4f}")

        def on_train_end(self, args, state, control, **kwargs):
            if self._bar is not None:
                self._bar.stop()
                self._bar = None

    return StepProgress(label)
