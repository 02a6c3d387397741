"""Files only their owner can read, made so by the mode they are created with, never by the process's umask: the
umask is one setting for every thread of the process, so a thread that changed it would change the modes of the
files every other thread makes meanwhile (a sandboxed verifier's tests, an agent's stdout).

DuckDB creates the store and its WAL itself, with the umask's mode; the store (lcap.store) keeps both private
with these two helpers:
- a new store file is made in a folder of its own that only the owner can enter, given mode 0600 there and then
  linked to its name (`made_privately`), so that under its name it is never readable by others;
- DuckDB deletes an empty WAL it finds when it attaches the file, writes to a WAL that exists as it is, and deletes
  the WAL at each checkpoint; so once the file is attached for writing, an empty WAL of mode 0600 is put in place
  (`private_file`), and the store's DuckDB checkpoints only when a unit of work ends, never within one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def private_file(path: Path) -> None:
    """`path` exists and only its owner may read or write it: made empty with mode 0600 if missing, else given
    that mode if others could read or write it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)


def made_privately(path: Path, make: Callable[[Path], None]) -> None:
    """Put at `path` (mode 0600) the file `make(p)` makes at `p`, whatever mode `make` gives it: `p` is in a folder
    beside `path` that only the owner can enter. A file that appeared at `path` meanwhile is kept."""
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.new-", dir=path.parent))  # mode 0700
    try:
        made = staging / path.name
        make(made)
        made.chmod(0o600)
        with contextlib.suppress(FileExistsError):
            os.link(made, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
