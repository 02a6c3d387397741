"""`lcap init-model`, `lcap serve`, `lcap deploy`: the policy server."""

from __future__ import annotations

import typer


def register_serve(app: typer.Typer) -> None:
    """Add the policy-server commands to `app`."""
