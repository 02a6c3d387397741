"""How a stage joins the command line, the one way it does: `lcap.cli` hands each stage's `commands.register` a
`StageRegistry`, and the stage adds its commands to `app`, its parts to `lcap setup`, and the modules whose import
registers its `lcap doctor` checks and `lcap status` sections (lcap.doctor, lcap.status). Those modules are loaded
only by the commands that show them, so `lcap --help` stays light."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import typer


@dataclass
class StageRegistry:
    app: typer.Typer
    setup_parts: dict[str, Callable[[], str]] = field(default_factory=dict)  # `lcap setup NAME`: a line to print
    doctor_modules: list[str] = field(default_factory=list)  # in the order their checks are listed
    status_modules: list[str] = field(default_factory=list)  # likewise, for status sections
