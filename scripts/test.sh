#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint and type-check, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
exec .venv/bin/python -m pytest "$@"
