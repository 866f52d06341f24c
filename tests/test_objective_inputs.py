"""policy_loss and ObjectiveOptions refuse bad input with the exact message that names what was passed (the
mutation run of docs/testing.md showed the other tests match only the start of most messages), and accept the
values on the edge: T equal to max_completion_length, a bool where a number is wanted is refused."""

from __future__ import annotations

import pytest
import torch

from logitless.objectives import ObjectiveOptions, loss_normalizer, policy_loss
from tests.test_objectives import _batch, _opts


def _raises(exc, message, fn, *args, **kw):
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert str(info.value) == message


def test_policy_loss_input_messages():
    logp, old, _, _, ent, adv, mask = _batch()
    logp, mask = logp[:, :4], mask[:, :4]  # B = 5, T = 4: a message that swaps B and T shows
    o = _opts()
    n = loss_normalizer(o, [mask])
    _raises(TypeError, "options must be an ObjectiveOptions, got int.", policy_loss, logp, mask, adv, 3, n)
    _raises(ValueError, "logp must be a floating [B, T] tensor, got <class 'list'> .",
            policy_loss, [[0.0]], mask, adv, o, n)
    _raises(ValueError, "logp must be a floating [B, T] tensor, got torch.Size([5, 4]) torch.int64.",
            policy_loss, logp.long(), mask, adv, o, n)
    _raises(ValueError, "mask must have the shape of logp [5, 4], got [].", policy_loss, logp, [1], adv, o, n)
    _raises(ValueError, "mask must have the shape of logp [5, 4], got [5, 3].", policy_loss, logp, mask[:, :3], adv,
            o, n)
    _raises(ValueError, "advantages must have shape [B] = [5] (one value per sequence) or the shape of logp [5, 4] "
                        "(one per token, e.g. per turn of an episode), got list.",
            policy_loss, logp, mask, [1.0] * 5, o, n)
    _raises(ValueError, "old_logp must have the shape of logp [5, 4], got list.",
            policy_loss, logp, mask, adv, o, n, old_logp=[0.0])
    _raises(ValueError, "truncated must be a [B] = [5] bool tensor, got list.",
            policy_loss, logp, mask, adv, o, n, truncated=[False] * 5)
    _raises(ValueError, "truncated must be a [B] = [5] bool tensor, got [4].",
            policy_loss, logp, mask, adv, o, n, truncated=torch.zeros(4, dtype=torch.bool))
    _raises(ValueError, "normalizer must be a scalar, got shape [2].", policy_loss, logp, mask, adv, o,
            torch.ones(2))
    _raises(ValueError, "entropy_coef must be a finite number >= 0, got -0.1.",
            policy_loss, logp, mask, adv, o, n, entropy=ent[:, :4], entropy_coef=-0.1)
    with pytest.raises(ValueError, match="entropy_coef must be a finite number >= 0, got inf"):
        policy_loss(logp, mask, adv, o, n, entropy=ent[:, :4], entropy_coef=float("inf"))
    for bad in (True, "3"):  # a bool is not a count; a string is not a number
        _raises(ValueError, f"normalizer must be a finite number >= 0 (from loss_normalizer, summed over ranks), "
                f"got {bad!r}.", policy_loss, logp, mask, adv, o, bad)


@pytest.mark.parametrize("kw,name,why", [
    ({"beta": 0.5}, "ref_logp", "options.beta=0.5 adds a KL term to the reference policy"),
    ({"sampler_is_mode": "token_mask"}, "sampler_logp",
     "options.sampler_is_mode='token_mask' corrects for the rollout engine's distribution"),
    ({"top_entropy_quantile": 0.5}, "entropy", "options.top_entropy_quantile=0.5 masks low-entropy tokens"),
    ({"entropy_coef": 0.25}, "entropy", "entropy_coef=0.25 adds an entropy bonus"),
    ({"mask_truncated_completions": True}, "truncated", "options.mask_truncated_completions=True"),
])
def test_missing_input_messages(kw, name, why):
    logp, _, _, _, _, adv, mask = _batch()
    shape = "[B] bool" if name == "truncated" else "[B, T]"
    _raises(ValueError, f"{why}, so it needs {name}= ({shape}); pass it or turn the option off.",
            policy_loss, logp, mask, adv, _opts(**kw), 10.0)


def test_dr_grpo_accepts_completions_of_exactly_max_completion_length():
    logp, _, _, _, _, adv, mask = _batch()  # T = 6
    o = _opts(loss_type="dr_grpo", max_completion_length=6)
    out = policy_loss(logp, mask, adv, o, loss_normalizer(o, [mask]))
    torch.testing.assert_close(out.loss, (-adv[:, None] * mask).sum() / (5 * 6))


def test_option_choice_and_number_messages():
    names = "'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'"
    _raises(ValueError, f"loss_type='ppo' is not valid; choose one of {names}.", ObjectiveOptions, loss_type="ppo")
    _raises(ValueError, f"loss_type=None is not valid; choose one of {names}.", ObjectiveOptions, loss_type=None)
    modes = "'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask', 'auto'"
    _raises(ValueError, f"sampler_is_mode='x' is not valid; choose one of {modes} or None.",
            ObjectiveOptions, sampler_is_mode="x")
    _raises(ValueError, "max_log_ratio=0.0 must be > 0.0.", ObjectiveOptions, max_log_ratio=0.0)
    _raises(ValueError, "beta=-1 must be >= 0.0.", ObjectiveOptions, beta=-1)
    _raises(ValueError, "epsilon_low=1.5 must be <= 1.0.", ObjectiveOptions, epsilon_low=1.5)
    for bad in (True, "0.1", float("nan")):
        _raises(TypeError, f"beta must be a finite number, got {bad!r}.", ObjectiveOptions, beta=bad)


@pytest.mark.parametrize("kw,exc,message", [
    ({"loss_type": "cispo"}, ValueError,
     "loss_type='cispo' caps the IS weight at epsilon_high itself (TRL/Liger semantics; ScaleRL uses 5.0), so "
     "epsilon_high=0.2 would scale every token down. Set epsilon_high >= 1 (open-instruct's cap 1+ε corresponds "
     "to epsilon_high=1.272)."),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, ValueError,
     "importance_sampling_level='sequence' is not supported with loss_type='sapo': sapo weights each token by its "
     "own ratio (Liger raises here; TRL only warns). Use importance_sampling_level='token'."),
    ({"loss_type": "luspo"}, ValueError,
     "loss_type='luspo' scales each sequence's loss by its length; at importance_sampling_level='token' TRL/Liger "
     "then average over all B×T positions including padding, so the loss depends on padding values. Use "
     "importance_sampling_level='sequence' (the LUSPO paper) or loss_type='dr_grpo'."),
    ({"loss_type": "cispo", "epsilon_high": 5.0, "delta": 3.0}, ValueError,
     "delta=3.0 only applies to the clipped-ratio loss types ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'luspo'); "
     "loss_type='cispo' has no unclipped ratio term. Set delta=None."),
    ({"delta": "x"}, TypeError, "delta must be a finite number, got 'x'."),
    ({"delta": 1.1}, ValueError,
     "delta=1.1 must be > 1 + epsilon_high = 1.2: a smaller delta is the same as epsilon_high = delta - 1; set that "
     "instead."),
    ({"loss_type": "dr_grpo"}, ValueError,
     "loss_type='dr_grpo' divides by num_sequences × max_completion_length; set max_completion_length (the "
     "generation limit, e.g. 1024)."),
    ({"max_completion_length": True}, ValueError, "max_completion_length must be a positive int, got True."),
    ({"max_completion_length": 0}, ValueError, "max_completion_length must be a positive int, got 0."),
    ({"use_bias_correction_kl": True}, ValueError,
     "use_bias_correction_kl=True has no effect with beta=0 (no KL term); set beta > 0 or "
     "use_bias_correction_kl=False."),
    ({"sampler_is_sequence_reduction": "product"}, ValueError,
     "sampler_is_sequence_reduction is set but sampler_is_mode='auto' (IS correction off, or token-level where auto "
     "turns it on); set sampler_is_mode to a sequence_* mode or leave the reduction None."),
    ({"sampler_is_mode": "token_mask", "sampler_is_clip_max": None}, ValueError,
     "sampler_is_mode='token_mask' needs sampler_is_clip_min and/or sampler_is_clip_max (TRL default "
     "clip_max=3.0)."),
    ({"sampler_is_mode": "token_mask", "sampler_is_clip_min": 2.0, "sampler_is_clip_max": 2.0}, ValueError,
     "sampler_is_clip_min=2.0 must be < sampler_is_clip_max=2.0."),
    ({"sampler_is_mode": "token_mask", "sampler_is_clip_min": 2.5, "sampler_is_clip_max": 2.0}, ValueError,
     "sampler_is_clip_min=2.5 must be < sampler_is_clip_max=2.0."),
    ({"sampler_is_mode": "sequence_mask"}, ValueError,
     "sampler_is_mode='sequence_mask' needs sampler_is_sequence_reduction: 'product' (exp of the summed "
     "log-ratios: TRL, verl) or 'geometric_mean' (exp of their mean: open-instruct, OpenRLHF)."),
    ({"loss_type": "vespo", "sampler_is_mode": "sequence_mask", "sampler_is_sequence_reduction": "product"},
     ValueError, "loss_type='vespo' folds a per-token IS ratio into its sequence weight (as TRL); use "
     "sampler_is_mode='token_truncate' or 'token_mask'."),
    ({"sampler_is_mode": "token_mask", "sampler_is_sequence_reduction": "product"}, ValueError,
     "sampler_is_sequence_reduction only applies to sequence_* modes, not 'token_mask'; set it to None."),
])
def test_option_messages(kw, exc, message):
    _raises(exc, message, ObjectiveOptions, **kw)


def test_edge_options_that_are_valid():
    ObjectiveOptions(max_completion_length=1)
    ObjectiveOptions(sampler_is_mode="token_mask", sampler_is_clip_min=1.9, sampler_is_clip_max=2.0)


def test_loss_normalizer_messages():
    m = torch.ones(2, 3)
    _raises(ValueError, "options.mask_truncated_completions=True: pass truncated= (one [B] bool tensor per "
            "micro-batch) so truncated rows are left out of the token count, as in policy_loss.",
            loss_normalizer, ObjectiveOptions(mask_truncated_completions=True), [m])
    _raises(ValueError, "truncated has 0 entries but masks has 1; pass one per micro-batch.",
            loss_normalizer, ObjectiveOptions(), [m], truncated=[])


def test_a_tensor_normalizer_of_one_divides_by_one():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.tensor([[1.0, 0.0]])
    adv = torch.tensor([2.0])
    for n in (1.0, torch.tensor(1.0), torch.tensor([1.5])):
        out = policy_loss(logp, mask, adv, ObjectiveOptions(), n)
        assert out.loss.item() == pytest.approx(-2.0 / float(n))


def test_on_policy_hint_with_a_zero_entropy_coef_overriding_the_options():
    from logitless.objectives import on_policy_logp_grad

    logp, _, _, _, _, adv, mask = _batch()
    o = _opts(entropy_coef=0.1)
    n = loss_normalizer(o, [mask])
    hint = on_policy_logp_grad(mask, adv, o, n, entropy_coef=0.0)  # e.g. the adaptive coefficient at 0
    torch.testing.assert_close(hint, (-adv[:, None] * mask / n).float())
    assert on_policy_logp_grad(mask, adv, o, n) is None  # the options' own coefficient needs the entropy
