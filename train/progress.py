"""What a person sees while a round trains: progress over optimiser steps (a bar, or a line every 30 s), then one line.

TRL's per-step log records go to TensorBoard (`RUN/round-N/trainer/runs`) and, averaged, to the
`train_runs` table; the terminal gets a bar and the round's summary, never the raw dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lcap.dataset import plural
from lcap.display import num, small
from lcap.progress import Reporter


def training_text(metrics: dict[str, Any]) -> str:
    """A round's training figures in one line (shared by `lcap train` and the loop's round line)."""
    if "n_groups" not in metrics:  # an SFT round (sft.py): no groups, clip, importance sampling or guard
        return f"sft loss {num(metrics.get('loss'), 4)} | {num(metrics.get('tokens_per_s'), 0)} tok/s"
    return (
        f"loss {num(metrics.get('loss'), 4)} | KL {num(metrics.get('kl'))} | IS ratio {num(metrics.get('is_ratio_mean'))}"
        f" | clip {num(metrics.get('clip_fraction'))} | {num(metrics.get('tokens_per_s'), 0)} tok/s"
        f" | train/serve KL {small(metrics.get('mismatch_kl'))}{_unchecked(metrics)}"
        f" | step KL {small(metrics.get('step_kl'))}{_left_out(metrics)}"
    )


def alone_text(n: int) -> str:
    """The samples a round leaves out because no other sample of their group is left to compare them with."""
    alone = "is alone in its group" if n == 1 else "are alone in their groups"
    return f"{plural(n, 'sample')} {alone} (GRPO compares two or more samples of a task)"


def _left_out(metrics: dict[str, Any]) -> str:
    return f" | left out: {alone_text(metrics['dropped_alone'])}" if metrics.get("dropped_alone") else ""


def _unchecked(metrics: dict[str, Any]) -> str:
    held = metrics.get("mismatch_held")
    return f" (no sample of {held}: not checked)" if held and metrics.get("mismatch_kl") is None else ""


def round_line(round: int, metrics: dict[str, Any], output: Path) -> str:
    if "n_groups" not in metrics:
        return f"round {round}: {metrics['n_samples']} sft samples | {training_text(metrics)} -> {output}"
    return (
        f"round {round}: {plural(metrics['n_samples'], 'sample')} in {plural(metrics['n_groups'], 'group')}, "
        f"mean reward {num(metrics.get('mean_reward'))} | {training_text(metrics)} -> {output}"
    )


def step_progress(label: str, show: bool | None = None) -> Any:
    """A TrainerCallback that shows the round's optimiser steps and last loss (main process only): a bar on a
    terminal, else a line at least every 30 s (lcap/progress.py). `show`: None for whichever stderr is."""
    from transformers import TrainerCallback  # the train extra

    class StepProgress(TrainerCallback):
        def __init__(self, label: str) -> None:
            self.label = label
            self.loss = ""
            self._reporter: Reporter | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            if not state.is_world_process_zero:
                return
            self._reporter = Reporter(self.label, state.max_steps, lambda: self.loss, show=show)
            self._reporter.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self._reporter is not None:
                self._reporter.advance(state.global_step - self._reporter.done)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self._reporter is not None and logs and "loss" in logs:
                self.loss = f"loss {logs['loss']:.4f}"
                self._reporter.refresh()

        def on_train_end(self, args, state, control, **kwargs):
            if self._reporter is not None:
                self._reporter.__exit__(None, None, None)
                self._reporter = None

    return StepProgress(label)
