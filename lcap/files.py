"""Files written whole or not at all: a reader (another process, a resumed run, a Router looking for a new policy
record) sees the old file or the new one, never half of one.

The new content goes to a file of its own beside the target, made for this write (`O_EXCL`: no name another
process's file, or a link someone planted, could already hold), with its mode from the first byte, and is moved
over the target when it is complete; a write that fails leaves the target as it was and no file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path, *, mode: int = 0o666) -> Iterator[Path]:
    """A new, empty file beside `path` (`mode`, less the umask) for the block to write by its name, moved over `path`
    when the block ends; removed if the block fails."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: str | bytes, *, mode: int = 0o666) -> None:
    """Replace `path` with `data` (text is written as UTF-8), whole or not at all; the file has `mode`, less the umask,
    from its first byte."""
    with replacing(path, mode=mode) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
