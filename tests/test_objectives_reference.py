"""Objective helpers against plain-Python references written from their docstrings, on the edge cases that
mutation testing (docs/testing.md) showed the other tests leave open: advantages over random groups with NaN
rewards, groups of 2 (RLOO), GDPO with NaNs; the KL clamps and defaults; the adaptive entropy coefficient at its
target; the top-entropy threshold with 0 or 1 valid token; statistics of empty sets and their packing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from logitless.objectives import AdvantageOptions, compute_advantages
from logitless.objectives.entropy import entropy_quantile_threshold, update_entropy_coef
from logitless.objectives.kl import kl_estimate
from logitless.objectives.metrics import Stat, pack_metrics, unpack_metrics
from logitless.objectives.options import ObjectiveOptions

NAN = float("nan")


def _mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else NAN


def _std(xs):
    """Bessel-corrected std of the non-NaN values; NaN when fewer than 2."""
    xs = [x for x in xs if not math.isnan(x)]
    if len(xs) < 2:
        return NAN
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _constant(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return len(xs) <= 1 or max(xs) == min(xs)


def reference_advantages(rows: list[list[float]], G: int, o: AdvantageOptions) -> list[float]:
    """compute_advantages written out per group and per row, from its docstring."""
    R = len(rows[0])
    w = o.reward_weights or [1.0] * R
    groups = [rows[i : i + G] for i in range(0, len(rows), G)]
    total = [NAN if all(math.isnan(x) for x in r) else sum(wk * x for wk, x in zip(w, r) if not math.isnan(x))
             for r in rows]
    out = []
    if o.multi_reward == "sum_then_normalize":
        for gi in range(len(groups)):
            g = total[gi * G : gi * G + G]
            n = sum(not math.isnan(x) for x in g)
            for x in g:
                if o.estimator == "grpo":
                    a = x - _mean(g)
                else:
                    a = (n * x - sum(v for v in g if not math.isnan(v))) / max(n - 1, 1)
                if o.scale == "group":
                    a = a / (_std(g) + o.epsilon)
                elif o.scale == "batch":
                    a = a / (_std(total) + o.epsilon)
                out.append(0.0 if _constant(g) or math.isnan(a) else a)
        return out
    s, const_all = [], []
    for g in groups:
        cols = [[r[k] for r in g] for k in range(R)]
        const = [_constant(c) for c in cols]
        const_all += [all(const)] * G
        for r in g:
            if all(math.isnan(x) for x in r):
                s.append(NAN)
                continue
            z = [0.0 if const[k] else (r[k] - _mean(cols[k])) / (_std(cols[k]) + o.epsilon) for k in range(R)]
            s.append(sum(w[k] * z[k] for k in range(R) if not (math.isnan(r[k]) or math.isnan(z[k]))))
    m, sd = _mean(s), _std(s)
    for x, c in zip(s, const_all):
        a = (x - m) / (sd + o.epsilon)
        out.append(0.0 if c or math.isnan(a) else a)
    return out


def reference_zero_variance(rows: list[list[float]], G: int, o: AdvantageOptions) -> list[bool]:
    """Per row: its group carries no signal (constant total; GDPO: every reward column constant)."""
    w = o.reward_weights or [1.0] * len(rows[0])
    out = []
    for i in range(0, len(rows), G):
        g = rows[i : i + G]
        if o.multi_reward == "sum_then_normalize":
            totals = [NAN if all(math.isnan(x) for x in r) else sum(a * x for a, x in zip(w, r) if not math.isnan(x))
                      for r in g]
            flag = _constant(totals)
        else:
            flag = all(_constant([r[k] for r in g]) for k in range(len(w)))
        out += [flag] * G
    return out


OPTIONS = [
    AdvantageOptions(estimator=e, scale=sc) for e in ("grpo", "rloo") for sc in ("group", "batch", "none")
] + [AdvantageOptions(multi_reward="normalize_then_sum", reward_weights=[1.0, 0.5])]


@pytest.mark.parametrize("o", OPTIONS, ids=lambda o: f"{o.estimator}-{o.scale}-{o.multi_reward}")
@pytest.mark.parametrize("G", [1, 2, 3, 4])
def test_advantages_match_the_reference_with_nan_rewards(o, G):
    rnd = random.Random(G)
    for trial in range(6):
        R = 2 if o.reward_weights else 1 + trial % 2
        rows = [[rnd.choice([0.0, 1.0, 0.5, rnd.random() * 3, NAN]) for _ in range(R)] for _ in range(G * 4)]
        rows[0] = [1.0] * R  # at least one scorable row
        out = compute_advantages(torch.tensor(rows), G, o)
        want = torch.tensor(reference_advantages(rows, G, o), dtype=torch.float64)
        torch.testing.assert_close(out.advantages.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{rows}\n{m}")
        assert out.zero_variance.tolist() == reference_zero_variance(rows, G, o), rows


def test_rloo_groups_of_two_and_group_std_metric():
    out = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, AdvantageOptions(estimator="rloo", scale="none"))
    assert out.advantages.tolist() == [1.0, -1.0, 2.0, -2.0]  # R_i - R_other
    std = out.metrics["reward_group_std"]
    assert std.count == 2 and std.total.item() == pytest.approx(math.sqrt(0.5) + math.sqrt(2.0))
    assert std.min.item() == pytest.approx(math.sqrt(0.5)) and std.max.item() == pytest.approx(math.sqrt(2.0))


def test_reward_metrics_skip_unscorable_rows_and_undefined_stds():
    out = compute_advantages(torch.tensor([1.0, NAN, 2.0, 3.0]), 2)  # group 0 has one scorable row
    reward, std = out.metrics["reward"], out.metrics["reward_group_std"]
    assert [reward.total.item(), reward.count.item()] == [6.0, 3.0]
    assert std.count.item() == 1 and std.total.item() == pytest.approx(math.sqrt(0.5))


def test_advantages_input_checks():
    assert compute_advantages(torch.tensor([2.0]), 1).advantages.tolist() == [0.0]  # one row is valid input
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.tensor([1.0, 2.0]), True)


def test_kl_defaults_and_clamps():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([-30.0, -0.5, 0.5, 30.0], dtype=torch.float64)  # d = ref - logp
    d = ref.clamp(-20.0, 20.0)
    k3 = torch.exp(d) - d - 1.0
    torch.testing.assert_close(kl_estimate(logp, ref), k3)  # default: k3, |d| clamped at 20
    torch.testing.assert_close(kl_estimate(logp, ref, "k3", 20.0), k3)
    d5 = ref.clamp(-5.0, 5.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3", 5.0), torch.exp(d5) - d5 - 1.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "low_var_kl"), k3.clamp(max=10.0))
    assert kl_estimate(logp, ref, "low_var_kl")[3].item() == 10.0  # k3(d = 20) = e^20 - 21, clamped
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3', 'low_var_kl'"):
        kl_estimate(logp, ref, "k4")


def test_adaptive_entropy_at_the_target_counts_as_low():
    o = ObjectiveOptions(use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=0.5, entropy_coef_delta=0.01)
    assert update_entropy_coef(0.1, 0.5, o) == pytest.approx((0.11, 0.11))  # at the target: grow, apply
    assert update_entropy_coef(0.1, 0.5 + 1e-9, o) == pytest.approx((0.09, 0.0))


def test_entropy_threshold_with_zero_or_one_valid_token():
    ent = torch.tensor([[3.0, 7.0]])
    one = entropy_quantile_threshold(ent, torch.tensor([[0, 1]]), 0.2)
    assert one.item() == 7.0 and one.dtype == torch.float32
    none = entropy_quantile_threshold(ent, torch.tensor([[0, 0]]), 0.2)
    assert none.item() == math.inf
    empty = entropy_quantile_threshold(torch.zeros(0, 3), torch.zeros(0, 3), 0.5)
    assert empty.item() == math.inf and empty.dtype == torch.float32
    with pytest.raises(ValueError, match=r"differ in length \(2 vs 1\)"):
        entropy_quantile_threshold([ent, ent], [torch.ones(1, 2)], 0.5)


def test_stats_of_empty_sets_and_packing_round_trip():
    empty = Stat.of(torch.zeros(0))
    assert empty.count == 0 and empty.min.item() == math.inf and empty.max.item() == -math.inf
    masked = Stat.of(torch.tensor([1.0, 2.0]), torch.tensor([False, False]))
    assert masked.min.item() == math.inf and masked.max.item() == -math.inf
    names, sum_count, mins, maxs = pack_metrics({})
    assert names == [] and sum_count.shape == (0, 2) and mins.shape == (0,) and maxs.shape == (0,)
    assert unpack_metrics(names, sum_count, mins, maxs) == {}
    stats = {"a": Stat.of(torch.tensor([1.0, 4.0])), "b": Stat.of(torch.tensor([-2.0]))}
    back = unpack_metrics(*pack_metrics(stats))
    for k, s in stats.items():
        assert [back[k].total, back[k].count, back[k].min, back[k].max] == [s.total, s.count, s.min, s.max]


def test_completion_length_metric_and_normalizer_mask_check():
    from logitless.objectives import loss_normalizer, policy_loss

    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    o = ObjectiveOptions()
    out = policy_loss(torch.zeros(2, 4), mask, torch.tensor([1.0, -1.0]), o, loss_normalizer(o, [mask]))
    length = out.metrics["completion_length"]
    assert [length.total.item(), length.count.item(), length.min.item(), length.max.item()] == [4.0, 2.0, 1.0, 3.0]
    with pytest.raises(ValueError, match=r"masks\[0\] must be a \[B, T\] tensor, got torch.Size\(\[3\]\)"):
        loss_normalizer(o, [torch.ones(3)])
    with pytest.raises(ValueError, match=r"masks\[0\] must be a \[B, T\] tensor, got <class 'list'>"):
        loss_normalizer(o, [[1, 1]])


def test_summarize_means_ranges_and_skips_empty():
    from logitless.objectives.metrics import summarize

    stats = {"a_empty": Stat.of(torch.zeros(0)), "kl": Stat.of(torch.tensor([0.0, 2.0])),
             "reward/digits": Stat.of(torch.tensor([1.0, 3.0])), "loss": Stat.of(torch.tensor([4.0, 6.0]))}
    assert summarize(stats) == {"kl": 1.0, "kl/min": 0.0, "kl/max": 2.0, "loss": 5.0,
                                "reward/digits": 2.0, "reward/digits/min": 1.0, "reward/digits/max": 3.0}
