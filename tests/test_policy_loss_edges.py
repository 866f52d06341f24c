"""policy_loss on the edges that mutation testing (docs/testing.md) showed the other objective tests leave open:
bf16 inputs computed in fp32, the max_log_ratio clamps of every ratio, VESPO's weight against a hand-written
reference at extreme ratios, boundaries of the clip, dual-clip, rollout-IS and off-policy masks, GSPO-token's
per-token gradient under a token mask, and the names of the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from logitless.objectives import loss_normalizer, policy_loss
from logitless.objectives.entropy import entropy_bonus_normalizer
from logitless.objectives.kl import kl_estimate
from tests.test_objectives import F64, _batch, _opts, _run


def _ones(B, T):
    return torch.ones(B, T, dtype=F64)


def test_bf16_inputs_are_computed_in_fp32():
    logp, old, ref, samp, ent, adv, mask = _batch(seed=7)
    o = _opts(loss_type="dapo", beta=0.1, sampler_is_mode="token_truncate", off_policy_mask_threshold=0.05,
              top_entropy_quantile=0.6, entropy_coef=0.01)
    n = loss_normalizer(o, [mask])
    en = entropy_bonus_normalizer(o, [mask], entropies=[ent], threshold=1.0)

    def run(dtype):
        x = logp.to(torch.bfloat16).to(dtype).requires_grad_()
        e = ent.to(torch.bfloat16).to(dtype).requires_grad_()
        kw = {k: v.to(torch.bfloat16).to(dtype) for k, v in
              {"old_logp": old, "ref_logp": ref, "sampler_logp": samp}.items()}
        out = policy_loss(x, mask, adv.to(torch.bfloat16).to(dtype), o, n, entropy=e, entropy_normalizer=en,
                          entropy_threshold=1.0, **kw)
        out.loss.backward()
        return out, x.grad, e.grad

    half, g_half, ge_half = run(torch.bfloat16)
    full, g_full, ge_full = run(torch.float32)
    assert half.loss.dtype == torch.float32
    assert torch.equal(half.loss, full.loss)
    assert torch.equal(g_half, g_full.to(torch.bfloat16)) and torch.equal(ge_half, ge_full.to(torch.bfloat16))
    assert half.metrics.keys() == full.metrics.keys()
    for k in full.metrics:
        assert torch.equal(half.metrics[k].total, full.metrics[k].total), k
    # the top-entropy threshold computed from bf16 entropies, in fp32
    o = _opts(top_entropy_quantile=0.6)
    e = ent.to(torch.bfloat16)
    half = policy_loss(logp.to(torch.bfloat16), mask, adv, o, n, entropy=e)
    full = policy_loss(logp.to(torch.bfloat16).float(), mask, adv, o, n, entropy=e.float())
    assert torch.equal(half.loss, full.loss)
    assert torch.equal(half.metrics["masked/entropy"].total, full.metrics["masked/entropy"].total)


def test_fp64_normalizers_do_not_promote_an_fp32_loss():
    logp, _, _, _, ent, adv, mask = _batch(seed=2)
    for lt in ("dapo", "grpo"):
        o = _opts(loss_type=lt, entropy_coef=0.1, entropy_bonus_reduction="trl")
        n = torch.tensor(loss_normalizer(o, [mask]), dtype=F64)
        en = torch.tensor(entropy_bonus_normalizer(o, [mask]), dtype=F64)
        out = policy_loss(logp.float(), mask, adv.float(), o, n, entropy=ent.float(), entropy_normalizer=en)
        assert out.loss.dtype == torch.float32, lt


def test_max_log_ratio_clamps_the_policy_and_rollout_ratios_and_the_kl():
    L = 0.5
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    old = logp - torch.tensor([[2.0, -2.0, 0.1]], dtype=F64)  # log ratios +2, -2, 0.1
    mask, adv = _ones(1, 3), torch.tensor([1.0], dtype=F64)
    out, _ = _run(_opts(max_log_ratio=L, epsilon_high=10.0, epsilon_low=0.99), logp, mask, adv, old_logp=old)
    r = out.metrics["ratio"]
    assert r.max.item() == pytest.approx(math.exp(L), rel=1e-12)
    assert r.min.item() == pytest.approx(math.exp(-L), rel=1e-12)
    # rollout IS, per token and per sequence (product of 3 token ratios, log 2.1, clamped to L)
    samp = old - torch.tensor([[2.0, -2.0, 0.1]], dtype=F64)
    o = _opts(max_log_ratio=L, sampler_is_mode="token_truncate", sampler_is_clip_min=1e-6, sampler_is_clip_max=1e6)
    out, _ = _run(o, logp, mask, adv, old_logp=old, sampler_logp=samp)
    assert out.metrics["is/ratio"].max.item() == pytest.approx(math.exp(L), rel=1e-12)
    assert out.metrics["is/ratio"].min.item() == pytest.approx(math.exp(-L), rel=1e-12)
    samp = old - torch.tensor([[2.0, 2.0, 0.1]], dtype=F64)
    o = _opts(max_log_ratio=L, sampler_is_mode="sequence_truncate", sampler_is_sequence_reduction="product",
              sampler_is_clip_min=1e-6, sampler_is_clip_max=1e6)
    out, _ = _run(o, logp, mask, adv, old_logp=old, sampler_logp=samp)
    assert out.metrics["is/ratio"].max.item() == pytest.approx(math.exp(L), rel=1e-12)
    samp = old + torch.tensor([[2.0, 2.0, 0.1]], dtype=F64)
    out, _ = _run(o, logp, mask, adv, old_logp=old, sampler_logp=samp)
    assert out.metrics["is/ratio"].min.item() == pytest.approx(math.exp(-L), rel=1e-12)
    # the KL metric with the KL term on and off uses the same clamp
    ref = logp + 3.0
    for beta in (0.0, 0.1):
        out, _ = _run(_opts(max_log_ratio=L, beta=beta), logp, mask, adv, ref_logp=ref)
        expected = kl_estimate(logp, ref, "k3", L).mean()
        assert out.metrics["kl"].mean.item() == pytest.approx(expected.item(), rel=1e-12)
        assert expected.item() == pytest.approx(math.exp(L) - L - 1, rel=1e-12)


def _vespo_reference(lp, old, samp, mask, adv, o):
    """VESPO's sequence weight φ written out from docs/objectives.md: W = Σ_t clamp(log r_t, ±20) (+ Σ_t log ρ_t,
    each clamped to [log 1e-8, 20]), clamped to [log 1e-8, 20]; φ = exp(λ + k·W - λ·e^W), 0 where it overflows;
    loss = Σ_it -φ_i A_i logp_it m_it / #tokens."""
    L, lo = o.max_log_ratio, math.log(1e-8)
    rows = []
    for i in range(lp.shape[0]):
        w = 0.0
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            w += min(max(min(max(float(lp[i, t] - old[i, t]), -L), L), -20.0), 20.0)
            if samp is not None:
                rho = math.exp(min(max(float(old[i, t] - samp[i, t]), -L), L))
                lo_c, hi_c = o.sampler_is_clip_min, o.sampler_is_clip_max
                if o.sampler_is_mode == "token_truncate":
                    rho = min(max(rho, lo_c if lo_c is not None else 0.0), hi_c if hi_c is not None else math.inf)
                elif (lo_c is not None and rho < lo_c) or (hi_c is not None and rho > hi_c):
                    rho = 0.0
                w += min(max(math.log(rho) if rho > 0 else -math.inf, lo), 20.0)
        w = min(max(w, lo), 20.0)
        a = float(adv[i])
        k, lam = (o.vespo_k_pos, o.vespo_lambda_pos) if a >= 0 else (o.vespo_k_neg, o.vespo_lambda_neg)
        k, lam = float(torch.tensor(k, dtype=torch.float32)), float(torch.tensor(lam, dtype=torch.float32))
        lam = max(lam, float(torch.tensor(1e-4, dtype=torch.float32)))  # k and λ enter as fp32 tensors
        e = lam + k * w - lam * math.exp(w)
        rows.append(0.0 if e > 709.0 else math.exp(e))
    phi = torch.tensor(rows, dtype=F64)[:, None]
    return (-phi * adv[:, None] * lp * mask).sum() / mask.sum(), -phi * adv[:, None] * mask / mask.sum()


@pytest.mark.parametrize("params", [
    {},  # defaults: k 2/3, lambda 3/2
    {"vespo_lambda_pos": 0.5, "vespo_lambda_neg": 0.01},  # lambda below 1 (and below the 1e-4 floor's neighbours)
    {"vespo_k_pos": 100.0, "vespo_lambda_pos": 1e-6},  # exp overflows: the weight is 0
    {"vespo_k_pos": 2440.0, "vespo_lambda_pos": 1e-6},  # finite only because W is clamped at 20
])
def test_vespo_weight_matches_the_reference_at_extreme_ratios(params):
    lp = torch.full((7, 3), -1.0, dtype=F64)
    d = torch.tensor([[25.0, -19.0, 0.0], [-25.0, 10.0, 0.0], [15.0, 15.0, 0.0], [10.0, 0.5, 0.0],
                      [-3.0, 0.2, 0.0], [2.0, -1.0, 0.7], [-25.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]] * 5 + [[1, 1, 1], [1, 1, 0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, -0.5, 0.7, 1.0], dtype=F64)
    o = _opts(loss_type="vespo", max_log_ratio=30.0, **params)
    out, grad = _run(o, lp, mask, adv, old_logp=lp - d)
    loss, g = _vespo_reference(lp, lp - d, None, mask, adv, o)
    torch.testing.assert_close(out.loss, loss, rtol=1e-9, atol=0)
    torch.testing.assert_close(grad, g, rtol=1e-9, atol=0)
    # with a rollout-IS ratio folded in: masked tokens (ρ = 0) count as log 1e-8, large ρ is capped at e^20
    # the last row: log ρ = 25 is capped at 20 (truncate mode), which offsets its token log-ratio of -20
    s = torch.tensor([[-22.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, -5.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0],
                      [0.1, 0.0, 0.0], [25.0, 0.0, 0.0]], dtype=F64)
    for mode, hi in (("token_mask", 10.0), ("token_truncate", 1e12)):
        o = _opts(loss_type="vespo", max_log_ratio=30.0, sampler_is_mode=mode, sampler_is_clip_max=hi, **params)
        out, grad = _run(o, lp, mask, adv, old_logp=lp - d, sampler_logp=lp - d - s)
        loss, g = _vespo_reference(lp, lp - d, lp - d - s, mask, adv, o)
        torch.testing.assert_close(out.loss, loss, rtol=1e-9, atol=0)
        torch.testing.assert_close(grad, g, rtol=1e-9, atol=0)


def test_clip_metrics_at_the_bounds_and_with_zero_advantage():
    logp = torch.full((3, 1), -1.0, dtype=F64)
    mask = _ones(3, 1)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=F64)
    # ratio exactly 1 = 1 - epsilon_low = 1 + epsilon_high: on the bound is not clipped
    out, _ = _run(_opts(epsilon_low=0.0, epsilon_high=0.0), logp, mask, adv, old_logp=logp)
    assert out.metrics["clip/low"].total.item() == 0 and out.metrics["clip/high"].total.item() == 0
    # a ratio of e above the bound with A = 0 is not counted as clipped
    out, _ = _run(_opts(), logp, mask, adv, old_logp=logp - 1.0)
    assert out.metrics["clip/high"].total.item() == 1  # the A > 0 row only
    out, _ = _run(_opts(loss_type="cispo", epsilon_high=1.0), logp, mask, adv, old_logp=logp)
    assert out.metrics["clip/high"].total.item() == 0
    out, _ = _run(_opts(loss_type="cispo", epsilon_high=1.0), logp, mask, adv, old_logp=logp - 1.0)
    assert out.metrics["clip/high"].total.item() == 1


def test_dual_clip_scales_with_the_advantage_and_leaves_positive_ones():
    logp = torch.log(torch.tensor([[5.0], [1.1]], dtype=F64))
    mask = _ones(2, 1)
    adv = torch.tensor([-2.0, 0.5], dtype=F64)
    out, grad = _run(_opts(dual_clip=3.0), logp, mask, adv, old_logp=torch.zeros(2, 1, dtype=F64))
    # A = -2, r = 5: ℓ = min(5·2, 3·2) = 6 (no grad); A = 0.5, r = 1.1: ℓ = -0.55, untouched by the dual clip
    torch.testing.assert_close(out.loss, torch.tensor((6.0 - 0.55) / 2, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[0.0], [-0.55 / 2]], dtype=F64))
    assert out.metrics["clip/dual"].total.item() == 1
    # a loss exactly on the dual-clip bound (r = c = 2, A = -1) is not counted as dual-clipped
    out, _ = _run(_opts(dual_clip=2.0), logp[:1] * 0 + math.log(2.0), mask[:1], adv[:1] * 0 - 1.0,
                  old_logp=torch.zeros(1, 1, dtype=F64))
    torch.testing.assert_close(out.loss, torch.tensor(2.0, dtype=F64))
    assert out.metrics["clip/dual"].total.item() == 0


def test_sampler_is_geometric_mean_of_one_token_and_is_ratio_counts():
    logp = torch.full((3, 2), -1.0, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=F64)
    adv = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    samp = logp - torch.tensor([[0.2, 0.4], [0.3, 0.0], [0.0, 0.0]], dtype=F64)  # log ρ per token
    o = _opts(sampler_is_mode="sequence_truncate", sampler_is_sequence_reduction="geometric_mean",
              sampler_is_clip_max=10.0)
    out, _ = _run(o, logp, mask, adv, old_logp=logp, sampler_logp=samp)
    st = out.metrics["is/ratio"]
    assert st.count.item() == 2  # one value per non-empty sequence
    assert st.max.item() == pytest.approx(math.exp(0.3), rel=1e-12)  # the 1-token row: mean of one log ratio
    assert st.min.item() == pytest.approx(math.exp(0.3), rel=1e-12)  # (0.2 + 0.4) / 2
    o = _opts(sampler_is_mode="token_truncate", sampler_is_clip_max=10.0)
    out, _ = _run(o, logp, mask, adv, old_logp=logp, sampler_logp=samp)
    assert out.metrics["is/ratio"].count.item() == 3  # one value per valid token (T = 2)
    torch.testing.assert_close(out.metrics["is/logp_diff"].total, torch.tensor(0.9, dtype=F64))


def test_sampler_is_mask_keeps_a_ratio_on_its_bounds():
    logp, mask, adv = torch.full((2, 2), -1.0, dtype=F64), _ones(2, 2), torch.tensor([1.0, -1.0], dtype=F64)
    for lo, hi in ((1.0, 2.0), (0.5, 1.0)):  # ρ = 1 exactly on the lower, then the upper bound
        o = _opts(sampler_is_mode="token_mask", sampler_is_clip_min=lo, sampler_is_clip_max=hi)
        out, _ = _run(o, logp, mask, adv, old_logp=logp, sampler_logp=logp)
        assert out.metrics["is/masked"].total.item() == 0
        torch.testing.assert_close(out.loss, torch.tensor(0.0, dtype=F64))  # -(1 - 1) · 2 tokens / 4


def test_off_policy_mask_edges():
    logp = torch.full((4, 2), -1.0, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]], dtype=F64)
    samp = logp + torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.3, 0.0]], dtype=F64)  # seq KL .5 .5 .5 .3
    adv = torch.tensor([-1.0, 0.5, 0.0, -1.0], dtype=F64)
    o = _opts(off_policy_mask_threshold=0.5, sampler_is_mode="token_truncate", sampler_is_clip_max=1e6)
    out, grad = _run(o, logp, mask, adv, old_logp=logp, sampler_logp=samp)
    # row 0: KL = threshold, kept; row 1: A > 0, kept; row 2: A = 0, kept; row 3 (one token): 0.3 <= 0.5, kept
    assert out.metrics["masked/off_policy"].total.item() == 0
    o = _opts(off_policy_mask_threshold=0.25, sampler_is_mode="token_truncate", sampler_is_clip_max=1e6)
    out, grad = _run(o, logp, mask, adv, old_logp=logp, sampler_logp=samp)
    # now rows 0 and 3 (A < 0, KL over 0.25) leave the policy term; rows with A >= 0 never do
    assert out.metrics["masked/off_policy"].total.item() == 3  # tokens: 2 of row 0, 1 of row 3
    rho = torch.exp(samp.new_tensor([[-0.5, -0.5], [-0.5, -0.5], [-0.5, -0.5], [-0.3, 0.0]]))  # π_old / π_sampler
    expected = (-adv[:, None] * rho * mask * torch.tensor([[0.0], [1.0], [1.0], [0.0]], dtype=F64)) / mask.sum()
    torch.testing.assert_close(grad, expected)


def test_gspo_token_gradient_follows_the_token_mask():
    logp, old, _, _, ent, adv, mask = _batch(seed=5)
    old = logp + 0.02 * (old - logp)
    o = _opts(loss_type="dapo", importance_sampling_level="sequence_token", top_entropy_quantile=0.5)
    out, grad = _run(o, logp, mask, adv, old_logp=old, entropy=ent, entropy_threshold=1.0)
    s = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
    kept = (ent >= 1.0) & mask.bool()
    torch.testing.assert_close(grad, -adv[:, None] * s * kept / mask.sum())
    assert kept.any() and (mask.bool() & ~kept).any()


def test_kl_term_at_beta_one():
    logp, _, ref, _, _, adv, mask = _batch(seed=1)
    out, grad = _run(_opts(beta=1.0), logp, mask, adv, ref_logp=ref)
    d = ref - logp
    torch.testing.assert_close(out.loss, ((-adv[:, None] + d.exp() - d - 1) * mask).sum() / mask.sum())
    torch.testing.assert_close(grad, (-adv[:, None] + 1 - d.exp()) * mask / mask.sum())


def test_metric_names():
    logp, old, ref, samp, ent, adv, mask = _batch(seed=6)
    o = _opts(beta=0.1, sampler_is_mode="token_mask", off_policy_mask_threshold=0.3, top_entropy_quantile=0.5,
              mask_truncated_completions=True, dual_clip=3.0)
    trunc = torch.zeros(5, dtype=torch.bool)
    out = policy_loss(logp, mask, adv, o, loss_normalizer(o, [mask], [trunc]), old_logp=old, ref_logp=ref,
                      sampler_logp=samp, entropy=ent, truncated=trunc)
    assert set(out.metrics) == {
        "completion_length", "masked/truncated", "ratio", "is/logp_diff", "is/masked", "is/ratio", "clip/low",
        "clip/high", "clip/fraction", "clip/dual", "masked/off_policy", "masked/entropy", "kl", "entropy",
        "entropy/kept"}
    torch.testing.assert_close(out.metrics["entropy"].total, (ent * mask).sum())
    torch.testing.assert_close(out.metrics["is/logp_diff"].total, ((old - samp).abs() * mask).sum())


def test_controlled_entropy_is_the_kept_tokens_mean():
    from logitless.objectives.entropy import controlled_entropy

    logp, old, _, _, ent, adv, mask = _batch(seed=8)
    out, _ = _run(_opts(top_entropy_quantile=0.5), logp, mask, adv, entropy=ent, entropy_threshold=1.0)
    kept = (ent >= 1.0) & mask.bool()
    assert controlled_entropy(out.metrics) == pytest.approx((ent * kept).sum().item() / kept.sum().item())
    out, _ = _run(_opts(), logp, mask, adv, entropy=ent)  # no top-entropy mask: every loss token
    assert controlled_entropy(out.metrics) == pytest.approx((ent * mask).sum().item() / mask.sum().item())
    assert isinstance(controlled_entropy(out.metrics), float)
