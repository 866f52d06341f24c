"""Entropy helpers: the top-entropy-quantile threshold, the entropy-bonus normalizer and the adaptive
entropy-bonus coefficient."""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch

from logitless.objectives.metrics import Stat
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


def entropy_bonus_normalizer(
    options: ObjectiveOptions,
    masks: list[Tensor],  # [B, T] loss mask of each micro-batch of this rank
    truncated: list[Tensor] | None = None,  # [B] bool each (needed with mask_truncated_completions)
    *,
    entropies: list[Tensor] | None = None,  # [B, T] each; needed with top_entropy_quantile < 1
    threshold: float | Tensor | None = None,  # the entropy_threshold passed to policy_loss
) -> float:
    """This rank's share of the entropy-bonus normalizer (additive: all-reduce it with SUM, then pass it to
    every `policy_loss(entropy_normalizer=...)` of the step).

    The bonus acts on the tokens the policy term keeps: the loss mask (less truncated rows when
    `mask_truncated_completions`) and, with `top_entropy_quantile < 1`, only tokens with entropy >= threshold
    (TRL 1.16's effective mask). What is counted depends on `options.entropy_bonus_reduction`:

    - step_mean: those tokens over the whole step, so the bonus is their exact step mean however the step is
      split. With `num_iterations` > 1 the count comes from the entropies given here (usually those of the
      rollout policy), while policy_loss keeps tokens by the current entropy; the two sets can drift apart.
    - trl: micro-batches (TRL's gradient-accumulation steps × ranks); each micro-batch adds its own token mean
      divided by this count, as TRL 1.16 does.
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if options.entropy_bonus_reduction == "trl":
        return float(len(masks))
    if truncated is not None and len(truncated) != len(masks):
        raise ValueError(f"truncated has {len(truncated)} entries but masks has {len(masks)}; pass one per micro-batch.")
    if options.mask_truncated_completions and truncated is None:
        raise ValueError("options.mask_truncated_completions=True: pass truncated= (one [B] bool tensor per "
                         "micro-batch) so truncated rows are left out of the bonus token count.")
    top = options.top_entropy_quantile < 1.0
    if top and (entropies is None or threshold is None or len(entropies) != len(masks)):
        raise ValueError(f"options.top_entropy_quantile={options.top_entropy_quantile}: the bonus counts only kept "
                         "tokens, so pass entropies= (one [B, T] tensor per micro-batch) and the threshold= given "
                         "to policy_loss(entropy_threshold=...).")
    total = 0.0
    for i, m in enumerate(masks):
        valid = m.bool()
        if options.mask_truncated_completions:
            valid = valid & ~truncated[i].bool().view(-1, 1)
        if top:
            thr = threshold if isinstance(threshold, Tensor) else float(threshold)
            valid = valid & (entropies[i].detach().to(torch.promote_types(entropies[i].dtype, torch.float32)) >= thr)
        total += float(valid.sum())
    return total


def controlled_entropy(metrics: Mapping[str, Stat]) -> float:
    """The step's mean entropy that the adaptive controller tracks (from `policy_loss` metrics merged over the
    step and ranks): over the tokens the policy term keeps, as TRL 1.16 (the top-entropy tokens when
    `top_entropy_quantile < 1`, else every loss token)."""
    stat = metrics["entropy/kept"] if "entropy/kept" in metrics else metrics["entropy"]
    return float(stat.mean)


def initial_entropy_coef(options: ObjectiveOptions) -> EntropyCoef:
    """Controller state before the first step. Adaptive: TRL 1.16 starts with no measured entropy, so the
    first step applies no bonus (`effective` 0) and the controller then moves from `entropy_coef`."""
    effective = 0.0 if options.use_adaptive_entropy else options.entropy_coef
    return EntropyCoef(options.entropy_coef, effective)


def update_entropy_coef(coef: float, step_mean_entropy: float, options: ObjectiveOptions) -> EntropyCoef:
    """Adaptive entropy bonus (TRL `use_adaptive_entropy`), called once after each optimizer step with the
    global mean entropy of that step: the coefficient grows by `entropy_coef_delta` while the entropy is at
    or below `entropy_target` and shrinks otherwise, clamped to [entropy_coef_min, entropy_coef_max]; the
    bonus is applied only while the entropy is at or below the target (`effective` is 0 otherwise)."""
    low = step_mean_entropy <= options.entropy_target
    new = coef + options.entropy_coef_delta if low else coef - options.entropy_coef_delta
    new = min(max(new, options.entropy_coef_min), options.entropy_coef_max)
    return EntropyCoef(new, new if low else 0.0)
