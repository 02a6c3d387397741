"""`lcap collect`, `lcap reward`, `lcap rescore`, `lcap judge-live`, `lcap build-dataset`, `lcap export` (flags from
`CollectOptions`, `RescoreOptions`, `ImplicitOptions`, `BuildOptions`, `ExportOptions`)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from lcap.capture import NOT_POLICY_ROUTE_FLAGS, ProxyOptions
from lcap.cli_options import DbOption, one_line_errors, parse_labels, with_options
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError
from lcap.dataset.build.explain import causes, explain
from lcap.dataset.options import BuildOptions, CollectOptions, ExportOptions, ImplicitOptions, RescoreOptions
from lcap.display import printable

if TYPE_CHECKING:
    from lcap.dataset.judge.run import JudgeResult


def register(cli: StageRegistry) -> None:
    """Add this stage's commands to the CLI."""
    app = cli.app
    app.command(context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(collect)
    app.command()(reward)
    app.command()(rescore)
    app.command("judge-live")(judge_live)
    app.command("build-dataset")(build_dataset)
    app.command("export")(export)


@one_line_errors
@with_options(CollectOptions, "options")
@with_options(ProxyOptions, "proxy", exclude=NOT_POLICY_ROUTE_FLAGS)
def collect(
    ctx: typer.Context,
    tasks: Annotated[Path, typer.Option("--tasks", help="JSONL, one task per line, each with an 'id'.")],
    db: DbOption,
    options: CollectOptions,
    proxy: ProxyOptions,
    label: Annotated[
        list[str] | None, typer.Option("--label", help="key=value stored on every episode; repeatable.")
    ] = None,
) -> None:
    """Run the agent command (after --) on every task, --group-size times, through the capture proxy.

    The command is a template: {field} is replaced by the task's field (shell-quoted inside
    `sh -c` scripts), plus {episode_id}, {sample}, {round}, {split}, {workdir}, {cwd}. The agent also gets
    LCAP_TASK (the task as JSON) and LCAP_EPISODE_ID, and runs in its own working directory.
    Re-running the same collect skips the episodes it already finished.
    """
    from lcap.dataset.collect.episodes import collect_episodes as run_collect  # start-up: the capture proxy
    from lcap.store import Store  # start-up: duckdb

    labels = parse_labels(label)

    def stop(*_: object) -> None:  # SIGTERM ends collect like Ctrl-C: children killed, episodes marked interrupted
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        result = run_collect(
            Store(db), tasks=tasks, command=list(ctx.args), options=options, labels=labels, proxy_options=proxy
        )
    except KeyboardInterrupt:
        typer.echo("lcap collect: interrupted; finished episodes are kept, re-run the same command to resume", err=True)
        raise typer.Exit(130) from None
    mean = "-" if result.mean_reward is None else f"{result.mean_reward:.4f}"
    typer.echo(
        f"collect {result.run_id} round {options.round} ({options.split}): {result.episodes} episodes, "
        f"{result.finished} ok, {result.not_ok()}, {result.skipped} skipped (already done), "
        f"{result.tampered} tampered, mean reward {mean}; workdirs in {result.run_dir}"
        + (" on the nodes" if options.ray is not None else "")
    )
    if result.summary is not None:
        typer.echo("\n".join(printable(line) for line in result.summary.lines()))
    if result.judge is not None and _judge_said(result.judge):
        raise typer.Exit(1)
    if result.failed and not result.finished:
        statuses = ", ".join(f"{n} {status}" for status, n in result.statuses.items())
        typer.echo(f"lcap: collect: no episode of this run finished ok ({statuses}): see the failures above", err=True)
        raise typer.Exit(1)


@one_line_errors
def reward(
    episode: Annotated[str, typer.Argument(help="Episode id.")],
    value: Annotated[float, typer.Argument(help="The reward.")],
    db: DbOption,
    details: Annotated[str | None, typer.Option("--details", help="JSON object stored with the reward.")] = None,
    source: Annotated[str, typer.Option("--source", help="Who gave it (default 'cli').")] = "cli",
    key: Annotated[
        str | None,
        typer.Option("--key", help="Idempotency key: a reward with a key already stored is not stored again."),
    ] = None,
) -> None:
    """Give an episode a reward (the latest reward of an episode wins). A running `lcap proxy --serve` also takes
    rewards over HTTP: POST /lcap/v1/rewards (docs/guide.md)."""
    from lcap.dataset.collect.rewards import add_reward  # start-up: duckdb
    from lcap.store import Store  # start-up: duckdb

    if add_reward(Store(db), episode, value, details=details, source=source, key=key):
        typer.echo(f"reward {value:g} -> {episode}")
    else:
        typer.echo(f"reward with key {key!r} stored already: {episode} left as it was")


@one_line_errors
@with_options(RescoreOptions, "options")
def rescore(db: DbOption, options: RescoreOptions) -> None:
    """Run a verifier again over stored episodes (--where) and store its verdicts as rewards of a source of their
    own (--source), which `build-dataset --reward-source` trains on. Parallel (--concurrency); a rerun after a crash
    or Ctrl-C skips the episodes already scored, and no episode gets two rewards of one source."""
    from lcap.dataset.collect.rescore import rescore as run_rescore  # start-up: duckdb
    from lcap.dataset.judge.run import JudgeResult  # start-up: duckdb
    from lcap.store import Store  # start-up: duckdb

    def stop(*_: object) -> None:  # SIGTERM ends rescore like Ctrl-C: verdicts in hand are stored
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        result = run_rescore(Store(db), options)
    except KeyboardInterrupt:
        typer.echo(
            "lcap rescore: interrupted; verdicts in hand are stored, re-run the same command to resume", err=True
        )
        raise typer.Exit(130) from None
    if isinstance(result, JudgeResult):
        if _judge_said(result):
            raise typer.Exit(1)
        return
    typer.echo(result.line())
    for error in result.errors:
        typer.echo(f"lcap: rescore: {printable(error)}", err=True)
    if result.failed:
        typer.echo(
            f"lcap: rescore: {result.failed} episodes' verifier failed (flag rescore_error, with what it said); "
            "re-run the same command to score them",
            err=True,
        )
        raise typer.Exit(1)


@one_line_errors
@with_options(ImplicitOptions, "options")
def judge_live(
    spec: Annotated[str, typer.Argument(help="The judge: judge:RUBRIC.md.")], db: DbOption, options: ImplicitOptions
) -> None:
    """Judge the user's next message in each live session as feedback on the assistant turn before it (satisfied,
    corrected, abandoned) and store it as a reward of source `implicit`, once per turn; until Ctrl-C, or --once.
    `lcap proxy --serve --implicit-reward judge:RUBRIC.md` runs it beside the proxy."""
    from lcap.dataset.judge.implicit import judge_live as watch  # start-up: the capture proxy
    from lcap.store import Store  # start-up: duckdb

    def stop(*_: object) -> None:  # SIGTERM ends it like Ctrl-C: verdicts in hand are stored
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        result = watch(Store(db), spec, options, echo=lambda line: typer.echo(line))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    typer.echo(result.line())
    for error in result.errors:
        typer.echo(f"lcap: judge-live: {printable(error)}", err=True)
    if options.once and result.failed and not result.judged:
        raise typer.Exit(1)


def _judge_said(result: JudgeResult) -> bool:
    """Print a judge pass's line and first failures; True when nothing was judged though something failed (exit 1)."""
    typer.echo(result.line())
    for error in result.errors:
        typer.echo(f"lcap: judge: {printable(error)}", err=True)
    if result.failed and not (result.rewarded or result.skipped):
        typer.echo(
            f"lcap: judge: no episode was judged ({result.failed} failed, flag judge_error): see above", err=True
        )
        return True
    if result.failed:
        typer.echo(
            f"lcap: judge: {result.failed} episodes left unrewarded (flag judge_error); re-run to judge them", err=True
        )
    return False


@one_line_errors
@with_options(BuildOptions, "options")
def build_dataset(
    out: Annotated[Path, typer.Option("--out", help="Output directory (samples.parquet, report.json).")],
    db: DbOption,
    options: BuildOptions,
    round: Annotated[
        int | None, typer.Option("--round", help="Round whose episodes to build (with --where: of this round only).")
    ] = None,
    role: Annotated[
        str | None,
        typer.Option(
            "--role",
            help="Build from this role's calls only (turns.role), for `lcap train --role`: the episodes with a call "
            "of it, each with its episode's reward, the baseline computed over them alone.",
        ),
    ] = None,
) -> None:
    """Join captured turns with rewards into GRPO samples (SQL views), clean them, write Parquet."""
    from lcap.dataset.build.builder import build_dataset as build  # start-up: duckdb, pyarrow
    from lcap.store import Store  # start-up: duckdb

    report = build(Store(db), round=round, out=out, options=options, role=role)
    typer.echo("\n".join(report.lines()))
    what = report.title() if options.where or role else f"round {round}"
    if report.samples == 0:
        raise LcapError(f"{what}: nothing to train on: {explain(report)}")
    if options.format == "grpo" and not report.groups.get("trainable"):
        typer.echo(
            f"lcap: warning: {what} has no group of two or more samples, which GRPO needs: {explain(report)}", err=True
        )
    else:
        for cause in causes(report):
            typer.echo(f"lost: {cause}")


@one_line_errors
@with_options(ExportOptions, "options")
def export(
    out: Annotated[Path, typer.Option("--out", help="The file (openai) or folder (hf, verl) to write.")],
    db: DbOption,
    options: ExportOptions,
) -> None:
    """Write captured episodes as other trainers' data: OpenAI fine-tuning JSONL, a Hugging Face dataset, or verl's
    SFT and RL Parquet; secrets redacted as in the store."""
    from lcap.dataset.build.export import export as write  # start-up: duckdb, pyarrow
    from lcap.store import Store  # start-up: duckdb

    report = write(Store(db), format=options.format, out=out, where=options.where)
    typer.echo(report.line())
