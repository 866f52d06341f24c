"""The trainer's entropy bonus: TRL 1.16's first step of the adaptive controller, and the trl reduction."""

from __future__ import annotations

import torch

from tests.test_trainer import _cfg, _lora, _train, rewards_module, tok  # noqa: F401 (fixtures)


def _weights_after_one_step(tmp_path, name, tok, *over):
    cfg = _cfg(tmp_path / name, "train.max_steps=1", "checkpoint.save_steps=1", *over)
    _train(cfg, tok)
    return _lora(tmp_path / name)


def test_adaptive_controller_applies_no_bonus_on_the_first_step(tmp_path, tok, rewards_module):
    base = _weights_after_one_step(tmp_path, "none", tok)
    adaptive = _weights_after_one_step(tmp_path, "adaptive", tok, "objective.use_adaptive_entropy=true",
                                       "objective.entropy_coef=0.5", "objective.entropy_target=100.0")
    fixed = _weights_after_one_step(tmp_path, "fixed", tok, "objective.entropy_coef=0.5")
    assert base.keys() == adaptive.keys() == fixed.keys()
    for k in base:  # no entropy measured yet: the first step is the plain policy-gradient step, as TRL 1.16
        torch.testing.assert_close(adaptive[k], base[k], rtol=0, atol=0)
    assert any(not torch.equal(fixed[k], base[k]) for k in base)  # a fixed bonus acts from the first step


def test_trl_reduction_trains(tmp_path, tok, rewards_module):
    """entropy_bonus_reduction=trl with uneven micro-batches (3, 3, 2 rows) and a top-entropy mask."""
    step_mean = _weights_after_one_step(tmp_path, "step_mean", tok, "objective.entropy_coef=0.5",
                                        "objective.top_entropy_quantile=0.5")
    trl = _weights_after_one_step(tmp_path, "trl", tok, "objective.entropy_coef=0.5",
                                  "objective.top_entropy_quantile=0.5", "objective.entropy_bonus_reduction=trl")
    assert any(not torch.equal(trl[k], step_mean[k]) for k in trl)  # per-micro-batch means differ here
