"""`lcap loop` and `lcap demo`: rounds of collect -> build-dataset -> train -> deploy."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from lcap.capture import NOT_POLICY_ROUTE_FLAGS, ProxyOptions
from lcap.cli_options import DbOption, one_line_errors, with_options
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError
from lcap.dataset import BuildOptions, CollectOptions
from lcap.loop.options import DemoOptions, EvalOptions, LoopOptions
from lcap.train import TrainOptions


def register(cli: StageRegistry) -> None:
    """Add this stage's commands to the CLI."""
    app = cli.app
    cli.status_modules.append("lcap.loop.status")
    app.command(context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(loop)
    app.command()(demo)
    app.command("eval", context_settings={"allow_extra_args": True, "allow_interspersed_args": False})(evaluate)


@one_line_errors
@with_options(LoopOptions, "options")
@with_options(TrainOptions, "train", exclude=("current", "sft", "sample_weight"))  # the build's weights
@with_options(BuildOptions, "build", exclude=("split", "where", "format"))
@with_options(CollectOptions, "collect", exclude=("round", "split", "upstream", "model", "run_dir", "ray"))
@with_options(ProxyOptions, "proxy", exclude=NOT_POLICY_ROUTE_FLAGS)
def loop(
    ctx: typer.Context,
    run: Annotated[Path, typer.Option("--run", help="Run folder (state.json, round-N/...).")],
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds of collect -> build -> train -> deploy.")],
    db: DbOption,
    collect: CollectOptions,
    build: BuildOptions,
    train: TrainOptions,
    proxy: ProxyOptions,
    options: LoopOptions,
    tasks: Annotated[
        Path | None, typer.Option("--tasks", help="Training tasks (JSONL with 'id'); not with --live.")
    ] = None,
    eval_tasks: Annotated[
        Path | None,
        typer.Option(
            "--eval-tasks",
            help="Held-out tasks, run before round 1 and on each round's candidate (and once on a current deployment "
            "not measured yet) before it may be deployed (--promote-margin); with --async or --full, after each "
            "deploy.",
        ),
    ] = None,
    eval_group_size: Annotated[int, typer.Option("--eval-group-size", help="Samples per held-out task.")] = 1,
    tasks_per_round: Annotated[
        int,
        typer.Option(
            "--tasks-per-round",
            help="Tasks per round, the file's next ones each round (wrapping around); 0: every task every round.",
        ),
    ] = 0,
) -> None:
    """Alternate collect -> build-dataset -> train -> deploy for --rounds rounds against the served policy.

    Resumable: killed anywhere, the same command continues at the first unfinished step. With --async,
    collection and training overlap (bounded by --max-staleness). With --live, it trains on a serving proxy's
    rewarded traffic instead of collecting, and promotes a candidate only after a held-out evaluation. With
    --per-role, each role of the agent trains an adapter of its own, deployed together.
    The agent command follows `--`, a template as in `lcap collect`.
    """
    from lcap.loop.rounds import run_loop  # start-up: the whole loop's modules
    from lcap.loop.status import running_loop  # start-up: the whole loop's modules
    from lcap.loop.steps import LoopConfig, LoopState  # start-up: the whole loop's modules
    from lcap.store import Store  # start-up: duckdb

    def stop(*_: object) -> None:  # SIGTERM ends the loop like Ctrl-C: its collect's agents killed, episodes marked
        raise KeyboardInterrupt

    config = LoopConfig(
        run=run,
        rounds=rounds,
        tasks=tasks,
        command=list(ctx.args),
        eval_tasks=eval_tasks,
        eval_group_size=eval_group_size,
        tasks_per_round=tasks_per_round,
        collect=collect,
        build=build,
        train=train,
        proxy=proxy,
        options=options,
    )
    signal.signal(signal.SIGTERM, stop)
    try:
        with running_loop(db, run):
            run_loop(Store(db), config, echo=typer.echo)
    except KeyboardInterrupt:
        where = LoopState(run, config.key()).where()
        typer.echo(
            f"lcap loop: interrupted {where}; finished steps are kept in {run / 'state.json'}, re-run the same "
            "command to resume",
            err=True,
        )
        raise typer.Exit(130) from None


@one_line_errors
@with_options(EvalOptions, "options")
@with_options(
    CollectOptions,
    "collect",
    exclude=(
        "group_size",
        "round",
        "split",
        "upstream",
        "model",
        "ray",
        "episode_cpus",
        "episode_resources",
        "replace",
    ),
)
@with_options(ProxyOptions, "proxy", exclude=NOT_POLICY_ROUTE_FLAGS)
def evaluate(
    ctx: typer.Context,
    tasks: Annotated[Path, typer.Option("--tasks", help="The task set (JSONL with 'id'), as for `lcap collect`.")],
    db: DbOption,
    options: EvalOptions,
    collect: CollectOptions,
    proxy: ProxyOptions,
) -> None:
    """Evaluate deployments side by side on one task set: right answers, mean reward with its 95% interval, and
    pass@k (k = --samples), printed and kept in the store (episodes of split eval, labelled eval and deployment).

    Each deployment gets a collect whose every call asks for it; --temperature sets every call's sampling
    temperature (0: greedy) whatever the agent sends. An episode that crashed or timed out counts as wrong.
    The agent command follows `--`, a template as in `lcap collect`.
    """
    from lcap.loop.evaluate import run_eval  # start-up: collect's modules
    from lcap.store import Store  # start-up: duckdb

    if not ctx.args:
        raise LcapError("give the agent command after `--`, as for `lcap collect`")
    run_eval(
        Store(db), tasks=tasks, command=list(ctx.args), options=options, collect=collect, proxy=proxy, echo=typer.echo
    )


@one_line_errors
@with_options(
    LoopOptions,
    "options",
    # the demo decides how a round deploys (runner.deploys_merged) and which loop its task needs
    exclude=(
        "groups_per_step",
        "sft_data",
        "live",
        "min_samples",
        "promote_margin",
        "wait_timeout",
        "per_role",
        "deploy_merge",
    ),
)
@with_options(DemoOptions, "demo_options")
def demo(
    out: Annotated[Path, typer.Option("--out", help="Where the demo writes its model, run, store and results.")] = Path(
        "lcap-demo"
    ),
    rounds: Annotated[
        int | None,
        typer.Option(
            "--rounds", help="Training rounds (default: the task's own, 3 for calculator and 5 for the tiny tasks)."
        ),
    ] = None,
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Start over instead of resuming an earlier demo in --out.")
    ] = False,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the model's init, the warm start, the task draw and training.")
    ] = 0,
    *,
    options: LoopOptions,
    demo_options: DemoOptions,
) -> None:
    """Serve a policy with vLLM and train it with GRPO on a bundled agent and task set: SmolLM2-135M-Instruct, a
    real pretrained model, learning to use a calculator tool (the default), or a tiny model made here (a quick look).

    Prints one line per round (training and held-out reward), then where the results are. Exits 1 when the run
    misses its learning targets (the same check as scripts/demo/check_learning.py).
    """
    from lcap.loop.demo.runner import demo_task, run_demo  # start-up: the whole loop's modules

    kind = demo_task(demo_options.task, demo_options.model)
    settings = kind.settings(seed)
    results = run_demo(
        out,
        rounds=rounds,
        fresh=fresh,
        task=kind.name,
        settings=settings,
        echo=typer.echo,
        loop=options,
        reward=demo_options.reward,
    )
    if not results["targets"]["passed"]:
        typer.echo("lcap: the demo missed its learning targets (above): exit 1", err=True)
        raise typer.Exit(1)
