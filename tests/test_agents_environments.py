"""Environments end to end with scripted model turns: per-episode instances, their tools, first observations,
rewards, and environments that break the protocol, raise or hang."""

from __future__ import annotations

import time
import warnings

import pytest

from logitless.data.prompts import PromptRow
from tests.agent_fixtures import call_text, chatml_tokenizer, make_agent, run_turns, tool_text


def test_environment_tools_act_on_each_episode_own_instance():
    tok = chatml_tokenizer()
    agent = make_agent(tok, environment="tests.agent_fixtures:Vault")
    assert list(agent.tools) == ["peek"]
    rows = [PromptRow([{"role": "user", "content": "Find it."}], {"secret": 5}),
            PromptRow([{"role": "user", "content": "Find it."}], {"secret": 2})]
    driver = agent.driver(rows, 2)
    driver.begin(4, 2)
    out = run_turns(driver, tok, [call_text("peek", {"digit": 4})] * 4)
    assert all(o is not None for o in out)
    assert [tool_text(driver, r) for r in range(4)] == ["above", "above", "not above", "not above"]
    assert [e.env.peeks for e in driver.episodes] == [1, 1, 1, 1]
    assert run_turns(driver, tok, ["5<|im_end|>", "4<|im_end|>", "2<|im_end|>", "2<|im_end|>"]) == [None] * 4
    assert [r.reward for r in driver.finish()] == [1.0, 0.0, 1.0, 1.0]


def test_group_episodes_must_start_from_one_observation():
    with pytest.raises(ValueError, match="different first observations.*seed any randomness"):
        make_agent(environment="tests.agent_fixtures:Random").driver([PromptRow([{"role": "user", "content": "x"}])], 2)


def test_environment_contract_violations_raise_and_its_failures_end_the_episode():
    tok = chatml_tokenizer()
    rows = [PromptRow([{"role": "user", "content": "x"}])]
    with pytest.raises(RuntimeError, match="resetting RaisingReset for prompt 0 failed .KeyError"):
        make_agent(tok, environment="tests.agent_fixtures:RaisingReset").driver(rows, 1)
    driver = make_agent(tok, environment="tests.agent_fixtures:BadStep").driver(rows, 1)
    driver.begin(1, 1)
    with pytest.raises(TypeError, match=r"BadStep.step\(\) must return \(observation"):
        run_turns(driver, tok, ["3<|im_end|>"])
    for env, why in [("RaisingStep", "raised KeyError"), ("HangingStep", "did not return within 0.3 s")]:
        driver = make_agent(tok, environment=f"tests.agent_fixtures:{env}", tool_timeout_s=0.3).driver(rows, 2)
        driver.begin(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert run_turns(driver, tok, ["3<|im_end|>", "3<|im_end|>"]) == [None, None]
        assert len(caught) == 1 and why in str(caught[0].message)
        recs = driver.finish()
        assert [r.metrics["env_errors"] for r in recs] == [1.0, 1.0] and recs[0].reward == 0.5


def test_rewards_are_none_when_the_environment_gives_none_and_close_is_called():
    tok = chatml_tokenizer()
    driver = make_agent(tok, environment="tests.agent_fixtures:Quiet").driver(
        [PromptRow([{"role": "user", "content": "x"}])], 1)
    driver.begin(1, 1)
    env = driver.episodes[0].env
    assert run_turns(driver, tok, ["3<|im_end|>"]) == [None]
    rec = driver.finish()[0]
    assert rec.reward is None and env.closed and rec.messages == [{"role": "assistant", "content": "3"}]


def test_a_close_that_raises_is_reported_as_close_and_the_reward_stands():
    tok = chatml_tokenizer()
    driver = make_agent(tok, environment="tests.agent_fixtures:FailingClose").driver(
        [PromptRow([{"role": "user", "content": "x"}])], 1)
    driver.begin(1, 1)
    assert run_turns(driver, tok, ["3<|im_end|>"]) == [None]
    with pytest.warns(UserWarning, match=r"FailingClose.close\(\) raised OSError: cannot release the board"):
        rec = driver.finish()[0]
    assert rec.reward == 1.0 and rec.metrics["env_errors"] == 1.0


def test_max_turns_truncates_an_environment_that_goes_on():
    tok = chatml_tokenizer()
    driver = make_agent(tok, environment="tests.agent_fixtures:CountDown", env_options={"start": 5},
                    max_turns=2).driver([PromptRow([{"role": "user", "content": "x"}])], 1)
    driver.begin(1, 1)
    assert run_turns(driver, tok, ["5<|im_end|>"])[0] is not None
    assert run_turns(driver, tok, ["4<|im_end|>"]) == [None]
    rec = driver.finish()[0]
    assert rec.truncated and rec.reward == 2.5 and rec.turns == 2


def test_a_hung_reset_ends_the_run_at_the_tool_timeout():
    """reset() has the bound of every other environment call (it hung the run at step 1)."""
    rows = [PromptRow([{"role": "user", "content": "x"}])]
    agent = make_agent(chatml_tokenizer(), environment="tests.agent_fixtures:HangingReset", tool_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"resetting HangingReset for prompt 0 did not return within "
                                           r"agent.tool_timeout_s=0.3 s; make reset\(\) return sooner"):
        agent.driver(rows, 2)
    assert 0.3 <= time.monotonic() - t0 < 3.0
