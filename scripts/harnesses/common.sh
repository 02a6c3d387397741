# Sourced by each harness adapter: where the harnesses are installed, and a private home per run.
#
# LCAP_HARNESS_DIR (default ~/.cache/lcap-harnesses) holds what install.sh puts there: node_modules/.bin
# for the npm harnesses, one venv per Python harness. A harness found there wins over one on PATH.
# Each run gets a home of its own (config, sessions, logs): beside the episode's workdir under
# `lcap collect` (RUN_DIR/round-N/EPISODE/harness-home), else a new temporary directory.
set -euo pipefail
harness_dir=${LCAP_HARNESS_DIR:-$HOME/.cache/lcap-harnesses}

harness_bin() {  # harness_bin NAME [VENV]: the harness's executable
  local name=$1 venv=${2:-}
  for candidate in "$harness_dir/node_modules/.bin/$name" ${venv:+"$harness_dir/$venv/bin/$name"}; do
    [ -x "$candidate" ] && { echo "$candidate"; return; }
  done
  command -v "$name" || { echo "lcap: $name is not installed: run scripts/harnesses/install.sh" >&2; exit 127; }
}

if [ -n "${LCAP_WORKDIR:-}" ]; then
  harness_home=$(dirname "$LCAP_WORKDIR")/harness-home
  mkdir -p "$harness_home"
else
  harness_home=$(mktemp -d "${TMPDIR:-/tmp}/lcap-harness-XXXXXX")
fi
# A key of the right shape, made here so that no key-shaped string is committed: lcap's proxy drops it on the
# policy route, and redacts it from the store anyway.
fake_key="sk-lcap-$(printf '0%.0s' $(seq 40))"
