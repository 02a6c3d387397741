#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint and type-check, then run the suite (every tier unless
# arguments name tests: `scripts/test.sh tests/unit`; the unit tier alone, without set-up or lint, is
# `.venv/bin/python -m pytest tests/unit`). The whole suite runs in two phases on pytest-xdist workers: tests/unit and
# tests/integration on three (their tests wait on timeouts and subprocesses a good part of the time, which two
# workers on two cores left idle), then tests/e2e on two, one per core (CPU-bound: vLLM training and decoding,
# which would also starve an integration test's proxy beside it); between them, the tests marked `serial` run alone.
# Each file runs on one worker (its module fixtures, a vLLM server or Ray cluster its tests share, are set up once),
# files handed out in collection order (xdist's default would order them by their count of tests, leaving a
# one-test file of minutes to the end). Tests named as arguments run on two workers; `-n 0` among the arguments
# runs them serially. The whole suite first installs the harnesses of tests/e2e/test_harnesses.py (their fixture
# only checks them then).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
times=()  # each phase's seconds, said together at the end, where a log's tail shows them
phase() { times+=("$1 $((SECONDS - start)) s"); start=$SECONDS; }
scripts/setup.sh
scripts/lint.sh
pytest=(.venv/bin/python -m pytest --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  if [[ $arg == tests* ]]; then
    exec "${pytest[@]}" -n 2 "$@"
  fi
done
scripts/harnesses/install.sh  # the real harnesses tests/e2e/test_harnesses.py runs (idempotent): set-up, not test time
# ...and the two tests/e2e/test_coding_sandbox.py runs under --sandbox, where the sandbox's user can reach them
LCAP_HARNESS_DIR=${LCAP_SANDBOX_HARNESS_DIR:-/var/cache/lcap-harnesses} LCAP_HARNESS_PYTHON=/usr/bin/python3 \
  scripts/harnesses/install.sh codex mini
phase "set-up and lint"
status=0
"${pytest[@]}" -n 3 tests/unit tests/integration -m "not serial" "$@" || status=$?
phase "unit and integration"
.venv/bin/python -m pytest tests/integration -m serial "$@" || status=$?  # a unit test cannot be serial (tests/conftest.py)
phase "serial"
# One OpenMP thread per process in e2e: its trainers and vLLM servers otherwise run a spinning thread per core
# each, beside the other worker's (docs/benchmarks.md, the whole test suite).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "${pytest[@]}" -n 2 tests/e2e "$@" || status=$?
phase "e2e"
# ...and on which kind of machine (this project's machines differ: with AVX-512, or AVX2 only and slower)
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores, $(grep -q avx512f /proc/cpuinfo \
  && echo with || echo without) AVX-512"
echo "scripts/test.sh: $(printf '%s, ' "${times[@]}")on $cpu"
exit "$status"
