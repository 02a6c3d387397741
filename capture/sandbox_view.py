"""What of the host a `--sandbox` agent sees (capture/sandbox.py builds the rest of its sandbox).

By default only what a program needs to run, read-only:

- the system folders (`SYSTEM`: /usr, /bin, /sbin, /lib*, /etc), /etc without its secrets (`SECRETS`: the
  password and group shadows, sudo's rules, TLS private keys, the SSH host keys), each shown empty;
- what the agent's command runs where that is elsewhere (`command_paths`): the folder of each file it names (a
  script comes with its siblings), a venv and the installation of the Python in it (named, or a script's `#!`
  interpreter), and `$LCAP_HARNESS_DIR` when set (scripts/harnesses/);
- for a verifier, this Python's installation, its import path and lcap's own packages (`python_paths`);
- and each `--sandbox-share` folder.

Nothing else of the host is there (not /root, /home, /var, /opt, the host's /tmp or other runs' folders): the
sandbox's root is an empty tmpfs, its /tmp a private one.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
SECRETS = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssl/private",
    "/etc/security/opasswd",
)
SHEBANG_DEPTH = 2  # a script's interpreter may be a script too (env, a wrapper), this many times


def system_args() -> list[str]:
    """bubblewrap's arguments that show the system folders (a merged-/usr link as the same link) and hide /etc's
    secrets: a file becomes /dev/null, a folder an empty tmpfs."""
    args: list[str] = []
    for path in SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in (*SECRETS, *sorted(str(p) for p in Path("/etc/ssh").glob("ssh_host_*_key"))):
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--tmpfs", path]
        elif os.path.lexists(path):
            args += ["--ro-bind", "/dev/null", path]
    return args


def in_system(path: Path) -> bool:
    """Whether `path` (resolved) is in a system folder the sandbox shows anyway."""
    return any(path.is_relative_to(Path(s).resolve()) for s in SYSTEM)


def command_paths(argv: Sequence[str], env: Mapping[str, str]) -> list[Path]:
    """The folders outside the system ones the agent's command needs: those of the program (named by its path, or
    a venv's found on the environment's PATH) and of each absolute file argument, with their venvs and Pythons;
    `$LCAP_HARNESS_DIR`."""
    found: list[Path] = []
    program = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    if program and not os.path.isabs(argv[0]) and not _in_venv(Path(program)):
        program = None  # a bare name stays the system's, unless a venv's (a pyenv shim would run pyenv, not shown)
    for arg in (program, *argv[1:]):
        if arg and os.path.isabs(arg) and os.path.isfile(arg):
            found += _program(Path(arg), SHEBANG_DEPTH)
    harnesses = env.get("LCAP_HARNESS_DIR")
    if harnesses and os.path.isdir(harnesses):
        found.append(Path(harnesses))
    return outside_system(found)


def python_paths() -> list[Path]:
    """This Python as a child of it (a verifier's) needs it: its installation and venv, each folder on its import
    path, and lcap's packages (an editable install maps them from anywhere)."""
    found = [Path(sys.prefix), Path(sys.base_prefix), *(Path(p) for p in sys.path if p and os.path.isdir(p))]
    for name, module in list(sys.modules.items()):
        if name == "lcap" or name.startswith("lcap."):
            found += [Path(p) for p in getattr(module, "__path__", ())]
    return outside_system(found)


def outside_system(paths: Iterable[Path]) -> list[Path]:
    """`paths` resolved, without those the system folders or another of them hold, shortest first."""
    out: list[Path] = []
    for path in sorted({Path(p).resolve() for p in paths if os.path.exists(p)}, key=lambda p: len(p.parts)):
        if path != Path("/") and not in_system(path) and not any(path.is_relative_to(o) for o in out):
            out.append(path)
    return out


def share_args(paths: Iterable[Path]) -> list[str]:
    """bubblewrap's arguments that show each of `paths` read-only at its own path, the folders above it made
    enterable (bubblewrap makes the ones a bind needs root's alone)."""
    args: list[str] = []
    for path in paths:
        args += folders(Path("/"), path) + ["--ro-bind", str(path), str(path)]
    return args


def folders(top: Path, path: Path) -> list[str]:
    """bubblewrap's arguments that make the folders strictly between `top` and `path` that others may enter."""
    between = [p for p in reversed(path.parents) if p.is_relative_to(top) and p != top]
    return [arg for p in between for arg in ("--perms", "0755", "--dir", str(p))]


def _program(path: Path, depth: int) -> list[Path]:
    """A file the command names: its folder (as named and as resolved); where it is a venv's program, the venv and
    its real file's installation (`prefix/bin/python3.x` -> `prefix`); for a script, its interpreter likewise."""
    real = path.resolve()
    found = [path.parent, real.parent]
    for file in (path, real):
        if file.parent.name == "bin" and not in_system(file.parent.resolve()):
            found.append(file.parent.parent)  # a venv (pyvenv.cfg, site-packages) or an installation (lib/)
    if depth > 0:
        interpreter = _shebang(real)
        if interpreter:
            found += _program(interpreter, depth - 1)
    return found


def _in_venv(program: Path) -> bool:
    return (program.parent.parent / "pyvenv.cfg").is_file()


def _shebang(path: Path) -> Path | None:
    """A script's `#!` interpreter (`/usr/bin/env NAME`: NAME on the PATH), or None."""
    try:
        with open(path, "rb") as f:
            head = f.readline(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) == "env" and len(words) > 1:
        named = shutil.which(words[-1] if words[1].startswith("-") else words[1])
        return Path(named) if named else None
    return Path(words[0]) if os.path.isfile(words[0]) else None
