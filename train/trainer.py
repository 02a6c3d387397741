"""TRL's GRPOTrainer, fed with captured samples instead of generating its own.

Four small, named departures from stock TRL, each tested. The first uses TRL's public `rollout_func`; the
other three are hooks of `GRPOInternals` (train/trl_internals.py), the one module that touches TRL's private
steps:

1. `captured_rollout`: a `rollout_func` that returns, for each dataset row (one row = one GRPO
   group), the samples the proxy captured for that group: prompt ids, completion ids, the
   behaviour logprobs vLLM reported when it served them, and the env mask (0 at tool/env tokens).
   Samples served without them (rebuilt Messages turns, Responses) carry NaN, which TRL's ratio
   turns into 1: no correction. It never generates.
2. `CapturedGRPOTrainer.corrects_sampling` (TRL's `use_vllm`): TRL applies its importance-sampling
   correction (`vllm_importance_sampling_*`: truncated or masked IS, token or sequence level) only when it
   generated with vLLM itself. Captured samples were served by vLLM too, by a deployment that may
   be older than the weights being trained, so the correction must apply to them: the trainer
   reports `use_vllm` true everywhere TRL asks about the correction, and false while generating
   (so TRL never tries to sync weights into a vLLM it does not own). In the `*_mask` modes the
   tokens whose ratio is rejected also leave the loss denominator (their loss mask becomes 0),
   the same way env tokens do.
3. `CapturedGRPOTrainer.completion_logps` (TRL's `_get_per_token_logps_and_entropies`): on CPU, the
   completion log-probs (and entropies) come from the model's own LM head over the completion
   positions only (`logits_to_keep`) and one log-softmax, as in a plain PyTorch loop.
   TRL's fused LM head is built for Triton devices; its torch fallback projects every
   position (prompt and padding too) and recomputes each logits tile in the backward, which made
   it the largest single cost of a step on CPU (`benchmarks/bench_train.py`). The fused head's
   gain, never holding a batch's logits, matters on a GPU, where it runs as TRL ships it; on CPU
   one micro-batch's completion logits are held. A padded, masked micro-batch takes SDPA's math
   kernel, which holds a length x length matrix per row, head and layer: fast for short samples,
   but quadratic in the length, which a harness's long prompts cannot afford. Past
   `PADDED_ATTENTION_BYTES` each sample runs alone, cut to its own tokens, with no mask (its
   absolute positions kept), on SDPA's causal kernel, whose memory grows linearly with the length.
4. `CapturedGRPOTrainer.loss` and `logps_scored` (TRL's `_compute_loss`), when each sample is
   trained on once under the weights it was scored with (TRL's aligned case: `gradient_accumulation_steps` a multiple of
   `steps_per_generation x num_iterations`) and the IS mode truncates: the old-policy log-probs
   would equal the loss forward's own, so TRL's extra no-grad forward to get them is skipped, and
   the truncated IS ratio is taken from the loss forward (detached), with TRL's formula and
   metrics. The `*_mask` modes keep TRL's forward: they change the loss mask, which `_compute_loss`
   fixes before its forward.

Advantages: the reward function hands TRL the advantage the episode builder computed (one
definition of advantage for the whole product: the builder's baseline, `--advantage group|batch|rloo`,
its filters and its handling of short groups) and TRL runs with `scale_rewards="none"`; TRL then
centres each group again, which leaves a GRPO group's advantages as they were but would re-centre a
batch baseline's layout group, so `scored_batch` (TRL's `_generate_and_score_completions`) puts the
builder's advantages back (padding members carry 0 and no loss).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is the documented way in; no warning per round
from trl import GRPOConfig, GRPOTrainer

from lcap.train.samples import Groups
from lcap.train.trl_internals import GRPOInternals


def captured_rollout(groups: Groups):
    """Build the `rollout_func` that serves `groups` to TRL; dataset prompts are group ids.

    TRL lays a generation batch out as each group id repeated `num_generations` times in a row, and
    hands process p the p-th equal slice of it (the slice it takes back after gathering rewards), so
    a group can straddle two processes. The sample at global position j of the batch is member
    `j % size` of its group; this process's share starts at `process_index * len(prompts)`.
    """

    def rollout(prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list]:
        out: dict[str, list] = {
            k: []
            for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "advantage", "captured_reward", "padding")
        }
        first = trainer.accelerator.process_index * len(prompts)
        for i, prompt in enumerate(prompts):
            gid = _group_id(prompt)
            k = (first + i) % groups.size
            if k and i and _group_id(prompts[i - 1]) != gid:
                raise ValueError(f"group {gid} starts at member {k}: TRL's batch layout changed")
            s = groups.groups[gid][k]
            out["prompt_ids"].append(list(s.prompt_ids))
            out["completion_ids"].append(list(s.completion_ids))
            out["logprobs"].append(list(s.logprobs) if s.behaviour else [math.nan] * len(s.completion_ids))
            out["env_mask"].append(list(s.env_mask))
            out["advantage"].append(s.advantage)
            out["captured_reward"].append(s.reward)
            out["padding"].append(s.padding)
        return out

    return rollout


def _without_none(callbacks_on_log):
    """The callbacks' on_log, given only the figures that exist: TRL logs a figure over no value as None (kept in
    the log history, which the round's averages skip), and the TensorBoard callback warns of each None it is given."""

    def on_log(args, state, control, logs, **kwargs):
        return callbacks_on_log(args, state, control, {k: v for k, v in logs.items() if v is not None}, **kwargs)

    return on_log


def captured_advantage(prompts, completions, advantage, **kwargs) -> list[float]:
    """Reward function: the builder's advantage for each captured sample (see module docstring)."""
    return [float(a) for a in advantage]


def _group_id(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):  # conversational form
        return str(prompt[-1]["content"])
    raise ValueError(f"unexpected GRPO prompt {prompt!r}: dataset prompts must be group ids")


class CapturedGRPOTrainer(GRPOInternals):
    """GRPOTrainer whose importance-sampling correction runs against the captured behaviour logprobs.

    It changes TRL's private steps only through `GRPOInternals`' hooks (train/trl_internals.py)."""

    args: GRPOConfig  # GRPOTrainer sets a GRPOConfig; transformers' Trainer declares TrainingArguments

    def __init__(self, *args, off_policy_correction: bool = True, **kwargs) -> None:
        self._is_correction = False  # TRL's __init__ must see use_vllm=False (it would start its own vLLM)
        self._scoring_fused = False
        self._fused_inputs: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)
        self._is_correction = off_policy_correction and self.vllm_importance_sampling_correction
        self.callback_handler.on_log = _without_none(self.callback_handler.on_log)  # type: ignore[method-assign]

    def corrects_sampling(self) -> bool:
        return self._is_correction and not self._scoring_fused

    @property
    def fuses_is_ratio(self) -> bool:
        """Whether the IS ratio comes from the loss forward (departure 4) instead of an extra no-grad forward."""
        steps_per_generation = self.args.steps_per_generation
        assert steps_per_generation is not None  # GRPOConfig.__post_init__ derives it when not given
        aligned = self.args.gradient_accumulation_steps % (steps_per_generation * self.num_iterations) == 0
        return self._is_correction and aligned and self.vllm_importance_sampling_mode.endswith("_truncate")

    def scored_batch(self, inputs, score):
        assert self.model is not None  # set before training starts (by __init__ or model_init)
        fused = self._scoring_fused = self.model.training and self.fuses_is_ratio
        try:
            output = score(inputs)
        finally:
            self._scoring_fused = False
        captured = [row.get("advantage") for row in inputs]  # the rollout's fields, merged into this process's rows
        if captured and None not in captured:
            before = output["advantages"]
            output["advantages"] = torch.tensor(captured, dtype=before.dtype, device=before.device).reshape(
                before.shape
            )
        ratio = output.get("importance_sampling_ratio")
        if ratio is not None and not fused:  # TRL appended this batch's IS figures just now
            self._no_token_figures(output)
        if ratio is not None and self.vllm_importance_sampling_mode.endswith("_mask"):
            # Rejected tokens (ratio set to 0) leave the denominator too, not only the numerator.
            keep = (ratio > 0).to(output["completion_mask"].dtype).expand_as(output["completion_mask"])
            tool_mask = output.get("tool_mask", torch.ones_like(output["completion_mask"]))
            output["tool_mask"] = tool_mask * keep
            loss_mask = output["completion_mask"] * output["tool_mask"]
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        return output

    def _no_token_figures(self, output: dict[str, Any]) -> None:
        """TRL's own IS figures (the `*_mask` modes, several epochs) count a batch with no loss token as 0: make
        them NaN, which its log leaves out, so a round's figures are over tokens that exist."""
        mask = output["completion_mask"] * output.get("tool_mask", torch.ones_like(output["completion_mask"]))
        if self.accelerator.gather(mask.sum()).sum().item():
            return
        metrics = self.train_metrics()
        for name in ("sampling_logp_difference/mean", "sampling_logp_difference/max"):
            if metrics.get(f"sampling/{name}"):
                metrics[f"sampling/{name}"][-1] = math.nan
        for name in ("min", "mean", "max"):
            key = f"sampling/importance_sampling_ratio/{name}"
            if metrics.get(key):
                metrics[key][-1] = math.nan

    def loss(self, model, inputs, compute):
        fused = self.use_vllm and "importance_sampling_ratio" not in inputs
        self._fused_inputs = inputs if fused else None
        try:
            return compute(model, inputs)
        finally:
            self._fused_inputs = None

    def own_logps(self, input_ids: torch.Tensor) -> bool:
        return input_ids.device.type == "cpu"

    def logps_scored(self, logps: torch.Tensor) -> None:
        if self._fused_inputs is not None:
            self._fused_inputs["importance_sampling_ratio"] = self._truncated_is_ratio(
                logps.detach(), self._fused_inputs
            )
            self._fused_inputs = None

    def completion_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
        """Padded, masked micro-batches while their attention matrices are small; else each sample alone."""
        batch_size = batch_size or input_ids.size(0)
        config = self.accelerator.unwrap_model(model).config  # DDP wraps the model in training with several workers
        if _padded_attention_bytes(config, batch_size, input_ids.size(1)) > PADDED_ATTENTION_BYTES:
            return self._one_by_one_logps(model, input_ids, attention_mask, logits_to_keep, compute_entropy)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, attn = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            with self.accelerator.autocast():
                logits = model(
                    input_ids=ids, attention_mask=attn, logits_to_keep=logits_to_keep + 1, use_cache=False
                ).logits
            logps_all = torch.log_softmax(logits[:, :-1].float() / self.temperature, dim=-1)
            padding = attn[:, -logits_to_keep:] == 0
            logps.append(logps_all.gather(-1, ids[:, -logits_to_keep:, None])[..., 0].masked_fill(padding, 0.0))
            if compute_entropy:
                with torch.set_grad_enabled(torch.is_grad_enabled() and self.entropy_bonus):
                    entropies.append(-(logps_all.exp() * logps_all).sum(-1).masked_fill(padding, 0.0))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _one_by_one_logps(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy):
        width = input_ids.size(1)
        first = width - logits_to_keep  # the first completion slot
        logps = input_ids.new_zeros(input_ids.shape[0], logits_to_keep, dtype=torch.float32)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        rows_logps, rows_entropies = [], []
        for row in range(input_ids.size(0)):
            real = attention_mask[row].nonzero()
            start, end = int(real[0]), int(real[-1]) + 1  # left-padded prompt, right-padded completion
            kept = end - first  # the row's completion tokens
            if kept <= 0:
                rows_logps.append(logps[row])
                if entropies is not None:
                    rows_entropies.append(entropies[row])
                continue
            with self.accelerator.autocast():
                logits = model(
                    input_ids=input_ids[row : row + 1, start:end],
                    position_ids=torch.arange(start, end, device=input_ids.device)[None],
                    logits_to_keep=kept + 1,
                    use_cache=False,
                ).logits
            logps_all = torch.log_softmax(logits[0, :-1].float() / self.temperature, dim=-1)
            pad = logits_to_keep - kept
            row_logps = logps_all.gather(-1, input_ids[row, first:end, None])[..., 0]
            rows_logps.append(torch.nn.functional.pad(row_logps, (0, pad)))
            if entropies is not None:
                with torch.set_grad_enabled(torch.is_grad_enabled() and self.entropy_bonus):
                    row_entropy = -(logps_all.exp() * logps_all).sum(-1)
                rows_entropies.append(torch.nn.functional.pad(row_entropy, (0, pad)))
        return torch.stack(rows_logps), torch.stack(rows_entropies) if compute_entropy else None, None

    def _truncated_is_ratio(self, logps: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's truncated IS ratio and its metrics, from the loss forward's log-probs instead of a second forward."""
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        behaviour = inputs["sampling_per_token_logps"]
        diff = torch.nan_to_num((logps - behaviour) * mask, nan=0.0)  # NaN behaviour logprob: ratio 1
        sequence_level = self.vllm_importance_sampling_mode.startswith("sequence")
        ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence_level else diff)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None or high is not None:
            ratio = ratio.clamp(min=low, max=high)

        metrics = self.train_metrics()
        mask = mask.bool()
        delta = (logps - behaviour).abs()[mask]
        delta = delta[~torch.isnan(delta)]
        flat = ratio.flatten() if sequence_level else ratio[mask]
        for name, values, reduce in (
            ("sampling/sampling_logp_difference/mean", delta, torch.mean),
            ("sampling/sampling_logp_difference/max", delta, torch.max),
            ("sampling/importance_sampling_ratio/min", flat, torch.min),
            ("sampling/importance_sampling_ratio/mean", flat, torch.mean),
            ("sampling/importance_sampling_ratio/max", flat, torch.max),
        ):
            # this process, then all of them; over no token a figure is NaN (shown as `-`), never 0
            value = reduce(values) if values.numel() else values.new_full((), math.nan)
            gathered = self.accelerator.gather(value)
            gathered = gathered[~torch.isnan(gathered)]
            metrics[name].append(reduce(gathered).item() if gathered.numel() else math.nan)
        return ratio


# The most a micro-batch's padded, masked attention may hold (SDPA's math kernel keeps a width x width matrix per
# row, head and layer for the backward) before samples are scored one by one, unpadded, on its causal kernel.
PADDED_ATTENTION_BYTES = 512 << 20


def _padded_attention_bytes(config, rows: int, width: int) -> int:
    heads = getattr(config, "num_attention_heads", 1) or 1
    layers = getattr(config, "num_hidden_layers", 1) or 1
    return rows * heads * layers * width * width * 4
