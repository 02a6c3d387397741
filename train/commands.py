"""CLI commands of the train stage: the policy server (serve_commands) and GRPO rounds (train_commands)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from lcap.train.serve_commands import register_serve
    from lcap.train.train_commands import register_train

    register_serve(app)
    register_train(app)
