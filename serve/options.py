"""The serve stage's options: the tiny model `lcap init-model` makes (each default and help, written once)."""

from __future__ import annotations

from dataclasses import dataclass

from lcap.cli_options import option
from lcap.config import LcapError


@dataclass(frozen=True)
class TinyModelOptions:
    """A random-init Qwen2-style policy with a locally trained tokenizer: the same options give the same bytes."""

    seed: int = option(0, help="Random seed: same seed and sizes, same bytes.")
    hidden_size: int = option(128, help="Hidden size (head_dim = hidden / heads must be >= 32, vLLM's CPU attention).")
    num_layers: int = option(2, flag="--layers", help="Transformer layers.")
    num_heads: int = option(2, flag="--heads", help="Attention heads.")
    num_kv_heads: int | None = option(None, flag="--kv-heads", help="Key/value heads (default: --heads).")
    intermediate_size: int | None = option(None, help="MLP width (default: twice the hidden size).")
    vocab_size: int = option(2048, help="Largest tokenizer vocabulary to train.")
    max_position_embeddings: int = option(
        65536,
        flag="--context",
        help="Context length in tokens (positions); `lcap serve` serves the model at it. Harnesses such as Codex "
        "send prompts past 16k tokens.",
    )
    max_new_tokens: int = option(
        256,
        help="Longest answer to a request that names no limit (generation_config.json, which vLLM follows): "
        "the random model rarely stops by itself, and some harnesses (Codex CLI) never set a limit.",
    )

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise LcapError(
                f"hidden size {self.hidden_size} / {self.num_heads} heads must be a whole head_dim >= 32 "
                "(vLLM's CPU attention)"
            )
        if self.num_heads % (self.num_kv_heads or self.num_heads):
            raise LcapError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} kv heads")
