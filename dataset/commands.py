"""CLI commands of this stage (registered on lcap's typer app)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this stage's commands to `app`. Keep module-level imports light: the CLI loads this at start."""
