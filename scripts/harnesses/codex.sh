#!/usr/bin/env bash
# Codex CLI, non-interactive (`codex exec`), behind lcap:
#   lcap collect --tasks T -- scripts/harnesses/codex.sh "{prompt}"          # Responses over WebSocket
#   lcap collect --tasks T -- scripts/harnesses/codex.sh --sse "{prompt}"    # Responses over HTTP SSE
# The default `openai` provider speaks the Responses API over a WebSocket to api.openai.com; a custom
# provider with the same base URL speaks it over HTTP + SSE. Either way lcap's proxy reroutes it.
# Approvals and Codex's own sandbox are off (the episode's workdir is the sandbox), update checks and
# analytics too. Codex has no turn limit: bound an episode with `lcap collect --timeout`. LCAP_CODEX_INSTRUCTIONS
# replaces Codex's base instructions and LCAP_CODEX_FEATURES_OFF (e.g. multi_agent,goals) turns features and their
# tools off: together they are most of its prompt.
source "$(dirname "$0")/common.sh"
provider=openai
if [ "${1:-}" = --sse ]; then provider=lcap; shift; fi
export CODEX_HOME=$harness_home/codex
mkdir -p "$CODEX_HOME"
settings=""
if [ -n "${LCAP_CODEX_INSTRUCTIONS:-}" ]; then
  printf '%s\n' "$LCAP_CODEX_INSTRUCTIONS" > "$CODEX_HOME/instructions.md"
  settings="model_instructions_file = \"$CODEX_HOME/instructions.md\""
fi
features=""
IFS=, read -ra off <<<"${LCAP_CODEX_FEATURES_OFF:-}"
for feature in "${off[@]}"; do features+="$feature = false"$'\n'; done
cat > "$CODEX_HOME/config.toml" <<TOML
model = "gpt-5.1-codex"
model_provider = "$provider"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
$settings

[analytics]
enabled = false

[feedback]
enabled = false

[features]
$features
[model_providers.lcap]
name = "lcap"
base_url = "https://api.openai.com/v1"
env_key = "OPENAI_API_KEY"
wire_api = "responses"
TOML
export OPENAI_API_KEY=$fake_key
codex=$(harness_bin codex)
printenv OPENAI_API_KEY | "$codex" login --with-api-key >/dev/null
exec "$codex" exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox --color never "$@"
