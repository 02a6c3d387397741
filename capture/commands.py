"""CLI commands of this stage (registered on lcap's typer app): `lcap proxy` and `lcap ca`."""

from __future__ import annotations

from typing import Annotated

import typer

from lcap.cli_options import DbOption, one_line_errors, parse_labels


def register(app: typer.Typer) -> None:
    """Add this stage's commands to `app`. Keep module-level imports light: the CLI loads this at start."""

    @app.command(context_settings={"allow_interspersed_args": False})
    @one_line_errors
    def proxy(
        db: DbOption,
        command: Annotated[list[str] | None, typer.Argument(help="The agent command, after --.")] = None,
        upstream: Annotated[
            str | None, typer.Option(help="Send LLM calls to this server instead (URL, or 'policy').")
        ] = None,
        model: Annotated[
            str | None, typer.Option(help="Ask the upstream for this model instead of the agent's.")
        ] = None,
        token_ids: Annotated[
            bool | None,
            typer.Option(
                "--token-ids/--no-token-ids",
                help="Ask vLLM for token ids and logprobs (default: when the upstream is vLLM).",
            ),
        ] = None,
        label: Annotated[
            list[str] | None, typer.Option(help="Episode label key=value (repeatable), e.g. task=17.")
        ] = None,
        episode: Annotated[str | None, typer.Option(help="Episode id (default: a new uuid).")] = None,
        serve: Annotated[bool, typer.Option(help="Run for many agents until Ctrl-C, without a command.")] = False,
        host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Listen port (0: a free one).")] = 0,
    ) -> None:
        """Run an unmodified agent behind the capture proxy; every LLM call becomes a turn in the store.

        `lcap proxy -- python agent.py` makes one episode. `--serve` runs for many agents: each names
        its episode as the proxy URL's user (http://EPISODE@127.0.0.1:PORT) or an X-Lcap-Episode header.
        """
        from lcap.capture.run import run_proxy, serve_proxy
        from lcap.config import LcapError

        labels = parse_labels(label)
        options = dict(db=db, upstream=upstream, model=model, token_ids=token_ids, host=host, port=port)
        if serve:
            if command:
                raise LcapError("--serve takes no command")
            serve_proxy(**options)
            return
        if not command:
            raise LcapError("no command: use `lcap proxy [OPTIONS] -- CMD ...`, or --serve")
        raise typer.Exit(run_proxy(command, labels=labels, episode=episode, **options))

    @app.command()
    @one_line_errors
    def ca() -> None:
        """Print the path of lcap's CA certificate (made on first use), to trust it by hand."""
        from lcap.capture.server import ensure_ca

        typer.echo(str(ensure_ca()))
