"""lcap's import graph by sub-package (every lcap import, top-level or inside a function), as a Mermaid chart.

    .venv/bin/python scripts/import_graph.py    (from the repository root; docs/architecture.md shows its output)

A name imported from a stage's face counts as an import of the module the face takes it from. Module by module
the graph has no cycle (tests/unit/test_structure.py); between sub-packages an arrow both ways means
modules of each import modules of the other, never the same ones.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from lcap.faces import face_names

STAGES = ("capture", "dataset", "loop", "serve", "train", "ui")
FACES = {f"lcap.{stage}" for stage in STAGES}
PACKAGE_DIRS: dict[str, str] = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def modules() -> dict[str, Path]:
    """Every lcap module and its file (the vLLM plugin runs in vLLM's venv, not as an lcap module)."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in Path(folder).rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] == "vllm_plugin":
                continue
            found[".".join((package, *(p for p in parts if p != "__init__")))] = path
    return found


def group(module: str) -> str:
    """The box a module is drawn in: its stage's sub-package, its stage, the CLI or the core."""
    parts = module.split(".")
    if module in ("lcap.cli", "lcap.__main__"):
        return "cli"
    if len(parts) < 2 or parts[1] not in STAGES:
        return "core"
    if len(parts) >= 3 and (Path(PACKAGE_DIRS[f"lcap.{parts[1]}"]) / parts[2]).is_dir():
        return f"{parts[1]}.{parts[2]}"
    return parts[1]


def edges(known: dict[str, Path]) -> set[tuple[str, str]]:
    found = set()
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lcap":
                face = face_names(known[node.module].with_suffix(".pyi")) if node.module in FACES else {}
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in known
                    else face[a.name][0]
                    if a.name in face
                    else node.module
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "lcap"]
            else:
                continue
            found.update((group(module), group(t)) for t in targets if group(t) != group(module))
    return found


def main() -> None:
    print("graph LR")
    for source, target in sorted(edges(modules())):
        print(f"  {source.replace('.', '_')}[{source}] --> {target.replace('.', '_')}[{target}]")


if __name__ == "__main__":
    main()
