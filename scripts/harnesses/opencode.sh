#!/usr/bin/env bash
# opencode, non-interactive (`opencode run`), behind lcap:
#   lcap collect --tasks T -- scripts/harnesses/opencode.sh "{prompt}"              # chat completions
#   lcap collect --tasks T -- scripts/harnesses/opencode.sh --messages "{prompt}"   # Anthropic Messages
# A provider of its own (the AI SDK's openai-compatible or anthropic package, both bundled in opencode) whose
# base URL is the usual public one: lcap's proxy reroutes the calls. Permissions are auto-approved, sharing,
# auto-update and the models.dev fetch are off; LCAP_MAX_TURNS (default 3) caps the agent's steps,
# LCAP_MAX_OUTPUT_TOKENS each answer.
source "$(dirname "$0")/common.sh"
npm=@ai-sdk/openai-compatible base=https://api.openai.com/v1
if [ "${1:-}" = --messages ]; then npm=@ai-sdk/anthropic base=https://api.anthropic.com/v1; shift; fi
export XDG_CONFIG_HOME=$harness_home/config XDG_DATA_HOME=$harness_home/data XDG_STATE_HOME=$harness_home/state
export XDG_CACHE_HOME=$harness_home/cache OPENCODE_CONFIG=$harness_home/opencode.json
export OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1
# LCAP_OPENCODE_TOOLS (e.g. bash,write) keeps only those built-in tools and LCAP_OPENCODE_PROMPT replaces the build
# agent's system prompt: together they are most of its prompt.
tools=""
if [ -n "${LCAP_OPENCODE_TOOLS:-}" ]; then
  tools='"tools": {"*": false'
  IFS=, read -ra kept <<<"$LCAP_OPENCODE_TOOLS"
  for tool in "${kept[@]}"; do tools+=", \"$tool\": true"; done
  tools+='},'
fi
prompt=""
[ -z "${LCAP_OPENCODE_PROMPT:-}" ] || prompt=", \"prompt\": $(printf '%s' "$LCAP_OPENCODE_PROMPT" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')"
cat > "$OPENCODE_CONFIG" <<JSON
{
  "autoupdate": false,$tools
  "share": "disabled",
  "model": "lcap/policy",
  "provider": {
    "lcap": {
      "npm": "$npm",
      "name": "lcap",
      "options": {"baseURL": "$base", "apiKey": "$fake_key"},
      "models": {"policy": {"name": "policy", "tool_call": true, "limit": {"context": 65536, "output": ${LCAP_MAX_OUTPUT_TOKENS:-4096}}}}
    }
  },
  "agent": {"build": {"steps": ${LCAP_MAX_TURNS:-3}$prompt}}
}
JSON
exec "$(harness_bin opencode)" run --auto "$@"
