"""The machine a benchmark's figures come from, printed with them (CPU model, cores, vector extensions, load), and
what its processes cost, read from /proc (Linux): one reading of a process's stat file for every benchmark."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu() -> str:
    """`MODEL, N cores, AVX-512 | AVX2 only | no AVX2, load L` (the same code runs at about half speed without
    AVX-512 on this project's machines)."""
    model, flags = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        flags = info
        for line in info.splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    vector = "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags else "no AVX2"
    return f"{model}, {os.cpu_count()} cores, {vector}, load {os.getloadavg()[0]:.1f}"


@dataclass(frozen=True)
class ProcStat:
    """What /proc/PID/stat says of a process: its name, parent, process group, CPU-seconds (user + system) with
    or without its reaped children's, and when it started (seconds of the boot clock, CLOCK_BOOTTIME)."""

    pid: int
    comm: str
    ppid: int
    pgrp: int
    cpu: float
    cpu_with_children: float
    started: float


def proc_stat(pid: int) -> ProcStat | None:
    """`pid`'s stat, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    own = int(rest[11]) + int(rest[12])
    with_children = own + int(rest[13]) + int(rest[14])
    return ProcStat(pid, comm, int(rest[1]), int(rest[2]), own / TICK, with_children / TICK, int(rest[19]) / TICK)


def processes() -> Iterator[ProcStat]:
    """Every process there is now (those that end meanwhile are left out)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None:
            yield stat


def cmdline(pid: int) -> bytes:
    """`pid`'s command line (NUL-separated), empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
