#!/usr/bin/env bash
# aider, non-interactive (`aider --message`), behind lcap:
#   lcap collect --tasks T -- scripts/harnesses/aider.sh "{prompt}"
# It speaks chat completions (through LiteLLM, streaming) to api.openai.com; lcap's proxy reroutes the calls.
# Every question is answered yes, git, the repo map, update checks and analytics are off, LiteLLM uses its
# bundled model list instead of fetching one. LCAP_MAX_OUTPUT_TOKENS caps each answer.
source "$(dirname "$0")/common.sh"
export HOME=$harness_home OPENAI_API_KEY=$fake_key LITELLM_LOCAL_MODEL_COST_MAP=True
settings=$harness_home/aider-models.yml
cat > "$settings" <<YAML
- name: openai/policy
  edit_format: whole
  use_repo_map: false
  extra_params: {max_tokens: ${LCAP_MAX_OUTPUT_TOKENS:-4096}}
YAML
exec "$(harness_bin aider aider-venv)" --model openai/policy --model-settings-file "$settings" --edit-format whole \
  --yes-always --no-git --no-auto-commits --no-check-update --analytics-disable --no-show-model-warnings \
  --map-tokens 0 --no-pretty --no-fancy-input --no-detect-urls --no-suggest-shell-commands \
  --no-restore-chat-history --chat-history-file "$harness_home/chat.md" \
  --input-history-file "$harness_home/input.txt" --message "$@"
