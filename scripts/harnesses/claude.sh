#!/usr/bin/env bash
# Claude Code, non-interactive (`claude -p`), behind lcap:
#   lcap collect --tasks T -- scripts/harnesses/claude.sh "{prompt}"
# It speaks Anthropic Messages (streaming) to api.anthropic.com; lcap's proxy reroutes the calls. Permission
# prompts are off (IS_SANDBOX lets root skip them: the episode's workdir is the sandbox), so are telemetry,
# error reports, the auto-updater and other non-essential traffic. LCAP_MAX_TURNS (default 3) caps its turns,
# LCAP_MAX_OUTPUT_TOKENS each answer; LCAP_CLAUDE_TOOLS (e.g. Bash,Write) limits its built-in tools, whose
# definitions are most of its prompt.
source "$(dirname "$0")/common.sh"
export CLAUDE_CONFIG_DIR=$harness_home/claude
mkdir -p "$CLAUDE_CONFIG_DIR"
export ANTHROPIC_API_KEY=$fake_key IS_SANDBOX=1
[ -z "${LCAP_MAX_OUTPUT_TOKENS:-}" ] || export CLAUDE_CODE_MAX_OUTPUT_TOKENS=$LCAP_MAX_OUTPUT_TOKENS
export DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1
tools=()  # --tools takes every word up to the next flag: it goes first
[ -z "${LCAP_CLAUDE_TOOLS:-}" ] || tools=(--tools "$LCAP_CLAUDE_TOOLS")
exec "$(harness_bin claude)" "${tools[@]}" -p --dangerously-skip-permissions --max-turns "${LCAP_MAX_TURNS:-3}" \
  --model sonnet --output-format text "$@"
