#!/usr/bin/env bash
# Lint and types, run by scripts/test.sh before the tests: ruff (lint + format check) over the tree, and mypy
# over lcap's packages and the vLLM plugin (serve/vllm_plugin; vLLM lives in a venv of its own, so mypy sees its
# names as Any and checks the plugin's own code). mypy finds a package in a folder of its name, while lcap maps
# `lcap.capture` to `capture/` and so on (pyproject's package-dir), so it checks a tree of links laid out as lcap
# imports.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${LCAP_VENV:-.venv}/bin
"$bin/ruff" check --quiet .
"$bin/ruff" format --check --quiet .
tree=build/typecheck
rm -rf "$tree"
"$bin/python" - "$tree" <<'PY'
import sys, tomllib
from pathlib import Path

tree = Path(sys.argv[1])
dirs = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for package, folder in dirs.items():
    for source in [*Path(folder).rglob("*.py"), *Path(folder).rglob("*.pyi")]:  # .pyi: each stage's face
        relative = source.relative_to(folder)
        if relative.parts[0] == "vllm_plugin":  # checked on its own below
            continue
        target = tree.joinpath(*package.split("."), relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source.resolve())
PY
"$bin/mypy" "$tree/lcap" serve/vllm_plugin
