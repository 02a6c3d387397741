# Sourced by each harness adapter: where the harnesses are installed, and a private home per run.
#
# LCAP_HARNESS_DIR (default ~/.cache/lcap-harnesses) holds what install.sh puts there: node_modules/.bin
# for the npm harnesses, one venv per Python harness. A harness found there wins over one on PATH.
# Each run gets a home of its own (config, sessions, logs): beside the episode's workdir under
# `lcap collect` (RUN_DIR/round-N/EPISODE/harness-home), else (`lcap collect --sandbox`, whose agent may write
# only its workspace and its private $TMPDIR; or no collect) a new folder in $TMPDIR.
set -euo pipefail
harness_dir=${LCAP_HARNESS_DIR:-$HOME/.cache/lcap-harnesses}

unsearchable() {  # unsearchable PATH: the first folder on the way to PATH this user may not enter, if any
  local path=/ part
  IFS=/ read -ra parts <<<"${1#/}"
  for part in "${parts[@]}"; do
    path=${path%/}/$part
    [ -d "$path" ] || return 1
    [ -x "$path" ] || { echo "$path"; return 0; }
  done
  return 1
}

harness_bin() {  # harness_bin NAME [VENV]: the harness's executable
  local name=$1 venv=${2:-}
  for candidate in "$harness_dir/node_modules/.bin/$name" ${venv:+"$harness_dir/$venv/bin/$name"}; do
    [ -x "$candidate" ] && { echo "$candidate"; return; }
  done
  command -v "$name" && return
  local blocked
  if blocked=$(unsearchable "$harness_dir"); then
    echo "lcap: $name: $blocked is not open to user $(id -un) (lcap collect --sandbox runs agents as nobody): install" \
      "the harnesses where every user can reach them, with a Python every user can run, and set LCAP_HARNESS_DIR:" \
      "LCAP_HARNESS_DIR=/var/cache/lcap-harnesses LCAP_HARNESS_PYTHON=/usr/bin/python3 scripts/harnesses/install.sh" >&2
    exit 127
  fi
  echo "lcap: $name is not installed: run scripts/harnesses/install.sh" >&2
  exit 127
}

if [ -n "${LCAP_WORKDIR:-}" ] && [ -w "$(dirname "$LCAP_WORKDIR")" ]; then
  harness_home=$(dirname "$LCAP_WORKDIR")/harness-home
  mkdir -p "$harness_home"
else  # also under `lcap collect --sandbox`, where the episode's folder is not the agent's: its private $TMPDIR
  harness_home=$(mktemp -d "${TMPDIR:-/tmp}/lcap-harness-XXXXXX")
fi
# A key of the right shape, made here so that no key-shaped string is committed: lcap's proxy drops it on the
# policy route, and redacts it from the store anyway.
fake_key="sk-lcap-$(printf '0%.0s' $(seq 40))"
