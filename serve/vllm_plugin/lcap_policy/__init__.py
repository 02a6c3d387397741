"""lcap's endpoints for vLLM (an endpoint plugin): exact tokens and stitched prompts in every dialect.

Runs inside vLLM's API server, in vLLM's own environment: nothing here imports lcap. `lcap serve`
starts vLLM through serve/vllm_plugin/launch.py, which makes this package and its entry point
visible and allow-lists it (vLLM loads endpoint plugins only when VLLM_PLUGINS names them).
"""

from __future__ import annotations

from typing import Any


class LcapEndpoints:
    """vLLM's EndpointPlugin protocol (vllm/plugins/endpoint_plugins/interface.py)."""

    name = "lcap"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from lcap_policy.endpoints import router

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        from lcap_policy.endpoints import Policy

        state.lcap_policy = Policy(state)
