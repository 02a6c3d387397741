"""Optional parts stay optional: Ray (the `ray` extra), the UI (the `ui` extra: starlette, uvicorn, jinja2) and
transparent mode (netns, its DNS, iptables). `lcap` and its core commands load none of them, and using one
without what it needs is a one-line error that says what to install."""

from __future__ import annotations

import ast
import importlib.abc
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from lcap.capture.reach import netns
from lcap.cli import DOCTOR_CHECKS, STATUS_SECTIONS, app
from lcap.config import LcapError
from lcap.ray_cluster import connect

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("ray", "starlette", "uvicorn", "jinja2")
TRANSPARENT = ("lcap.capture.reach.netns", "lcap.capture.reach.dns", "lcap.capture.reach.netns_init")
# The CLI registers `lcap ui` (its flags are UiOptions'); nothing else of lcap.ui loads before `lcap ui` runs.
UI_REGISTRATION = ("lcap.ui", "lcap.ui.commands", "lcap.ui.options")
# The modules each core command runs; the CLI imports them when the command runs.
CORE_COMMANDS = {
    "proxy": ("lcap.capture.run", "lcap.capture.proxy.server"),
    "episode": ("lcap.capture.trust.credentials", "lcap.store"),
    "ca": ("lcap.capture.trust.ca",),
    "collect": ("lcap.dataset.collect.episodes",),
    "build-dataset": ("lcap.dataset.build.builder", "lcap.dataset.build.explain"),
    "reward": ("lcap.dataset.collect.rewards",),
    "train": ("lcap.train.grpo",),
    "serve": ("lcap.serve.server",),
    "deploy": ("lcap.serve.deploy",),
    "sql": ("lcap.store", "lcap.sql_output"),
    "status": ("lcap.status", *STATUS_SECTIONS),
    "doctor": ("lcap.doctor", *(m for m in DOCTOR_CHECKS if m != "lcap.ui.doctor")),
}


def _modules() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in config.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[0] == "vllm_plugin":  # runs inside vLLM's venv, not an lcap module
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top_level_imports(source: str) -> set[str]:
    """Every module a file's import statements name at import time: at the top, in `try`/`if`, in class bodies;
    not inside a function, nor under `if TYPE_CHECKING:`. `from a import b` names `a.b` too (b may be a module)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                visit(node.body)

    visit(ast.parse(source).body)
    return names


def loaded_by(entries: tuple[str, ...], modules: dict[str, Path]) -> set[str]:
    """What importing `entries` loads: lcap's modules through their top-level imports (and the packages above
    them), and the outside modules they name."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for cut in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            prefix = ".".join(parts[:cut])
            if prefix in seen or (prefix not in modules and prefix.startswith("lcap.")):
                continue  # `from lcap.x import name`: a name, not a module
            seen.add(prefix)
            if prefix in modules:
                todo.extend(top_level_imports(modules[prefix].read_text()))
    return seen


def forbidden(loaded: set[str]) -> list[str]:
    bad = [m for m in loaded if m.split(".")[0] in EXTRAS or m in TRANSPARENT]
    bad += [m for m in loaded if m.startswith("lcap.ui.") and m not in UI_REGISTRATION]
    return sorted(bad)


def test_the_cli_loads_no_optional_part():
    modules = _modules()
    assert set(TRANSPARENT) <= set(modules) and set(UI_REGISTRATION) <= set(modules)
    assert forbidden(loaded_by(("lcap", "lcap.cli", "lcap.__main__"), modules)) == []


@pytest.mark.parametrize("command", sorted(CORE_COMMANDS))
def test_core_commands_load_no_optional_part(command):
    modules = _modules()
    entries = CORE_COMMANDS[command]
    assert set(entries) <= set(modules), "a command module moved: update CORE_COMMANDS"
    assert forbidden(loaded_by(entries, modules)) == []


def test_the_check_sees_an_optional_part_loaded(tmp_path):
    """The check above fails on a core module importing an extra or transparent mode at its top, through a chain;
    an import inside a function or under TYPE_CHECKING is not loaded and passes."""
    files = {
        "lcap.core_a": "import lcap.core_b\nfrom lcap import core_c\n",
        "lcap.core_b": "from lcap.capture.reach.netns import Namespaces\n",
        "lcap.core_c": "try:\n    import ray.train\nexcept ImportError:\n    ray = None\n",
        "lcap.core_d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import starlette\n"
        "def serve():\n    import uvicorn\n    from lcap.ui.app import create_app\n",
        "lcap.core_e": "from lcap.ui.server import serve\n",
    }
    modules = dict(_modules())
    for name, text in files.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    assert forbidden(loaded_by(("lcap.core_a",), modules)) == [
        "lcap.capture.reach.dns",
        "lcap.capture.reach.netns",
        "ray",
        "ray.train",
    ]
    assert forbidden(loaded_by(("lcap.core_d",), modules)) == []
    assert {"lcap.ui.server", "uvicorn", "starlette", "jinja2"} <= set(forbidden(loaded_by(("lcap.core_e",), modules)))


# --- without the extra: a one-line error naming it -------------------------------------------------------------


class _Uninstalled(importlib.abc.MetaPathFinder):
    """Finds `package` and its submodules nowhere, as an environment without them would."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == self.package or name.startswith(self.package + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make `package` unimportable, as if its extra were not installed."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Uninstalled(package), *sys.meta_path])


def _one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize("missing", ["starlette", "uvicorn", "jinja2"])
def test_lcap_ui_without_the_ui_extra(monkeypatch, tmp_path, missing):
    _hide(monkeypatch, missing)
    for loaded in ("lcap.ui.server", "lcap.ui.app"):
        monkeypatch.delitem(sys.modules, loaded, raising=False)
    result = CliRunner().invoke(app, ["ui", "--db", str(tmp_path / "lcap.duckdb")])
    assert result.exit_code == 2, result.output
    assert (
        _one_line(result.output) == f"lcap: lcap ui needs the ui extra: pip install -e '.[ui]' ({missing} is missing)"
    )


def test_ray_without_the_ray_extra(monkeypatch):
    _hide(monkeypatch, "ray")
    with pytest.raises(LcapError) as caught:
        connect("auto")
    assert str(caught.value) == "--ray needs the ray extra: pip install -e '.[ray]' (scripts/setup.sh does)"


def test_collect_ray_without_the_ray_extra(monkeypatch, tmp_path):
    _hide(monkeypatch, "ray")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "1"}\n')
    result = CliRunner().invoke(
        app, ["collect", "--tasks", str(tasks), "--ray", "auto", "--db", str(tmp_path / "lcap.duckdb"), "--", "true"]
    )
    assert result.exit_code == 2, result.output
    assert (
        _one_line(result.output) == "lcap: --ray needs the ray extra: pip install -e '.[ray]' (scripts/setup.sh does)"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_transparent_without_iptables(monkeypatch, tmp_path):
    """Transparent mode's missing piece is a system tool: the error names it and how to install it."""
    monkeypatch.setenv("LCAP_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(netns, "restore_program", lambda: None)
    result = CliRunner().invoke(app, ["proxy", "--transparent", "--db", str(tmp_path / "lcap.duckdb"), "--", "true"])
    assert result.exit_code == 2, result.output
    assert _one_line(result.output) == (
        "lcap: --transparent needs iptables (iptables-restore; `apt-get install iptables`, or scripts/setup.sh); "
        "the default mode (without --transparent) still works"
    )
