"""`lcap train`, `lcap loop`, `lcap demo`: GRPO rounds on captured samples."""


import sys
from pathlib import Path
from typing import Annotated

import typer

# Training flags shared by `train` and `loop` (one field of TrainOptions each).
Model = Annotated[str | None, typer.Option("--model", help="Base model (HF path or name); default: the run's, else the policy server's.")]
Full = Annotated[bool, typer.Option("--full", help="Full fine-tuning instead of a LoRA adapter.")]
LossType = Annotated[str, typer.Option("--loss-type", help="TRL loss: dapo, grpo, dr_grpo, bnpo, cispo, sapo, luspo.")]
Lr = Annotated[float, typer.Option("--lr", help="Learning rate.")]
Beta = Annotated[float, typer.Option("--beta", help="KL coefficient against the base model (0: no reference pass).")]
Epochs = Annotated[int, typer.Option("--epochs", help="Passes over the round's samples, all clipped against the round's starting policy (TRL num_iterations).")]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Samples per optimiser step, whole groups (0: two groups).")]
GradAccum = Annotated[int, typer.Option("--grad-accum", help="Gradient accumulation steps.")]
MaxSteps = Annotated[int, typer.Option("--max-steps", help="Stop after this many optimiser steps (-1: epochs decide).")]
Stale = Annotated[str, typer.Option("--stale", help="Samples from an older deployment: correct (importance sampling) or drop.")]
IsMode = Annotated[str, typer.Option("--is-mode", help="token_truncate, token_mask, sequence_truncate, sequence_mask (TRL).")]
IsMax = Annotated[float, typer.Option("--is-max", help="Importance-ratio cap (truncate) or upper bound (mask).")]
NoIs = Annotated[bool, typer.Option("--no-is", help="Turn the off-policy correction off.")]
LoraR = Annotated[int, typer.Option("--lora-r", help="LoRA rank.")]
LoraAlpha = Annotated[int, typer.Option("--lora-alpha", help="LoRA alpha.")]
ReportTo = Annotated[str, typer.Option("--report-to", help="TRL report_to: tensorboard (offline), none, wandb...")]
Checkpointing = Annotated[bool | None, typer.Option("--activation-checkpointing/--no-activation-checkpointing",
                                                    help="Recompute activations in the backward pass (default: on a GPU, off on CPU).")]


def register_train(app: typer.Typer) -> None:
    """Add the training commands to `app`."""
    from lcap.cli import DbOption, one_line_errors

    @app.command()
    @one_line_errors
    def train(
        round: Annotated[int, typer.Option("--round", help="The round to train (its collected episodes).")],
        run: Annotated[Path, typer.Option("--run", help="Run folder: RUN/round-N/{data,adapter,config.json}.")],
        db: DbOption,
        data: Annotated[Path | None, typer.Option("--data", help="A samples.parquet (or its folder) instead of building RUN/round-N/data.")] = None,
        model: Model = None, full: Full = False, loss_type: LossType = "dapo", lr: Lr = 1e-5, beta: Beta = 0.0,
        epochs: Epochs = 1, batch_size: BatchSize = 0, grad_accum: GradAccum = 1,
        max_steps: MaxSteps = -1, stale: Stale = "correct", is_mode: IsMode = "token_truncate", is_max: IsMax = 2.0,
        no_is: NoIs = False, lora_r: LoraR = 16, lora_alpha: LoraAlpha = 32, report_to: ReportTo = "tensorboard",
        activation_checkpointing: Checkpointing = None,
        current: Annotated[str | None, typer.Option("--current", help="The deployment being trained (default: the policy server's current).")] = None,
        accelerate_config: Annotated[Path | None, typer.Option("--accelerate-config", help="Run under `accelerate launch --config_file` (multi-GPU).")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the accelerate command instead of running it.")] = False,
    ) -> None:
        """Train one GRPO round (TRL GRPOTrainer) on the round's captured samples; LoRA unless --full."""
        from lcap.train.grpo import TrainOptions

        if accelerate_config is not None:
            import os
            import subprocess

            from lcap.train.grpo import accelerate_command

            argv = _without_option(sys.argv[1:], "--accelerate-config")
            argv = [a for a in argv if a != "--dry-run"]
            command = accelerate_command(str(accelerate_config), argv)
            if dry_run:
                typer.echo(" ".join(command))
                return
            raise typer.Exit(subprocess.call(command, env=os.environ))
        from lcap.store import Store
        from lcap.train.grpo import train_round

        options = TrainOptions(
            base_model=model, full=full, loss_type=loss_type, learning_rate=lr, beta=beta, epochs=epochs,
            batch_size=batch_size, grad_accum=grad_accum, max_steps=max_steps, stale=stale,
            current=current, is_correction=not no_is, is_mode=is_mode, is_max=is_max, lora_r=lora_r, lora_alpha=lora_alpha,
            report_to=report_to, activation_checkpointing=activation_checkpointing,
        )
        result = train_round(Store(db), run, round, options, data=data)
        m = result.metrics
        typer.echo(
            f"round {round}: {m['n_samples']} samples in {m['n_groups']} groups, mean reward {m['mean_reward']:.3f}, "
            f"loss {_f(m.get('loss'))}, KL {_f(m.get('kl'))}, IS ratio {_f(m.get('is_ratio_mean'))}, "
            f"clip {_f(m.get('clip_fraction'))}, {_f(m.get('tokens_per_s'), 0)} tokens/s -> {result.output}"
        )

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    @one_line_errors
    def loop(
        ctx: typer.Context,
        run: Annotated[Path, typer.Option("--run", help="Run folder (state.json, round-N/...).")],
        rounds: Annotated[int, typer.Option("--rounds", help="Rounds of collect -> build -> train -> deploy.")],
        tasks: Annotated[Path, typer.Option("--tasks", help="Training tasks (JSONL with 'id').")],
        db: DbOption,
        group_size: Annotated[int, typer.Option("--group-size", "-g", help="Samples per task (the GRPO group).")] = 8,
        verifier: Annotated[str | None, typer.Option("--verifier", help="Command, module:function or file.py:function.")] = None,
        eval_tasks: Annotated[Path | None, typer.Option("--eval-tasks", help="Held-out tasks, run before round 1 and after each deploy.")] = None,
        eval_group_size: Annotated[int, typer.Option("--eval-group-size", help="Samples per held-out task.")] = 1,
        concurrency: Annotated[int, typer.Option("--concurrency", "-j", help="Episodes running at once.")] = 4,
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds per episode.")] = 300.0,
        model: Model = None, full: Full = False, loss_type: LossType = "dapo", lr: Lr = 1e-5, beta: Beta = 0.0,
        epochs: Epochs = 1, batch_size: BatchSize = 0, grad_accum: GradAccum = 1,
        max_steps: MaxSteps = -1, stale: Stale = "correct", is_mode: IsMode = "token_truncate", is_max: IsMax = 2.0,
        no_is: NoIs = False, lora_r: LoraR = 16, lora_alpha: LoraAlpha = 32, report_to: ReportTo = "tensorboard",
        activation_checkpointing: Checkpointing = None,
    ) -> None:
        """Alternate collect -> build-dataset -> train -> deploy for --rounds rounds against the served policy.

        Resumable: killed anywhere, the same command continues at the first unfinished step.
        The agent command follows `--`, a template as in `lcap collect`.
        """
        from lcap.store import Store
        from lcap.train.grpo import TrainOptions
        from lcap.train.loop import LoopConfig, run_loop

        options = TrainOptions(
            base_model=model, full=full, loss_type=loss_type, learning_rate=lr, beta=beta, epochs=epochs,
            batch_size=batch_size, grad_accum=grad_accum, max_steps=max_steps, stale=stale,
            is_correction=not no_is, is_mode=is_mode, is_max=is_max, lora_r=lora_r, lora_alpha=lora_alpha,
            report_to=report_to, activation_checkpointing=activation_checkpointing,
        )
        config = LoopConfig(run=run, rounds=rounds, tasks=tasks, command=list(ctx.args), group_size=group_size,
                            verifier=verifier, eval_tasks=eval_tasks, eval_group_size=eval_group_size,
                            concurrency=concurrency, timeout=timeout, train=options)
        run_loop(Store(db), config, echo=typer.echo)

    @app.command()
    @one_line_errors
    def demo(
        out: Annotated[Path, typer.Option("--out", help="Where the demo writes its model, run, store and results.")] = Path("lcap-demo"),
        rounds: Annotated[int, typer.Option("--rounds", help="Training rounds.")] = 5,
        fresh: Annotated[bool, typer.Option("--fresh", help="Start over instead of resuming an earlier demo in --out.")] = False,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the model's init, the warm start, the task draw and training.")] = 0,
    ) -> None:
        """Make a tiny model, serve it with vLLM, and train it with GRPO on a bundled agent and task set.

        Prints each round's training and held-out reward, then where the reward curve (PNG) and the
        summary table are.
        """
        from lcap.train.demo import DemoSettings, run_demo

        run_demo(out, rounds=rounds, fresh=fresh, settings=DemoSettings(seed=seed), echo=typer.echo)


def _without_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return out


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
