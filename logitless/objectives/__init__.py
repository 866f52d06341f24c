"""GRPO-family objectives over [B, T] tensors and group-relative advantages. Pure torch: no kernels, models,
logging, I/O or collectives (the trainer all-reduces the counts and metrics these functions return)."""

from logitless.objectives.advantages import AdvantageOutput, compute_advantages
from logitless.objectives.credit import TurnAdvantageOutput, token_advantages, token_turns, turn_advantages
from logitless.objectives.entropy import (
    EntropyCoef,
    controlled_entropy,
    entropy_bonus_normalizer,
    entropy_quantile_threshold,
    initial_entropy_coef,
    update_entropy_coef,
)
from logitless.objectives.kl import kl_estimate
from logitless.objectives.loss import LOGP_FLOOR, ObjectiveOutput, loss_normalizer, on_policy_logp_grad, policy_loss
from logitless.objectives.metrics import Stat, merge_metrics, pack_metrics, summarize, unpack_metrics
from logitless.objectives.options import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    CREDITS,
    ENTROPY_BONUS_REDUCTIONS,
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    MULTI_REWARD_MODES,
    SAMPLER_IS_MODES,
    TURN_BASELINES,
    AdvantageOptions,
    ObjectiveOptions,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "CREDITS",
    "ENTROPY_BONUS_REDUCTIONS",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LOGP_FLOOR",
    "LOSS_TYPES",
    "MULTI_REWARD_MODES",
    "SAMPLER_IS_MODES",
    "TURN_BASELINES",
    "AdvantageOptions",
    "AdvantageOutput",
    "EntropyCoef",
    "ObjectiveOptions",
    "ObjectiveOutput",
    "Stat",
    "TurnAdvantageOutput",
    "compute_advantages",
    "controlled_entropy",
    "entropy_bonus_normalizer",
    "entropy_quantile_threshold",
    "initial_entropy_coef",
    "kl_estimate",
    "loss_normalizer",
    "merge_metrics",
    "on_policy_logp_grad",
    "pack_metrics",
    "policy_loss",
    "summarize",
    "token_advantages",
    "token_turns",
    "turn_advantages",
    "unpack_metrics",
    "update_entropy_coef",
]
