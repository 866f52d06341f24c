"""on_policy_logp_grad: the on-policy gradient w.r.t. logp, known before the forward, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from logitless.objectives import (
    IS_LEVELS,
    LOSS_TYPES,
    ObjectiveOptions,
    loss_normalizer,
    on_policy_logp_grad,
    policy_loss,
)


def _batch(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 4, 1, 5, 3])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    logp = -torch.rand(B, T, generator=g) * 4 - 0.01  # fp32, as completion_logprobs returns
    logp[mask == 0] = 0.0
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    samp = logp + 0.2 * torch.randn(B, T, generator=g)
    ent = torch.rand(B, T, generator=g) * 2
    adv = torch.tensor([1.2, -0.8, 0.5, -1.5, 0.0])[:B]
    truncated = torch.tensor([False, True, False, False, True])[:B]
    return logp, ref, samp, ent, adv, mask, truncated


def _valid_options():
    extras = [{}, dict(mask_truncated_completions=True), dict(off_policy_mask_threshold=0.5), dict(delta=1.5),
              dict(dual_clip=3.0), dict(epsilon_high=0.28)]
    for lt, level, extra in itertools.product(LOSS_TYPES, IS_LEVELS, extras):
        kw = dict(loss_type=lt, importance_sampling_level=level, max_completion_length=8, **extra)
        if lt == "cispo":
            kw["epsilon_high"] = 5.0
        try:
            yield ObjectiveOptions(**kw)
        except ValueError:  # combination the options refuse (e.g. cispo at sequence level)
            continue


OPTIONS = list(_valid_options())


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: f"{o.loss_type}-{o.importance_sampling_level}")
def test_equals_the_on_policy_gradient_bit_for_bit(opts):
    logp, ref, _, ent, adv, mask, truncated = _batch()
    norm = loss_normalizer(opts, [mask], [truncated])
    hint = on_policy_logp_grad(mask, adv, opts, norm, truncated=truncated)
    assert hint is not None and hint.shape == logp.shape and hint.dtype == torch.float32
    for seed in (0, 1):  # at two different logp values: the gradient must not depend on them
        x = (logp + seed * torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))).requires_grad_()
        out = policy_loss(x, mask, adv, opts, norm, ref_logp=ref, entropy=ent, truncated=truncated)
        out.loss.backward()
        assert torch.equal(x.grad, hint), (opts, (x.grad - hint).abs().max())
    assert hint.abs().sum() > 0  # not trivially zero: the advantages are non-zero


@pytest.mark.parametrize(
    "kw,call",
    [
        (dict(beta=0.04), {}),
        (dict(sampler_is_mode="token_truncate"), {}),
        (dict(top_entropy_quantile=0.2), {}),
        (dict(entropy_coef=0.01), {}),
        (dict(entropy_coef=0.01, entropy_bonus_reduction="trl"), {}),
        ({}, dict(entropy_coef=0.02)),
        (dict(off_policy_mask_threshold=0.5), dict(sampler_logp=True)),
    ],
)
def test_none_when_the_gradient_depends_on_logp_or_entropy(kw, call):
    logp, _, samp, _, adv, mask, truncated = _batch()
    opts = ObjectiveOptions(max_completion_length=8, **kw)
    if call.get("sampler_logp"):
        call = dict(call, sampler_logp=samp)
    assert on_policy_logp_grad(mask, adv, opts, loss_normalizer(opts, [mask]), truncated=truncated, **call) is None


def test_runs_under_no_grad_and_is_detached():
    _, _, _, _, adv, mask, truncated = _batch()
    opts = ObjectiveOptions(loss_type="dapo")
    with torch.no_grad():
        hint = on_policy_logp_grad(mask, adv, opts, loss_normalizer(opts, [mask]), truncated=truncated)
    assert hint is not None and not hint.requires_grad
    expected = -adv[:, None] * mask / mask.sum()  # dapo at ratio 1: d/dlogp of -Σ A·r / Σ m
    torch.testing.assert_close(hint, expected, rtol=1e-6, atol=0)
