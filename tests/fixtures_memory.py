"""Memory-bound tests: compression bombs built without ever holding what they decode to (`json_bomb`), and a
memory cgroup for tests whose regression would take the machine's memory: the processes put in it are OOM-killed
at its limit, so a test that fails that way fails alone (cgroups v1, as on the test machines; the test is skipped
where no writable v1 memory hierarchy exists).

    with memory_cgroup(512 << 20) as cgroup:
        proc = subprocess.Popen([...], preexec_fn=cgroup.enter)  # the child and everything it starts
        ...
    assert cgroup.oom_kills == 0
"""

from __future__ import annotations

import itertools
import os
import struct
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import brotli
import pytest
import zstandard

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
_numbers = itertools.count()
FILL = b"a" * (1 << 20)
PREFIX = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "'
SUFFIX = b'"}]}'


def json_bomb(coding: str, mebibytes: int, prefix: bytes = PREFIX, suffix: bytes = SUFFIX) -> bytes:
    """JSON holding a string of `mebibytes` MiB, in `coding`, built without ever holding it: gzip as one deflate
    stream of blocks that each restart the dictionary (so one megabyte's block repeats), zstd as frames one after
    another, brotli compressed as it streams."""
    if coding == "gzip":

        def block(data: bytes, last: bool = False) -> bytes:
            compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
            return compressor.compress(data) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_FULL_FLUSH)

        crc = zlib.crc32(prefix)
        for _ in range(mebibytes):
            crc = zlib.crc32(FILL, crc)
        crc = zlib.crc32(suffix, crc)
        size = len(prefix) + (mebibytes << 20) + len(suffix)
        header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
        body = block(prefix) + block(FILL) * mebibytes + block(suffix, last=True)
        return header + body + struct.pack("<II", crc, size & 0xFFFFFFFF)
    if coding == "zstd":
        frame = zstandard.ZstdCompressor().compress
        return frame(prefix) + frame(FILL) * mebibytes + frame(suffix)
    compressor = brotli.Compressor(quality=1)
    parts = [compressor.process(prefix)]
    parts += [compressor.process(FILL) for _ in range(mebibytes)]
    return b"".join(parts) + compressor.process(suffix) + compressor.finish()


class MemoryCgroup:
    """One v1 memory cgroup: put processes in it, read what they used and whether the limit killed one."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit
        self.oom_kills = 0  # read when the cgroup is removed

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def enter(self) -> None:
        """Put the calling process in: a `preexec_fn`, so that a child and all it starts run inside."""
        self.add(os.getpid())

    def pids(self) -> list[int]:
        return [int(line) for line in (self.path / "cgroup.procs").read_text().split()]

    def peak(self) -> int:
        """The most memory its processes used at once (bytes)."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def kills(self) -> int:
        """Processes the limit killed so far (0 on a kernel that does not count them: then see `peak`)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0


@contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup of `limit` bytes (no swap beyond it); on exit, any process still in it goes back to the
    root cgroup and the cgroup is removed."""
    if not os.access(MEMORY_ROOT / "cgroup.procs", os.W_OK):
        pytest.skip(f"needs a writable cgroup v1 memory hierarchy at {MEMORY_ROOT}")
    path = MEMORY_ROOT / f"lcap-test-{os.getpid()}-{next(_numbers)}"
    path.mkdir()
    cgroup = MemoryCgroup(path, limit)
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit))
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
        yield cgroup
    finally:
        cgroup.oom_kills = cgroup.kills()
        for _ in range(50):
            for pid in cgroup.pids():
                try:
                    (MEMORY_ROOT / "cgroup.procs").write_text(f"{pid}\n")
                except ProcessLookupError:
                    pass
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
