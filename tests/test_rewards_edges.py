"""Reward plumbing on the edges that mutation testing (docs/testing.md) found open: what each failing sample's
re-run receives, default weights and penalty, the per-sample values a reward may return, reserved field names,
number spellings, reward lookup and its hints."""

from __future__ import annotations

from decimal import Decimal

import pytest
import torch

from logitless.rewards import RewardFunctionError, score_completions
from logitless.rewards.builtin import REWARDS, get_reward_fn, numeric_answer, parse_number, reward_name


def test_failing_samples_are_rerun_alone_with_their_own_fields():
    calls = []

    def picky(prompts, completions, **fields):
        calls.append((list(prompts), list(completions), {k: list(v) for k, v in fields.items()}))
        if len(completions) > 1 or completions[0] == "bad":
            raise RuntimeError("no")
        return [float(fields["answer"][0])]

    rows = [{"answer": 1}, {"answer": 2}, {"answer": 3}]
    s = score_completions([picky], None, ["p0", "p1", "p2"], ["a", "bad", "c"], rows, on_error="penalty")
    assert calls[1:] == [(["p0"], ["a"], {"answer": [1]}), (["p1"], ["bad"], {"answer": [2]}),
                         (["p2"], ["c"], {"answer": [3]})]
    assert s.rewards[:, 0].tolist() == [1.0, 0.0, 3.0] and s.num_errors == [1]  # default penalty 0.0


def test_default_weights_sum_the_rewards_and_nan_is_skipped():
    def half(prompts, completions, **fields):
        return [0.5, None]

    s = score_completions(["numeric_answer", half], None, ["", ""], ["#### 2", "#### 3"], [{"answer": "2"}] * 2)
    assert s.total.tolist() == [1.5, 0.0] and s.num_none == [0, 1] and s.rewards.dtype == torch.float32
    assert s.names == ["numeric_answer", "half"]


@pytest.mark.parametrize(
    "value,ok",
    [(torch.tensor(0.25), 0.25), (torch.tensor([0.75]), 0.75), (True, 1.0), (3, 3.0)],
)
def test_reward_values_accepted(value, ok):
    s = score_completions([lambda p, c, **f: [value]], None, [""], [""], [{}])
    assert s.rewards.tolist() == [[ok]]


@pytest.mark.parametrize("value", [torch.tensor([0.1, 0.2]), "1.0", b"1", [1.0]])
def test_reward_values_refused(value):
    with pytest.raises(RewardFunctionError, match="for sample 0; expected a float or None"):
        score_completions([lambda p, c, **f: [value]], None, [""], [""], [{}])


@pytest.mark.parametrize("field", ["prompts", "completions"])
def test_reserved_row_field_names(field):
    with pytest.raises(ValueError, match=rf"may not be named \['{field}'\]"):
        score_completions(["numeric_answer"], None, [""], [""], [{field: 1, "answer": "1"}])


def test_long_completion_is_shortened_in_the_error():
    def boom(prompts, completions, **fields):
        raise KeyError("x")

    with pytest.raises(RewardFunctionError) as e:
        score_completions([boom], None, [""], ["y" * 300], [{}])
    assert f"(completion '{'y' * 200}...')" in str(e.value)
    with pytest.raises(RewardFunctionError) as e:
        score_completions([boom], None, [""], ["y" * 200], [{}])
    assert f"(completion '{'y' * 200}')" in str(e.value)


@pytest.mark.parametrize(
    "text,expected",
    [("1\\!000", "1000"), ("50%", "50"), ("1 000", "1000"), ("- 5", "-5"), ("3..", None), (".5", "0.5"),
     ("7.", "7"), ("$-2.50", "-2.50")],
)
def test_parse_number_spellings(text, expected):
    assert parse_number(text) == (None if expected is None else Decimal(expected))


def test_get_reward_fn_lookup_and_hints():
    def mine(prompts, completions, **fields):
        return [0.0] * len(completions)

    assert get_reward_fn(mine) is mine and reward_name(mine) == "mine"
    assert REWARDS["numeric_answer"] is numeric_answer and reward_name(numeric_answer) == "numeric_answer"
    assert reward_name(42) == "42"
    with pytest.raises(ValueError, match=r"unknown reward 'numeric_answr'; did you mean 'numeric_answer'\?"):
        get_reward_fn("numeric_answr")
    with pytest.raises(ValueError, match=r"unknown reward 'zzz' Built-ins"):
        get_reward_fn("zzz")
    with pytest.raises(ValueError, match=r"has no attribute 'JSONDecodr'; did you mean 'json:JSONDecoder'\?$"):
        get_reward_fn("json:JSONDecodr")
    with pytest.raises(ValueError, match=r"has no attribute 'decodr'$"):  # json.decoder is a module: no hint
        get_reward_fn("json:decodr")


def test_none_anywhere_and_every_failing_sample_counted():
    def first_none(prompts, completions, **fields):
        if len(completions) == 1 and completions[0].startswith("bad"):
            raise RuntimeError("no")
        if len(completions) > 1 and any(c.startswith("bad") for c in completions):
            raise RuntimeError("batch")
        return [None] + [1.0] * (len(completions) - 1)

    s = score_completions([first_none], None, [""] * 3, ["x", "y", "z"], [{}] * 3)
    assert s.rewards[:, 0].isnan().tolist() == [True, False, False] and s.num_none == [1]
    s = score_completions([first_none], None, [""] * 3, ["bad1", "y", "bad2"], [{}] * 3, on_error="penalty",
                          penalty=-1.0)
    assert s.num_errors == [2] and s.rewards[[0, 2], 0].tolist() == [-1.0, -1.0]


def test_bad_value_found_on_a_single_sample_names_the_function():
    def flaky(prompts, completions, **fields):
        if len(completions) > 1:
            raise RuntimeError("batch")
        return ["high"]

    with pytest.raises(RewardFunctionError, match=r"reward function 'flaky' returned str 'high' for sample 0"):
        score_completions([flaky], None, ["", ""], ["a", "b"], [{}, {}])


def test_no_reward_functions_score_an_empty_column_set_without_a_warning():
    """`reward_funcs: []` (an environment's reward alone): [B, 0] rewards and zero totals, no torch deprecation
    warning at every step (a 1-D tensor's `.T`)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = score_completions([], None, ["p", "q", "r"], ["a", "b", "c"], [{}, {}, {}])
    assert scores.rewards.shape == (3, 0) and torch.equal(scores.total, torch.zeros(3))
