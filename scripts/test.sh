#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint and type-check, then run the suite (every tier unless
# arguments say otherwise: `scripts/test.sh tests/unit`). Two pytest-xdist workers, one per core here: each file
# stays on one worker (its module fixtures, a store or cluster its tests share, are set up once). Files are handed
# out in collection order, tests/e2e's long runs first (xdist's default would order them by their count of tests,
# leaving a one-test file of minutes to the end); `-n 4` among the arguments overrides the count, `-n 0` runs
# serially.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
