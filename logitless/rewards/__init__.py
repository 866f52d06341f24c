"""Reward functions `(prompts, completions, **row_fields) -> list[float | None]` and batch scoring."""

from logitless.rewards.builtin import (
    REWARDS,
    completion_text,
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
from logitless.rewards.sandbox import ExecResult, SandboxOptions, SandboxPool, SandboxResult
from logitless.rewards.scoring import RewardFunctionError, RewardScores, add_reward_column, score_completions

__all__ = [
    "REWARDS",
    "ExecResult",
    "RewardFunctionError",
    "RewardScores",
    "SandboxOptions",
    "SandboxPool",
    "SandboxResult",
    "add_reward_column",
    "code_tests",
    "completion_text",
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
