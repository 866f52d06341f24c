"""Options of the GRPO-family objective and of the advantage estimator, validated on construction.

Names follow TRL's `GRPOConfig` where TRL has the option (`loss_type`, `importance_sampling_level`, `beta`,
`delta`, `use_bias_correction_kl`, `off_policy_mask_threshold`, `top_entropy_quantile`, `entropy_coef`, ...);
`epsilon_low` is TRL's `epsilon`, and the rollout ("sampler") IS options are TRL's `vllm_importance_sampling_*`.
See docs/objectives.md for the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # ℓ = -min(r·A, clip(r)·A)
IS_LEVELS = ("token", "sequence", "sequence_token")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SEQUENCE_IS_REDUCTIONS = ("product", "geometric_mean")
ENTROPY_BONUS_REDUCTIONS = ("step_mean", "trl")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
ADVANTAGE_SCALES = ("group", "batch", "none")
MULTI_REWARD_MODES = ("sum_then_normalize", "normalize_then_sum")
CREDITS = ("episode", "turn")  # one advantage per episode | per model turn of a multi-turn episode
TURN_BASELINES = ("turn", "episode")  # turn credit: group statistics at the same turn index | of the episode returns

# What the caller-given normalizer counts, per loss type (see `loss_normalizer`).
NORMALIZER_KIND = {
    "grpo": "sequences",  # Σ_i mean_t(ℓ_it) / #sequences
    "sapo": "sequences",
    "luspo": "sequences",  # Σ_i |o_i|·ℓ_i / #sequences
    "bnpo": "tokens",  # Σ ℓ·m / #tokens   (TRL: tokens of the micro-batch; here: of the step)
    "dapo": "tokens",
    "cispo": "tokens",
    "vespo": "tokens",
    "dr_grpo": "constant",  # Σ ℓ·m / (#sequences · max_completion_length)
}


def _choice(field: str, value, valid: tuple, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in valid:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{field}={value!r} is not valid; choose one of {', '.join(map(repr, valid))}{extra}.")


def _number(field: str, value, *, low: float | None = None, high: float | None = None, strict_low=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{field} must be a finite number, got {value!r}.")
    if low is not None and (value < low or (strict_low and value == low)):
        raise ValueError(f"{field}={value!r} must be {'>' if strict_low else '>='} {low}.")
    if high is not None and value > high:
        raise ValueError(f"{field}={value!r} must be <= {high}.")


@dataclass
class ObjectiveOptions:
    """Every knob of the per-token GRPO-family objective. Defaults match TRL's `GRPOConfig` except that
    rollout IS correction is off by default (TRL: on, `sequence_mask`, clip_max 3.0): `sampler_is_mode="auto"` is
    off here, and a training run decides it (token_truncate with FP8 rollouts, `rollout.fp8`; off otherwise)."""

    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo (docs/objectives.md)
    importance_sampling_level: str = "token"  # token | sequence (GSPO) | sequence_token (GSPO-token)
    epsilon_low: float = 0.2  # TRL `epsilon`; lower clip 1 - epsilon_low
    epsilon_high: float = 0.2  # upper clip 1 + epsilon_high; for cispo the raw IS-weight cap (e.g. 5.0)
    delta: float | None = None  # INTELLECT-2 upper clamp of the unclipped ratio (PPO-clip types)
    dual_clip: float | None = None  # dual-clip constant c > 1 (verl clip_ratio_c): ℓ <= -c·A when A < 0
    max_completion_length: int | None = None  # required by dr_grpo (the constant normalizer)
    sapo_temperature_pos: float = 1.0  # sapo: gate temperature τ of tokens with A > 0
    sapo_temperature_neg: float = 1.05  # sapo: τ of tokens with A < 0
    vespo_k_pos: float = 2.0  # vespo: k of the weight e^{λ + k·log W - λ·W} for A > 0
    vespo_lambda_pos: float = 3.0  # vespo: λ for A > 0
    vespo_k_neg: float = 3.0  # vespo: k for A < 0
    vespo_lambda_neg: float = 2.0  # vespo: λ for A < 0
    # KL to the reference policy
    beta: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10], verl)
    use_bias_correction_kl: bool = False  # kl *= unclipped IS ratio (DeepSeek-V3.2)
    # Rollout-engine (sampler) importance-sampling correction: ρ = π_old / π_sampler. token_truncate | token_mask |
    # sequence_truncate | sequence_mask, None (off), or auto: token_truncate with rollout.fp8=true (the sampler is the
    # FP8 model), off otherwise; the objective itself reads auto as off (a run decides it: resolved.json)
    sampler_is_mode: str | None = "auto"
    sampler_is_clip_min: float | None = None  # lower bound of ρ (truncate: clamp; mask: ρ = 0 below it)
    sampler_is_clip_max: float | None = 3.0  # upper bound of ρ (truncate: clamp; mask: ρ = 0 above it)
    sampler_is_sequence_reduction: str | None = None  # product (TRL, verl) | geometric_mean (open-instruct)
    # Token / sequence masks and entropy terms
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2 off-policy sequence mask δ
    top_entropy_quantile: float = 1.0  # keep tokens whose entropy is in the top ρ fraction
    entropy_coef: float = 0.0  # loss -= coef · mean entropy of the tokens the policy term keeps
    # step_mean: Σ H over those tokens / their count over the step (exact under any split);
    # trl: TRL 1.16, the mean of per-micro-batch token means (see `entropy_bonus_normalizer`)
    entropy_bonus_reduction: str = "step_mean"
    use_adaptive_entropy: bool = False  # see `update_entropy_coef`
    entropy_coef_min: float = 0.0  # adaptive entropy: the coefficient stays within [min, max]
    entropy_coef_max: float = 1.0  # (see entropy_coef_min)
    entropy_coef_delta: float = 0.005  # adaptive entropy: change of the coefficient per optimizer step
    entropy_target: float = 0.2  # adaptive entropy: the coefficient grows while the step's mean entropy is at most this
    mask_truncated_completions: bool = False  # rows with truncated=True leave the loss (and the normalizer)
    max_log_ratio: float = 20.0  # |log ratio| clamp before exp (policy ratio, IS ratio, k3); verl uses 20

    def __post_init__(self) -> None:
        _choice("loss_type", self.loss_type, LOSS_TYPES)
        _choice("importance_sampling_level", self.importance_sampling_level, IS_LEVELS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("entropy_bonus_reduction", self.entropy_bonus_reduction, ENTROPY_BONUS_REDUCTIONS)
        _choice("sampler_is_mode", self.sampler_is_mode, (*SAMPLER_IS_MODES, "auto"), allow_none=True)
        _choice("sampler_is_sequence_reduction", self.sampler_is_sequence_reduction, SEQUENCE_IS_REDUCTIONS, True)
        lt, level = self.loss_type, self.importance_sampling_level
        _number("epsilon_low", self.epsilon_low, low=0.0, high=1.0)
        _number("epsilon_high", self.epsilon_high, low=0.0)
        _number("beta", self.beta, low=0.0)
        _number("max_log_ratio", self.max_log_ratio, low=0.0, strict_low=True)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            _number(name, getattr(self, name), low=0.0, strict_low=True)
        _number("vespo_k_pos", self.vespo_k_pos)
        _number("vespo_k_neg", self.vespo_k_neg)

        if lt == "cispo" and self.epsilon_high < 1.0:
            raise ValueError(
                f"loss_type='cispo' caps the IS weight at epsilon_high itself (TRL/Liger semantics; ScaleRL uses "
                f"5.0), so epsilon_high={self.epsilon_high} would scale every token down. Set epsilon_high >= 1 "
                "(open-instruct's cap 1+ε corresponds to epsilon_high=1.272)."
            )
        if lt in ("cispo", "sapo", "vespo") and level != "token":
            raise ValueError(
                f"importance_sampling_level={level!r} is not supported with loss_type={lt!r}: {lt} weights each "
                "token by its own ratio (Liger raises here; TRL only warns). Use importance_sampling_level='token'."
            )
        if lt == "luspo" and level == "token":
            raise ValueError(
                "loss_type='luspo' scales each sequence's loss by its length; at importance_sampling_level='token' "
                "TRL/Liger then average over all B×T positions including padding, so the loss depends on padding "
                "values. Use importance_sampling_level='sequence' (the LUSPO paper) or loss_type='dr_grpo'."
            )
        if self.delta is not None:
            if lt not in PPO_CLIP_LOSS_TYPES:
                raise ValueError(f"delta={self.delta} only applies to the clipped-ratio loss types "
                                 f"{PPO_CLIP_LOSS_TYPES}; loss_type={lt!r} has no unclipped ratio term. "
                                 "Set delta=None.")
            _number("delta", self.delta)
            if self.delta <= 1.0 + self.epsilon_high:
                raise ValueError(
                    f"delta={self.delta} must be > 1 + epsilon_high = {1 + self.epsilon_high}: a smaller delta is "
                    "the same as epsilon_high = delta - 1; set that instead."
                )
        if self.dual_clip is not None:
            if lt not in PPO_CLIP_LOSS_TYPES:
                raise ValueError(f"dual_clip only applies to the clipped-ratio loss types {PPO_CLIP_LOSS_TYPES}, "
                                 f"not loss_type={lt!r}. Set dual_clip=None.")
            _number("dual_clip", self.dual_clip, low=1.0, strict_low=True)
        if lt == "dr_grpo":
            if self.max_completion_length is None:
                raise ValueError("loss_type='dr_grpo' divides by num_sequences × max_completion_length; set "
                                 "max_completion_length (the generation limit, e.g. 1024).")
        if self.max_completion_length is not None:
            if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int) \
                    or self.max_completion_length <= 0:
                raise ValueError(f"max_completion_length must be a positive int, got {self.max_completion_length!r}.")
        if self.use_bias_correction_kl and self.beta == 0.0:
            raise ValueError("use_bias_correction_kl=True has no effect with beta=0 (no KL term); set beta > 0 "
                             "or use_bias_correction_kl=False.")

        mode = self.sampler_is
        if mode is None:
            if self.sampler_is_sequence_reduction is not None:
                raise ValueError(f"sampler_is_sequence_reduction is set but sampler_is_mode={self.sampler_is_mode!r} "
                                 "(IS correction off, or token-level where auto turns it on); set sampler_is_mode to a "
                                 "sequence_* mode or leave the reduction None.")
        else:
            lo, hi = self.sampler_is_clip_min, self.sampler_is_clip_max
            if lo is not None:
                _number("sampler_is_clip_min", lo, low=0.0)
            if hi is not None:
                _number("sampler_is_clip_max", hi, low=0.0, strict_low=True)
            if lo is None and hi is None:
                raise ValueError(f"sampler_is_mode={mode!r} needs sampler_is_clip_min and/or sampler_is_clip_max "
                                 "(TRL default clip_max=3.0).")
            if lo is not None and hi is not None and lo >= hi:
                raise ValueError(f"sampler_is_clip_min={lo} must be < sampler_is_clip_max={hi}.")
            if mode.startswith("sequence"):
                if self.sampler_is_sequence_reduction is None:
                    raise ValueError(
                        f"sampler_is_mode={mode!r} needs sampler_is_sequence_reduction: 'product' (exp of the summed "
                        "log-ratios: TRL, verl) or 'geometric_mean' (exp of their mean: open-instruct, OpenRLHF)."
                    )
                if lt == "vespo":
                    raise ValueError("loss_type='vespo' folds a per-token IS ratio into its sequence weight (as "
                                     "TRL); use sampler_is_mode='token_truncate' or 'token_mask'.")
            elif self.sampler_is_sequence_reduction is not None:
                raise ValueError(f"sampler_is_sequence_reduction only applies to sequence_* modes, not {mode!r}; "
                                 "set it to None.")

        if self.off_policy_mask_threshold is not None:
            _number("off_policy_mask_threshold", self.off_policy_mask_threshold, low=0.0)
        _number("top_entropy_quantile", self.top_entropy_quantile, low=0.0, high=1.0, strict_low=True)
        _number("entropy_coef", self.entropy_coef, low=0.0)
        if self.use_adaptive_entropy:
            _number("entropy_coef_min", self.entropy_coef_min, low=0.0)
            _number("entropy_coef_max", self.entropy_coef_max, low=self.entropy_coef_min)
            _number("entropy_coef_delta", self.entropy_coef_delta, low=0.0)
            _number("entropy_target", self.entropy_target, low=0.0)

    @property
    def sampler_is(self) -> str | None:
        """The rollout IS correction in force: `sampler_is_mode`, None when off (None, or "auto" left undecided)."""
        return None if self.sampler_is_mode == "auto" else self.sampler_is_mode

    @property
    def normalizer_kind(self) -> str:
        """'tokens', 'sequences' or 'constant': what `loss_normalizer` counts for this loss type."""
        return NORMALIZER_KIND[self.loss_type]


@dataclass
class AdvantageOptions:
    """Group-relative advantages from per-function rewards (TRL `GRPOConfig` names in comments)."""

    estimator: str = "grpo"  # grpo: R - group mean | rloo: R - mean of the other group members
    scale: str = "group"  # TRL scale_rewards: divide by the group std, the batch std, or nothing
    multi_reward: str = "sum_then_normalize"  # TRL multi_objective_aggregation; normalize_then_sum = GDPO
    reward_weights: tuple[float, ...] | None = None  # one per reward function; None = all 1.0
    epsilon: float = 1e-4  # added to the std before dividing (TRL)
    # episode: every model token of an episode gets the episode's advantage; turn: each model turn of a multi-turn
    # episode gets its own, from the discounted return-to-go of the per-turn rewards (needs an agent; docs/agents.md)
    credit: str = "episode"
    turn_discount: float = 1.0  # credit=turn: gamma of the return-to-go sum_{t'>=t} gamma^(t'-t) r_t', in [0, 1]
    # credit=turn: turn = mean/std over the group's episodes that reached the same turn index (MT-GRPO); episode =
    # mean/std of the group's episode returns (the return-to-go of turn 0)
    turn_baseline: str = "turn"

    def __post_init__(self) -> None:
        _choice("estimator", self.estimator, ADVANTAGE_ESTIMATORS)
        _choice("scale", self.scale, ADVANTAGE_SCALES)
        _choice("multi_reward", self.multi_reward, MULTI_REWARD_MODES)
        _choice("credit", self.credit, CREDITS)
        _choice("turn_baseline", self.turn_baseline, TURN_BASELINES)
        _number("epsilon", self.epsilon, low=0.0)
        _number("turn_discount", self.turn_discount, low=0.0, high=1.0)
        if self.credit == "episode" and (self.turn_discount != 1.0 or self.turn_baseline != "turn"):
            key = "turn_discount" if self.turn_discount != 1.0 else "turn_baseline"
            raise ValueError(f"{key}={getattr(self, key)!r} only applies to credit='turn' (an advantage per model "
                             f"turn); with credit='episode' every turn gets the episode's advantage. Set "
                             f"credit='turn', or leave {key} at its default.")
        if self.credit == "turn" and self.multi_reward == "normalize_then_sum":
            raise ValueError("credit='turn' sums the weighted rewards into per-turn returns before normalizing; "
                             "multi_reward='normalize_then_sum' (GDPO) z-scores each reward function per episode, "
                             "which has no per-turn form. Use multi_reward='sum_then_normalize'.")
        if self.reward_weights is not None:
            self.reward_weights = tuple(self.reward_weights)
            for i, w in enumerate(self.reward_weights):
                _number(f"reward_weights[{i}]", w)
        if self.multi_reward == "normalize_then_sum":
            if self.scale != "group":
                raise ValueError(
                    f"multi_reward='normalize_then_sum' (GDPO) always z-scores each reward within its group and "
                    f"the weighted sum over the batch; scale={self.scale!r} only applies to sum_then_normalize. "
                    "Leave scale='group'."
                )
            if self.estimator != "grpo":
                raise ValueError("multi_reward='normalize_then_sum' z-scores each reward by its group mean; a "
                                 "leave-one-out (rloo) baseline is not defined there. Use estimator='grpo'.")
