"""A stage's public face: the names other stages may import from it, each loaded on first use.

A stage's `__init__.pyi` lists its face, one `from lcap.<stage>.<module> import Name as Name` line a name: what type
checkers read, and what `attach_face` reads at run time to import a name's module the first time the name is asked
for. So `from lcap.capture import CaptureProxy` loads the proxy's modules, and importing the stage alone (its
commands, for `lcap --help`) loads none of them. tests/unit/test_structure.py holds other stages to these names."""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def face_names(stub: Path) -> dict[str, tuple[str, str]]:
    """Each name a face stub lists -> (the module it comes from, its name there)."""
    names = {}
    for node in ast.parse(stub.read_text(), str(stub)).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
    return names


def attach_face(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for a stage's `__init__.py`, from the `__init__.pyi` beside it."""
    names = face_names(Path(init_file).with_suffix(".pyi"))

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = names[name]
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)  # asked once: later lookups find it without this hook
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__, sorted(names)
