"""The GRPO-family policy objective over [B, T] tensors, divided by a caller-given global normalizer.

    ℓ_it  = policy term (by loss_type, ratio at token / sequence level)
            × off-policy sequence mask × top-entropy token mask × rollout IS weight ρ
            + β · KL_it (× ratio if bias-corrected)
    loss  = Σ_i Σ_t ℓ_it·m_it·w_i / normalizer  −  c_H · Σ H_it·m_it·e_it / entropy_normalizer
            w_i = 1/|o_i| for grpo/sapo, else 1;  e = top-entropy token mask (1 when off)

The normalizer counts tokens, sequences or a constant over the WHOLE optimizer step (all micro-batches and
ranks; see `loss_normalizer`), so the sum of the micro-batch losses is the full-batch loss and the sum of
their gradients the full-batch gradient, exactly, however the step is split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from logitless.objectives.entropy import entropy_quantile_threshold
from logitless.objectives.kl import kl_estimate
from logitless.objectives.metrics import Stat, stats_of
from logitless.objectives.options import PPO_CLIP_LOSS_TYPES, ObjectiveOptions

Tensor = torch.Tensor

# Logprobs inside the mask are clamped to at least this value (a -inf logprob would make the loss infinite
# and its gradient NaN; the clamp zeroes the gradient of such a token instead). Positions outside the mask
# may hold anything (0, -inf, NaN): they are replaced by 0 before any arithmetic.
LOGP_FLOOR = -1e4


@dataclass
class ObjectiveOutput:
    loss: Tensor  # [] already divided by the global normalizer; Σ over micro-batches (and ranks) = step loss
    metrics: dict[str, Stat]  # detached, exactly mergeable across micro-batches and ranks (metrics.py)


def loss_normalizer(options: ObjectiveOptions, masks: list[Tensor], truncated: list[Tensor] | None = None) -> float:
    """This rank's share of the step normalizer, from the loss masks [B, T] of all its micro-batches.

    The value is additive: all-reduce it with SUM across ranks and pass the result to every `policy_loss`
    call of the step. What it counts depends on `options.loss_type`:

    - dapo, bnpo, cispo, vespo: tokens Σ m (after masking truncated rows if `mask_truncated_completions`)
    - grpo, sapo, luspo:        sequences (rows, including empty ones, as TRL and Liger)
    - dr_grpo:                  sequences × max_completion_length

    Under DDP/FSDP gradient *averaging*, multiply each loss by the world size (or divide the normalizer by it).
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if truncated is not None and len(truncated) != len(masks):
        raise ValueError(f"truncated has {len(truncated)} entries but masks has {len(masks)}; pass one per "
                         "micro-batch.")
    if options.mask_truncated_completions and truncated is None and options.normalizer_kind == "tokens":
        raise ValueError("options.mask_truncated_completions=True: pass truncated= (one [B] bool tensor per "
                         "micro-batch) so truncated rows are left out of the token count, as in policy_loss.")
    total = 0.0
    for i, m in enumerate(masks):
        if not isinstance(m, Tensor) or m.dim() != 2:
            raise ValueError(f"masks[{i}] must be a [B, T] tensor, got {getattr(m, 'shape', type(m))}.")
        if options.normalizer_kind == "tokens":
            valid = m.bool()
            if options.mask_truncated_completions:
                valid = valid & ~truncated[i].bool().view(-1, 1)
            total += float(valid.sum())
        else:
            total += m.shape[0]
    if options.normalizer_kind == "constant":
        total *= options.max_completion_length
    return total


def _clean(x: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """x inside the mask (floored at LOGP_FLOOR), 0 outside; gradients flow only inside the mask."""
    return torch.where(valid, x.to(dtype).clamp(min=LOGP_FLOOR), 0.0)


def _check_inputs(logp, mask, advantages, options, normalizer, tensors: dict, truncated, entropy_coef) -> None:
    if not isinstance(options, ObjectiveOptions):
        raise TypeError(f"options must be an ObjectiveOptions, got {type(options).__name__}.")
    if not isinstance(logp, Tensor) or logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(f"logp must be a floating [B, T] tensor, got {getattr(logp, 'shape', type(logp))} "
                         f"{getattr(logp, 'dtype', '')}.")
    shape = tuple(logp.shape)
    if not isinstance(mask, Tensor) or tuple(mask.shape) != shape:
        raise ValueError(f"mask must have the shape of logp {list(shape)}, got {list(getattr(mask, 'shape', []))}.")
    if not isinstance(advantages, Tensor) or tuple(advantages.shape) not in (shape[:1], shape):
        got = list(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(f"advantages must have shape [B] = [{shape[0]}] (one value per sequence) or the shape of "
                         f"logp {list(shape)} (one per token, e.g. per turn of an episode), got {got}.")
    for name, t in tensors.items():
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != shape):
            raise ValueError(f"{name} must have the shape of logp {list(shape)}, got "
                             f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}.")
    if truncated is not None and (not isinstance(truncated, Tensor) or tuple(truncated.shape) != shape[:1]):
        raise ValueError(f"truncated must be a [B] = [{shape[0]}] bool tensor, got "
                         f"{list(truncated.shape) if isinstance(truncated, Tensor) else type(truncated).__name__}.")
    o = options
    needs = [
        (o.beta != 0.0, "ref_logp", f"options.beta={o.beta} adds a KL term to the reference policy"),
        (o.sampler_is is not None, "sampler_logp", f"options.sampler_is_mode={o.sampler_is_mode!r} corrects "
                                                         "for the rollout engine's distribution"),
        (o.top_entropy_quantile < 1.0, "entropy", f"options.top_entropy_quantile={o.top_entropy_quantile} masks "
                                                  "low-entropy tokens"),
        (entropy_coef != 0.0, "entropy", f"entropy_coef={entropy_coef} adds an entropy bonus"),
        (o.mask_truncated_completions, "truncated", "options.mask_truncated_completions=True"),
    ]
    for cond, name, why in needs:
        if cond and (tensors.get(name) if name != "truncated" else truncated) is None:
            raise ValueError(f"{why}, so it needs {name}= ({'[B] bool' if name == 'truncated' else '[B, T]'}); "
                             f"pass it or turn the option off.")
    if o.loss_type == "dr_grpo" and shape[1] > o.max_completion_length:
        raise ValueError(f"loss_type='dr_grpo': the completion length T={shape[1]} exceeds "
                         f"options.max_completion_length={o.max_completion_length}; set it to the generation limit.")
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {list(normalizer.shape)}.")
    elif isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)) or not math.isfinite(normalizer) \
            or normalizer < 0:
        raise ValueError(f"normalizer must be a finite number >= 0 (from loss_normalizer, summed over ranks), "
                         f"got {normalizer!r}.")
    if entropy_coef < 0 or not math.isfinite(entropy_coef):
        raise ValueError(f"entropy_coef must be a finite number >= 0, got {entropy_coef!r}.")


def policy_loss(
    logp: Tensor,  # [B, T] current policy logprobs of the sampled tokens (with grad)
    mask: Tensor,  # [B, T] loss mask: completion × tool × (truncation) mask, 0/1
    advantages: Tensor,  # [B] one per sequence, or [B, T] one per token (turn-level credit, objectives/credit.py)
    options: ObjectiveOptions,
    normalizer: float | Tensor,  # global count over the step (loss_normalizer, all-reduced)
    *,
    old_logp: Tensor | None = None,  # [B, T] policy that generated the batch; None = on-policy (ratio ≡ 1)
    ref_logp: Tensor | None = None,  # [B, T] reference policy (KL term)
    sampler_logp: Tensor | None = None,  # [B, T] rollout engine's logprobs (IS correction, off-policy mask)
    entropy: Tensor | None = None,  # [B, T] policy entropy (with grad if entropy_coef > 0)
    truncated: Tensor | None = None,  # [B] bool, completion hit the length limit
    entropy_coef: float | None = None,  # overrides options.entropy_coef (adaptive coefficient)
    entropy_threshold: float | Tensor | None = None,  # top-entropy mask threshold; None = from this micro-batch
    entropy_normalizer: float | Tensor | None = None,  # entropy_bonus_normalizer, all-reduced (bonus on only)
) -> ObjectiveOutput:
    """GRPO-family loss of one micro-batch (formulas in docs/objectives.md); equivalent to TRL's
    `GRPOTrainer._compute_loss` with the normalizer taken over the whole step. The entropy bonus acts on the
    tokens the policy term keeps and is divided by `entropy_normalizer` (see `entropy_bonus_normalizer`;
    it may be left None for step_mean token-normalized loss types without a top-entropy mask, where it equals
    `normalizer`)."""
    o = options
    if not isinstance(o, ObjectiveOptions):
        raise TypeError(f"options must be an ObjectiveOptions, got {type(o).__name__}.")
    coef_h = o.entropy_coef if entropy_coef is None else float(entropy_coef)
    tensors = {"old_logp": old_logp, "ref_logp": ref_logp, "sampler_logp": sampler_logp, "entropy": entropy}
    _check_inputs(logp, mask, advantages, o, normalizer, tensors, truncated, coef_h)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    lt, level, L = o.loss_type, o.importance_sampling_level, o.max_log_ratio
    stats: dict[str, tuple[Tensor, Tensor | None]] = {}  # name -> (values, where), reduced at the end

    valid0 = mask.bool()  # [B, T]
    valid = valid0
    if o.mask_truncated_completions:
        valid = valid0 & ~truncated.bool().view(-1, 1)
        stats["masked/truncated"] = (~valid, valid0)
    m = valid.to(dtype)  # [B, T]
    lengths = m.sum(-1, keepdim=True)  # [B, 1]
    stats["completion_length"] = (valid0.sum(-1).to(dtype), None)
    lp = _clean(logp, valid, dtype)  # [B, T]
    old = lp.detach() if old_logp is None else _clean(old_logp.detach(), valid, dtype)
    # [B, 1], or [B, T] per token: every term below takes A elementwise (sign tests, the off-policy mask, vespo's
    # (k, λ) then follow each token's own advantage)
    adv = advantages.detach().to(dtype)
    adv = adv.view(-1, 1) if adv.dim() == 1 else torch.where(valid, adv, 0.0)

    # Importance ratio π_θ / π_old at the chosen level.
    log_ratio = (lp - old).clamp(-L, L)  # [B, T]
    if level == "token":
        log_w = log_ratio
    else:
        seq = ((log_ratio * m).sum(-1, keepdim=True) / lengths.clamp(min=1.0)).clamp(-L, L)  # [B, 1]
        log_w = seq if level == "sequence" else lp - lp.detach() + seq.detach()  # [B, 1] or [B, T]
    coef_1 = torch.exp(log_w)
    stats["ratio"] = (coef_1, valid)

    # Rollout-engine IS weight ρ = π_old / π_sampler (detached).
    rho = None
    if o.sampler_is is not None:
        with torch.no_grad():
            samp = _clean(sampler_logp.detach(), valid, dtype)
            d = old.detach() - samp  # [B, T], 0 outside the mask
            stats["is/logp_diff"] = (d.abs(), valid)
            if o.sampler_is.startswith("token"):
                log_rho = d.clamp(-L, L)  # [B, T]
            else:
                log_rho = d.sum(-1, keepdim=True)  # [B, 1] product of the token ratios
                if o.sampler_is_sequence_reduction == "geometric_mean":
                    log_rho = log_rho / lengths.clamp(min=1.0)
                log_rho = log_rho.clamp(-L, L)
            rho = torch.exp(log_rho)
            lo, hi = o.sampler_is_clip_min, o.sampler_is_clip_max
            if o.sampler_is.endswith("truncate"):
                rho = rho.clamp(min=lo, max=hi)
            else:
                keep = torch.ones_like(rho, dtype=torch.bool)
                if lo is not None:
                    keep &= rho >= lo
                if hi is not None:
                    keep &= rho <= hi
                rho = torch.where(keep, rho, 0.0)
                stats["is/masked"] = (~keep, valid)
            stats["is/ratio"] = (rho, valid if rho.shape[1] > 1 else lengths > 0)

    # Policy term per loss type.
    zero = torch.zeros((), dtype=torch.bool, device=lp.device)
    clip_low = clip_high = zero
    if lt in PPO_CLIP_LOSS_TYPES:
        lo_b, hi_b = 1.0 - o.epsilon_low, 1.0 + o.epsilon_high
        coef_2 = coef_1.clamp(lo_b, hi_b)
        coef_d = coef_1.clamp(max=o.delta) if o.delta is not None else coef_1
        pg = -torch.min(coef_d * adv, coef_2 * adv)
        clip_low, clip_high = (coef_1 < lo_b) & (adv < 0), (coef_1 > hi_b) & (adv > 0)
        if o.dual_clip is not None:
            bound = -o.dual_clip * adv  # like adv
            stats["clip/dual"] = ((adv < 0) & (pg > bound), valid)
            pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    elif lt == "cispo":
        pg = -coef_1.clamp(max=o.epsilon_high).detach() * adv * lp
        clip_high = (coef_1 > o.epsilon_high) & (adv > 0)
    elif lt == "sapo":
        tau = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)  # like adv
        pg = -(torch.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau) * adv
    else:  # vespo: detached gamma weight φ(W_i) of the sequence ratio (× ρ), REINFORCE-style term
        with torch.no_grad():
            log_w_seq = (log_ratio.clamp(-20.0, 20.0) * m).sum(-1, keepdim=True)  # [B, 1]
            if rho is not None:
                log_rho_c = torch.log(rho).clamp(math.log(1e-8), 20.0)
                log_w_seq = log_w_seq + torch.where(valid, log_rho_c, 0.0).sum(-1, keepdim=True)
            log_w_seq = log_w_seq.clamp(math.log(1e-8), 20.0)
            nonneg = adv >= 0
            k = torch.where(nonneg, o.vespo_k_pos, o.vespo_k_neg)
            lam = torch.where(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w_seq - lam * torch.exp(log_w_seq)).nan_to_num(0.0, 0.0, 0.0)
        pg = -phi * adv * lp
    stats["clip/low"] = (clip_low, valid)
    stats["clip/high"] = (clip_high, valid)
    stats["clip/fraction"] = (clip_low | clip_high, valid)

    # Masks on the policy term (not on the KL term, as TRL).
    if o.off_policy_mask_threshold is not None:
        with torch.no_grad():
            behaviour = _clean(sampler_logp.detach(), valid, dtype) if sampler_logp is not None else old
            d_kl = torch.nan_to_num(behaviour - lp.detach(), nan=0.0)  # unscored (NaN) tokens: no evidence, TRL 1.16
            seq_kl = (d_kl * m).sum(-1, keepdim=True) / lengths.clamp(min=1.0)  # [B, 1]
            keep_seq = (adv >= 0) | (seq_kl <= o.off_policy_mask_threshold)
        stats["masked/off_policy"] = (~keep_seq, valid)
        pg = pg * keep_seq
    keep_tok = None
    if o.top_entropy_quantile < 1.0:
        with torch.no_grad():
            ent = _clean(entropy.detach(), valid, dtype)
            thr = entropy_threshold
            if thr is None:
                thr = entropy_quantile_threshold(ent, valid, o.top_entropy_quantile)
            keep_tok = ent >= (thr if isinstance(thr, Tensor) else float(thr))
        stats["masked/entropy"] = (~keep_tok, valid)
        pg = pg * keep_tok
    if rho is not None and lt != "vespo":  # vespo folds ρ into φ
        pg = pg * rho

    per_token = pg
    if ref_logp is not None:
        ref = _clean(ref_logp.detach(), valid, dtype)
        if o.beta != 0.0:
            kl = kl_estimate(lp, ref, o.kl_estimator, L)
            kl_term = kl * coef_1 if o.use_bias_correction_kl else kl  # unclipped ratio, before delta
            per_token = per_token + o.beta * kl_term
        else:
            with torch.no_grad():
                kl = kl_estimate(lp.detach(), ref, o.kl_estimator, L)
        stats["kl"] = (kl, valid)
    # Reduction: numerator local to the micro-batch, denominator global.
    if lt in ("grpo", "sapo"):
        total = ((per_token * m).sum(-1) / lengths.squeeze(-1).clamp(min=1.0)).sum()
    else:
        total = (per_token * m).sum()
    loss = total / _denominator(normalizer, total.device, dtype)
    if entropy is not None:
        ent_g = _clean(entropy, valid, dtype)
        kept = valid if keep_tok is None else valid & keep_tok  # [B, T] tokens of the policy term
        stats["entropy"] = (ent_g, valid)
        if keep_tok is not None:
            stats["entropy/kept"] = (ent_g, kept)
        if coef_h != 0.0:
            loss = loss - coef_h * _entropy_bonus(ent_g, kept, o, normalizer, entropy_normalizer, dtype)
    return ObjectiveOutput(loss=loss, metrics=stats_of(stats))


def _denominator(normalizer: float | Tensor, device: torch.device, dtype: torch.dtype) -> float | Tensor:
    """A caller-given normalizer as a divisor: detached, at least 1 (an all-masked step gives loss 0)."""
    if isinstance(normalizer, Tensor):
        return normalizer.detach().to(device=device, dtype=dtype).reshape(()).clamp(min=1.0)
    return max(float(normalizer), 1.0)


def _entropy_bonus(ent: Tensor, kept: Tensor, o: ObjectiveOptions, normalizer, entropy_normalizer, dtype) -> Tensor:
    """This micro-batch's share of the bonus's entropy mean (before the coefficient): Σ H over the kept tokens
    / step count of kept tokens (step_mean), or their micro-batch mean / number of micro-batches (trl)."""
    if entropy_normalizer is None:
        if o.entropy_bonus_reduction == "step_mean" and o.normalizer_kind == "tokens" and o.top_entropy_quantile == 1:
            entropy_normalizer = normalizer  # the same tokens: the policy term's own count
        else:
            raise ValueError(
                f"the entropy bonus (entropy_bonus_reduction={o.entropy_bonus_reduction!r}, loss_type={o.loss_type!r}, "
                f"top_entropy_quantile={o.top_entropy_quantile}) needs entropy_normalizer=: pass "
                "entropy_bonus_normalizer(options, masks_of_the_step, ...) summed over ranks, as for loss_normalizer."
            )
    num = (ent * kept).sum()
    if o.entropy_bonus_reduction == "trl":
        num = num / kept.sum().clamp(min=1).to(dtype)
    return num / _denominator(entropy_normalizer, num.device, dtype)


def on_policy_logp_grad(
    mask: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    options: ObjectiveOptions,
    normalizer: float | Tensor,
    *,
    sampler_logp: Tensor | None = None,  # [B, T]
    truncated: Tensor | None = None,  # [B] bool
    entropy_coef: float | None = None,
) -> Tensor | None:  # [B, T] d loss / d logp, or None
    """d policy_loss / d logp [B, T] for an on-policy step (old_logp=None), when it does not depend on logp.

    On-policy, every ratio is exp(logp - logp.detach()) = 1 exactly, so without a KL term (beta = 0), a rollout
    IS weight, an off-policy mask against the sampler, a top-entropy mask or an entropy bonus, the gradient
    w.r.t. logp is the same for every logp value. It is then returned (computed by autograd through
    `policy_loss` itself at logp = 0, so it equals the gradient of the real call bit for bit); otherwise None.
    Fused ops can take it as a hint to form their gradients in the forward
    (`logitless.ops.token_logprobs(grad_hint=...)`).
    """
    o = options
    coef_h = o.entropy_coef if entropy_coef is None else float(entropy_coef)
    if (o.beta != 0.0 or o.sampler_is is not None or o.top_entropy_quantile < 1.0 or coef_h != 0.0
            or (o.off_policy_mask_threshold is not None and sampler_logp is not None)):
        return None
    x = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        out = policy_loss(x, mask, advantages, o, normalizer, sampler_logp=sampler_logp, truncated=truncated,
                          entropy_coef=0.0)
        (grad,) = torch.autograd.grad(out.loss, x)
    return grad
