#!/usr/bin/env bash
# Install the harnesses lcap is tested with, at the versions in ./versions, into LCAP_HARNESS_DIR
# (default ~/.cache/lcap-harnesses): npm ones into its node_modules, each Python one into a venv of its
# own (their pins clash with lcap's), made with LCAP_HARNESS_PYTHON (default python3). Idempotent: what is there
# at the right version is left alone.
#   scripts/harnesses/install.sh                 # all of them
#   scripts/harnesses/install.sh codex aider     # some: codex claude opencode aider mini
# For `lcap collect --sandbox`, whose agents run as nobody: a folder and a Python every user can reach, e.g.
#   LCAP_HARNESS_DIR=/var/cache/lcap-harnesses LCAP_HARNESS_PYTHON=/usr/bin/python3 scripts/harnesses/install.sh codex mini
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/versions"
dir=${LCAP_HARNESS_DIR:-$HOME/.cache/lcap-harnesses}
python=${LCAP_HARNESS_PYTHON:-python3}
mkdir -p "$dir"
wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=(codex claude opencode aider mini)

npm_package() {  # npm_package NAME VERSION
  local installed
  installed=$(node -p "require('$dir/node_modules/$1/package.json').version" 2>/dev/null || true)
  [ "$installed" = "$2" ] && return
  npm install --prefix "$dir" --no-audit --no-fund --loglevel=error --save-exact "$1@$2" >&2
}

pip_package() {  # pip_package VENV PACKAGE VERSION
  local venv=$dir/$1
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  [ "$("$venv/bin/python" -c "from importlib.metadata import version; print(version('$2'))" 2>/dev/null)" = "$3" ] && return
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$2==$3" >&2
}

for name in "${wanted[@]}"; do
  case $name in
    codex) npm_package @openai/codex "$CODEX_VERSION" ;;
    claude) npm_package @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" ;;
    opencode) npm_package opencode-ai "$OPENCODE_VERSION" ;;
    aider) pip_package aider-venv aider-chat "$AIDER_VERSION" ;;
    mini) pip_package mini-venv mini-swe-agent "$MINI_SWE_AGENT_VERSION" ;;
    *) echo "install.sh: unknown harness $name (codex claude opencode aider mini)" >&2; exit 2 ;;
  esac
done
