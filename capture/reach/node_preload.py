"""Node 20 ignores proxy variables: a `--require` preload routes Node children through the proxy.

`lcap setup node` installs pinned npm packages into lcap's home; `preload.js` (shipped in this
package) makes undici's `EnvHttpProxyAgent` the global dispatcher, so `fetch` (and every SDK built
on it, such as the openai and anthropic Node SDKs) honours HTTPS_PROXY, and points the `http` /
`https` modules' global agents at the proxy (https-proxy-agent / http-proxy-agent, NO_PROXY
honoured), for clients built on them. Clients that bring their own agent keep it. Without the
install the preload does nothing and says so only when LCAP_DEBUG is set.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lcap.config import LcapError, lcap_home
from lcap.installs import announce, run_install

# undici 6.x matches Node 20's built-in fetch dispatcher interface; the 7.x proxy agents are CommonJS.
PACKAGES = {"undici": "6.21.3", "https-proxy-agent": "7.0.6", "http-proxy-agent": "7.0.2"}
PRELOAD = Path(__file__).with_name("preload.js")


def node_dir() -> Path:
    """Where the preload's npm packages live (`LCAP_NODE_DIR`, default `<lcap home>/node`)."""
    return Path(os.environ.get("LCAP_NODE_DIR") or lcap_home() / "node")


def installed_version(package: str) -> str | None:
    try:
        return json.loads((node_dir() / "node_modules" / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def _all_installed() -> bool:
    return all(installed_version(name) == version for name, version in PACKAGES.items())


def install_node_preload() -> str:
    """Install the preload's npm packages into lcap's home (idempotent); return what was done."""
    wanted = ", ".join(f"{name} {version}" for name, version in PACKAGES.items())
    if _all_installed():
        return f"{wanted} already in {node_dir()}"
    npm = shutil.which("npm")
    if npm is None:
        return "npm not found: Node agents will not go through the proxy (install Node 18+ and rerun)"
    target = node_dir()
    target.mkdir(parents=True, exist_ok=True)
    announce(f"installing {wanted} into {target} with npm", "a few MB", "seconds")
    argv = [npm, "install", "--prefix", str(target), "--no-audit", "--no-fund", "--loglevel=error"]
    argv += [f"{name}@{version}" for name, version in PACKAGES.items()]
    try:
        run_install(argv, "install the Node preload's packages")
    except LcapError:
        return f"npm could not install {wanted} (offline?): its last lines are above"
    if not _all_installed():
        return f"npm could not install {wanted}: {target} does not hold them afterwards"
    return f"installed {wanted} into {target}"


def node_options(existing: str | None) -> str:
    """NODE_OPTIONS with lcap's preload required (appended to what is there, once)."""
    path = str(PRELOAD)
    flag = f"--require {json.dumps(path) if ' ' in path else path}"
    if existing and path in existing:
        return existing
    return f"{existing} {flag}" if existing else flag


def preload_env() -> dict[str, str]:
    return {"LCAP_NODE_MODULES": str(node_dir() / "node_modules")}
