"""The dataset stage's `lcap doctor` checks: what `lcap collect --sandbox` needs (bubblewrap, root, cgroups v1)."""

from __future__ import annotations

import os
import shutil
import subprocess

from lcap.capture.sandbox import NAMESPACES, PACKAGE, missing
from lcap.doctor import Context, Result, check


@check("sandbox.bubblewrap", section="optional", required=False)
def bubblewrap(ctx: Context) -> Result:
    reason = missing()
    if reason is not None:
        fix = f"apt-get install {PACKAGE}" if shutil.which("bwrap") is None else "run lcap as root on cgroups v1"
        return Result.fail(f"{reason} (needed only by collect --sandbox)", fix)
    argv = ["bwrap", *NAMESPACES, "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return Result.fail("bwrap did not end within 30 s", "run `bwrap --ro-bind / / true` by hand to see why")
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return Result.fail(f"bwrap cannot make a sandbox: {last}", "run as root on a kernel with namespaces")
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return Result.ok(f"{version or 'bwrap'}: a sandbox can be made")
