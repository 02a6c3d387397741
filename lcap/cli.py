"""The `lcap` command line: the top of the import graph. Each stage registers its own commands (its
`commands.py`, which imports only the core and the stages before it); heavy imports stay inside them."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from lcap.capture.commands import register as register_capture
from lcap.cli_options import DbOption, one_line_errors
from lcap.config import LcapError
from lcap.dataset.commands import register as register_dataset
from lcap.loop.commands import register as register_loop
from lcap.serve.commands import register as register_serve
from lcap.train.commands import register as register_train
from lcap.ui.commands import register as register_ui

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
) -> None:
    """Run SQL on the store, even while a proxy is writing to it: read-only unless --write, and never the file
    system (no COPY TO, no reading other files, no ATTACH, no extensions)."""
    import duckdb

    from lcap.sql_output import render
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
    sys.stdout.write(render(columns, rows, format))


@app.command()
@one_line_errors
def setup(
    parts: Annotated[list[str] | None, typer.Argument(help="What to set up: node, vllm (default: both).")] = None,
) -> None:
    """Install what lcap runs beside itself: the Node proxy preload and vLLM's own venv. Idempotent."""
    from lcap.capture.node_preload import install_node_preload
    from lcap.serve.vllm_env import ensure_vllm_env

    steps = {"node": install_node_preload, "vllm": ensure_vllm_env}
    for part in parts or list(steps):
        if part not in steps:
            raise LcapError(f"unknown set-up part {part!r}: use {', '.join(steps)}")
        typer.echo(f"lcap setup {part}: {steps[part]()}")


def _register_stages() -> None:
    for register in (register_capture, register_dataset, register_serve, register_train, register_loop, register_ui):
        register(app)


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
_register_stages()
