"""The `lcap` command line: the top of the import graph. Each stage registers itself, one way: its `commands.py`
`register` adds its commands, its `lcap setup` parts and its doctor and status modules to a `StageRegistry`
(lcap.cli_stages); heavy imports stay inside the commands."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
from typing import Annotated

import typer

from lcap.capture import commands as capture_commands
from lcap.cli_options import DbOption, one_line_errors
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError, lcap_home
from lcap.dataset import commands as dataset_commands
from lcap.loop import commands as loop_commands
from lcap.serve import commands as serve_commands
from lcap.sql_output import DEFAULT_MAX_WIDTH, render
from lcap.train import commands as train_commands
from lcap.ui import commands as ui_commands

# Help read through a pipe or a pager: rich's 80-column default would cut long flag names (`--eval-group-si…`).
HELP_WIDTH = 140
if (len(sys.argv) < 2 or "--help" in sys.argv) and not sys.stdout.isatty() and not os.environ.get("TERMINAL_WIDTH"):
    import typer.rich_utils  # start-up: rich, only to print help

    typer.rich_utils.MAX_WIDTH = HELP_WIDTH

app = typer.Typer(
    name="lcap",
    help="Reinforcement learning for any LLM agent, without touching the agent.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
@one_line_errors
def sql(
    query: Annotated[str, typer.Argument(help="SQL to run against the store.")],
    db: DbOption,
    format: Annotated[str, typer.Option("--format", "-f", help="table | csv | json")] = "table",
    write: Annotated[
        bool, typer.Option("--write", help="Allow statements that modify the store (still no file system access).")
    ] = False,
    max_width: Annotated[
        int,
        typer.Option(
            "--max-width",
            help="Table format: longest cell, in characters (cut with …; 0: no limit). CSV and JSON are whole.",
        ),
    ] = DEFAULT_MAX_WIDTH,
) -> None:
    """Run SQL on the store, even while a proxy is writing to it: read-only unless --write, and never the file
    system (no COPY TO, no reading other files, no ATTACH, no extensions). The table format rounds floats and cuts
    long values for reading; csv and json print every value exactly."""
    # start-up: duckdb, here and in the store
    import duckdb

    from lcap.store import Store

    if format not in ("table", "csv", "json"):
        raise LcapError(f"unknown format {format!r}: use table, csv or json")
    store = Store(db)
    try:
        with store.user_sql(write=write) as con:
            cursor = con.execute(query)
            columns = [d[0] for d in cursor.description] if cursor.description else []
            rows = cursor.fetchall() if columns else []
    except duckdb.Error as exc:
        raise LcapError(str(exc).splitlines()[0]) from None
    sys.stdout.write(render(columns, rows, format, max_width=max_width))


@app.command()
@one_line_errors
def setup(
    parts: Annotated[
        list[str] | None, typer.Argument(help="What to set up: node, vllm, smollm2 (default: all three).")
    ] = None,
) -> None:
    """Install what lcap runs beside itself: the Node proxy preload, vLLM's own venv, and the weights of
    `lcap init-model --from smollm2`. Idempotent."""
    from lcap.progress import Reporter  # start-up: rich

    steps = STAGES.setup_parts
    for part in parts or list(steps):
        if part not in steps:
            raise LcapError(f"unknown set-up part {part!r}: use {', '.join(steps)}")
        doing = "checking what is there, installing or making what is missing"
        with Reporter(f"lcap setup {part}", counted=False, doing=doing) as shown:  # an install shows its own too
            said = steps[part]()
            shown.doing = "done"
        typer.echo(f"lcap setup {part}: {said}")


DOCTOR_SECTIONS = ("capture", "serve", "store", "optional")


@app.command()
@one_line_errors
def doctor(
    db: DbOption,
    checks: Annotated[
        list[str] | None,
        typer.Argument(help="Only these checks: a name or its group (ca, trust, node, spool, policy, store, ...)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object: every check, its status and fix.")] = False,
) -> None:
    """Check what lcap needs on this machine, each with a fix: its CA and whether Python, curl, Node and Java trust
    it, the Node preload, vLLM and the policy server, the store and the spool, optional parts, and a live call
    through a throwaway proxy. Exit code 0 only when every required check passes."""
    # start-up: rich, here and in the registry
    from rich.console import Console

    from lcap import doctor as registry

    for module in DOCTOR_CHECKS:
        importlib.import_module(module)
    chosen = sorted(registry.selected(checks or ()), key=lambda c: DOCTOR_SECTIONS.index(c.section))
    if not chosen:
        names = ", ".join(c.name for c in registry.CHECKS)
        raise LcapError(f"no check named {' or '.join(checks or ())}: the checks are {names}")
    console = Console(highlight=False, soft_wrap=True)
    shown: list[str] = []

    def show(item: registry.Check, result: registry.Result) -> None:
        if item.section not in shown:
            shown.append(item.section)
            console.print(item.section, style="bold underline")
        console.print(registry.line(item, result))

    if not json_out:
        console.print(f"lcap doctor: LCAP_HOME {lcap_home()}, store {db}", style="dim")
    with registry.context(db) as ctx:
        results = registry.run_checks(ctx, chosen, on_result=None if json_out else show)
    code = registry.exit_code(results, checks or ())
    if json_out:
        typer.echo(json.dumps(registry.as_json(results), indent=2))
    else:
        console.print(registry.verdict(results), style="bold red" if code else "bold green")
    raise typer.Exit(code)


STATUS_ORDER = ("proxies", "writers", "policy", "store", "loop")


@app.command()
@one_line_errors
def status(
    db: DbOption,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object (one per refresh with --watch).")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh in place until Ctrl-C (or --count refreshes).")
    ] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes with --watch.")] = 2.0,
    count: Annotated[int, typer.Option("--count", help="With --watch: stop after this many refreshes (0: never).")] = 0,
) -> None:
    """What runs on this machine for this LCAP_HOME: proxies (episodes, calls in flight, turns), turn writers and
    what waits in their spools, the policy server and its current deployment, the store, the last loop step."""
    # start-up: rich, here and in the registry
    from rich.console import Console
    from rich.live import Live

    from lcap import status as registry

    if interval < 0.2:
        raise LcapError("--interval must be at least 0.2 seconds")
    for module in STATUS_SECTIONS:
        importlib.import_module(module)

    def take() -> list[tuple[str, registry.Section]]:
        return registry.snapshot(db, STATUS_ORDER)

    limit = (count or None) if watch else 1  # refreshes; None: until Ctrl-C
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    shown = 0
    try:
        if json_out:
            while limit is None or shown < limit:
                if shown:
                    time.sleep(interval)
                typer.echo(json.dumps(registry.as_json(take()), default=str))
                shown += 1
        elif not watch:
            console.print(registry.render(take()))
        else:
            with Live(registry.render(take()), console=console, auto_refresh=False) as live:
                shown = 1
                while limit is None or shown < limit:
                    time.sleep(interval)
                    live.update(registry.render(take()), refresh=True)
                    shown += 1
    except KeyboardInterrupt:
        pass


def _log_to_stderr() -> None:
    """lcap's warnings go to stderr. Its own handler: the embedded mitmproxy routes the root logger into its
    event log, which `lcap` does not display, and a capture failure must never go unseen."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("lcap")
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


_log_to_stderr()
STAGES = StageRegistry(app)
for stage in (capture_commands, dataset_commands, serve_commands, train_commands, loop_commands):
    stage.register(STAGES)
# The core's doctor checks (the store, Ray) come after those of the stages it serves and before the UI's browser.
STAGES.doctor_modules.append("lcap.doctor_checks")
ui_commands.register(STAGES)
# Modules whose import registers `lcap doctor` checks (lcap.doctor's registry) and `lcap status` sections
# (lcap.status's), in the order shown.
DOCTOR_CHECKS = tuple(STAGES.doctor_modules)
STATUS_SECTIONS = tuple(STAGES.status_modules)
