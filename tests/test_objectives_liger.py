"""Parity of `policy_loss` with Liger-Kernel's `LigerFusedLinearGRPOFunction.ppo_loss_fn` (the TRL formulas),
loss value, gradient and metrics, for every option combination both support.

Liger normalizes each batch chunk by the full batch (`full_attention_mask`, `num_items_in_batch`); we call it
on the whole batch at once, which is what its chunk sum equals. The rollout IS ratio Liger takes as input
(`vllm_is_ratio`) is computed here by hand from TRL's formula and compared with ours computed from
`sampler_logp`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from logitless.objectives import ObjectiveOptions, loss_normalizer, policy_loss

liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")
ppo_loss_fn = liger_grpo.LigerFusedLinearGRPOFunction.ppo_loss_fn

B, T, MAX_LEN = 6, 7, 10
PPO = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IS_MODES = (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _combos():
    for lt, level, kl, delta, is_mode, on_policy in itertools.product(
        ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
        ("token", "sequence"),
        ("none", "kl", "bias_kl"),
        (None, 1.5),
        IS_MODES,
        (False, True),
    ):
        if level == "sequence" and lt in ("cispo", "sapo", "vespo"):
            continue  # Liger raises; we raise too (test_objectives.py)
        if lt == "luspo" and (level == "token" or kl != "none" or (is_mode or "").startswith("token")):
            continue  # Liger averages over padding positions there; we refuse / differ (docs/objectives.md)
        if delta is not None and lt not in PPO:
            continue
        if lt == "vespo" and (is_mode or "").startswith("sequence"):
            continue
        if on_policy and (delta is not None or kl == "bias_kl"):
            continue  # ratio ≡ 1: nothing new to test
        yield lt, level, kl, delta, is_mode, on_policy


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 0, 3, 1, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # [B, T], row 2 empty
    logp = -torch.rand(B, T, generator=g) * 3 - 0.05
    old = logp + 0.35 * torch.randn(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    noise = 0.15 * torch.randn(B, T, generator=g)
    noise[0] += 0.3  # row 0: sampler ratio well below 1, row 1: well above (so IS bounds are hit)
    noise[1] -= 0.3
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.0, 0.9])
    # garbage (finite, for Liger) outside the mask: it must not matter
    for t in (logp, old, ref):
        t.masked_fill_(mask == 0, -7.0)
    return logp, old, ref, noise, adv, mask


def _trl_is_ratio(old, samp, mask, mode, lo, hi):
    """TRL: d = (old - samp)·m; token ρ = exp(d), sequence ρ = exp(Σ_t d) [B, 1]; truncate clamps, mask zeroes."""
    d = (old - samp) * mask
    rho = torch.exp(d) if mode.startswith("token") else torch.exp(d.sum(-1, keepdim=True))
    if mode.endswith("truncate"):
        return rho.clamp(min=lo, max=hi)
    return torch.where((rho >= lo) & (rho <= hi), rho, torch.zeros_like(rho))


@pytest.mark.parametrize("lt,level,kl,delta,is_mode,on_policy", list(_combos()))
def test_matches_liger_ppo_loss_fn(lt, level, kl, delta, is_mode, on_policy):
    logp, old, ref, noise, adv, mask = _inputs(seed=len(lt) * 7 + len(level))
    samp = (logp if on_policy else old) + noise  # the sampler's logprobs, off by a little
    eps_high = 1.5 if lt == "cispo" else 0.28
    beta = 0.0 if kl == "none" else 0.04
    lo, hi = (0.8, 1.25) if (is_mode or "").startswith("token") else (0.6, 1.6)
    opts = ObjectiveOptions(
        loss_type=lt, importance_sampling_level=level, epsilon_low=0.2, epsilon_high=eps_high, delta=delta,
        beta=beta, use_bias_correction_kl=kl == "bias_kl", max_completion_length=MAX_LEN,
        sampler_is_mode=is_mode, sampler_is_clip_min=lo, sampler_is_clip_max=hi,
        sampler_is_sequence_reduction="product" if (is_mode or "").startswith("sequence") else None,
    )
    old_in = None if on_policy else old
    rho = None
    if is_mode is not None:
        rho = _trl_is_ratio(logp if on_policy else old, samp, mask, is_mode, lo, hi)
        assert 0 < float((rho == 0).sum() + (rho == hi).sum() + (rho == lo).sum()), "IS bounds never hit"

    x_ours = logp.clone().requires_grad_()
    out = policy_loss(x_ours, mask, adv, opts, loss_normalizer(opts, [mask]), old_logp=old_in,
                      ref_logp=ref if beta else None, sampler_logp=samp if is_mode else None)
    out.loss.backward()

    x_ref = logp.clone().requires_grad_()
    ref_loss, ref_metrics = ppo_loss_fn(
        per_token_logps=x_ref, attention_mask=mask, advantages=adv, full_attention_mask=mask,
        ref_per_token_logps=ref if beta else None, old_per_token_logps=old_in, epsilon_low=0.2,
        epsilon_high=eps_high, beta=beta, loss_type=lt, max_completion_length=MAX_LEN,
        importance_sampling_level=level, vllm_is_ratio=rho, delta=delta,
        use_bias_correction_kl=kl == "bias_kl", num_items_in_batch=mask.sum(),
    )
    ref_loss.backward()

    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert x_ref.grad.abs().sum() > 0 or is_mode == "sequence_mask"  # (masking may drop every row)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-7)
    clip_ratio = ref_metrics[-1]
    torch.testing.assert_close(out.metrics["clip/fraction"].mean.float(), clip_ratio.float(), rtol=1e-6, atol=1e-7)
    if kl == "kl":
        torch.testing.assert_close(out.metrics["kl"].mean.float(), ref_metrics[0].float(), rtol=1e-5, atol=1e-7)


def test_combination_count():
    # Guard against the filter silently dropping the grid.
    assert len(list(_combos())) > 200


@pytest.mark.parametrize("lt,extra", [
    ("sapo", dict(sapo_temperature_pos=0.7, sapo_temperature_neg=1.6)),
    ("vespo", dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0, vespo_lambda_neg=1.2)),
])
def test_matches_liger_non_default_parameters(lt, extra):
    logp, old, ref, noise, adv, mask = _inputs(seed=5)
    opts = ObjectiveOptions(loss_type=lt, beta=0.04, **extra)
    x_ours = logp.clone().requires_grad_()
    out = policy_loss(x_ours, mask, adv, opts, loss_normalizer(opts, [mask]), old_logp=old, ref_logp=ref)
    out.loss.backward()
    x_ref = logp.clone().requires_grad_()
    ref_loss, _ = ppo_loss_fn(per_token_logps=x_ref, attention_mask=mask, advantages=adv, full_attention_mask=mask,
                              ref_per_token_logps=ref, old_per_token_logps=old, beta=0.04, loss_type=lt,
                              num_items_in_batch=mask.sum(), **extra)
    ref_loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-7)
    # and the parameters matter
    base = policy_loss(logp, mask, adv, ObjectiveOptions(loss_type=lt, beta=0.04), loss_normalizer(opts, [mask]),
                       old_logp=old, ref_logp=ref).loss
    assert abs(float(base - out.loss.detach())) > 1e-4
