"""compute_advantages against hand-computed values and against TRL's formulas (written out below)."""

from __future__ import annotations

import math

import pytest
import torch

from logitless.objectives import AdvantageOptions, compute_advantages

F64 = torch.float64


def _trl_nanstd(x, dim=None, keepdim=False):
    if dim is None:
        x, dim = x.reshape(-1), 0
    var = torch.nanmean((x - torch.nanmean(x, dim, keepdim=True)) ** 2, dim, keepdim=True)
    n = (~torch.isnan(x)).sum(dim, keepdim=True)
    std = torch.sqrt(var * n / (n - 1))
    return std if keepdim else std.squeeze(dim)


def _trl_advantages(rpf, G, weights, scale, aggregation):
    """TRL GRPOTrainer._generate_and_score_completions, advantage part (NaN-aware version)."""
    unscorable = torch.isnan(rpf).all(1)
    if aggregation == "sum_then_normalize":
        rewards = (rpf * weights[None]).nansum(1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, G), 1).repeat_interleave(G)
        if scale in ("group", "none"):
            std = _trl_nanstd(rewards.view(-1, G), 1).repeat_interleave(G)
        else:
            std = _trl_nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = rpf.view(-1, G, rpf.shape[1])
        z = (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (_trl_nanstd(grouped, 1, keepdim=True) + 1e-4)
        rewards = (z.view(-1, rpf.shape[1]) * weights[None]).nansum(1)
        rewards[unscorable] = torch.nan
        adv = (rewards - torch.nanmean(rewards)) / (_trl_nanstd(rewards) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def test_hand_computed_group_scale():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0])  # 2 groups of 3
    out = compute_advantages(r, 3)
    s1 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # Bessel
    s2 = math.sqrt(((4 / 3) ** 2 + (5 / 3) ** 2 + (1 / 3) ** 2) / 2)
    expected = [2 / 3 / (s1 + 1e-4), -1 / 3 / (s1 + 1e-4), -1 / 3 / (s1 + 1e-4),
                -4 / 3 / (s2 + 1e-4), 5 / 3 / (s2 + 1e-4), -1 / 3 / (s2 + 1e-4)]
    torch.testing.assert_close(out.advantages, torch.tensor(expected))
    torch.testing.assert_close(out.total_reward, r)


def test_hand_computed_batch_scale_none_and_rloo():
    r = torch.tensor([1.0, 0.0, 2.0, 6.0])  # 2 groups of 2
    std_b = float(torch.tensor([1.0, 0.0, 2.0, 6.0], dtype=F64).std())
    out = compute_advantages(r, 2, AdvantageOptions(scale="batch"))
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, -2.0, 2.0]) / (std_b + 1e-4))
    out = compute_advantages(r, 2, AdvantageOptions(scale="none"))
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, -2.0, 2.0]))
    # rloo, group of 3: A_i = R_i - mean(others)
    r3 = torch.tensor([1.0, 0.0, 4.0])
    out = compute_advantages(r3, 3, AdvantageOptions(estimator="rloo", scale="none"))
    torch.testing.assert_close(out.advantages, torch.tensor([1 - 2.0, 0 - 2.5, 4 - 0.5]))


def test_weights_and_gdpo_hand_computed():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # one group of 4, two functions
    w = (1.0, 0.5)
    out = compute_advantages(r, 4, AdvantageOptions(reward_weights=w, scale="none"))
    total = torch.tensor([1.0, 0.0, 1.5, 0.5])
    torch.testing.assert_close(out.total_reward, total)
    torch.testing.assert_close(out.advantages, total - total.mean())
    out = compute_advantages(r, 4, AdvantageOptions(reward_weights=w, multi_reward="normalize_then_sum"))
    s = math.sqrt((4 * 0.25) / 3)  # each function: values {0,1} twice, Bessel std
    z = (r - 0.5) / (s + 1e-4)
    summed = z[:, 0] * 1.0 + z[:, 1] * 0.5
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    torch.testing.assert_close(out.advantages, expected)


@pytest.mark.parametrize("scale,aggregation", [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"),
                                               ("none", "sum_then_normalize"), ("group", "normalize_then_sum")])
def test_matches_trl_formulas_with_nan_rewards(scale, aggregation):
    g = torch.Generator().manual_seed(0)
    G, R = 4, 3
    rpf = torch.randint(0, 3, (24, R), generator=g).to(F64)
    rpf[torch.rand(24, R, generator=g) < 0.2] = torch.nan  # function not applicable to a row
    rpf[5] = torch.nan  # unscorable row
    rpf[8:12] = torch.tensor([1.0, 2.0, 0.0], dtype=F64)  # a zero-variance group
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    opts = AdvantageOptions(reward_weights=tuple(weights.tolist()), scale=scale, multi_reward=aggregation)
    out = compute_advantages(rpf, G, opts)
    expected = _trl_advantages(rpf.clone(), G, weights, scale, aggregation)
    torch.testing.assert_close(out.advantages, expected.float(), rtol=1e-5, atol=1e-5)
    assert out.advantages[5] == 0 and (out.advantages[8:12] == 0).all()  # exactly zero
    assert out.advantages.abs().sum() > 1
    assert math.isnan(float(out.total_reward[5]))
    assert float(out.metrics["unscorable"].total) == 1


def test_zero_variance_groups_are_exactly_zero_and_counted():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3])  # mean of 3×0.1 is not exactly 0.1
    for opts in (AdvantageOptions(), AdvantageOptions(scale="none"), AdvantageOptions(estimator="rloo")):
        out = compute_advantages(r, 3, opts)
        assert (out.advantages[:3] == 0).all() and (out.advantages[6:] == 0).all()
        assert (out.advantages[3:6] != 0).all()
        assert out.zero_variance.tolist() == [True] * 3 + [False] * 3 + [True] * 3
        assert float(out.metrics["zero_variance_groups"].total) == 2
        assert float(out.metrics["zero_variance_groups"].count) == 3


@pytest.mark.parametrize("opts", [
    AdvantageOptions(), AdvantageOptions(scale="batch"), AdvantageOptions(estimator="rloo"),
    AdvantageOptions(multi_reward="normalize_then_sum")])
def test_groups_of_one_and_single_scorable(opts):
    out = compute_advantages(torch.tensor([[1.0], [3.0], [float("nan")]]), 1, opts)
    assert torch.equal(out.advantages, torch.zeros(3))
    assert float(out.metrics["zero_variance_groups"].total) == 3
    # a group where only one row is scorable carries no signal either
    out = compute_advantages(torch.tensor([1.0, float("nan"), 0.0, 2.0]), 2, opts)
    assert out.advantages[:2].tolist() == [0.0, 0.0] and torch.isfinite(out.advantages).all()
    assert out.advantages[2] < 0 < out.advantages[3]


def test_metrics():
    out = compute_advantages(torch.tensor([[1.0, float("nan")], [0.0, 2.0]]), 2)
    m = out.metrics
    assert float(m["reward"].mean) == pytest.approx(1.5) and float(m["reward"].max) == 2.0
    assert float(m["reward/1"].count) == 1 and float(m["reward/0"].mean) == 0.5
    assert float(m["advantage"].count) == 2


@pytest.mark.parametrize("args,match", [
    ((torch.zeros(5), 2, None), "not a multiple of group_size=2"),
    ((torch.zeros(4, 2), 2, AdvantageOptions(reward_weights=(1.0,))), "1 weights but rewards has 2"),
    ((torch.zeros(4), 0, None), "group_size must be a positive int"),
    ((torch.zeros(2, 2, 2), 2, None), r"\[B, R\]"),
])
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(*args)


@pytest.mark.parametrize("kw,match", [
    ({"estimator": "ppo"}, "estimator='ppo'.*'rloo'"),
    ({"scale": "std"}, "scale='std'.*'batch'"),
    ({"multi_reward": "gdpo"}, "multi_reward='gdpo'.*'normalize_then_sum'"),
    ({"multi_reward": "normalize_then_sum", "scale": "batch"}, "Leave scale='group'"),
    ({"multi_reward": "normalize_then_sum", "estimator": "rloo"}, "leave-one-out"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        AdvantageOptions(**kw)
