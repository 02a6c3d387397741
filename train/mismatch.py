"""The train/serve mismatch guard: before a round's first optimiser step, does the policy being trained
score the captured tokens as the deployment that served them did?

A round continues the policy of the round before it, and the loop deploys that policy before
collecting, so the trainer's starting weights ARE the deployment that served the round's samples:
its log-probs of the sampled tokens must equal vLLM's captured ones up to numerics (kernels, dtype).
When they do not, every importance ratio and every clip of the round is computed against the wrong
policy and the round trains on data it misreads, silently: an adapter that never reached vLLM (a
skipped or failed deploy, another adapter under its name), a different base model or chat template on
either side, or a dtype far from the trainer's.

Per deployment that served the round's samples, over the model tokens (env mask 1) of samples that
carry behaviour logprobs, with r = train logp - behaviour logp:

    logp_diff = mean |r|
    kl        = mean(exp(r) - 1 - r)   (Schulman's k3: an unbiased, never negative estimate of
                                        KL(served || trained) per token, from the served samples)

One no-grad forward of the trainer's own scoring function (`per_token_logps`: TRL's `_get_per_token_logps_and_entropies`,
the one the loss uses) over at most `samples` samples per deployment, laid out as TRL lays out a batch.
A deployment older than the round's starting policy (a stale sample kept under `--stale correct`)
is held to the same limit: its KL includes the drift of the rounds since it served.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from lcap.config import LcapError
from lcap.train.samples import Sample


@dataclass
class DeploymentMismatch:
    """How far the trainer's log-probs of one deployment's captured tokens are from the served ones."""

    deployment: str | None
    samples: int  # scored samples (those with behaviour logprobs, at most the guard's per-deployment cap)
    tokens: int  # model tokens scored
    logp_diff: float  # mean |train logp - served logp|
    kl: float  # k3 estimate of KL(served || trained) per token


@dataclass
class Mismatch:
    """The guard's measurement of a round, per deployment, and how long its forward took. `held`: the one
    deployment held to the limit (an async step's: the one being trained; the others' KL includes the drift
    since they served), or None for all of them."""

    deployments: list[DeploymentMismatch]
    seconds: float
    held: str | None = None

    @property
    def checked(self) -> list[DeploymentMismatch]:
        """The deployments held to the limit and scored; with `held` set and none scored, the batch had no sample
        of it and the guard checked nothing this round."""
        return [d for d in self.deployments if self.held is None or d.deployment == self.held]

    @property
    def worst(self) -> DeploymentMismatch | None:
        return max(self.checked, key=lambda d: d.kl, default=None)

    def unchecked(self) -> str | None:
        """Why the guard checked nothing, or None when it checked the held deployment (or held them all)."""
        if self.held is None or self.checked:
            return None
        return f"no scored sample was served by {self.held!r}, the deployment being trained: not checked"

    def metrics(self) -> dict[str, Any]:
        """The `train_runs` columns: the worst held deployment's figures (NULL when none was scored), and every
        deployment's as JSON."""
        worst = self.worst
        return {
            "mismatch_kl": worst.kl if worst else None,
            "mismatch_logp_diff": worst.logp_diff if worst else None,
            "mismatch_seconds": self.seconds,
            "mismatch_held": self.held,
        }

    def details(self) -> list[dict[str, Any]]:
        return [asdict(d) for d in self.deployments]


def pick_samples(samples: list[Sample], per_deployment: int, seed: int = 0) -> dict[str | None, list[Sample]]:
    """The samples the guard scores: real ones with behaviour logprobs, at most `per_deployment` (0: all) of each
    deployment, drawn at random (seeded) so a capped deployment is represented across its groups."""
    by_deployment: dict[str | None, list[Sample]] = {}
    for s in samples:
        if s.behaviour and not s.padding and any(s.env_mask):
            by_deployment.setdefault(s.deployment, []).append(s)
    rng = random.Random(seed)
    return {
        name: members if not per_deployment or len(members) <= per_deployment else rng.sample(members, per_deployment)
        for name, members in sorted(by_deployment.items(), key=lambda kv: str(kv[0]))
    }


def measure_mismatch(
    trainer, samples: list[Sample], *, per_deployment: int, seed: int = 0, held: str | None = None
) -> Mismatch:
    """Score the picked samples with the trainer's model (no grad) and compare with the served logprobs."""
    import torch  # the train extra

    t0 = time.perf_counter()
    picked = pick_samples(samples, per_deployment, seed)
    chosen = [s for members in picked.values() for s in members]
    if not chosen:
        return Mismatch([], time.perf_counter() - t0, held)
    diffs = _logp_differences(trainer, chosen)
    out = []
    start = 0
    for name, members in picked.items():
        r = torch.cat(diffs[start : start + len(members)])
        start += len(members)
        if not r.numel():
            continue
        out.append(
            DeploymentMismatch(
                deployment=name,
                samples=len(members),
                tokens=int(r.numel()),
                logp_diff=float(r.abs().mean()),
                kl=float((torch.expm1(r.clamp(max=50.0)) - r).mean()),
            )
        )
    return Mismatch(out, time.perf_counter() - t0, held)


def _logp_differences(trainer, samples: list[Sample]) -> list[Any]:
    """Per sample, train logp - served logp at its model tokens (float64), scored in micro-batches of the
    trainer's batch size, prompts left-padded and completions right-padded as TRL pads them."""
    import torch  # the train extra

    device = trainer.accelerator.device
    pad = trainer.processing_class.pad_token_id
    batch = trainer.args.per_device_train_batch_size
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].completion_ids))
    result: list[Any] = [None] * len(samples)
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch):
            rows = [samples[i] for i in order[start : start + batch]]
            p_len = max(len(s.prompt_ids) for s in rows)
            c_len = max(len(s.completion_ids) for s in rows)
            ids = torch.full((len(rows), p_len + c_len), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for k, s in enumerate(rows):
                ids[k, p_len - len(s.prompt_ids) : p_len + len(s.completion_ids)] = torch.tensor(
                    s.prompt_ids + s.completion_ids
                )
                attn[k, p_len - len(s.prompt_ids) : p_len + len(s.completion_ids)] = 1
            with torch.no_grad():
                logps = trainer.per_token_logps(model, ids.to(device), attn.to(device), c_len, batch_size=len(rows))
            logps = logps.double().cpu()
            for k, s in enumerate(rows):
                n = len(s.completion_ids)
                mask = torch.tensor(s.env_mask, dtype=torch.bool)
                served = torch.tensor(s.logprobs, dtype=torch.float64)
                r = (logps[k, :n] - served)[mask]
                result[order[start + k]] = r[~torch.isnan(r)]
    finally:
        model.train(was_training)
    return result


def check_mismatch(mismatch: Mismatch, limit: float, *, where: str, policy: str, details: str) -> None:
    """Stop the round (one-line error) when a held deployment's KL is past `limit` (0: never)."""
    if not limit:
        return
    bad = [d for d in mismatch.checked if d.kl > limit]
    if not bad:
        return
    worst = max(bad, key=lambda d: d.kl)
    raise LcapError(
        f"{where}: the policy being trained ({policy}) does not score the captured tokens as deployment "
        f"{worst.deployment!r} served them ({worst.samples} samples, {worst.tokens} tokens): KL {worst.kl:.3g} per "
        f"token, mean |delta logp| {worst.logp_diff:.3g}, over --mismatch-max {limit:g}. Likely causes: the adapter "
        "being trained is not the one vLLM served (deploy skipped or failed, another adapter under its name), "
        "a different base model or chat template on the two sides, or a dtype far from the trainer's. "
        f"Per deployment: {details}; --mismatch-max 0 turns the check off"
    )
