"""The shape of the code: imports flow one way, core <- capture <- dataset <- train/serve <- loop <- CLI."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A stage may import the core, itself and the stages of lower layers; train and serve are peers and
# import neither each other nor anything above them, and so are loop and ui.
LAYERS = {"core": 0, "capture": 1, "dataset": 2, "train": 3, "serve": 3, "loop": 4, "ui": 4, "cli": 5}
STAGES = ("capture", "dataset", "train", "serve", "loop", "ui")


def _package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in config.items()}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] == "vllm_plugin":  # runs inside vLLM's venv, not an lcap module
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def stage_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] in (["lcap", "cli"], ["lcap", "__main__"]):
        return "cli"
    if len(parts) > 1 and parts[1] in STAGES:
        return parts[1]
    return "core"


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every `lcap...` module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "lcap")
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "lcap"
        ):
            named = {f"{node.module}.{a.name}" for a in node.names} & known  # `from lcap import cli` names a module
            found.update(named or {node.module})
    return found


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    known = set(_modules())
    for module, path in sorted(modules.items()):
        mine = stage_of(module)
        for target in sorted(imports_of(path, known)):
            theirs = stage_of(target)
            if theirs == mine:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs})")
    return bad


def test_imports_flow_one_way():
    modules = _modules()
    assert {stage_of(m) for m in modules} == set(LAYERS), "every layer has modules"
    assert violations(modules) == []


def test_the_check_sees_a_backward_import(tmp_path):
    """The check above would fail on the cycles the layout forbids (a stage importing the CLI, or a later stage)."""
    capture = tmp_path / "capture.py"
    capture.write_text("def f():\n    from lcap.dataset.build.builder import build_dataset\n")
    serve = tmp_path / "serve.py"
    serve.write_text("from lcap.train.grpo import TrainOptions\n")
    dataset = tmp_path / "dataset.py"
    dataset.write_text("from lcap import cli\nimport lcap.cli\n")
    found = violations({"lcap.capture.x": capture, "lcap.serve.x": serve, "lcap.dataset.x": dataset})
    assert found == [
        "lcap.capture.x (capture) imports lcap.dataset.build.builder (dataset)",
        "lcap.dataset.x (dataset) imports lcap.cli (cli)",
        "lcap.serve.x (serve) imports lcap.train.grpo (train)",
    ]


@pytest.mark.parametrize("stage", STAGES)
def test_each_stages_commands_import_on_their_own(stage):
    """A stage's commands load without the CLI module (they take shared options from lcap.cli_options)."""
    code = (
        f"import sys, typer; import lcap.{stage}.commands as c; app = typer.Typer(); c.register(app); "
        "assert 'lcap.cli' not in sys.modules, 'lcap.cli was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
