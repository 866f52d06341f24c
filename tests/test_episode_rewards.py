"""Rewards and metrics over multi-turn episodes (trainer/episodes.py): reward functions see the whole conversation
(messages after a chat prompt, the text of model turns and observations after a raw prompt), the built-ins score
the last assistant message, the environment's episode reward is one more weighted column, and the step's
episode metrics are per-episode means."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from logitless.rewards import (
    RewardFunctionError,
    add_reward_column,
    code_tests,
    completion_text,
    format_tags,
    length_target,
    math_verify,
    numeric_answer,
    score_completions,
)
from logitless.rollout import SamplingOptions
from logitless.rollout.hf import HFEngine
from logitless.trainer.episodes import (
    conversation_texts,
    environment_rewards,
    environment_weight,
    episode_metrics,
    reward_completions,
)
from tests.episode_driver import ScriptedDriver
from tests.test_rollout_families import TOK, make_model

CONVERSATION = [
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                         "function": {"name": "calc", "arguments": {"x": "6*7"}}}]},
    {"role": "tool", "name": "calc", "content": "42"},
    {"role": "assistant", "content": "<think>6*7</think><answer>The answer is 42</answer>"},
    {"role": "user", "content": "Are you sure? 41?"},
]


def test_completion_text_is_the_last_assistant_message():
    assert completion_text("plain 7") == "plain 7"
    assert completion_text(CONVERSATION) == "<think>6*7</think><answer>The answer is 42</answer>"
    assert completion_text(CONVERSATION[:2]) == ""  # only a tool call so far
    assert completion_text([{"role": "tool", "content": "1"}]) == "" and completion_text([]) == ""
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text",
                                                                                                 "text": "b"}]}]
    assert completion_text(parts) == "ab"
    with pytest.raises(TypeError, match="a completion must be a string or a list of chat messages"):
        completion_text(42)


def test_builtin_rewards_score_conversations_by_their_last_assistant_message():
    convs = [CONVERSATION, CONVERSATION[:2], [{"role": "assistant", "content": "it is 41"}]]
    # the tool's 42 and the user's 41 do not count
    assert numeric_answer([], convs, answer=["42", "42", "42"]) == [1.0, 0.0, 0.0]
    assert math_verify([], convs, answer=["42"] * 3) == [1.0, 0.0, 0.0]
    assert format_tags([], convs) == [1.0, 0.0, 0.0]
    assert length_target([], convs, target=8) == [-1.0, -1.0, 0.0]
    program = [{"role": "assistant", "content": "```python\ndef f():\n    return 3\n```"}]
    assert code_tests([], [program, CONVERSATION], tests=["assert f() == 3"] * 2) == [1.0, 0.0]


def test_a_raising_reward_names_a_conversation_sample():
    def bad(prompts, completions, **kw):
        if any(isinstance(c, list) and len(c) == 2 for c in completions):
            raise KeyError("two messages")
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"raised KeyError: 'two messages' on sample 1 \(completion \"\[\{"):
        score_completions([bad], None, ["p", "p"], [CONVERSATION, CONVERSATION[:2]], [{}, {}])


def test_environment_column_is_weighted_and_none_is_nan():
    scores = score_completions([lambda p, c, **k: [1.0, None, 0.5, None]], [2.0], ["p"] * 4, ["a"] * 4, [{}] * 4)
    out = add_reward_column(scores, "environment", [0.5, 1.0, None, None], 3.0)
    assert out.names == ["<lambda>", "environment"] and out.num_none == [2, 2] and out.num_errors == [0, 0]
    assert out.rewards[:, 1].tolist()[:2] == [0.5, 1.0] and math.isnan(out.rewards[2, 1])
    assert out.total.tolist() == [2.0 + 1.5, 3.0, 1.0, 0.0]
    with pytest.raises(RewardFunctionError, match="reward function 'environment' returned NaN for sample 0"):
        add_reward_column(scores, "environment", [math.nan, 1.0, None, None], 1.0)
    with pytest.raises(ValueError, match="a reward function is already named '<lambda>'"):
        add_reward_column(scores, "<lambda>", [1.0] * 4, 1.0)


def test_environment_weight_follows_the_agent_section():
    def cfg(**agent):
        return SimpleNamespace(agent=SimpleNamespace(**{"enabled": True, "environment": None, "driver": None,
                                                        "environment_reward_weight": 1.0, **agent}))

    assert environment_weight(cfg(enabled=False)) is None
    assert environment_weight(cfg()) is None  # tools only: no environment reward
    assert environment_weight(cfg(environment="m:Env", environment_reward_weight=0.5)) == 0.5
    assert environment_weight(cfg(driver="m:Driver", environment_reward_weight=0.5)) == 0.5  # its records' rewards


@pytest.fixture(scope="module")
def episodes(one_thread):
    drv = ScriptedDriver(lambda b: 1 + b % 3, lambda b, k: TOK(f"<obs {k}>", add_special_tokens=False)["input_ids"],
                         max_turn_tokens=4, reward=lambda b: None if b == 1 else float(b))
    options = SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=14, seed=0, ignore_eos=True)
    prompt_ids = [TOK("one")["input_ids"], TOK("user: two\n")["input_ids"]]  # as a driver renders them
    return HFEngine(make_model("llama"), TOK).generate(prompt_ids, options, episodes=drv)


def test_reward_completions_are_conversations(episodes):
    b = episodes
    prompts = ["one", "one", [{"role": "user", "content": "two"}], [{"role": "user", "content": "two"}]]
    comps = reward_completions(TOK, b, prompts)
    texts = conversation_texts(TOK, b)
    assert all(comps[i] == b.episodes[i].messages for i in range(4))  # chat and raw-text prompts: the messages
    assert "<obs 1>" in texts[1] and "<obs 1>" not in b.completions[1]  # the batch's own texts: the model's turns
    assert environment_rewards(b) == [0.0, None, 2.0, 3.0]
    single = SimpleNamespace(episodes=None, completions=["a", "b"])
    assert reward_completions(TOK, single, ["x", "y"]) == ["a", "b"]


def test_episode_metrics_are_means_per_episode(episodes):
    b = episodes
    recs = b.episodes
    m = episode_metrics(b, torch.device("cpu"))
    env = (b.env_mask * b.completion_mask).sum(1).double()
    model = (b.completion_mask.sum(1) - env).double()
    assert m["episode/turns_mean"] == pytest.approx(sum(r.turns for r in recs) / 4)
    assert [r.turns for r in recs] == [1, 2, 2, 1]  # row 2: its third turn does not fit the budget
    assert b.truncated.tolist() == [False, True, True, False]  # rows 1 and 2: the second turn cut to 3 tokens
    assert m["episode/tool_calls_mean"] == pytest.approx(sum(r.tool_calls for r in recs) / 4)
    assert m["episode/tool_errors_mean"] == 0.5
    assert m["episode/truncated"] == pytest.approx(float(b.truncated.double().mean()))
    assert m["tokens/model_mean"] == pytest.approx(float(model.mean())) and m["tokens/env_mean"] == float(env.mean())
    assert m["episode/row"] == 1.5  # EpisodeRecord.metrics averaged
    assert episode_metrics(SimpleNamespace(episodes=None), torch.device("cpu")) == {}
