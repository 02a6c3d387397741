"""Node 20 ignores proxy variables: a `--require` preload routes Node children through the proxy.

`lcap setup node` installs pinned npm packages into lcap's home; `preload.js` (shipped in this
package) makes undici's `EnvHttpProxyAgent` the global dispatcher, so `fetch` (and every SDK built
on it, such as the openai and anthropic Node SDKs) honours HTTPS_PROXY, and points the `http` /
`https` modules' global agents at the proxy (https-proxy-agent / http-proxy-agent, NO_PROXY
honoured), for clients built on them. Clients that bring their own agent keep it. Without the
install the preload does nothing and says so only when LCAP_DEBUG is set, so an agent lcap can see runs on Node
(`runs_node`) is never started before the install: `ensure_node_capture` installs it on first need, or refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from lcap.config import LcapError, lcap_home
from lcap.installs import announce, run_install

# undici 6.x matches Node 20's built-in fetch dispatcher interface; the 7.x proxy agents are CommonJS.
PACKAGES = {"undici": "6.21.3", "https-proxy-agent": "7.0.6", "http-proxy-agent": "7.0.2"}
PRELOAD = Path(__file__).with_name("preload.js")
# Programs that run JavaScript on Node: the agent's argv[0] (or a script whose shebang names one).
NODE_PROGRAMS = frozenset({"node", "nodejs", "npx", "npm", "pnpm", "yarn", "tsx", "ts-node"})
SHEBANG_BYTES = 256  # enough for `#!/usr/bin/env -S node --flags`


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


def runs_node(argv: Sequence[str]) -> bool:
    """Whether `argv` starts Node: a Node program (through `env` too), or a script whose shebang names one."""
    words = _program(argv)
    if not words:
        return False
    if Path(words[0]).name in NODE_PROGRAMS:
        return True
    found = shutil.which(words[0]) if os.sep not in words[0] else words[0]
    try:
        with open(found or "", "rb") as script:
            head = script.read(SHEBANG_BYTES).split(b"\n", 1)[0]
    except OSError:
        return False
    shebang = _program(head[2:].decode(errors="replace").split()) if head.startswith(b"#!") else []
    return bool(shebang) and Path(shebang[0]).name in NODE_PROGRAMS


def _program(argv: Sequence[str]) -> list[str]:
    """`argv` from the program `env` would run: env [-S] [-u NAME] [NAME=value ...] PROGRAM ARGS."""
    words = list(argv)
    while words and Path(words[0]).name == "env":
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):
            words = words[2:] if words[0] in ("-u", "--unset", "-C", "--chdir") else words[1:]
    return words


def ensure_node_capture(argv: Sequence[str]) -> None:
    """Before an agent that runs on Node starts: install the preload on first need (as `lcap setup node` does),
    or refuse, since without it the agent's calls would leave uncaptured (Node ignores HTTPS_PROXY)."""
    if not runs_node(argv) or _all_installed():
        return
    print("lcap: the agent runs on Node, which lcap captures through its preload: installing it", file=sys.stderr)
    done = install_node_preload()
    if not _all_installed():
        raise LcapError(
            f"the agent runs on Node, whose calls would bypass lcap without its preload ({done}): "
            "run `lcap setup node`, then run this again"
        )


def node_options(existing: str | None) -> str:
    """NODE_OPTIONS with lcap's preload required (appended to what is there, once)."""
    path = str(PRELOAD)
    flag = f"--require {json.dumps(path) if ' ' in path else path}"
    if existing and path in existing:
        return existing
    return f"{existing} {flag}" if existing else flag


def preload_env() -> dict[str, str]:
    return {"LCAP_NODE_MODULES": str(node_dir() / "node_modules")}
