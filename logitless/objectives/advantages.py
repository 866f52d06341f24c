"""Group-relative advantages from the rewards of a rollout (rows i*G .. i*G+G-1 are one prompt's group).

NaN rewards follow TRL: a reward function that returns None for a row gives NaN there; the weighted sum
over functions is a nansum, a row whose every function is NaN is "unscorable" (NaN total, advantage 0),
and group means/stds are NaN-aware (the std with Bessel's correction, + epsilon). Groups with zero
variance (all scorable rewards equal, or at most one scorable row) get an advantage of exactly 0 and are
counted in the `zero_variance_groups` metric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless.objectives.metrics import Stat
from logitless.objectives.options import AdvantageOptions

Tensor = torch.Tensor


@dataclass
class AdvantageOutput:
    advantages: Tensor  # [B] float32
    total_reward: Tensor  # [B] float32, weighted nansum of the reward functions (NaN if unscorable)
    zero_variance: Tensor  # [B] bool, the row's group carries no signal (advantage 0)
    metrics: dict[str, Stat]


def _nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Std ignoring NaNs, with Bessel's correction (TRL `nanstd`); NaN when fewer than 2 values."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    n = (~torch.isnan(x)).sum(dim, keepdim=True).to(x.dtype)
    var = torch.nanmean((x - torch.nanmean(x, dim, keepdim=True)) ** 2, dim, keepdim=True) * n / (n - 1)
    std = torch.sqrt(var)
    std = torch.where(n > 1, std, float("nan"))
    return std if keepdim else std.squeeze(dim)


def _constant(x: Tensor, dim: int) -> Tensor:
    """True where the non-NaN values along `dim` are all equal or fewer than two (keepdim)."""
    nan = torch.isnan(x)
    hi = torch.where(nan, -torch.inf, x).amax(dim, keepdim=True)
    lo = torch.where(nan, torch.inf, x).amin(dim, keepdim=True)
    n = (~nan).sum(dim, keepdim=True)
    return (hi == lo) | (n <= 1)


def compute_advantages(rewards: Tensor, group_size: int, options: AdvantageOptions | None = None) -> AdvantageOutput:
    """Advantages [B] from rewards [B, R] (R reward functions; a [B] tensor means R = 1).

    sum_then_normalize (TRL default): R_i = nansum_k w_k r_ik; A_i = R_i - b_i, with b_i the group mean (grpo)
      or the mean of the other scorable group members (rloo, = G/(G-1)·(R_i - mean)); then ÷ (std + ε) with
      the group std (scale='group'), the batch std ('batch') or not at all ('none').
    normalize_then_sum (GDPO): z_ik = (r_ik - mean_group_k) / (std_group_k + ε); S_i = nansum_k w_k z_ik;
      A_i = (S_i - mean_batch S) / (std_batch S + ε).
    The batch is the whole rollout of the step: gather it across ranks before calling.
    """
    o = options if options is not None else AdvantageOptions()
    if not isinstance(o, AdvantageOptions):
        raise TypeError(f"options must be an AdvantageOptions, got {type(o).__name__}.")
    if not isinstance(rewards, Tensor) or rewards.dim() not in (1, 2) or rewards.shape[0] == 0:
        got = getattr(rewards, "shape", type(rewards))
        raise ValueError(f"rewards must be a non-empty [B, R] (or [B]) tensor, got {got}.")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int (samples per prompt), got {group_size!r}.")
    r = (rewards if rewards.dim() == 2 else rewards.view(-1, 1)).to(torch.float64)  # [B, R]
    B, R = r.shape
    if B % group_size != 0:
        raise ValueError(f"rewards has {B} rows, not a multiple of group_size={group_size}; rows i*G..i*G+G-1 "
                         "must be the G samples of prompt i.")
    if o.reward_weights is not None and len(o.reward_weights) != R:
        raise ValueError(f"options.reward_weights has {len(o.reward_weights)} weights but rewards has {R} "
                         "reward functions (columns).")
    w = torch.tensor(o.reward_weights if o.reward_weights is not None else [1.0] * R, dtype=r.dtype, device=r.device)
    G, n_groups = group_size, B // group_size
    unscorable = torch.isnan(r).all(1)  # [B]
    total = (r * w).nansum(1).masked_fill(unscorable, float("nan"))  # [B]
    metrics: dict[str, Stat] = {}

    if o.multi_reward == "sum_then_normalize":
        g = total.view(n_groups, G)
        if o.estimator == "grpo":
            adv = g - torch.nanmean(g, 1, keepdim=True)
        else:  # rloo: R_i - (S - R_i)/(n - 1)
            n = (~torch.isnan(g)).sum(1, keepdim=True).to(g.dtype)
            adv = (n * g - g.nansum(1, keepdim=True)) / (n - 1).clamp(min=1.0)
        group_std = _nanstd(g, 1, keepdim=True)  # [n_groups, 1]
        if o.scale == "group":
            adv = adv / (group_std + o.epsilon)
        elif o.scale == "batch":
            adv = adv / (_nanstd(total) + o.epsilon)
        zero_var = _constant(g, 1)  # [n_groups, 1]
        metrics["reward_group_std"] = Stat.of(group_std, ~torch.isnan(group_std))
    else:  # normalize_then_sum (GDPO)
        g = r.view(n_groups, G, R)
        const_k = _constant(g, 1)  # [n_groups, 1, R]
        z = (g - torch.nanmean(g, 1, keepdim=True)) / (_nanstd(g, 1, keepdim=True) + o.epsilon)
        z = torch.where(const_k & ~torch.isnan(g), 0.0, z)
        s = (z * w).nansum(2).reshape(B).masked_fill(unscorable, float("nan"))  # [B]
        adv = ((s - torch.nanmean(s)) / (_nanstd(s) + o.epsilon)).view(n_groups, G)
        zero_var = const_k.all(-1)  # [n_groups, 1]
    adv = torch.where(zero_var, 0.0, adv).nan_to_num(0.0, 0.0, 0.0).reshape(B)
    zero_var_rows = zero_var.expand(n_groups, G).reshape(B)

    scorable = ~torch.isnan(total)
    metrics["reward"] = Stat.of(total, scorable)
    for k in range(R):
        metrics[f"reward/{k}"] = Stat.of(r[:, k], ~torch.isnan(r[:, k]))
    metrics["advantage"] = Stat.of(adv)
    metrics["zero_variance_groups"] = Stat.of(zero_var)
    metrics["unscorable"] = Stat.of(unscorable)
    return AdvantageOutput(adv.float(), total.float(), zero_var_rows, metrics)
