"""Node's built-in fetch ignores proxy variables: a `--require` preload routes it through the proxy.

`lcap setup node` installs a pinned `undici` into lcap's home with npm; `preload.js` (shipped in
this package) makes its `EnvHttpProxyAgent` Node's global dispatcher, so `fetch` (and every SDK
built on it, such as the openai and anthropic Node SDKs) honours HTTPS_PROXY. Without the install
the preload does nothing and says so only when LCAP_DEBUG is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from lcap.config import lcap_home

UNDICI_VERSION = "6.21.3"  # the 6.x line matches Node 20's built-in fetch dispatcher interface
PRELOAD = Path(__file__).with_name("preload.js")


def node_dir() -> Path:
    """Where the preload's npm packages live (`LCAP_NODE_DIR`, default `<lcap home>/node`)."""
    return Path(os.environ.get("LCAP_NODE_DIR") or lcap_home() / "node")


def installed_version() -> str | None:
    try:
        return json.loads((node_dir() / "node_modules" / "undici" / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install_node_preload() -> str:
    """Install the preload's npm packages into lcap's home (idempotent); return what was done."""
    if installed_version() == UNDICI_VERSION:
        return f"undici {UNDICI_VERSION} already in {node_dir()}"
    npm = shutil.which("npm")
    if npm is None:
        return "npm not found: Node agents' fetch will not go through the proxy (install Node 18+ and rerun)"
    target = node_dir()
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "install", "--prefix", str(target), "--no-audit", "--no-fund", "--loglevel=error",
         f"undici@{UNDICI_VERSION}"],
        capture_output=True, text=True,
    )
    if result.returncode != 0 or installed_version() != UNDICI_VERSION:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"npm could not install undici {UNDICI_VERSION} (offline?): {last[0]}"
    return f"installed undici {UNDICI_VERSION} into {target}"


def node_options(existing: str | None) -> str:
    """NODE_OPTIONS with lcap's preload required (appended to what is there, once)."""
    path = str(PRELOAD)
    flag = f"--require {json.dumps(path) if ' ' in path else path}"
    if existing and path in existing:
        return existing
    return f"{existing} {flag}" if existing else flag


def preload_env() -> dict[str, str]:
    return {"LCAP_NODE_MODULES": str(node_dir() / "node_modules")}
