"""`lcap train`, `lcap loop`, `lcap demo`: GRPO rounds on captured samples."""

from __future__ import annotations

import typer


def register_train(app: typer.Typer) -> None:
    """Add the training commands to `app`."""
