#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: the project's venv (.venv, or $LCAP_VENV) with lcap
# installed editable, the Node preload's npm packages, vLLM in a venv of its own (its pins
# clash with mitmproxy's), Debian's Chromium for the UI's browser tests, iptables for
# `--transparent`, bubblewrap for `--sandbox` and a JDK for the JVM tests. Re-running it only checks what is
# already there.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LCAP_VENV:-.venv}
py=$venv/bin/python

[ -x "$py" ] || python3 -m venv "$venv"
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch==2.13.0   # the CPU build; unpinned torch pulls GBs of CUDA
  fi
fi
stamp=$venv/.lcap-installed
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$py" -m pip install -q -e ".[train,test,ui,ray]"
  echo "$want" > "$stamp"
fi
# lcap's own modules byte-compiled (only what changed): where PYTHONDONTWRITEBYTECODE is set, as on this project's
# machines, every process would otherwise compile again each lcap module it imports, every `lcap` command included.
folders=$("$py" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].values())')
"$py" -m compileall -q -j 0 $folders
# The UI's browser tests drive the system Chromium (Playwright's own browser downloads are not reachable).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium
fi
# `--transparent` rewrites the agent's connections with iptables inside its own network namespace; the JVM agents
# of the capture tests run from one source file (`java File.java` needs a JDK, not only a JRE), one of them on OkHttp.
missing=()
PATH=$PATH:/usr/sbin:/sbin command -v iptables-restore >/dev/null 2>&1 || missing+=(iptables)
command -v javac >/dev/null 2>&1 || missing+=(default-jdk-headless)
[ -f /usr/share/java/okhttp.jar ] || missing+=(libokhttp-java)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)   # `collect --sandbox`: each episode in a sandbox
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
"$venv/bin/lcap" setup "$@"
