"""Observation tokens of multi-turn episodes are out of the objective: with the loss mask (completion_mask less
env_mask), the loss, its gradient, every normalizer and every metric equal those of the same batch with the
observation columns deleted (the oracle), whatever the observation positions hold, and the gradient there is
exactly zero. Every loss type and option of `test_objectives_accum.CASES`, whole and split into micro-batches."""

from __future__ import annotations

import pytest
import torch

from logitless.objectives import (
    ObjectiveOptions,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    loss_normalizer,
    merge_metrics,
    on_policy_logp_grad,
    policy_loss,
)
from tests.test_objectives_accum import CASES, SPLIT_1, B, _data

F64 = torch.float64
LEAVES = ("logp", "old_logp", "ref_logp", "sampler_logp", "entropy")


def episode_layout(mask: torch.Tensor, seed: int = 5):
    """Spread each row's model tokens (compact [B, T] mask, a prefix) over turns, with 1-3 observation tokens
    between turns and after the last turn of some rows. Returns (index [B, W] of the compact column each
    episode column holds, -1 at observations and padding; completion mask [B, W]; env mask [B, W])."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(mask.shape[0]):
        n, cols, k = int(mask[b].sum()), [], 0
        while k < n:
            turn = int(torch.randint(1, 4, (1,), generator=g))
            cols += list(range(k, min(n, k + turn)))
            k += turn
            if k < n or b % 3 == 0:  # an observation after every turn but the last (and after it, in some rows)
                cols += [-1] * int(torch.randint(1, 4, (1,), generator=g))
        rows.append(cols)
    W = max(len(c) for c in rows)
    index = torch.full((mask.shape[0], W), -1)
    completion = torch.zeros((mask.shape[0], W), dtype=torch.long)
    for b, cols in enumerate(rows):
        index[b, : len(cols)] = torch.tensor(cols, dtype=torch.long)
        completion[b, : len(cols)] = 1
    env = completion * (index < 0)
    return index, completion, env


def spread(x: torch.Tensor, index: torch.Tensor, garbage: float) -> torch.Tensor:
    """The compact [B, T] values at their episode columns; `garbage` (NaN, ±1e6) at observations and padding."""
    out = x.gather(1, index.clamp(min=0))
    return torch.where(index >= 0, out, garbage)


def step(opts: ObjectiveOptions, leaves: dict, mask: torch.Tensor, adv, truncated, split: list[list[int]],
         width: torch.Tensor):
    """The trainer's accumulation: normalizers over the whole step from the loss masks, micro-batches trimmed to
    their longest completion (`width` [B]: columns holding any completion token)."""
    parts = [(rows, max(1, int(width[rows].max()))) for rows in split]
    normalizer = loss_normalizer(opts, [mask[r, :t] for r, t in parts], [truncated[r] for r, _ in parts])
    valid = mask.bool() & ~truncated[:, None] if opts.mask_truncated_completions else mask.bool()
    threshold = entropy_quantile_threshold(leaves["entropy"].detach(), valid, opts.top_entropy_quantile)
    entropies = [leaves["entropy"].detach()[r, :t] for r, t in parts]
    bonus = entropy_bonus_normalizer(opts, [mask[r, :t] for r, t in parts], [truncated[r] for r, _ in parts],
                                     entropies=entropies, threshold=threshold)
    total, metrics, hints = 0.0, [], []
    for rows, t in parts:
        kw = {k: v[rows, :t] for k, v in leaves.items() if k != "logp"}
        out = policy_loss(leaves["logp"][rows, :t], mask[rows, :t], adv[rows], opts, normalizer,
                          truncated=truncated[rows], entropy_threshold=threshold, entropy_normalizer=bonus, **kw)
        out.loss.backward()
        total = total + out.loss.detach()
        metrics.append(out.metrics)
        hints.append(on_policy_logp_grad(mask[rows, :t], adv[rows], opts, normalizer, truncated=truncated[rows]))
    return total, merge_metrics(metrics), normalizer, bonus, hints


@pytest.mark.parametrize("case", list(CASES))
def test_observations_are_out_of_the_objective(case):
    opts = ObjectiveOptions(**{**CASES[case], **({"max_completion_length": 32} if case == "dr_grpo" else {})})
    data, mask, adv, truncated = _data()
    index, completion, env = episode_layout(mask)
    loss_mask = completion * (1 - env)
    assert int(loss_mask.sum()) == int(mask.sum()) and int(env.sum()) > 10

    compact = {k: v.clone().requires_grad_(k in ("logp", "entropy")) for k, v in data.items()}
    ref = step(opts, compact, mask, adv, truncated, [list(range(B))], mask.sum(1))
    assert compact["logp"].grad.abs().sum() > 0

    width = completion.sum(1)
    for garbage, split in ((float("nan"), [list(range(B))]), (1e6, SPLIT_1), (-1e6, SPLIT_1)):
        leaves = {k: spread(v, index, garbage).requires_grad_(k in ("logp", "entropy")) for k, v in data.items()}
        loss, metrics, norm, bonus, hints = step(opts, leaves, loss_mask, adv, truncated, split, width)
        torch.testing.assert_close(loss, ref[0], rtol=1e-12, atol=1e-14)
        assert (norm, bonus) == (ref[2], ref[3])  # every normalizer counts the model's tokens only
        assert metrics.keys() == ref[1].keys()
        for name in metrics:  # ratios, clip fractions, IS, KL, entropy, completion_length: the model's tokens
            for f in ("total", "count", "min", "max"):
                torch.testing.assert_close(getattr(metrics[name], f), getattr(ref[1][name], f), rtol=1e-12,
                                           atol=1e-14, msg=f"{name}.{f}")
        for name in ("logp", "entropy"):
            g, g_ref = leaves[name].grad, compact[name].grad
            if g_ref is None:
                assert g is None
                continue
            assert (g[index < 0] == 0).all()  # observations and padding: exactly zero gradient
            sel, rows = index >= 0, torch.arange(B)[:, None].expand_as(index)
            torch.testing.assert_close(g[sel], g_ref[rows[sel], index[sel]], rtol=1e-12, atol=1e-14)
        if hints[0] is not None:  # the on-policy gradient hint: zero at observations, the loss's own elsewhere
            for h in hints:
                assert torch.isfinite(h).all()
            full_hint = on_policy_logp_grad(loss_mask, adv, opts, norm, truncated=truncated)
            assert (full_hint[env.bool()] == 0).all()
