"""CLI commands of this stage (registered on lcap's typer app): `lcap proxy` and `lcap ca`."""

from __future__ import annotations

from typing import Annotated

import typer

from lcap.capture.options import ProxyOptions
from lcap.cli_options import DbOption, one_line_errors, parse_labels, with_options


def register(app: typer.Typer) -> None:
    """Add this stage's commands to `app`. Keep module-level imports light: the CLI loads this at start."""

    @app.command(context_settings={"allow_interspersed_args": False})
    @one_line_errors
    @with_options(ProxyOptions, "options")
    def proxy(
        db: DbOption,
        options: ProxyOptions,
        command: Annotated[list[str] | None, typer.Argument(help="The agent command, after --.")] = None,
        label: Annotated[
            list[str] | None, typer.Option(help="Episode label key=value (repeatable), e.g. task=17.")
        ] = None,
        episode: Annotated[str | None, typer.Option(help="Episode id (default: a new uuid).")] = None,
        serve: Annotated[bool, typer.Option(help="Run for many agents until Ctrl-C, without a command.")] = False,
    ) -> None:
        """Run an unmodified agent behind the capture proxy; every LLM call becomes a turn in the store.

        `lcap proxy -- python agent.py` makes one episode. `--serve` runs for many agents: each names
        its episode as the proxy URL's user (http://EPISODE@127.0.0.1:PORT) or an X-Lcap-Episode header.
        """
        from lcap.capture.run import run_proxy, serve_proxy
        from lcap.config import LcapError

        if serve:
            if command:
                raise LcapError("--serve takes no command")
            serve_proxy(db=db, options=options)
            return
        if not command:
            raise LcapError("no command: use `lcap proxy [OPTIONS] -- CMD ...`, or --serve")
        raise typer.Exit(run_proxy(command, labels=parse_labels(label), episode=episode, db=db, options=options))

    @app.command()
    @one_line_errors
    def ca() -> None:
        """Print the path of lcap's CA certificate (made on first use), to trust it by hand."""
        from lcap.capture.server import ensure_ca

        typer.echo(str(ensure_ca()))
