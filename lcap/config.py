"""Where lcap keeps its files: one home directory per install, one database per project."""

from __future__ import annotations

import os
from pathlib import Path


def lcap_home() -> Path:
    """lcap's per-install directory (`LCAP_HOME`, default `~/.lcap`): CA, policy-server record, venvs."""
    home = Path(os.environ.get("LCAP_HOME") or Path.home() / ".lcap").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_db() -> Path:
    """The store used when no `--db` is given (`LCAP_DB`, default `./lcap.duckdb`)."""
    return Path(os.environ.get("LCAP_DB") or "lcap.duckdb")


class LcapError(Exception):
    """A failure the user can act on. The CLI prints its message as one line and exits non-zero."""
