"""`lcap doctor`'s check of the UI's optional part: the system Chromium its browser tests drive."""

from __future__ import annotations

import shutil
import subprocess

from lcap.doctor import Context, Result, check

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


@check("ui.chromium", section="optional", required=False)
def chromium(ctx: Context) -> Result:
    browser = next((found for name in CANDIDATES if (found := shutil.which(name))), None)
    if browser is None:
        return Result.fail(
            "no Chromium on PATH (only the UI's browser tests need it; `lcap ui` itself does not)",
            "apt-get install chromium (scripts/setup.sh does it)",
        )
    try:
        done = subprocess.run([browser, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Result.fail(f"{browser} --version: {exc}", "reinstall it (apt-get install --reinstall chromium)")
    if done.returncode:
        return Result.fail(
            f"{browser} --version exited {done.returncode}", "reinstall it (apt-get install --reinstall chromium)"
        )
    return Result.ok(done.stdout.strip() or browser)
