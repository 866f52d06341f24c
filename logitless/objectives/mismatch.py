"""How far the rollout engine's logprobs are from the trainer's on the sampled tokens (training–inference mismatch).

With r = logp_trainer − logp_sampler on each sampled token (both of the same temperature-scaled distribution):

    rollout/mismatch_mean = mean |r|               over the step's tokens (nats)
    rollout/mismatch_max  = max |r|
    rollout/mismatch_kl   = mean (exp(r) − 1 − r)   k3 estimate of KL(sampler ‖ trainer), nats per token

Tokens x are drawn from the sampler, so E_x[−r] = KL(sampler ‖ trainer), and k3 = exp(r) − 1 − r has the same
expectation (E_x[exp(r)] = 1) while being non-negative on every token and of low variance when the two are close
(Schulman's k3, as `kl.kl_estimate`). k1 = −r is not logged: with a small mismatch KL ≈ E[r²]/2 is much smaller
than E|r|, so k1's mean over a step's tokens is dominated by the noise of its signs.

The trainer takes `logp_trainer` from the update's first optimizer pass (before any optimizer step of the step,
so it is the policy the sampler was meant to be), detached: no extra forward. Stats merge exactly over
micro-batches and ranks (`metrics.Stat`). A step on which no row trains (every advantage 0) has no such pass; there
one no-grad forward over a sample of `train.mismatch_sample_rows` rows measures it (trainer/mismatch_rows.py).

What a value means. Two bf16 forwards of the same weights round differently: on real models the mean is about
0.005–0.02 nats (the `hf` backend against the trainer: 0.002–0.007 on tiny random models, issue 32's table).
Beyond that the engine computes another function (a compiled decode that reorders bf16 ops, merged LoRA weights,
quantized weights) or another policy (train.async_rollout: samples of the policy one optimizer step before).
"""

from __future__ import annotations

import torch

from logitless.objectives.loss import LOGP_FLOOR
from logitless.objectives.metrics import Stat, stats_of

Tensor = torch.Tensor

ABS = "rollout/mismatch"  # Stat of |r| (mean and max are logged)
KL = "rollout/mismatch_kl"  # Stat of k3 (mean is logged)
MAX_LOG_RATIO = 20.0  # r is clamped to ±this before exp (as kl_estimate): one broken token cannot overflow the mean


def sampler_mismatch(logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, Stat]:
    """Stats of |r| and of k3 = exp(r) − 1 − r, r = logp − sampler_logp, over the tokens where `mask` is set.

    logp: [B, T] the trainer's logprobs of the sampled tokens (detached here); sampler_logp: [B, T] the engine's;
    mask: [B, T] the tokens to count. Logprobs are floored at LOGP_FLOOR as in the loss; computed in fp64.
    """
    with torch.no_grad():
        valid = mask.bool()
        a = logp.detach().to(torch.float64).clamp(min=LOGP_FLOOR)
        b = sampler_logp.detach().to(device=a.device, dtype=torch.float64).clamp(min=LOGP_FLOOR)
        r = torch.where(valid, a - b, 0.0)
        rc = r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return stats_of({ABS: (r.abs(), valid), KL: (torch.exp(rc) - 1.0 - rc, valid)})


def mismatch_summary(metrics: dict[str, Stat]) -> dict[str, float]:
    """The logged values {rollout/mismatch_mean, _max, _kl} of the merged Stats in `metrics` (other names are
    ignored); empty when no token was counted (every row skipped). Synchronizes with the device."""
    if ABS not in metrics or float(metrics[ABS].count) == 0.0:
        return {}
    return {f"{ABS}_mean": float(metrics[ABS].mean), f"{ABS}_max": float(metrics[ABS].max),
            KL: float(metrics[KL].mean)}
