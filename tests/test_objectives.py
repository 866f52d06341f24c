"""policy_loss against hand-written formulas (options Liger lacks), edge cases and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from logitless.objectives import (
    LOSS_TYPES,
    ObjectiveOptions,
    Stat,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    initial_entropy_coef,
    kl_estimate,
    loss_normalizer,
    merge_metrics,
    pack_metrics,
    policy_loss,
    summarize,
    unpack_metrics,
    update_entropy_coef,
)
from logitless.objectives.metrics import stats_of

F64 = torch.float64


def _batch(seed=0, B=5, T=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 4, 1, 5, 3])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    logp = (-torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05)
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    samp = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    ent = torch.rand(B, T, generator=g, dtype=F64) * 2
    adv = torch.tensor([1.2, -0.8, 0.5, -1.5, 0.3], dtype=F64)[:B]
    return logp, old, ref, samp, ent, adv, mask


def _opts(**kw):
    kw.setdefault("max_completion_length", 8)
    return ObjectiveOptions(**kw)


def _run(opts, logp, mask, adv, **kw):
    x = logp.clone().requires_grad_()
    out = policy_loss(x, mask, adv, opts, loss_normalizer(opts, [mask]), **kw)
    out.loss.backward()
    return out, x.grad


# ----------------------------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("est", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_value_and_grad(est):
    logp, _, ref, _, _, adv, mask = _batch()
    ref = ref.clone()
    ref[0, 0] = logp[0, 0] + 12.0  # low_var_kl clamps this token's k3 at 10
    beta = 0.1
    out, grad = _run(_opts(loss_type="dapo", beta=beta, kl_estimator=est), logp, mask, adv, ref_logp=ref)
    d = ref - logp
    kl = {"k1": -d, "k2": d * d / 2, "k3": d.exp() - d - 1, "low_var_kl": (d.exp() - d - 1).clamp(-10, 10)}[est]
    dkl = {"k1": torch.ones_like(d), "k2": -d, "k3": 1 - d.exp(), "low_var_kl": torch.where(
        (d.exp() - d - 1) > 10, 0.0, 1 - d.exp())}[est]
    n = mask.sum()
    # on-policy: ratio ≡ 1, policy term -A, d(policy)/d logp = -A
    expected = ((-adv[:, None] + beta * kl) * mask).sum() / n
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, ((-adv[:, None] + beta * dkl) * mask) / n)
    torch.testing.assert_close(out.metrics["kl"].mean, (kl * mask).sum() / n)
    torch.testing.assert_close(kl_estimate(logp, ref, est), kl)


def test_dual_clip():
    B, T = 3, 1
    mask = torch.ones(B, T, dtype=F64)
    old = torch.zeros(B, T, dtype=F64)
    logp = torch.log(torch.tensor([[5.0], [2.0], [5.0]], dtype=F64))  # ratios 5, 2, 5
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=F64)
    out, grad = _run(_opts(loss_type="dapo", dual_clip=3.0, epsilon_high=0.28), logp, mask, adv, old_logp=old)
    # A<0: ℓ = min(max(r|A|, clip(r)|A|), c|A|) -> 3 (no grad), 2 (grad r·|A| = 2); A>0, r=5: clipped -1.28
    torch.testing.assert_close(out.loss, torch.tensor((3.0 + 2.0 - 1.28) / 3, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[0.0], [2.0 / 3], [0.0]], dtype=F64))
    torch.testing.assert_close(out.metrics["clip/dual"].total, torch.tensor(1.0, dtype=F64))


def test_delta_caps_the_unclipped_ratio():
    mask = torch.ones(2, 1, dtype=F64)
    logp = torch.log(torch.tensor([[4.0], [1.1]], dtype=F64))
    adv = torch.tensor([-1.0, -1.0], dtype=F64)
    out, grad = _run(_opts(loss_type="dapo", delta=2.0), logp, mask, adv, old_logp=torch.zeros(2, 1, dtype=F64))
    # A<0: ℓ = max(min(r, δ)|A|, clip(r)|A|): r=4 -> 2 (no grad), r=1.1 -> 1.1 (grad 1.1)
    torch.testing.assert_close(out.loss, torch.tensor((2.0 + 1.1) / 2, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[0.0], [0.55]], dtype=F64))


@pytest.mark.parametrize("lt", ["grpo", "dapo", "bnpo"])
def test_sequence_token_level_equals_gspo_value_and_gradient(lt):
    logp, old, _, _, _, adv, mask = _batch(seed=3)
    old = logp + 0.05 * (old - logp)  # keep sequence ratios inside the clip range for some rows
    seq, g_seq = _run(_opts(loss_type=lt, importance_sampling_level="sequence"), logp, mask, adv, old_logp=old)
    tok, g_tok = _run(_opts(loss_type=lt, importance_sampling_level="sequence_token"), logp, mask, adv, old_logp=old)
    torch.testing.assert_close(tok.loss, seq.loss)
    torch.testing.assert_close(g_tok, g_seq)
    # hand formula: s_i = exp(mean_t(logp - old)); ∂/∂logp_it = -A_i s_i 1[unclipped] · w_it
    n_len = mask.sum(-1, keepdim=True)
    s = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / n_len)
    a = adv[:, None]
    unclipped = ~(((s < 0.8) & (a < 0)) | ((s > 1.2) & (a > 0)))
    norm = loss_normalizer(_opts(loss_type=lt), [mask])
    w = mask / n_len if lt == "grpo" else mask  # the reduction's weight of token t of sequence i
    expected = -a * s * unclipped * w / norm
    torch.testing.assert_close(g_tok, expected)
    assert unclipped.any() and g_tok.abs().sum() > 0


@pytest.mark.parametrize("mode,reduction", [
    ("sequence_truncate", "product"), ("sequence_mask", "product"), ("sequence_truncate", "geometric_mean"),
    ("sequence_mask", "geometric_mean"), ("token_truncate", None), ("token_mask", None)])
def test_sampler_is_modes(mode, reduction):
    logp, old, _, samp, _, adv, mask = _batch(seed=4)
    lo, hi = (0.95, 1.05) if reduction == "geometric_mean" else (0.8, 1.2)
    opts = _opts(loss_type="dapo", sampler_is_mode=mode, sampler_is_clip_min=lo, sampler_is_clip_max=hi,
                 sampler_is_sequence_reduction=reduction)
    out, grad = _run(opts, logp, mask, adv, old_logp=old, sampler_logp=samp)
    d = (old - samp) * mask
    if mode.startswith("token"):
        log_rho = d
    elif reduction == "product":
        log_rho = d.sum(-1, keepdim=True)
    else:
        log_rho = d.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    rho = log_rho.exp()
    rho = rho.clamp(lo, hi) if mode.endswith("truncate") else torch.where((rho >= lo) & (rho <= hi), rho, 0.0)
    assert ((rho == 0) | (rho == lo) | (rho == hi)).any() and ((rho > lo) & (rho < hi)).any()
    r = (logp - old).exp()
    a = adv[:, None]
    pg = -torch.min(r * a, r.clamp(0.8, 1.2) * a)
    n = mask.sum()
    torch.testing.assert_close(out.loss, (pg * rho * mask).sum() / n)
    unclipped = (torch.min(r * a, r.clamp(0.8, 1.2) * a) == r * a)
    torch.testing.assert_close(grad, -a * r * unclipped * rho * mask / n)
    if mode.endswith("mask"):
        masked = ((rho == 0) & (mask > 0)).sum() if mode.startswith("token") else ((rho == 0) * mask).sum()
        torch.testing.assert_close(out.metrics["is/masked"].total, masked.to(F64))


def test_off_policy_sequence_mask():
    logp, old, _, samp, _, adv, mask = _batch(seed=5)
    samp = logp.clone()
    samp[1] = logp[1] + 0.5  # A<0, KL 0.5 > δ -> masked
    samp[0] = logp[0] + 0.5  # A>0 -> kept whatever the KL
    samp[3] = logp[3] + 0.01  # A<0, KL 0.01 <= δ -> kept
    samp[3, 0] = math.nan  # a token the rollout engine could not score: no evidence (TRL 1.16), still kept
    delta = 0.1
    out, grad = _run(_opts(loss_type="dapo", off_policy_mask_threshold=delta), logp, mask, adv, old_logp=old,
                     sampler_logp=samp)
    keep = torch.tensor([1, 0, 1, 1, 1], dtype=F64)[:, None]
    r = (logp - old).exp()
    a = adv[:, None]
    pg = -torch.min(r * a, r.clamp(0.8, 1.2) * a)
    torch.testing.assert_close(out.loss, (pg * keep * mask).sum() / mask.sum())
    assert (grad[1] == 0).all() and (grad[0] != 0).any()
    torch.testing.assert_close(out.metrics["masked/off_policy"].mean, mask[1].sum() / mask.sum())


def test_top_entropy_quantile_mask_and_threshold():
    logp, old, _, _, ent, adv, mask = _batch(seed=6)
    q = 0.4
    thr = torch.quantile(ent[mask.bool()], 1 - q)
    torch.testing.assert_close(entropy_quantile_threshold(ent, mask, q), thr)
    out, grad = _run(_opts(loss_type="dapo", top_entropy_quantile=q), logp, mask, adv, old_logp=old, entropy=ent)
    keep = (ent >= thr).to(F64)
    r = (logp - old).exp()
    a = adv[:, None]
    pg = -torch.min(r * a, r.clamp(0.8, 1.2) * a)
    torch.testing.assert_close(out.loss, (pg * keep * mask).sum() / mask.sum())
    torch.testing.assert_close(out.metrics["masked/entropy"].mean, ((1 - keep) * mask).sum() / mask.sum())
    # an explicit (e.g. step-global) threshold is used as given
    out2, _ = _run(_opts(loss_type="dapo", top_entropy_quantile=q), logp, mask, adv, old_logp=old, entropy=ent,
                   entropy_threshold=0.0)
    torch.testing.assert_close(out2.loss, (pg * mask).sum() / mask.sum())


@pytest.mark.parametrize("lt", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("q", [1.0, 0.5])
def test_entropy_bonus_value_and_gradient(lt, q):
    """Default (step_mean): the bonus is the mean entropy over the tokens the policy term keeps (TRL 1.16's
    effective mask), whatever the loss type's own reduction."""
    logp, old, _, _, ent, adv, mask = _batch(seed=7)
    c, thr = 0.05, 0.9
    e = ent.clone().requires_grad_()
    opts = _opts(loss_type=lt, entropy_coef=c, top_entropy_quantile=q)
    n = loss_normalizer(opts, [mask])
    base = policy_loss(logp, mask, adv, _opts(loss_type=lt, top_entropy_quantile=q), n, old_logp=old, entropy=ent,
                       entropy_threshold=thr).loss
    kept = mask * (ent >= thr) if q < 1 else mask
    n_h = entropy_bonus_normalizer(opts, [mask], entropies=[ent], threshold=thr)
    assert n_h == float(kept.sum()) and 0 < n_h < (mask.sum() if q < 1 else math.inf)
    out = policy_loss(logp, mask, adv, opts, n, old_logp=old, entropy=e, entropy_threshold=thr, entropy_normalizer=n_h)
    out.loss.backward()
    torch.testing.assert_close(out.loss, base - c * (ent * kept).sum() / kept.sum())
    torch.testing.assert_close(e.grad, -c * kept / kept.sum())
    if q < 1:  # the controller's entropy: over the kept tokens
        torch.testing.assert_close(out.metrics["entropy/kept"].mean, (ent * kept).sum() / kept.sum())
    # the coefficient can be overridden per call (adaptive controller)
    out0 = policy_loss(logp, mask, adv, opts, n, old_logp=old, entropy=ent, entropy_coef=0.0, entropy_threshold=thr)
    torch.testing.assert_close(out0.loss, base)
    if lt == "dapo" and q == 1:  # same tokens as the policy normalizer: it may be left out
        out1 = policy_loss(logp, mask, adv, opts, n, old_logp=old, entropy=ent)
        torch.testing.assert_close(out1.loss, base - c * (ent * kept).sum() / kept.sum())
    else:
        with pytest.raises(ValueError, match="needs entropy_normalizer=.*entropy_bonus_normalizer"):
            policy_loss(logp, mask, adv, opts, n, old_logp=old, entropy=ent, entropy_threshold=thr)


def _trl_116_bonus(ent, mask, q, micro_batches):
    """TRL 1.16 `_compute_loss` entropy bonus, transcribed: per micro-batch, the top-entropy mask from the
    micro-batch's own quantile, entropy_loss = Σ H·m·e / Σ m·e / gradient_accumulation_steps."""
    total = 0.0
    for rows in micro_batches:
        h, m = ent[rows], mask[rows]
        eff = m
        if q < 1.0:
            thr = torch.quantile(h[m.bool()], 1 - q)
            eff = m * ((h >= thr) & m.bool())
        total = total + (h * eff).sum() / eff.sum().clamp(min=1.0) / len(micro_batches)
    return total


@pytest.mark.parametrize("lt", ["dapo", "bnpo", "grpo"])
@pytest.mark.parametrize("q", [1.0, 0.4])
def test_entropy_bonus_trl_reduction_matches_trl_116(lt, q):
    logp, old, _, _, ent, adv, mask = _batch(seed=3)
    c = 0.03
    split = [[0, 1], [2], [3, 4]]  # uneven token counts: the per-micro-batch means differ from the step mean
    trl = _opts(loss_type=lt, entropy_coef=c, top_entropy_quantile=q, entropy_bonus_reduction="trl")
    n, n_h = loss_normalizer(trl, [mask[r] for r in split]), entropy_bonus_normalizer(trl, [mask[r] for r in split])
    assert n_h == 3.0
    e = ent.clone().requires_grad_()
    bonus = 0.0
    for rows in split:  # entropy_threshold=None: the micro-batch's own quantile, as TRL
        with_bonus = policy_loss(logp[rows], mask[rows], adv[rows], trl, n, old_logp=old[rows], entropy=e[rows],
                                 entropy_normalizer=n_h).loss
        without = policy_loss(logp[rows], mask[rows], adv[rows], trl, n, old_logp=old[rows], entropy=ent[rows],
                              entropy_coef=0.0).loss
        bonus = bonus + (without - with_bonus) / c
    expected = _trl_116_bonus(ent, mask, q, split)
    torch.testing.assert_close(bonus, expected)
    e_ref = ent.clone().requires_grad_()
    _trl_116_bonus(e_ref, mask, q, split).backward()
    sum(policy_loss(logp[r], mask[r], adv[r], trl, n, old_logp=old[r], entropy=e[r], entropy_normalizer=n_h).loss
        for r in split).backward()
    torch.testing.assert_close(e.grad, -c * e_ref.grad)
    # the default is the exact step mean, which differs here
    if q == 1.0:
        assert abs(float(expected - (ent * mask).sum() / mask.sum())) > 1e-3


def test_entropy_bonus_normalizer_input_errors():
    _, _, _, _, ent, _, mask = _batch()
    with pytest.raises(ValueError, match="top_entropy_quantile=0.5.*pass entropies="):
        entropy_bonus_normalizer(_opts(top_entropy_quantile=0.5, entropy_coef=0.1), [mask])
    with pytest.raises(ValueError, match="mask_truncated_completions=True: pass truncated="):
        entropy_bonus_normalizer(_opts(mask_truncated_completions=True), [mask])
    with pytest.raises(ValueError, match="entropy_bonus_reduction='mean' is not valid"):
        _opts(entropy_bonus_reduction="mean")
    truncated = torch.tensor([True, False, False, False, False])
    got = entropy_bonus_normalizer(_opts(mask_truncated_completions=True), [mask], [truncated])
    assert got == float(mask[1:].sum())


@pytest.mark.parametrize("q", [1e-3, 0.2, 0.5, 0.999])
def test_entropy_quantile_threshold_matches_torch_quantile(q):
    g = torch.Generator().manual_seed(1)
    ents = [torch.rand(3, 7, generator=g, dtype=F64), torch.rand(2, 4, generator=g, dtype=F64)]
    masks = [torch.rand(3, 7, generator=g) > 0.4, torch.rand(2, 4, generator=g) > 0.4]
    expected = torch.quantile(torch.cat([e[m] for e, m in zip(ents, masks)]), 1 - q)
    torch.testing.assert_close(entropy_quantile_threshold(ents, masks, q), expected)
    one = torch.zeros(1, 3, dtype=torch.bool)
    one[0, 1] = True
    torch.testing.assert_close(entropy_quantile_threshold(ents[0][:1, :3], one, q), ents[0][0, 1])
    assert math.isinf(float(entropy_quantile_threshold(ents[0], torch.zeros(3, 7), q)))


def test_stats_of_equals_stat_of():
    g = torch.Generator().manual_seed(2)
    v = torch.randn(4, 5, generator=g)
    w = torch.rand(4, 5, generator=g) > 0.5
    items = {"a": (v, w), "b": (v > 0, w), "c": (v[:, :1], torch.ones(4, 1, dtype=torch.bool)), "d": (v[0], None),
             "e": (v, torch.zeros_like(w)), "f": (v[:0], None), "g": (torch.zeros((), dtype=torch.bool), w)}
    batched = stats_of(items)
    assert list(batched) == list(items)
    for name, (x, m) in items.items():
        ref = Stat.of(x, m)
        for f in ("total", "count", "min", "max"):
            torch.testing.assert_close(getattr(batched[name], f), getattr(ref, f), msg=f"{name}.{f}")


def _trl_116_controller(coef, entropies, o):
    """TRL 1.16 adaptive controller, transcribed: the coefficient applied in each step (given the world entropy
    measured in each step)."""
    last, applied = math.inf, []
    for h in entropies:
        applied.append(coef if last <= o.entropy_target else 0.0)
        coef = min(coef + o.entropy_coef_delta, o.entropy_coef_max) if h <= o.entropy_target else \
            max(coef - o.entropy_coef_delta, o.entropy_coef_min)
        last = h
    return applied


def test_adaptive_entropy_first_step_and_trajectory_match_trl_116():
    o = _opts(use_adaptive_entropy=True, entropy_coef=0.02, entropy_coef_delta=0.01, entropy_target=0.5,
              entropy_coef_max=0.045)
    state = initial_entropy_coef(o)
    assert state == (0.02, 0.0)  # no entropy measured yet: no bonus on the first step, as TRL
    entropies = [0.3, 0.3, 0.9, 0.2, 0.1, 0.1, 0.1, 0.7]
    applied = []
    for h in entropies:
        applied.append(state.effective)
        state = update_entropy_coef(state.coef, h, o)
    assert applied == pytest.approx(_trl_116_controller(0.02, entropies, o))
    assert applied[0] == 0.0 and applied[1] == pytest.approx(0.03)
    assert initial_entropy_coef(_opts(entropy_coef=0.02)) == (0.02, 0.02)  # a fixed bonus applies from step 1


def test_adaptive_entropy_coef():
    o = _opts(use_adaptive_entropy=True, entropy_coef_delta=0.01, entropy_target=0.5, entropy_coef_max=0.025)
    assert update_entropy_coef(0.0, 0.3, o) == (0.01, 0.01)  # entropy below target: grow, apply
    assert update_entropy_coef(0.02, 0.3, o) == (0.025, 0.025)  # clamped at max
    c = update_entropy_coef(0.02, 0.9, o)  # above target: shrink, not applied
    assert c.coef == pytest.approx(0.01) and c.effective == 0.0


def test_mask_truncated_completions():
    logp, old, _, _, _, adv, mask = _batch(seed=8)
    trunc = torch.tensor([False, True, False, True, False])
    opts = _opts(loss_type="dapo", mask_truncated_completions=True)
    norm = loss_normalizer(opts, [mask], [trunc])
    m2 = mask * (~trunc)[:, None]
    assert norm == float(m2.sum())
    out = policy_loss(logp, mask, adv, opts, norm, old_logp=old, truncated=trunc)
    ref = policy_loss(logp, m2, adv, _opts(loss_type="dapo"), norm, old_logp=old)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.metrics["masked/truncated"].mean, (mask.sum() - m2.sum()) / mask.sum())


@pytest.mark.parametrize("lt,kind", [("dapo", "tokens"), ("bnpo", "tokens"), ("grpo", "sequences"),
                                     ("luspo", "sequences"), ("dr_grpo", "constant")])
def test_loss_normalizer_counts(lt, kind):
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1, 1]])]
    level = "sequence" if lt == "luspo" else "token"
    o = _opts(loss_type=lt, importance_sampling_level=level)
    assert o.normalizer_kind == kind
    expected = {"tokens": 6.0, "sequences": 3.0, "constant": 3.0 * 8}[kind]
    assert loss_normalizer(o, masks) == expected


def test_tensor_normalizer_equals_float():
    logp, old, _, _, _, adv, mask = _batch()
    o = _opts(loss_type="dapo")
    n = loss_normalizer(o, mask)  # a single mask is accepted too
    a = policy_loss(logp, mask, adv, o, n, old_logp=old).loss
    b = policy_loss(logp, mask, adv, o, torch.tensor([n]), old_logp=old).loss
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a * n, policy_loss(logp, mask, adv, o, 1.0, old_logp=old).loss)


def test_metrics_merge_pack_summarize():
    v = torch.tensor([[1.0, 5.0, -2.0], [3.0, 0.0, 7.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    a, b = Stat.of(v[:1], m[:1]), Stat.of(v[1:], m[1:])
    merged = merge_metrics([{"x": a}, {"x": b, "y": Stat.of(v[1:], m[1:] & False)}])
    full = Stat.of(v, m)
    for f in ("total", "count", "min", "max"):
        torch.testing.assert_close(getattr(merged["x"], f), getattr(full, f))
    assert float(merged["y"].count) == 0 and math.isinf(float(merged["y"].min))
    names, sc, mins, maxs = pack_metrics(merged)
    back = unpack_metrics(names, sc, mins, maxs)
    assert float(back["x"].mean) == pytest.approx(3.0)
    s = summarize({"ratio": full, "clip/low": full, "y": merged["y"]})
    assert s == {"clip/low": 3.0, "ratio": 3.0, "ratio/min": 1.0, "ratio/max": 5.0}


# ----------------------------------------------------------------------------------------------- edge cases
def _all_options(lt):
    return _opts(loss_type=lt, importance_sampling_level="sequence" if lt == "luspo" else "token",
                 epsilon_high=2.0 if lt == "cispo" else 0.28, beta=0.04, sampler_is_mode="token_truncate",
                 off_policy_mask_threshold=0.1, top_entropy_quantile=0.5, entropy_coef=0.01)


@pytest.mark.parametrize("lt", LOSS_TYPES)
def test_all_masked_micro_batch_is_finite_zero(lt):
    logp, old, ref, samp, ent, adv, _ = _batch()
    mask = torch.zeros_like(logp)
    for t in (logp, old, ref, samp):
        t[:, -1] = -math.inf  # padding may hold -inf
    x, e = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    out = policy_loss(x, mask, adv, _all_options(lt), 10.0, old_logp=old, ref_logp=ref, sampler_logp=samp,
                      entropy=e, entropy_normalizer=7.0)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert (x.grad == 0).all() and (e.grad == 0).all()
    assert float(out.metrics["ratio"].count) == 0
    # a whole step that is masked: normalizer 0 is treated as 1 (as TRL/Liger)
    assert policy_loss(logp, mask, adv, _opts(loss_type=lt, epsilon_high=2.0 if lt == "cispo" else 0.2,
                                              importance_sampling_level="sequence" if lt == "luspo" else "token"),
                       0, old_logp=old).loss.item() == 0.0


@pytest.mark.parametrize("lt", LOSS_TYPES)
@pytest.mark.parametrize("pad", [-math.inf, math.nan, -1e30])
def test_padding_values_do_not_matter(lt, pad):
    logp, old, ref, samp, ent, adv, mask = _batch()
    kw = {"old_logp": old, "ref_logp": ref, "sampler_logp": samp, "entropy": ent}
    clean, g_clean = _run(_all_options(lt), logp, mask, adv, entropy_normalizer=7.0, **kw)
    dirty = {k: v.masked_fill(mask == 0, pad) for k, v in kw.items()}
    out, grad = _run(_all_options(lt), logp.masked_fill(mask == 0, pad), mask, adv, entropy_normalizer=7.0, **dirty)
    torch.testing.assert_close(out.loss, clean.loss)
    torch.testing.assert_close(grad, g_clean)


@pytest.mark.parametrize("lt", LOSS_TYPES)
def test_neg_inf_and_very_negative_logprobs_inside_the_mask(lt):
    logp, old, ref, samp, ent, adv, mask = _batch()
    logp = logp.clone()
    logp[0, 1] = -math.inf
    logp[1, 0] = -1e3
    old = old.clone()
    old[1, 0] = -1e3 + 0.1  # a very unlikely token: the ratio is still exp(-0.1)
    ref = ref.clone()
    ref[3, 2] = -math.inf
    out, grad = _run(_all_options(lt), logp, mask, adv, old_logp=old, ref_logp=ref, sampler_logp=samp, entropy=ent,
                     entropy_normalizer=7.0)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert grad[0, 1] == 0  # no gradient through a -inf logprob
    for name, s in out.metrics.items():
        assert all(math.isfinite(float(getattr(s, f))) or float(s.count) == 0 for f in ("total", "count")), name


def test_very_negative_logprobs_exact_gradient():
    mask = torch.ones(1, 2, dtype=F64)
    logp = torch.tensor([[-1000.0, -2.0]], dtype=F64)
    old = torch.tensor([[-1000.1, -2.0]], dtype=F64)
    out, grad = _run(_opts(loss_type="dapo", epsilon_high=0.28), logp, mask, torch.tensor([1.0], dtype=F64),
                     old_logp=old)
    r = math.exp(0.1)
    torch.testing.assert_close(out.loss, torch.tensor(-(r + 1.0) / 2, dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([[-r / 2, -0.5]], dtype=F64))


def test_zero_length_completion_counts_as_a_sequence_for_grpo():
    logp, old, _, _, _, adv, mask = _batch()
    mask = mask.clone()
    mask[2] = 0
    o = _opts(loss_type="grpo")
    out, _ = _run(o, logp, mask, adv, old_logp=old)
    r = (logp - old).exp()
    a = adv[:, None]
    pg = -torch.min(r * a, r.clamp(0.8, 1.2) * a)
    per_seq = (pg * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(out.loss, per_seq.sum() / 5)


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,match", [
    ({"loss_type": "ppo"}, "loss_type='ppo'.*'grpo'.*'dapo'"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level='seq'.*'sequence_token'"),
    ({"kl_estimator": "k4"}, "kl_estimator='k4'.*'low_var_kl'"),
    ({"sampler_is_mode": "seq_mask"}, "sampler_is_mode='seq_mask'.*'sequence_mask'"),
    ({"loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence"}, "not supported"),
    ({"loss_type": "luspo"}, "importance_sampling_level='sequence'"),
    ({"loss_type": "sapo", "delta": 2.0}, "delta"),
    ({"delta": 1.1}, "delta=1.1 must be > 1 \\+ epsilon_high"),
    ({"dual_clip": 0.5}, "dual_clip=0.5 must be >"),
    ({"loss_type": "cispo", "dual_clip": 3.0, "epsilon_high": 5.0}, "dual_clip only applies"),
    ({"loss_type": "dr_grpo"}, "max_completion_length"),
    ({"use_bias_correction_kl": True}, "beta=0"),
    ({"sampler_is_mode": "sequence_mask"}, "sampler_is_sequence_reduction.*product.*geometric_mean"),
    ({"sampler_is_mode": "token_mask", "sampler_is_sequence_reduction": "product"}, "only applies to sequence"),
    ({"loss_type": "vespo", "sampler_is_mode": "sequence_mask", "sampler_is_sequence_reduction": "product"},
     "token_truncate"),
    ({"loss_type": "cispo"}, "epsilon_high=0.2"),
    ({"sampler_is_mode": "token_mask", "sampler_is_clip_max": None}, "clip_min and/or"),
    ({"top_entropy_quantile": 0.0}, "top_entropy_quantile"),
    ({"beta": -0.1}, "beta"),
])
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveOptions(**kw)


def test_bad_inputs():
    logp, old, ref, samp, ent, adv, mask = _batch()
    o = _opts()
    n = loss_normalizer(o, [mask])
    with pytest.raises(ValueError, match=r"mask must have the shape of logp \[5, 6\]"):
        policy_loss(logp, mask[:, :4], adv, o, n)
    with pytest.raises(ValueError, match=r"old_logp must have the shape of logp \[5, 6\], got \[5, 5\]"):
        policy_loss(logp, mask, adv, o, n, old_logp=old[:, :5])
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\] = \[5\].*\[5, 1\]"):
        policy_loss(logp, mask, adv[:, None], o, n)
    with pytest.raises(ValueError, match=r"truncated must be a \[B\]"):
        policy_loss(logp, mask, adv, o, n, truncated=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="beta=0.04.*needs ref_logp"):
        policy_loss(logp, mask, adv, _opts(beta=0.04), n)
    with pytest.raises(ValueError, match="sampler_is_mode='token_mask'.*needs sampler_logp"):
        policy_loss(logp, mask, adv, _opts(sampler_is_mode="token_mask"), n)
    with pytest.raises(ValueError, match="top_entropy_quantile=0.2.*needs entropy"):
        policy_loss(logp, mask, adv, _opts(top_entropy_quantile=0.2), n)
    with pytest.raises(ValueError, match="entropy_coef=0.1.*needs entropy"):
        policy_loss(logp, mask, adv, _opts(entropy_coef=0.1), n)
    with pytest.raises(ValueError, match="mask_truncated_completions=True.*needs truncated"):
        policy_loss(logp, mask, adv, _opts(mask_truncated_completions=True), n)
    with pytest.raises(ValueError, match="T=6 exceeds options.max_completion_length=4"):
        policy_loss(logp, mask, adv, _opts(loss_type="dr_grpo", max_completion_length=4), n)
    with pytest.raises(ValueError, match="normalizer must be a finite number"):
        policy_loss(logp, mask, adv, o, -1.0)
    with pytest.raises(ValueError, match="normalizer must be a finite number"):
        policy_loss(logp, mask, adv, o, float("nan"))
    with pytest.raises(ValueError, match="logp must be a floating \\[B, T\\] tensor"):
        policy_loss(logp[0], mask, adv, o, n)
    with pytest.raises(TypeError, match="options must be an ObjectiveOptions"):
        policy_loss(logp, mask, adv, {"loss_type": "dapo"}, n)
    with pytest.raises(ValueError, match="pass truncated="):
        loss_normalizer(_opts(mask_truncated_completions=True), [mask])


def test_old_ref_sampler_inputs_are_constants():
    logp, old, ref, samp, ent, adv, mask = _batch()
    inputs = {"old_logp": old, "ref_logp": ref, "sampler_logp": samp}
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out, grad = _run(_opts(beta=0.1, sampler_is_mode="token_truncate", off_policy_mask_threshold=0.1), logp, mask, adv,
                     **leaves)
    assert grad.abs().sum() > 0
    assert all(v.grad is None for v in leaves.values())


@pytest.mark.gpu
@pytest.mark.parametrize("lt", LOSS_TYPES)
def test_cuda_matches_cpu_without_device_syncs(lt):
    logp, old, ref, samp, ent, adv, mask = _batch()
    opts = _all_options(lt)
    cpu, g_cpu = _run(opts, logp, mask, adv, old_logp=old, ref_logp=ref, sampler_logp=samp, entropy=ent,
                      entropy_normalizer=7.0)
    dev = {k: v.float().cuda() for k, v in dict(old_logp=old, ref_logp=ref, sampler_logp=samp, entropy=ent).items()}
    x = logp.float().cuda().requires_grad_()
    mask_d, adv_d = mask.float().cuda(), adv.float().cuda()
    norm = loss_normalizer(opts, [mask])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # policy_loss and backward must not synchronize with the device
    try:
        out = policy_loss(x, mask_d, adv_d, opts, norm, entropy_normalizer=7.0, **dev)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.loss.double().cpu(), cpu.loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(x.grad.double().cpu(), g_cpu, rtol=1e-4, atol=1e-6)
    for name, s in cpu.metrics.items():
        torch.testing.assert_close(out.metrics[name].total.cpu(), s.total, rtol=1e-4, atol=1e-5, msg=name)
