#!/usr/bin/env bash
# mini-swe-agent, non-interactive (`mini --yolo --exit-immediately`), behind lcap:
#   lcap collect --tasks T -- scripts/harnesses/mini.sh "{prompt}"
# It speaks chat completions with a bash tool (through LiteLLM) to api.openai.com; lcap's proxy reroutes the
# calls. No confirmations, no cost limit (the policy has no price), LiteLLM's bundled model list;
# LCAP_MAX_TURNS (default 3) caps its steps, LCAP_MAX_OUTPUT_TOKENS each answer.
source "$(dirname "$0")/common.sh"
export MSWEA_GLOBAL_CONFIG_DIR=$harness_home/mini MSWEA_CONFIGURED=true MSWEA_COST_TRACKING=ignore_errors
export MSWEA_SILENT_STARTUP=1 OPENAI_API_KEY=$fake_key LITELLM_LOCAL_MODEL_COST_MAP=True
mkdir -p "$MSWEA_GLOBAL_CONFIG_DIR"
exec "$(harness_bin mini mini-venv)" --model openai/policy --yolo --exit-immediately --cost-limit 0 \
  -c mini.yaml -c "agent.step_limit=${LCAP_MAX_TURNS:-3}" \
  -c "model.model_kwargs.max_tokens=${LCAP_MAX_OUTPUT_TOKENS:-4096}" \
  --output "$harness_home/trajectory.json" --task "$@"
