"""Rules kept in one place: the process's umask is never changed at run time (files are private by their modes:
lcap.private_files), every lock between processes on a file goes through lcap.locks, and every file written whole
or not at all through lcap.files."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOMES = {"lock": "lcap.locks", "replace": "lcap.files"}


def _modules() -> dict[str, Path]:
    """lcap's modules (as tests/unit/test_structure.py walks them) by name."""
    modules = {}
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[0] != "vllm_plugin":  # runs inside vLLM's venv, not an lcap module
                modules[".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return modules


def breaches(modules: dict[str, Path]) -> list[str]:
    """Where a module changes the umask, locks a file itself, or moves a file over another itself."""
    found = []
    for module, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            name = node.func.attr
            if owner == "os" and name == "umask":
                found.append(f"{module}:{node.lineno} changes the umask")
            elif owner == "fcntl" and name in ("flock", "lockf") and module != HOMES["lock"]:
                found.append(f"{module}:{node.lineno} locks a file itself")
            elif module != HOMES["replace"] and (
                (owner == "os" and name in ("replace", "rename"))
                # Path.replace(target): one argument (str.replace takes two, dataclass-like replaces keywords)
                or (name == "replace" and len(node.args) == 1 and not node.keywords)
            ):
                found.append(f"{module}:{node.lineno} replaces a file itself")
    return found


def test_umask_locks_and_atomic_writes_each_have_one_home():
    modules = _modules()
    assert {"lcap.locks", "lcap.files", "lcap.store"} <= set(modules)
    assert breaches(modules) == []


def test_the_check_sees_each_breach(tmp_path):
    (tmp_path / "a.py").write_text(
        "import fcntl, os\n"
        "def f(fd, tmp, path):\n"
        "    old = os."
        "umask(0o077)\n"  # split: a grep for the call finds none in lcap
        "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "    tmp.replace(path)\n"
        "    os.replace(tmp, path)\n"
        "    'text'.replace('t', 'x')\n"  # a string's replace is no file's
    )
    (tmp_path / "locks.py").write_text("import fcntl\ndef g(fd):\n    fcntl.flock(fd, fcntl.LOCK_SH)\n")
    modules = {"lcap.x.a": tmp_path / "a.py", "lcap.locks": tmp_path / "locks.py"}
    assert breaches(modules) == [
        "lcap.x.a:3 changes the umask",
        "lcap.x.a:4 locks a file itself",
        "lcap.x.a:5 replaces a file itself",
        "lcap.x.a:6 replaces a file itself",
    ]
