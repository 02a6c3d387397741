#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint and type-check, then run the suite (every tier unless
# arguments name tests: `scripts/test.sh tests/unit`). Two pytest-xdist workers, one per core here, each file on
# one worker (its module fixtures, a store or cluster its tests share, are set up once). The whole suite runs in
# two phases: tests/unit and tests/integration, then tests/e2e, so that the end-to-end runs (vLLM, training, Ray,
# the harnesses) never share the two cores with the integration tests' timing bounds. Within a phase files are
# handed out in collection order (xdist's default would order them by their count of tests, leaving a one-test
# file of minutes to the end); `-n 4` among the arguments overrides the count, `-n 0` runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh
pytest=(.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  if [[ $arg == tests* ]]; then
    exec "${pytest[@]}" "$@"
  fi
done
status=0
"${pytest[@]}" tests/unit tests/integration "$@" || status=$?
"${pytest[@]}" tests/e2e "$@" || status=$?
exit "$status"
