"""The one module that touches TRL's private GRPOTrainer API.

TRL has one public way in for a trainer that does not generate, `rollout_func` (used by train/trainer.py), and no
public hook for the rest of what lcap changes: the importance-sampling correction against logprobs TRL did not
generate, the completion log-probs on CPU, and the IS ratio taken from the loss forward. Those need TRL's private
steps, which change between minor releases; so pyproject pins `trl` to the minor release listed in `TESTED`, and
every private name lcap relies on is here:

- `GRPOInternals` overrides TRL's private steps and hands each to a hook named for what lcap does in it;
  `CapturedGRPOTrainer` (train/trainer.py) implements the hooks against this class, not against TRL's privates.
- `METHODS`, `ATTRIBUTES` and `BATCH_KEYS` list the private methods (with the parameters lcap passes), the
  attributes `GRPOTrainer.__init__` sets that lcap reads or replaces, and the keys of TRL's scored batch lcap reads
  and writes. `drift()` says which of them a TRL release no longer has; tests/unit/test_trl_internals.py fails
  with that list, so an upgrade names what to port before it trains wrongly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from trl import GRPOTrainer

# The TRL releases lcap's overrides were written and tested against: equal to pyproject's `trl` bound.
TESTED = ">=1.16,<1.17"

# The private methods lcap overrides or calls, and the parameters it passes them, in order.
METHODS: dict[str, tuple[str, ...]] = {
    "_generate": ("prompts",),
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ),
}

# What GRPOTrainer.__init__ sets that lcap reads (or, for `use_vllm`, replaces with a property).
ATTRIBUTES = (
    "use_vllm",
    "temperature",
    "num_iterations",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "_metrics",
    "_entropy_bonus_enabled",
)

# Keys of the batch `_generate_and_score_completions` returns and `_compute_loss` reads, that lcap reads or sets.
BATCH_KEYS = (
    "advantages",
    "completion_mask",
    "tool_mask",
    "num_items_in_batch",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
)

# The IS figures TRL logs, which lcap logs too when it takes the ratio from the loss forward.
IS_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def drift(trainer: type[GRPOTrainer] = GRPOTrainer) -> list[str]:
    """What of the private API above `trainer` (TRL's GRPOTrainer) no longer has, one line each; [] when none."""
    problems = []
    for name, params in METHODS.items():
        method = getattr(trainer, name, None)
        if method is None:
            problems.append(f"GRPOTrainer.{name} is gone")
            continue
        have = tuple(inspect.signature(method).parameters)[1 : 1 + len(params)]
        if have != params:
            problems.append(f"GRPOTrainer.{name} takes {have}, lcap passes {params}")
    init = inspect.getsource(vars(trainer).get("__init__") or GRPOTrainer.__init__)
    problems += [f"GRPOTrainer.__init__ no longer sets self.{a}" for a in ATTRIBUTES if f"self.{a} =" not in init]
    steps = "".join(inspect.getsource(getattr(trainer, name)) for name in METHODS if getattr(trainer, name, None))
    problems += [f"TRL's scored batch has no {key!r}" for key in BATCH_KEYS if f'"{key}"' not in steps]
    problems += [f"TRL no longer logs {m!r}" for m in IS_METRICS if f'"{m}"' not in steps]
    return problems


class GRPOInternals(GRPOTrainer):
    """GRPOTrainer whose private steps call hooks; the hooks' defaults leave TRL's behaviour as it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._generating = False
        super().__init__(*args, **kwargs)

    # TRL sets `self.use_vllm` in __init__ and reads it both to generate and to apply its IS correction.
    @property
    def use_vllm(self) -> bool:
        return not self._generating and self.corrects_sampling()

    @use_vllm.setter
    def use_vllm(self, value: bool) -> None:
        if value:
            raise ValueError("CapturedGRPOTrainer trains on captured samples: it never generates with vLLM")

    def _generate(self, prompts: list):
        self._generating = True
        try:
            return super()._generate(prompts)
        finally:
            self._generating = False

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        return self.scored_batch(inputs, super()._generate_and_score_completions)

    def _compute_loss(self, model, inputs):
        return self.loss(model, inputs, super()._compute_loss)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        if compute_aux_loss or any(v is not None for v in multimodal.values()) or not self.own_logps(input_ids):
            out = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        else:
            out = self.completion_logps(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy)
        self.logps_scored(out[0])
        return out

    def per_token_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size) -> torch.Tensor:
        """The completion log-probs the loss would use: TRL's scoring step, as the trainer runs it."""
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
        )[0]

    def train_metrics(self) -> dict[str, list]:
        """TRL's figures of the training steps so far, by name: the lists its log averages."""
        return self._metrics["train"]

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has an entropy term (then entropies keep their gradient)."""
        return self._entropy_bonus_enabled

    # The hooks. Their defaults are TRL's own behaviour.

    def corrects_sampling(self) -> bool:
        """Whether TRL applies its IS correction (`vllm_importance_sampling_*`) now; it never generates with vLLM."""
        return False

    def scored_batch(
        self, inputs: list[dict[str, Any]], score: Callable[[list[dict[str, Any]]], dict[str, Any]]
    ) -> dict[str, Any]:
        """The batch TRL trains on: `score(inputs)` is TRL's generation and scoring step."""
        return score(inputs)

    def loss(self, model, inputs: dict[str, Any], compute: Callable[[Any, dict[str, Any]], Any]):
        """One micro-batch's loss: `compute(model, inputs)` is TRL's."""
        return compute(model, inputs)

    def own_logps(self, input_ids: torch.Tensor) -> bool:
        """Whether `completion_logps` scores these ids instead of TRL (never for aux losses or multimodal inputs)."""
        return False

    def completion_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
        """(log-probs, entropies or None, None) of the last `logits_to_keep` tokens, where `own_logps` says so."""
        raise NotImplementedError

    def logps_scored(self, logps: torch.Tensor) -> None:
        """Called with each scoring step's log-probs (with their gradient), whoever computed them."""
