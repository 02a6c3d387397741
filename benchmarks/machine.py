"""The machine a benchmark's figures come from, printed with them: CPU model, cores, vector extensions, load."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


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
