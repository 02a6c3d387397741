"""CLI commands of this stage (registered on lcap's typer app): `lcap proxy`, `lcap episode new` and `lcap ca`."""

from __future__ import annotations

import json
import uuid
from typing import Annotated

import typer

from lcap.capture.options import ProxyOptions
from lcap.capture.reach.node_preload import install_node_preload
from lcap.cli_options import DbOption, one_line_errors, parse_labels, with_options
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError

LabelOption = Annotated[list[str] | None, typer.Option(help="Episode label key=value (repeatable), e.g. task=17.")]


def register(cli: StageRegistry) -> None:
    """Add this stage's commands to `app`. Keep module-level imports light: the CLI loads this at start."""
    app = cli.app
    cli.setup_parts["node"] = install_node_preload
    cli.doctor_modules += ["lcap.capture.doctor_trust", "lcap.capture.doctor"]  # the CA and its trust first
    cli.status_modules.append("lcap.capture.status")

    @app.command(context_settings={"allow_interspersed_args": False})
    @one_line_errors
    @with_options(ProxyOptions, "options")
    def proxy(
        db: DbOption,
        options: ProxyOptions,
        command: Annotated[list[str] | None, typer.Argument(help="The agent command, after --.")] = None,
        label: LabelOption = None,
        episode: Annotated[str | None, typer.Option(help="Episode id (default: a new uuid).")] = None,
        serve: Annotated[bool, typer.Option(help="Run for many agents until Ctrl-C, without a command.")] = False,
    ) -> None:
        """Run an unmodified agent behind the capture proxy; every LLM call becomes a turn in the store.

        `lcap proxy -- python agent.py` makes one episode. `--serve` runs for many agents: each gets its
        episode's proxy URL from `lcap episode new` (http://EPISODE:SECRET@127.0.0.1:PORT).
        """
        from lcap.capture.run import run_proxy, serve_proxy  # start-up: mitmproxy

        if serve:
            if command:
                raise LcapError("--serve takes no command")
            if options.transparent:
                raise LcapError(
                    "--transparent runs one command in namespaces of its own: it takes a command, not --serve"
                )
            serve_proxy(db=db, options=options)
            return
        if not command:
            raise LcapError("no command: use `lcap proxy [OPTIONS] -- CMD ...`, or --serve")
        raise typer.Exit(run_proxy(command, labels=parse_labels(label), episode=episode, db=db, options=options))

    episode_app = typer.Typer(help="Episodes of a running `lcap proxy --serve`.", no_args_is_help=True)
    app.add_typer(episode_app, name="episode")

    @episode_app.command("new")
    @one_line_errors
    def episode_new(
        label: LabelOption = None,
        port: Annotated[
            int | None, typer.Option(help="The proxy's port (default: the only proxy of this LCAP_HOME running).")
        ] = None,
        episode: Annotated[str | None, typer.Option("--id", help="Episode id (default: a new uuid).")] = None,
        json_out: Annotated[
            bool, typer.Option("--json", help="Print the id, proxy URL and X-Lcap-Episode value as JSON.")
        ] = False,
    ) -> None:
        """Start an episode on a running proxy and print its proxy URL: HTTPS_PROXY=$(lcap episode new ...).

        The URL carries the episode's secret; only calls that present it are written into the episode."""
        from lcap.capture.trust.credentials import find_proxy  # start-up: credentials (hashlib, secrets)
        from lcap.store import Store  # start-up: duckdb

        record = find_proxy(port)
        episode_id = episode or str(uuid.uuid4())
        Store(record.db).start_episode(episode_id, command=None, cwd=None, labels=parse_labels(label))
        keys = record.keys()
        url = keys.proxy_url(episode_id, record.host, record.port)
        if json_out:
            typer.echo(json.dumps({"episode_id": episode_id, "proxy_url": url, "header": keys.pair(episode_id)}))
        else:
            typer.echo(url)

    @app.command()
    @one_line_errors
    def ca() -> None:
        """Print the path of lcap's CA certificate (made on first use), to trust it by hand."""
        from lcap.capture.trust.ca import ensure_ca  # start-up: mitmproxy

        typer.echo(str(ensure_ca()))
