"""Turn-level credit for multi-turn episodes: one advantage per model turn instead of one per episode.

Rows i*G .. i*G+G-1 are the G episodes of prompt i (a group); episode b has K_b model turns and a reward r_bt
per turn (the caller decides what lands on which turn: logitless puts each environment step reward on its turn
and the episode-level rewards on the last turn). Then, with discount γ (`AdvantageOptions.turn_discount`):

    R_bt = Σ_{t' = t}^{K_b - 1} γ^(t' - t) · r_bt'                  return-to-go of turn t, t < K_b
    A_bt = (R_bt - mean S) / (std S + ε)                            grpo, scale=group
    S    = {R_gt : g in b's group, K_g > t}                          turn_baseline=turn (the same turn index)
         = {R_g0 : g in b's group}                                   turn_baseline=episode (the episode returns)

rloo leaves episode b out of S (A = R_bt − mean(S \\ {b's own value})); scale=batch divides by the std of every
return-to-go of the batch, scale=none by nothing. A set S with fewer than two values, or whose values are all
equal, gives advantage 0 (and is counted in `zero_variance_turns`). Every model token of turn t gets A_bt
(`token_advantages`). With one turn per episode both baselines are the episode-level `compute_advantages`.

The baseline of turn t depends on the turn index and the group only, never on how many turns episode b itself
took, so it does not reward or punish the decision to go on (verl RFC #7244: per-turn normalised rewards summed
into returns subtract a baseline with one term per turn the episode lived, a hidden length bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitless.objectives.advantages import _constant, _nanstd
from logitless.objectives.metrics import Stat
from logitless.objectives.options import AdvantageOptions

Tensor = torch.Tensor


@dataclass
class TurnAdvantageOutput:
    advantages: Tensor  # [B, K] float32, A_bt; 0 at t >= num_turns[b], on unscorable rows and zero-variance cells
    returns: Tensor  # [B, K] float32, R_bt; NaN at t >= num_turns[b] and on unscorable rows
    zero_variance: Tensor  # [B] bool, no turn of the row's group carries signal (all of the group's advantages 0)
    metrics: dict[str, Stat]


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """[B, K] R_t = r_t + γ·R_{t+1} (R_K = 0) from rewards [B, K]; entries past an episode's last turn must be 0."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def turn_advantages(turn_rewards: Tensor, num_turns: Tensor, group_size: int,
                    options: AdvantageOptions | None = None) -> TurnAdvantageOutput:
    """Per-turn advantages [B, K] (module docstring) from per-turn rewards `turn_rewards` [B, K] (already weighted
    and summed over reward sources; entries at t >= num_turns[b] are ignored) and `num_turns` [B] (model turns of
    each episode, 0..K). A row with a NaN reward at one of its turns is unscorable: it is left out of every
    baseline and gets advantage 0. Pass the whole rollout (whole groups), as for `compute_advantages`."""
    o = options if options is not None else AdvantageOptions(credit="turn")
    if not isinstance(o, AdvantageOptions):
        raise TypeError(f"options must be an AdvantageOptions, got {type(o).__name__}.")
    if not isinstance(turn_rewards, Tensor) or turn_rewards.dim() != 2 or 0 in turn_rewards.shape:
        raise ValueError(f"turn_rewards must be a non-empty [B, K] tensor, got {getattr(turn_rewards, 'shape', None)}.")
    B, K = turn_rewards.shape
    if not isinstance(num_turns, Tensor) or tuple(num_turns.shape) != (B,) or num_turns.is_floating_point():
        raise ValueError(f"num_turns must be an integer [B] = [{B}] tensor, got {getattr(num_turns, 'shape', None)}.")
    if bool((num_turns < 0).any()) or bool((num_turns > K).any()):
        raise ValueError(f"num_turns must lie in [0, K={K}], got {num_turns.tolist()}.")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or B % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing the {B} rows (G per prompt).")
    G, n = group_size, B // group_size
    r = turn_rewards.to(torch.float64)
    alive = torch.arange(K, device=r.device) < num_turns.to(r.device).view(-1, 1)  # [B, K]
    unscorable = (torch.isnan(r) & alive).any(1) | (num_turns.to(r.device) == 0)  # [B]
    valid = alive & ~unscorable.view(-1, 1)  # [B, K]
    ret = torch.where(valid, discounted_returns(torch.where(valid, r, 0.0), o.turn_discount), float("nan"))

    x = ret.view(n, G, K)
    base = x if o.turn_baseline == "turn" else x[:, :, :1]  # the values of S: [n, G, K] or [n, G, 1]
    count = (~torch.isnan(base)).sum(1, keepdim=True).to(r.dtype)  # |S| per cell: [n, 1, K] or [n, 1, 1]
    total = base.nansum(1, keepdim=True)
    if o.estimator == "grpo":
        adv = x - total / count.clamp(min=1.0)
    else:  # rloo: the mean of S without the episode's own value
        adv = x - (total - base) / (count - 1).clamp(min=1.0)
    if o.scale == "group":
        adv = adv / (_nanstd(base, 1, keepdim=True) + o.epsilon)
    elif o.scale == "batch":
        adv = adv / (_nanstd(ret) + o.epsilon)
    zero = _constant(base, 1)  # [n, 1, K] or [n, 1, 1]
    adv = torch.where(zero, 0.0, adv).nan_to_num(0.0, 0.0, 0.0).reshape(B, K)
    adv = torch.where(valid, adv, 0.0)
    cells = zero.expand(n, 1, K if o.turn_baseline == "turn" else 1)
    members = (count > 0).expand_as(cells)  # cells with at least one scorable episode
    zero_rows = (cells | ~members).flatten(1).all(1).view(n, 1).expand(n, G).reshape(B)
    metrics = {
        "advantage": Stat.of(adv, valid),  # per (episode, turn)
        "advantage/return": Stat.of(ret, valid),
        "zero_variance_turns": Stat.of(cells, members),  # share of (group, turn index) cells without signal
    }
    return TurnAdvantageOutput(adv.float(), ret.float(), zero_rows, metrics)


def token_turns(completion_mask: Tensor, env_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(turn index of each completion token [B, T] long, model turns per row [B] long). The model's tokens are
    completion_mask & ~env_mask; each maximal run of them is one model turn (the driver's observation tokens
    separate turns), numbered 0, 1, ...; observation and padding tokens get -1."""
    model = completion_mask.bool() & ~env_mask.bool()  # [B, T]
    before = torch.nn.functional.pad(model[:, :-1], (1, 0), value=False)
    starts = model & ~before
    index = torch.where(model, starts.long().cumsum(1) - 1, -1)
    return index, starts.sum(1)


def token_advantages(turn_adv: Tensor, turn_index: Tensor) -> Tensor:
    """[B, T] the advantage of each token's turn: turn_adv [B, K] gathered at turn_index [B, T] (`token_turns`),
    0 where turn_index is -1 (observations, padding)."""
    if turn_index.numel() and int(turn_index.max()) >= turn_adv.shape[1]:
        raise ValueError(f"turn_index names turn {int(turn_index.max())} but turn_adv has {turn_adv.shape[1]} turns.")
    picked = turn_adv.gather(1, turn_index.clamp(min=0).to(turn_adv.device))
    return torch.where(turn_index.to(turn_adv.device) >= 0, picked, 0.0)
