"""Answer extraction with several answers in one completion: the last answer wins, for every extractor
(`####`, `\\boxed{}`, last number, math-verify, GSM8K reference solutions); `####` beats `\\boxed{}`, which beats a
bare number, wherever they stand."""

from __future__ import annotations

from decimal import Decimal

import pytest

from logitless.data.tasks import gsm8k_answer
from logitless.rewards.builtin import extract_numeric_answer, math_verify, numeric_answer


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("#### 3\n#### 5", "5"),  # '####' twice
        ("#### 3\nno wait\n#### -5.5 is it", "-5.5"),
        ("#### 1,000 then #### 2,500", "2500"),
        ("\\boxed{3} wait, no: \\boxed{5}", "5"),  # \boxed twice
        ("\\boxed{3}\\boxed{5}", "5"),
        ("\\boxed{\\text{3}} or rather \\boxed{\\$5}", "5"),
        ("3 apples and 5 pears", "5"),  # last number
        ("it is 7, not 12. So 9", "9"),
        ("#### 5 then \\boxed{3} and 7", "5"),  # precedence: '####' anywhere beats \boxed and numbers
        ("\\boxed{3} then #### 5 then \\boxed{7}", "5"),
        ("\\boxed{5} and then 3", "5"),  # \boxed beats a later bare number
    ],
)
def test_numeric_extraction_last_answer_wins(completion, expected):
    assert extract_numeric_answer(completion) == Decimal(expected)


@pytest.mark.parametrize("completion", ["#### 3\n#### 5", "\\boxed{3} no \\boxed{5}", "first 3, finally 5"])
def test_numeric_answer_rewards_only_the_last_answer(completion):
    assert numeric_answer([""] * 2, [completion] * 2, answer=["5", "3"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{3} wait, no: \\boxed{5}",  # \boxed twice
        "\\boxed{\\frac{6}{2}} hmm, \\boxed{\\frac{10}{2}}",
        "First $3$, then finally $5$",  # two LaTeX answers
        "The answer is 3. Actually the answer is 5.",  # plain text
        "\\boxed{5} and then $3$",  # \boxed beats a later LaTeX answer
    ],
)
def test_math_verify_rewards_only_the_last_answer(completion):
    assert math_verify([""] * 2, [completion] * 2, answer=["5", "3"]) == [1.0, 0.0]


def test_gsm8k_reference_answer_is_after_the_last_hashes():
    assert gsm8k_answer("She has 3 #### 4 apples.\nSo 1,234 in all.\n#### 1,234") == "1234"
