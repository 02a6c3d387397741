"""`lcap ui`: look at what the agent did and what training did, in a browser (flags from `UiOptions`)."""

from __future__ import annotations

import typer

from lcap.cli_options import DbOption, one_line_errors, with_options
from lcap.cli_stages import StageRegistry
from lcap.config import LcapError
from lcap.ui.options import UiOptions


def register(cli: StageRegistry) -> None:
    """Add this stage's commands to the CLI."""
    app = cli.app
    cli.doctor_modules.append("lcap.ui.doctor")
    app.command()(ui)


@one_line_errors
@with_options(UiOptions, "options")
def ui(db: DbOption, options: UiOptions) -> None:
    """Serve a web view of the store: overview per round, episodes, conversations, tokens, groups.

    Reads the store read-only and never holds it, so it runs beside `lcap proxy`, `collect` and `loop`;
    pages update while they write. Binds 127.0.0.1 unless --host says otherwise; a non-loopback host
    needs the token printed at start. Opens no browser by itself.
    """
    try:
        from lcap.ui.server import serve  # the ui extra: starlette, uvicorn, jinja2
    except ImportError as exc:
        raise LcapError(f"lcap ui needs the ui extra: pip install -e '.[ui]' ({exc.name} is missing)") from None
    serve(db, options, echo=typer.echo)
