"""Exact gradient accumulation: one full batch == 4 uneven micro-batches == 2 ranks × 2 micro-batches.

Micro-batches are trimmed to their own longest completion (as a trainer pads them), the normalizer is the
sum of every rank's `loss_normalizer`, and merged metrics equal the full-batch metrics.
"""

from __future__ import annotations

import pytest
import torch

from logitless.objectives import (
    ObjectiveOptions,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    loss_normalizer,
    merge_metrics,
    policy_loss,
)

F64 = torch.float64
B, T = 12, 9
SPLIT_1 = [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9], [10, 11]]  # 4 uneven micro-batches
RANKS = [[[0, 1, 2], [3, 4, 5, 6]], [[7, 8], [9, 10, 11]]]  # 2 ranks × 2 micro-batches

CASES = {
    "dapo": dict(loss_type="dapo"),  # tokens
    "bnpo": dict(loss_type="bnpo", beta=0.05, kl_estimator="k2"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2, sampler_is_mode="token_mask", sampler_is_clip_min=0.8,
                  sampler_is_clip_max=1.25),
    "vespo": dict(loss_type="vespo", sampler_is_mode="token_truncate"),
    "grpo": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=True, entropy_coef=0.02),  # sequences
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", sampler_is_mode="sequence_truncate",
                 sampler_is_sequence_reduction="geometric_mean"),
    "sapo": dict(loss_type="sapo", off_policy_mask_threshold=0.05),
    "sapo_bonus": dict(loss_type="sapo", top_entropy_quantile=0.6, entropy_coef=0.03),  # bonus on kept tokens
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=16, dual_clip=3.0, top_entropy_quantile=0.5,
                    mask_truncated_completions=True),  # constant
    "dapo_all": dict(loss_type="dapo", importance_sampling_level="sequence_token", delta=1.5, beta=0.04,
                     sampler_is_mode="sequence_mask", sampler_is_sequence_reduction="product",
                     sampler_is_clip_max=2.0, off_policy_mask_threshold=0.05, top_entropy_quantile=0.7,
                     entropy_coef=0.01, mask_truncated_completions=True),
}


def _data():
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([9, 3, 0, 5, 7, 2, 9, 1, 4, 6, 8, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    d = {
        "logp": logp,
        "old_logp": logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64),
        "ref_logp": logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64),
        "entropy": torch.rand(B, T, generator=g, dtype=F64) * 2,
    }
    d["sampler_logp"] = d["old_logp"] + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    truncated = lengths == T
    return d, mask, adv, truncated


def _step(opts, micro_batches_per_rank, leaves, mask, adv, truncated):
    """Run one optimizer step; returns (summed loss, metrics). Gradients accumulate into the leaves."""
    ranks = []
    for mbs in micro_batches_per_rank:  # each micro-batch: rows, trimmed to its longest completion
        ranks.append([(rows, max(1, int(mask[rows].sum(-1).max()))) for rows in mbs])
    normalizer = sum(  # all-reduce SUM of every rank's local count
        loss_normalizer(opts, [mask[r, :t] for r, t in mbs], [truncated[r] for r, _ in mbs]) for mbs in ranks
    )
    valid = mask.bool() & ~truncated[:, None] if opts.mask_truncated_completions else mask.bool()
    threshold = entropy_quantile_threshold(leaves["entropy"].detach(), valid, opts.top_entropy_quantile)
    entropy_normalizer = sum(  # all-reduce SUM, like the loss normalizer
        entropy_bonus_normalizer(opts, [mask[r, :t] for r, t in mbs], [truncated[r] for r, _ in mbs],
                                 entropies=[leaves["entropy"].detach()[r, :t] for r, t in mbs], threshold=threshold)
        for mbs in ranks
    )
    total, metrics = 0.0, []
    for mbs in ranks:
        for rows, t in mbs:
            kw = {k: v[rows, :t] for k, v in leaves.items() if k != "logp"}
            out = policy_loss(leaves["logp"][rows, :t], mask[rows, :t], adv[rows], opts, normalizer,
                              truncated=truncated[rows], entropy_threshold=threshold,
                              entropy_normalizer=entropy_normalizer, **kw)
            out.loss.backward()
            total = total + out.loss.detach()
            metrics.append(out.metrics)
    return total, merge_metrics(metrics)


@pytest.mark.parametrize("case", list(CASES))
def test_accumulation_is_exact(case):
    opts = ObjectiveOptions(**CASES[case])
    data, mask, adv, truncated = _data()
    results = []
    for split in ([[list(range(B))]], [SPLIT_1], RANKS):
        leaves = {k: v.clone().requires_grad_(k in ("logp", "entropy")) for k, v in data.items()}
        loss, metrics = _step(opts, split, leaves, mask, adv, truncated)
        results.append((loss, leaves["logp"].grad.clone(), leaves["entropy"].grad, metrics))
    (loss0, g0, e0, m0) = results[0]
    assert g0.abs().sum() > 0
    for loss, g, e, m in results[1:]:
        torch.testing.assert_close(loss, loss0, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-14)
        if e0 is not None:
            torch.testing.assert_close(e, e0, rtol=1e-12, atol=1e-14)
        assert m.keys() == m0.keys()
        for name in m0:
            for f in ("total", "count", "min", "max"):
                torch.testing.assert_close(getattr(m[name], f), getattr(m0[name], f), rtol=1e-12, atol=1e-14,
                                           msg=f"{name}.{f}")


def test_trl_local_bnpo_would_not_be_exact():
    """Why bnpo uses the step's token count here: TRL's per-micro-batch token mean ÷ GAS differs from the
    full-batch value as soon as micro-batches hold different numbers of tokens."""
    data, mask, adv, _ = _data()
    opts = ObjectiveOptions(loss_type="bnpo")
    full = policy_loss(data["logp"], mask, adv, opts, loss_normalizer(opts, [mask]), old_logp=data["old_logp"]).loss
    trl = sum(policy_loss(data["logp"][r], mask[r], adv[r], opts, loss_normalizer(opts, [mask[r]]),
                          old_logp=data["old_logp"][r]).loss / len(SPLIT_1) for r in SPLIT_1)
    assert abs(float(trl - full)) > 1e-3
