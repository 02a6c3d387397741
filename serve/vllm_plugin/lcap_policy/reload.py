"""The worker method `lcap deploy` calls to reload a full checkpoint in place (vLLM's `--worker-extension-cls`).

vLLM's own `reload_weights` loads the checkpoint's tensors into the model. On CPU, vLLM also keeps a
packed copy of each linear layer's weight for its GEMM kernels (`dispatch_cpu_unquantized_gemm`),
made again for every layer the reload loads; an LM head tied to the embeddings has no tensor of its
own in the checkpoint, so its packed copy would keep the old weights (the logits would come from the
old head and the rest from the new model). This method packs such heads again after the reload.
"""

from __future__ import annotations

from typing import Any


class ReloadExtension:
    """Mixed into vLLM's worker class: `collective_rpc("lcap_reload_weights", kwargs={"weights_path": DIR})`."""

    def lcap_reload_weights(self, weights_path: str) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.platforms import current_platform

        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        if not current_platform.is_cpu():
            return
        for module in worker.model_runner.get_model().modules():
            if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
                module.quant_method.process_weights_after_loading(module)
