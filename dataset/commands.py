"""CLI commands of this stage (registered on lcap's typer app): collect, reward, build-dataset."""


from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this stage's commands to `app`. Keep module-level imports light: the CLI loads this at start."""
    from lcap.cli import DbOption, one_line_errors

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    @one_line_errors
    def collect(
        ctx: typer.Context,
        tasks: Annotated[Path, typer.Option("--tasks", help="JSONL, one task per line, each with an 'id'.")],
        db: DbOption,
        group_size: Annotated[int, typer.Option("--group-size", "-g", help="Samples per task (the GRPO group).")] = 8,
        concurrency: Annotated[int, typer.Option("--concurrency", "-j", help="Episodes running at once.")] = 8,
        round: Annotated[int, typer.Option("--round", help="Training round these episodes belong to.")] = 0,
        split: Annotated[str, typer.Option("--split", help="train | eval (a label; build-dataset reads train).")] = "train",
        verifier: Annotated[str | None, typer.Option("--verifier", help="Command, module:function or file.py:function.")] = None,
        upstream: Annotated[str, typer.Option("--upstream", help="'policy' (the deployed vLLM), a URL, or 'none' (the agent's own).")] = "policy",
        model: Annotated[str | None, typer.Option("--model", help="Model name to ask the upstream for.")] = None,
        timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds per episode; its process group is killed.")] = None,
        protect: Annotated[list[str] | None, typer.Option("--protect", help="Glob (in the workdir) the agent must not change; repeatable.")] = None,
        label: Annotated[list[str] | None, typer.Option("--label", help="key=value stored on every episode; repeatable.")] = None,
        run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Where episode workdirs go (default ./lcap-runs/collect-ID).")] = None,
    ) -> None:
        """Run the agent command (after --) on every task, --group-size times, through the capture proxy.

        The command is a template: {field} is replaced by the task's field (shell-quoted inside
        `sh -c` scripts), plus {episode_id}, {sample}, {round}, {workdir}, {cwd}. The agent also gets
        LCAP_TASK (the task as JSON) and LCAP_EPISODE_ID, and runs in its own working directory.
        Re-running the same collect skips the episodes it already finished.
        """
        import signal

        from lcap.config import LcapError
        from lcap.dataset.collect import collect as run_collect
        from lcap.store import Store

        labels = {}
        for item in label or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise LcapError(f"--label {item!r}: expected key=value")
            labels[key] = value
        def stop(*_):  # SIGTERM ends collect like Ctrl-C: children killed, episodes marked interrupted
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        try:
            result = run_collect(
                Store(db), tasks=tasks, command=list(ctx.args), group_size=group_size, concurrency=concurrency,
                round=round, verifier=verifier, upstream=None if upstream == "none" else upstream, model=model,
                timeout=timeout, split=split, labels=labels, protected=protect or (), run_dir=run_dir,
            )
        except KeyboardInterrupt:
            typer.echo("lcap collect: interrupted; finished episodes are kept, re-run the same command to resume",
                       err=True)
            raise typer.Exit(130) from None
        mean = "-" if result.mean_reward is None else f"{result.mean_reward:.4f}"
        typer.echo(
            f"collect {result.run_id} round {round} ({split}): {result.episodes} episodes, {result.finished} ok, "
            f"{result.failed} failed, {result.skipped} skipped (already done), {result.tampered} tampered, "
            f"mean reward {mean}; workdirs in {result.run_dir}"
        )
        if result.statuses:
            typer.echo("statuses: " + ", ".join(f"{k} {v}" for k, v in sorted(result.statuses.items())))

    @app.command()
    @one_line_errors
    def reward(
        episode: Annotated[str, typer.Argument(help="Episode id.")],
        value: Annotated[float, typer.Argument(help="The reward.")],
        db: DbOption,
        details: Annotated[str | None, typer.Option("--details", help="JSON object stored with the reward.")] = None,
        source: Annotated[str, typer.Option("--source", help="Who gave it (default 'cli').")] = "cli",
    ) -> None:
        """Give an episode a reward (the latest reward of an episode wins)."""
        from lcap.dataset.rewards import add_reward
        from lcap.store import Store

        add_reward(Store(db), episode, value, details=details, source=source)
        typer.echo(f"reward {value:g} -> {episode}")

    @app.command("build-dataset")
    @one_line_errors
    def build_dataset(
        round: Annotated[int, typer.Option("--round", help="Round whose train episodes to build.")],
        out: Annotated[Path, typer.Option("--out", help="Output directory (samples.parquet, report.json).")],
        db: DbOption,
        split: Annotated[str, typer.Option("--split", help="Episode split to read.")] = "train",
        truncated: Annotated[str, typer.Option("--truncated", help="drop | mask completions cut by max_tokens.")] = "drop",
        keep_zero_variance: Annotated[bool, typer.Option("--keep-zero-variance", help="Keep groups whose rewards are all equal.")] = False,
        drop_tampered: Annotated[bool, typer.Option("--drop-tampered", help="Leave tampered episodes out (default: keep with reward 0).")] = False,
        rebuild: Annotated[bool, typer.Option("--rebuild/--no-rebuild", help="Re-tokenise turns captured without token ids.")] = True,
        tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Tokenizer for rebuilds (default: the deployment's base model).")] = None,
    ) -> None:
        """Join captured turns with rewards into GRPO samples (SQL views), clean them, write Parquet."""
        from lcap.dataset.build import BuildOptions
        from lcap.dataset.build import build_dataset as build
        from lcap.store import Store

        options = BuildOptions(split=split, truncated=truncated, keep_zero_variance=keep_zero_variance,
                               drop_tampered=drop_tampered, rebuild=rebuild, tokenizer=tokenizer)
        report = build(Store(db), round=round, out=out, options=options)
        typer.echo("\n".join(report.lines()))
