"""`lcap init-model`, `lcap serve`, `lcap deploy`: the policy server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lcap.cli_options import DbOption, one_line_errors, with_options
from lcap.serve.options import TinyModelOptions


def register(app: typer.Typer) -> None:
    """Add the policy-server commands to `app`."""

    @app.command("init-model")
    @one_line_errors
    @with_options(TinyModelOptions, "options")
    def init_model_command(
        out: Annotated[Path, typer.Argument(help="Directory to write the model to (must be empty or new).")],
        options: TinyModelOptions,
    ) -> None:
        """Make the tiny default policy: random-init Qwen2-style LM, local BPE tokenizer, tool-call chat template."""
        from lcap.serve.tiny_model import init_model

        typer.echo(str(init_model(out, options)))

    @app.command()
    @one_line_errors
    def serve(
        db: DbOption,
        model: Annotated[str | None, typer.Option("--model", "-m", help="HF model name or path to serve.")] = None,
        port: Annotated[int | None, typer.Option(help="Port on 127.0.0.1 (default: a free one).")] = None,
        python: Annotated[
            str | None,
            typer.Option("--python", help="Interpreter with vllm (default: lcap's vLLM venv, else `vllm` on PATH)."),
        ] = None,
        name: Annotated[
            str | None, typer.Option("--name", help="Name to serve the base model under (default: its directory name).")
        ] = None,
        tool_parser: Annotated[str, typer.Option(help="vLLM tool-call parser, or 'none'.")] = "hermes",
        timeout: Annotated[float, typer.Option(help="Seconds to wait for /health.")] = 600,
        stop: Annotated[bool, typer.Option("--stop", help="Stop the running policy server.")] = False,
        status: Annotated[
            bool, typer.Option("--status", help="Print the policy server's record and health as JSON.")
        ] = False,
        vllm_args: Annotated[list[str] | None, typer.Argument(help="Extra vLLM arguments, after `--`.")] = None,
    ) -> None:
        """Start vLLM's OpenAI server on the policy (LoRA hot-loading on), wait until healthy, record it."""
        import json

        from lcap.config import LcapError
        from lcap.serve.server import server_status, start_server, stop_server
        from lcap.store import Store

        if stop:
            stopped = stop_server()
            typer.echo(
                f"stopped policy server {stopped.url} (pid {stopped.pid})"
                if stopped
                else "no policy server was running"
            )
            return
        if status:
            state = server_status()
            if state is None:
                typer.echo(json.dumps({"running": False}))
                raise typer.Exit(1)
            typer.echo(json.dumps({"running": state["alive"] and state["healthy"], **state}, indent=2))
            raise typer.Exit(0 if state["healthy"] else 1)
        if not model:
            raise LcapError(
                "give --model (an HF model name or path; `lcap init-model DIR` makes a tiny one), or --stop / --status"
            )
        record = start_server(
            model,
            port=port,
            python=python,
            served_name=name,
            timeout=timeout,
            tool_parser=None if tool_parser == "none" else tool_parser,
            extra_args=vllm_args or (),
            store=Store(db),
            progress=True,
        )
        typer.echo(
            f"policy server ready at {record.url}: serving {record.served_model!r} (pid {record.pid}, log {record.log_path})"
        )

    @app.command()
    @one_line_errors
    def deploy(
        path: Annotated[
            Path, typer.Argument(help="A PEFT LoRA adapter dir (hot-loaded) or a full checkpoint dir (vLLM restarts).")
        ],
        db: DbOption,
        name: Annotated[
            str | None, typer.Option("--name", help="Served name (default: policy-r{round}-{hash}).")
        ] = None,
        round: Annotated[int | None, typer.Option("--round", help="Training round that produced it.")] = None,
    ) -> None:
        """Make a new checkpoint the current policy: every routed call is served by it from now on."""
        from lcap.serve.deploy import deploy as deploy_policy
        from lcap.store import Store

        served = deploy_policy(path, name=name, round=round, store=Store(db))
        typer.echo(served)
