"""Every bound of ObjectiveOptions / AdvantageOptions at its edge: the value just outside is refused with an
error naming the field, the edge itself is accepted (pins each `<` vs `<=` and each field name)."""

from __future__ import annotations

import re

import pytest

from logitless.objectives import AdvantageOptions, ObjectiveOptions

ADAPTIVE = {"use_adaptive_entropy": True}
SEQ_IS = {"sampler_is_mode": "sequence_truncate", "sampler_is_clip_max": 2.0}

def named(field: str) -> str:
    """A pattern matching `field` as a whole name in an error message."""
    return rf"(?<![\w]){re.escape(field)}(?![\w])"


# (field, refused value, accepted edge value, other fields)
BOUNDS = [
    ("epsilon_low", -0.01, 0.0, {}),
    ("epsilon_low", 1.01, 1.0, {}),
    ("epsilon_high", -0.01, 0.0, {}),
    ("epsilon_high", 0.99, 1.0, {"loss_type": "cispo"}),  # cispo caps the weight at epsilon_high itself
    ("beta", -0.01, 0.0, {}),
    ("max_log_ratio", 0.0, 1e-9, {}),
    ("sapo_temperature_pos", 0.0, 1e-9, {}),
    ("sapo_temperature_neg", 0.0, 1e-9, {}),
    ("vespo_lambda_pos", 0.0, 1e-9, {}),
    ("vespo_lambda_neg", 0.0, 1e-9, {}),
    ("vespo_k_pos", float("nan"), -5.0, {}),
    ("vespo_k_neg", float("inf"), -5.0, {}),
    ("dual_clip", 1.0, 1.0001, {}),
    ("delta", 1.28, 1.2801, {"epsilon_high": 0.28}),
    ("off_policy_mask_threshold", -0.01, 0.0, {}),
    ("top_entropy_quantile", 0.0, 1e-9, {}),
    ("top_entropy_quantile", 1.01, 1.0, {}),
    ("entropy_coef", -0.01, 0.0, {}),
    ("entropy_coef_min", -0.01, 0.0, ADAPTIVE),
    ("entropy_coef_max", 0.09, 0.1, {**ADAPTIVE, "entropy_coef_min": 0.1}),
    ("entropy_coef_delta", -0.01, 0.0, ADAPTIVE),
    ("entropy_target", -0.01, 0.0, ADAPTIVE),
    ("sampler_is_clip_min", -0.01, 0.0, {"sampler_is_mode": "token_truncate", "sampler_is_clip_max": 2.0}),
    ("sampler_is_clip_max", 0.0, 1e-9, {"sampler_is_mode": "token_truncate"}),
    ("sampler_is_sequence_reduction", "median", "geometric_mean", SEQ_IS),
    ("importance_sampling_level", "tokens", "sequence", {}),
    ("kl_estimator", "k4", "low_var_kl", {}),
]


@pytest.mark.parametrize("field,bad,edge,other", BOUNDS, ids=[f"{b[0]}={b[1]}" for b in BOUNDS])
def test_objective_option_bounds(field, bad, edge, other):
    ObjectiveOptions(**other, **{field: edge})
    with pytest.raises((ValueError, TypeError), match=named(field)):
        ObjectiveOptions(**other, **{field: bad})


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_per_token_weighted_losses_refuse_sequence_level(loss_type):
    extra = {"epsilon_high": 1.0} if loss_type == "cispo" else {}
    ObjectiveOptions(loss_type=loss_type, importance_sampling_level="token", **extra)
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}'"):
        ObjectiveOptions(loss_type=loss_type, importance_sampling_level="sequence", **extra)


@pytest.mark.parametrize(
    "kw,field",
    [({"epsilon": -1e-9}, "epsilon"), ({"reward_weights": [1.0, float("nan")]}, "reward_weights[1]"),
     ({"estimator": "ppo"}, "estimator"), ({"scale": "global"}, "scale"), ({"multi_reward": "max"}, "multi_reward")],
)
def test_advantage_option_bounds(kw, field):
    AdvantageOptions(epsilon=0.0, reward_weights=[1.0, -2.0])  # the edges
    with pytest.raises((ValueError, TypeError), match=named(field)):
        AdvantageOptions(**kw)
