"""Naive dense oracle for the fused token-logprob op.

It materializes the full [N, V] logits and is used only by tests and benchmarks as the ground truth
(upcast inputs to float64 for an exact reference) and as the "dense torch" baseline.
"""

from __future__ import annotations

import torch


def token_logprobs_reference(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] int
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    with_entropy: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense log-softmax gather: logp[i] = log_softmax((h_i·Wᵀ + b) / T)[targets[i]].

    Returns (logp [N], entropy [N] or None). The logits are computed in the inputs' dtype (like a
    plain `F.linear`) and the softmax in `compute_dtype` (default: float32, or float64 for float64
    inputs), which is what a TRL-style loss does.
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = torch.nn.functional.linear(hidden, weight, bias).to(compute_dtype)  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # [N]
    logp = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - logz  # [N]
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)  # [N, V]
        entropy = logz - (probs * logits).sum(-1)  # [N]
    return logp, entropy
