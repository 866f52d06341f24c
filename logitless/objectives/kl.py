"""Per-token estimators of KL(π_θ || π_ref) from sampled-token logprobs (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3", max_log_ratio: float = 20.0) -> Tensor:
    """Per-token KL estimate, same shape as the inputs. With d = ref_logp - logp:

    - k1:         -d                       (= logp - ref_logp; unbiased, can be negative)
    - k2:         d² / 2
    - k3:         exp(d) - d - 1           (TRL, Liger; non-negative, unbiased)
    - low_var_kl: clamp(k3, -10, 10)       (verl)

    For k3 and low_var_kl, d is clamped to ±max_log_ratio before the exp (verl clamps at 20; TRL does not
    clamp, which only differs when |d| > max_log_ratio).
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator in ("k3", "low_var_kl"):
        d = d.clamp(-max_log_ratio, max_log_ratio)
        kl = torch.exp(d) - d - 1.0
        return kl.clamp(-10.0, 10.0) if estimator == "low_var_kl" else kl
    raise ValueError(f"kl estimator {estimator!r} is not valid; choose one of 'k1', 'k2', 'k3', 'low_var_kl'.")
