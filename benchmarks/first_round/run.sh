#!/usr/bin/env bash
# The guide's "time to the first deployed round" (docs/guide.md, "Your own agent, step by step"): an agent written
# for the purpose (agent.py: the openai SDK, one tool; verify.py: a graded verifier), 16 tasks in groups of 4,
# SmolLM2, each step timed, from `lcap init-model` to `lcap deploy`. Run it from the repository root:
#   benchmarks/first_round/run.sh DIR     (DIR: a new folder; stops the policy server it started at the end)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lcap=$(pwd)/.venv/bin/lcap
out=${1:?usage: run.sh DIR}
mkdir -p "$out" && cd "$out"
cp "$here/agent.py" "$here/verify.py" .
i=0
for word in apple river stone garden window planet silver orange bridge candle forest marble pocket rocket shadow thunder; do
  echo "{\"id\": \"w$i\", \"word\": \"$word\"}"; i=$((i + 1))
done > tasks.jsonl
started=$(date +%s)
step() { echo "=== $(( $(date +%s) - started )) s: $*"; }
trap '"$lcap" serve --stop >/dev/null 2>&1 || true' EXIT
step init-model; "$lcap" init-model runs/sm --from smollm2
step serve; "$lcap" serve --model runs/sm
step collect; "$lcap" collect --tasks tasks.jsonl -g 4 --round 1 --concurrency 4 --verifier verify.py:verify -- \
  "$(dirname "$lcap")/python" agent.py "{word}"
step build; "$lcap" build-dataset --round 1 --out runs/me/round-1/data
step train; "$lcap" train --round 1 --run runs/me
step deploy; "$lcap" deploy runs/me/round-1/adapter --round 1
step "first round deployed"
