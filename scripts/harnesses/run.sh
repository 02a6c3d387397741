#!/usr/bin/env bash
# Every adapter here under one command, the harness chosen by name, so that one tasks file can give each task
# its own harness (a field of the task, e.g. {"id": "t1", "harness": "codex-sse", "prompt": "..."}):
#   lcap collect --tasks T -- scripts/harnesses/run.sh {harness} "{prompt}"
# Names: codex-websocket codex-sse claude-code opencode-chat opencode-messages aider mini-swe-agent.
set -euo pipefail
here=$(dirname "$0")
name=${1:?usage: run.sh HARNESS ARGS... (codex-websocket codex-sse claude-code opencode-chat opencode-messages aider mini-swe-agent)}
shift
case $name in
  codex-websocket) exec "$here/codex.sh" "$@" ;;
  codex-sse) exec "$here/codex.sh" --sse "$@" ;;
  claude-code) exec "$here/claude.sh" "$@" ;;
  opencode-chat) exec "$here/opencode.sh" "$@" ;;
  opencode-messages) exec "$here/opencode.sh" --messages "$@" ;;
  aider) exec "$here/aider.sh" "$@" ;;
  mini-swe-agent) exec "$here/mini.sh" "$@" ;;
  *)
    echo "run.sh: no harness named $name (codex-websocket codex-sse claude-code opencode-chat opencode-messages aider mini-swe-agent)" >&2
    exit 2
    ;;
esac
