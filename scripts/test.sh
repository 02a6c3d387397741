#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
