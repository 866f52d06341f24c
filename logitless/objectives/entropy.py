"""Entropy helpers: the top-entropy-quantile threshold and the adaptive entropy-bonus coefficient."""

from __future__ import annotations

from typing import NamedTuple

import torch

from logitless.objectives.options import ObjectiveOptions

Tensor = torch.Tensor


def entropy_quantile_threshold(
    entropy: Tensor | list[Tensor],  # [B, T] or a list of them (e.g. every micro-batch of the step)
    mask: Tensor | list[Tensor],  # [B, T] each
    top_quantile: float,
) -> Tensor:
    """Entropy value above which a token is in the top `top_quantile` fraction of the valid tokens.

    Equivalent to `torch.quantile(entropy[mask.bool()], 1 - top_quantile)` (linear interpolation, as TRL),
    without torch.quantile's 16M-element limit. Returns a 0-dim tensor; +inf when there is no valid token.
    To use a threshold over the whole step and all ranks (exact under accumulation), gather the valid
    entropies of every micro-batch and rank and pass the result to `policy_loss(entropy_threshold=...)`.
    """
    ents = entropy if isinstance(entropy, (list, tuple)) else [entropy]
    masks = mask if isinstance(mask, (list, tuple)) else [mask]
    if len(ents) != len(masks):
        raise ValueError(f"entropy and mask lists differ in length ({len(ents)} vs {len(masks)}).")
    dtype = torch.promote_types(ents[0].dtype, torch.float32)
    # invalid positions sort last as +inf; indices stay tensors, so this never synchronizes with the device
    vals = torch.cat([torch.where(m.bool(), e.detach().to(dtype), torch.inf).flatten() for e, m in zip(ents, masks)])
    if vals.numel() == 0:
        return torch.tensor(float("inf"), dtype=dtype, device=vals.device)
    v = vals.sort().values
    n = sum(m.bool().sum() for m in masks)  # [] number of valid tokens
    pos = (1.0 - top_quantile) * (n - 1).clamp(min=0).to(dtype)
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    v_lo, v_hi = v.index_select(0, lo.view(1))[0], v.index_select(0, hi.view(1))[0]
    thr = v_lo + (v_hi - v_lo) * (pos - lo.to(dtype))
    return torch.where(n > 0, thr, torch.inf)


class EntropyCoef(NamedTuple):
    coef: float  # controller state for the next step
    effective: float  # coefficient to pass as policy_loss(entropy_coef=...) for the next step


def update_entropy_coef(coef: float, step_mean_entropy: float, options: ObjectiveOptions) -> EntropyCoef:
    """Adaptive entropy bonus (TRL `use_adaptive_entropy`), called once after each optimizer step with the
    global mean entropy of that step: the coefficient grows by `entropy_coef_delta` while the entropy is at
    or below `entropy_target` and shrinks otherwise, clamped to [entropy_coef_min, entropy_coef_max]; the
    bonus is applied only while the entropy is at or below the target (`effective` is 0 otherwise)."""
    low = step_mean_entropy <= options.entropy_target
    new = coef + options.entropy_coef_delta if low else coef - options.entropy_coef_delta
    new = min(max(new, options.entropy_coef_min), options.entropy_coef_max)
    return EntropyCoef(new, new if low else 0.0)
