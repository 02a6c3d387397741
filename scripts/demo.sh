#!/usr/bin/env bash
# The README's main command: set up (idempotent), then the full collect/train loop on the
# embedded defaults (`lcap demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lcap demo "$@"
