#!/usr/bin/env bash
# The README's main command: set up (idempotent), then the full collect/train loop on the
# embedded defaults (`lcap demo`: SmolLM2-135M-Instruct learns a calculator tool; `--model tiny` for a quick look).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/lcap demo "$@"
