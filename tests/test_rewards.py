from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch

from logitless.data import PromptRow, load_task
from logitless.rewards import (
    REWARDS,
    RewardFunctionError,
    extract_numeric_answer,
    format_tags,
    get_reward_fn,
    length_target,
    math_verify,
    numeric_answer,
    score_completions,
)


def test_numeric_answer_on_real_gsm8k_reference_solutions(gsm8k_test_rows):
    recs = [json.loads(line) for line in gsm8k_test_rows.read_text().splitlines()]
    rows = load_task("gsm8k", "test", path=str(gsm8k_test_rows), limit=50)
    solutions = [r["answer"] for r in recs]
    answers = [r.fields["answer"] for r in rows]
    assert numeric_answer([""] * 50, solutions, answer=answers) == [1.0] * 50
    # each solution scored against the next row's (different) answer is wrong
    shifted = answers[1:] + answers[:1]
    differs = [float(a) != float(b) for a, b in zip(answers, shifted)]
    assert sum(differs) >= 40
    scores = numeric_answer([""] * 50, solutions, answer=shifted)
    assert [s == 0.0 for s in scores] == differs


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("so she makes 9*2=18 dollars.\n#### 1,234", "1234"),
        ("#### $18.", "18"),
        ("The answer is \\boxed{42}. Check: 6*7=42, and 3", "42"),
        ("\\boxed{\\$1,000.50}", "1000.50"),
        ("I think 3 apples and then 17.", "17"),
        ("the result is -12", "-12"),
        ("16-3-4 = 9", "9"),
        ("costs $.5 each", "0.5"),
        ("\\boxed{\\text{18}}", "18"),
        ("#### 50\\%", "50"),
        ("\\boxed{1\\,000}", "1000"),
        ("no number here", None),
        ("\\boxed{x+1}", None),
    ],
)
def test_extract_numeric_answer(completion, expected):
    got = extract_numeric_answer(completion)
    assert (got is None) if expected is None else (got is not None and float(got) == float(expected))


def test_numeric_answer_scores_and_none():
    comps = ["#### 18", "answer: 18.00", "19", "#### 7"]
    assert numeric_answer([""] * 4, comps, answer=["18", 18, "18", None]) == [1.0, 1.0, 0.0, None]
    with pytest.raises(ValueError, match="needs an 'answer' row field; got row fields \\['gold'\\]"):
        numeric_answer([""], ["1"], gold=["1"])
    with pytest.raises(ValueError, match="row answer 'x/2' is not a number"):
        numeric_answer([""], ["1"], answer=["x/2"])


def test_math_verify_equivalence():
    comps = ["so $\\frac{1}{2}$", "\\boxed{0.5}", "I get $3$", "\\boxed{2\\sqrt{2}}", "anything"]
    answers = ["0.5", "\\frac{1}{2}", "\\frac{1}{2}", "\\sqrt{8}", None]
    assert math_verify([""] * 5, comps, answer=answers) == [1.0, 1.0, 0.0, 1.0, None]


def test_format_tags_strict_and_loose():
    comps = [
        "<think>add them</think>\n<answer>5</answer>",
        "  <think>a</think><answer>5</answer>\n",
        "<answer>5</answer><think>a</think>",
        "Sure! <think>a</think> <answer>5</answer>",
        "<think>a</think>",
        "<think>a<think>b</think><answer>5</answer>",
    ]
    assert format_tags([""] * 6, comps) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert format_tags([""] * 6, comps, strict=False) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    fn = get_reward_fn("format_tags", tags=["reason"])
    assert fn([""] * 2, ["<reason>x</reason>", "<think>x</think>"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="tags must be a non-empty list"):
        format_tags([""], ["x"], tags="think")


def test_length_target_penalty():
    comps = ["a" * 10, "a" * 5, "a" * 15, "a" * 40, ""]
    assert length_target([""] * 5, comps, target=10) == [0.0, -0.5, -0.5, -1.0, -1.0]
    assert length_target([""] * 5, comps, target=10, only_longer=True) == [0.0, 0.0, -0.5, -1.0, 0.0]
    assert length_target([""], ["one two three four"], target=2, unit="words") == [-1.0]
    with pytest.raises(ValueError, match="target must be a positive int"):
        length_target([""], ["x"], target=0)


def test_get_reward_fn_specs(tmp_path, monkeypatch):
    assert set(REWARDS) >= {"numeric_answer", "math_verify", "format_tags", "length_target"}
    assert get_reward_fn("numeric_answer") is numeric_answer
    mod = types.ModuleType("my_rewards_mod")
    mod.always_one = lambda prompts, completions, **kw: [1.0] * len(completions)
    mod.not_a_fn = 3
    monkeypatch.setitem(sys.modules, "my_rewards_mod", mod)
    assert get_reward_fn("my_rewards_mod:always_one")([""], ["x"]) == [1.0]
    with pytest.raises(ValueError, match=r"no module 'no_such_module_xyz' in the current folder \(.*\), on PYTHONPATH"):
        get_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'always_on'; did you mean 'my_rewards_mod:always_one'"):
        get_reward_fn("my_rewards_mod:always_on")
    with pytest.raises(TypeError, match="'my_rewards_mod:not_a_fn' is a int, not a callable"):
        get_reward_fn("my_rewards_mod:not_a_fn")
    with pytest.raises(ValueError, match="unknown reward 'numeric_answr'; did you mean 'numeric_answer'"):
        get_reward_fn("numeric_answr")
    with pytest.raises(ValueError, match="has no option 'tag'; its options .* are \\['tags', 'strict'\\]"):
        get_reward_fn("format_tags", tag=["x"])
    assert get_reward_fn("length_target", target=5).__name__ == "length_target"


def rows_of(answers):
    return [PromptRow(prompt="q", fields={"answer": a}) for a in answers]


def test_score_completions_matrix_and_weighted_total():
    comps = ["<think>x</think><answer>4</answer>", "#### 5", "nothing"]
    s = score_completions(["numeric_answer", format_tags], [1.0, 0.5], ["q"] * 3, comps, rows_of(["4", "5", None]))
    expected = torch.tensor([[1.0, 1.0], [1.0, 0.0], [math.nan, 0.0]])
    assert s.rewards.shape == (3, 2) and s.rewards.dtype == torch.float32
    assert torch.equal(s.rewards.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(s.rewards), torch.nan_to_num(expected))
    assert torch.equal(s.total, torch.tensor([1.5, 1.0, 0.0]))
    assert s.names == ["numeric_answer", "format_tags"] and s.num_none == [1, 0] and s.num_errors == [0, 0]
    # rows may also be plain field dicts; fields missing in a row arrive as None
    s2 = score_completions([numeric_answer], None, ["q"] * 2, ["1", "2"], [{"answer": "1"}, {}])
    assert s2.rewards[0, 0] == 1.0 and s2.rewards[1, 0].isnan()


def flaky(prompts, completions, **kw):
    out = []
    for c in completions:
        if "boom" in c:
            raise ZeroDivisionError("division by zero")
        out.append(1.0)
    return out


def test_reward_raising_names_function_and_sample():
    comps = ["fine", "also fine", "boom here"]
    with pytest.raises(RewardFunctionError,
                       match=r"'flaky' raised ZeroDivisionError: division by zero on sample 2 \(completion 'boom here'\)"):
        score_completions([flaky], None, ["q"] * 3, comps, rows_of([None] * 3))
    s = score_completions([flaky], None, ["q"] * 3, comps, rows_of([None] * 3), on_error="penalty", penalty=-2.0)
    assert s.rewards[:, 0].tolist() == [1.0, 1.0, -2.0] and s.num_errors == [1]


def test_reward_broken_on_batch_only():
    def batch_bug(prompts, completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("shape mismatch")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="'batch_bug' raised RuntimeError: shape mismatch on the batch of 2"):
        score_completions([batch_bug], None, ["q"] * 2, ["a", "b"], rows_of([None] * 2), on_error="penalty")


def test_reward_wrong_length_nan_and_type():
    def short(prompts, completions, **kw):
        return [1.0] * (len(completions) - 1)

    def nan(prompts, completions, **kw):
        return [0.0, float("nan")]

    def text(prompts, completions, **kw):
        return ["1.0", "2.0"]

    rows = rows_of([None, None])
    with pytest.raises(RewardFunctionError, match="'short' returned 1 values for 2 completions"):
        score_completions([short], None, ["q"] * 2, ["a", "b"], rows)
    with pytest.raises(RewardFunctionError, match="'nan' returned NaN for sample 1; return None"):
        score_completions([nan], None, ["q"] * 2, ["a", "b"], rows, on_error="penalty")
    with pytest.raises(RewardFunctionError, match="'text' returned str '1.0' for sample 0"):
        score_completions([text], None, ["q"] * 2, ["a", "b"], rows)


def test_score_completions_bad_arguments():
    with pytest.raises(ValueError, match="got 1 reward weights for 2 reward functions"):
        score_completions([numeric_answer, format_tags], [1.0], ["q"], ["1"], rows_of(["1"]))
    with pytest.raises(ValueError, match="got 2 prompts, 1 completions, 1 rows"):
        score_completions([numeric_answer], None, ["q", "q"], ["1"], rows_of(["1"]))
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'penalty'"):
        score_completions([numeric_answer], None, ["q"], ["1"], rows_of(["1"]), on_error="ignore")


# ---- your own reward module, found as `python -m` finds it


@pytest.fixture
def console_script_path(tmp_path, monkeypatch):
    """The working directory is tmp_path and, as for a console script (`logitless`), neither it nor '' is on
    sys.path; modules imported here are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def test_a_reward_module_in_the_current_folder_is_importable(console_script_path):
    (console_script_path / "folder_rewards.py").write_text(
        "def half(prompts, completions, **fields):\n    return [0.5] * len(completions)\n")
    assert get_reward_fn("folder_rewards:half")(["p"], ["c", "d"]) == [0.5, 0.5]


def test_a_reward_module_that_fails_to_import_names_its_own_error(console_script_path):
    (console_script_path / "broken_rewards.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ValueError, match=r"importing module 'broken_rewards' failed: ModuleNotFoundError: No module "
                                         r"named 'no_such_dependency_xyz' \(.*broken_rewards.py, line 1\)"):
        get_reward_fn("broken_rewards:f")
    (console_script_path / "syntax_rewards.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match=r"importing module 'syntax_rewards' failed: SyntaxError: .*syntax_rewards.py, "
                                         r"line 1"):
        get_reward_fn("syntax_rewards:f")


def test_the_row_fields_each_reward_reads():
    from logitless.rewards import reward_row_fields

    assert reward_row_fields(get_reward_fn("numeric_answer")) == ["answer"]
    assert reward_row_fields(get_reward_fn("math_verify", timeout_seconds=None)) == ["answer"]  # options bound
    assert reward_row_fields(get_reward_fn("code_tests")) == ["tests"]
    assert reward_row_fields(get_reward_fn("format_tags")) == []

    def mine(prompts, completions, solution, difficulty=1, *, units, scale=1.0, **fields):
        return [0.0] * len(completions)

    assert reward_row_fields(mine) == ["solution", "units"]


def test_a_reward_that_is_none_for_every_sample_is_warned_once():
    from logitless.trainer.report.metrics import RewardNoneReport

    shown = []
    report = RewardNoneReport(shown.append)
    for step in (1, 2, 3):
        report(step, ["numeric_answer", "format_tags"], [8, 0], 8, ["answer", "id"])
    assert len(shown) == 1 and "step 1: reward function 'numeric_answer' returned None for all 8 samples" in shown[0]
    assert "'not applicable to this sample'" in shown[0] and "the other reward functions alone decide" in shown[0]
    assert "these rows have: answer, id" in shown[0] and "Shown once per reward function" in shown[0]
    report(4, ["numeric_answer", "format_tags"], [8, 8], 8, ["answer", "id"])  # now format_tags too: its own warning
    assert len(shown) == 2 and "'format_tags'" in shown[1] and "this step trained nothing" in shown[1]
    report(5, ["numeric_answer"], [7], 8, [])  # not every sample: no warning
    assert len(shown) == 2


def test_a_run_whose_reward_is_always_none_says_so_once(tmp_path, gpt2_tokenizer, monkeypatch, capsys):
    import copy

    from tests.test_rundir import _e2e_cfg, _tiny_train

    tok = copy.deepcopy(gpt2_tokenizer)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    (tmp_path / "none_rewards.py").write_text("def never(prompts, completions, **fields):\n"
                                              "    return [None] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _tiny_train(_e2e_cfg(tmp_path / "run", "reward.reward_funcs=[none_rewards:never]"), tok)
    err = capsys.readouterr().err
    assert [r["reward/never/none"] for r in result.records] == [8, 8]
    assert err.count("reward function 'never' returned None for all 8 samples") == 1
    assert "this step trained nothing" in err
