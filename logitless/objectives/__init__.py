"""GRPO-family objectives over [B, T] tensors and group-relative advantages. Pure torch: no kernels, models,
logging, I/O or collectives (the trainer all-reduces the counts and metrics these functions return)."""

from logitless.objectives.advantages import AdvantageOutput, compute_advantages
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
    ENTROPY_BONUS_REDUCTIONS,
    IS_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    MULTI_REWARD_MODES,
    SAMPLER_IS_MODES,
    AdvantageOptions,
    ObjectiveOptions,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "ENTROPY_BONUS_REDUCTIONS",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LOGP_FLOOR",
    "LOSS_TYPES",
    "MULTI_REWARD_MODES",
    "SAMPLER_IS_MODES",
    "AdvantageOptions",
    "AdvantageOutput",
    "EntropyCoef",
    "ObjectiveOptions",
    "ObjectiveOutput",
    "Stat",
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
    "unpack_metrics",
    "update_entropy_coef",
]
