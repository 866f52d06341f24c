"""Reward functions `(prompts, completions, **row_fields) -> list[float | None]` and batch scoring."""

from logitless.rewards.builtin import (
    REWARDS,
    extract_numeric_answer,
    format_tags,
    get_reward_fn,
    length_target,
    math_verify,
    numeric_answer,
    parse_number,
    register_reward,
    reward_name,
    reward_row_fields,
)
from logitless.rewards.code import code_tests, extract_program
from logitless.rewards.sandbox import SandboxOptions, SandboxPool, SandboxResult
from logitless.rewards.scoring import RewardFunctionError, RewardScores, score_completions

__all__ = [
    "REWARDS",
    "RewardFunctionError",
    "RewardScores",
    "SandboxOptions",
    "SandboxPool",
    "SandboxResult",
    "code_tests",
    "extract_program",
    "extract_numeric_answer",
    "format_tags",
    "get_reward_fn",
    "length_target",
    "math_verify",
    "numeric_answer",
    "parse_number",
    "register_reward",
    "reward_name",
    "reward_row_fields",
    "score_completions",
]
