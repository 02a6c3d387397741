"""`python -m lcap ...` is `lcap ...` (what `accelerate launch -m lcap train ...` runs on every process)."""

from lcap.cli import app

app()
