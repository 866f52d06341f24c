"""AgentDriver end to end with scripted model turns (token ids, no model): tools, environments, the raw
protocol, budgets, and every failure case answered to the model instead of crashing."""

from __future__ import annotations

import threading
import warnings

import pytest

from logitless.agents import Agent, AgentOptions
from logitless.data.prompts import PromptRow
from logitless.rollout.episodes import EpisodeDriver, TurnEnd
from tests.agent_fixtures import byte_tokenizer, chatml_tokenizer, ids

HANG = threading.Event()  # never set while a test runs: a tool waiting on it hangs


class CountDown:
    """Say the numbers from `start` down to 1, one per turn; +1 per right number, 0.5 at the end."""

    def __init__(self, start: int = 3) -> None:
        self.start = start
        self.closed = False

    def reset(self, row: dict) -> str:
        self.next = self.start
        return f"Start at {self.start}."

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        if text.strip() != str(self.next):
            return "Wrong.", -1.0, True
        self.next -= 1
        return (None, 1.0, True) if self.next == 0 else (f"Now {self.next}.", 1.0, False)

    def reward(self) -> float:
        return 0.5


class Vault:
    """A per-episode secret the model finds with a tool; `step` ends the episode, rewarding the right guess."""

    tools = ["peek"]

    def __init__(self, secret: int = 7) -> None:
        self.secret, self.peeks = secret, 0

    def reset(self, row: dict) -> None:
        self.secret = int(row.get("secret", self.secret))
        return None

    def peek(self, digit: int) -> str:
        """Whether the secret is above a number.

        Args:
            digit: The number to compare with.
        """
        self.peeks += 1
        return "above" if self.secret > digit else "not above"

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        return None, float(text.strip() == str(self.secret)), True


def slow(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    HANG.wait(seconds)
    return "done"


def huge(n: int) -> str:
    """A long text.

    Args:
        n: Its length.
    """
    return "x" * n


def boom(x: int) -> int:
    """Fail.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no {x}")


def _agent(tok=None, **kw):
    return Agent(tok or chatml_tokenizer(), AgentOptions(**kw))


def _call(name, args=None, raw=None):
    body = raw if raw is not None else '{"name": "%s", "arguments": %s}' % (name, __import__("json").dumps(args or {}))
    return f"<tool_call>\n{body}\n</tool_call><|im_end|>"


def _run(driver, tok, texts, room=100_000, ended="eos"):
    """One respond() for all rows at once: texts[row] is the sampled text of that row's turn."""
    turns = [TurnEnd(r, ids(tok, t), ended, room) for r, t in enumerate(texts) if t is not None]
    return driver.respond(turns)


def _tool_text(driver, row=0, k=-1):
    return [m for m in driver.episodes[row].record.messages if m["role"] == "tool"][k]["content"]


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("kw,key", [
    ({"tools": "calculator"}, "tools"), ({"tools": ["calculator", "calculator"]}, "tools"), ({"tools": [""]}, "tools"),
    ({"environment": "nocolon"}, "environment"), ({"env_options": {"a": 1}}, "env_options"),
    ({"tool_options": {"python": 5}}, "tool_options"), ({"format": "chatml"}, "format"),
    ({"max_turns": 0}, "max_turns"), ({"max_turn_tokens": 0}, "max_turn_tokens"), ({"tool_timeout_s": 0}, "tool_timeout_s"),
    ({"max_tool_output_chars": 10}, "max_tool_output_chars"), ({"max_parallel_tools": 0}, "max_parallel_tools"),
    ({"environment_reward_weight": float("nan")}, "environment_reward_weight"), ({"chat_template": ""}, "chat_template"),
])
def test_bad_options_are_refused_naming_the_key(kw, key):
    with pytest.raises(ValueError, match=f"agent.{key}="):
        AgentOptions(**kw)


def test_enabled_and_the_config_loader():
    from dataclasses import dataclass, field

    from logitless.configlib import load_config

    assert not AgentOptions().enabled and AgentOptions(tools=["calculator"]).enabled
    assert AgentOptions(environment="m:C").enabled

    @dataclass
    class Cfg:
        agent: AgentOptions = field(default_factory=AgentOptions)

    cfg = load_config(Cfg, None, ["agent.tools=[calculator]", "agent.max_turns=3", "agent.format=hermes",
                                  "agent.tool_options={python: {timeout_seconds: 2}}"])
    assert cfg.agent.tools == ["calculator"] and cfg.agent.max_turns == 3


def test_bad_tools_and_environments_are_refused_when_the_agent_is_built():
    cases = [
        ({"tools": ["calculater"]}, "agent.tools: 'calculater' is neither a built-in"),
        ({"tools": ["calculator"], "tool_options": {"calc": {}}}, "agent.tool_options.calc: no tool is named 'calc'"),
        ({"tools": ["calculator"], "tool_options": {"calculator": {"digits": 3}}}, "agent.tool_options.calculator"),
        ({"tools": ["calculator", "tests.test_agents_tools:add", "tests.test_agents_driver:huge"],
          "environment": "tests.test_agents_driver:Vault", "tool_options": {"huge": {"m": 1}}}, "not a parameter"),
        ({"environment": "tests.test_agents_driver:Nope"}, "has no class 'Nope'"),
        ({"environment": "tests.test_agents_driver:slow"}, "not a class"),
        ({"environment": "tests.test_agents_driver:NoStep"}, r"NoStep has no method step\(\)"),
        ({"environment": "tests.test_agents_driver:CountDown", "env_options": {"begin": 3}},
         r"agent.env_options: CountDown\(begin=...\) cannot be called"),
        ({"environment": "tests.test_agents_driver:BadTools"}, "names 'peak'.*did you mean 'peek'"),
        ({"environment": "tests.test_agents_driver:UndocumentedTool"}, "cannot describe the tool 'peek'"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            _agent(**kw)


def test_two_tools_with_one_name_are_refused():
    def calculator(expression: str) -> str:
        """Mine.

        Args:
            expression: Text.
        """
        return expression

    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        _agent(tools=["calculator", calculator])


def test_prompt_kinds_must_match_the_format():
    chat, raw = [PromptRow([{"role": "user", "content": "hi"}])], [PromptRow("hi")]
    with pytest.raises(ValueError, match="agent.format=hermes needs chat prompts"):
        _agent(tools=["calculator"], format="hermes").driver(raw, 2)
    with pytest.raises(ValueError, match="agent.format=raw"):
        _agent(tools=["calculator"], format="raw").driver(chat, 2)
    with pytest.raises(ValueError, match="mix raw text and chat"):
        _agent(tools=["calculator"]).driver(chat + raw, 2)
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        _agent(byte_tokenizer(["<|endoftext|>"]), tools=["calculator"]).driver(chat, 2)
    assert isinstance(_agent(tools=["calculator"]).driver(raw, 2), EpisodeDriver)


# ---------------------------------------------------------------------------------------------- failure cases


def test_every_bad_call_is_answered_with_an_error_and_counted():
    tok = chatml_tokenizer()
    agent = _agent(tok, tools=["calculator", "tests.test_agents_tools:add", boom])
    rows = [PromptRow([{"role": "user", "content": "q"}])]
    cases = [
        (_call(None, raw='{"name": "add", "arguments": {"a": 1}'), "Error: the tool call is not valid JSON"),
        (_call("calc", {"expression": "1"}), "Error: unknown tool 'calc'; the tools are: calculator, add, boom"),
        (_call("add", {"b": 1}), "Error: add() is missing the required argument 'a'"),
        (_call("add", {"a": "one"}), "Error: add(): argument 'a' must be integer, got \"one\""),
        (_call("add", {"a": 1, "c": 2}), "Error: add() got an unexpected argument 'c'"),
        (_call("boom", {"x": 3}), "Error: boom raised RuntimeError: no 3"),
        (_call("calculator", {"expression": "1/0"}), "Error: division by zero"),
        ("<tool_call>\n{\"name\": \"add\"<|im_end|>", "Error: the <tool_call> is not closed with </tool_call>"),
    ]
    driver = agent.driver(rows, len(cases))
    driver.begin(len(cases), len(cases))
    out = _run(driver, tok, [t for t, _ in cases])
    for row, (_, want) in enumerate(cases):
        assert out[row] is not None, row
        assert _tool_text(driver, row).startswith(want), (row, _tool_text(driver, row))
        assert tok.decode(out[row]).startswith("\n<|im_start|>user\n<tool_response>\nError: ")
        rec = driver.episodes[row].record
        assert (rec.tool_calls, rec.tool_errors) == (1, 1)
    ok = _run(driver, tok, ["Fine.<|im_end|>"] * len(cases))
    assert ok == [None] * len(cases)
    assert not any(r.truncated for r in driver.finish())


def test_a_hanging_tool_times_out_and_a_huge_result_is_cut():
    tok = chatml_tokenizer()
    agent = _agent(tok, tools=[slow, huge], tool_timeout_s=0.3, max_tool_output_chars=200)
    driver = agent.driver([PromptRow([{"role": "user", "content": "q"}])], 2)
    driver.begin(2, 2)
    out = _run(driver, tok, [_call("slow", {"seconds": 60}), _call("huge", {"n": 5_000_000})])
    assert all(o is not None for o in out)
    assert _tool_text(driver, 0).startswith("Error: slow did not finish within")
    cut = _tool_text(driver, 1)
    assert len(cut) < 300 and "[... 4,999,800 characters cut ...]" in cut
    recs = [e.record for e in driver.episodes]
    assert recs[0].metrics["tool_timeouts"] == 1 and recs[0].tool_errors == 1
    assert recs[1].metrics["tool_outputs_cut"] == 1 and recs[1].tool_errors == 0


def test_calls_of_many_rows_run_concurrently():
    barrier = threading.Barrier(4, timeout=10)

    def meet(n: int) -> str:
        """Wait for the others.

        Args:
            n: Anything.
        """
        barrier.wait()
        return str(n)

    tok = chatml_tokenizer()
    driver = _agent(tok, tools=[meet], max_parallel_tools=4).driver([PromptRow([{"role": "user", "content": "q"}])], 4)
    driver.begin(4, 4)
    _run(driver, tok, [_call("meet", {"n": r}) for r in range(4)])
    assert [_tool_text(driver, r) for r in range(4)] == ["0", "1", "2", "3"]


# ---------------------------------------------------------------------------------------------- budgets


def test_max_turns_truncates_an_episode_still_calling():
    tok = chatml_tokenizer()
    driver = _agent(tok, tools=["calculator"], max_turns=2).driver([PromptRow([{"role": "user", "content": "q"}])], 1)
    driver.begin(1, 1)
    call = _call("calculator", {"expression": "1+1"})
    assert _run(driver, tok, [call])[0] is not None
    assert _run(driver, tok, [call]) == [None]
    rec = driver.finish()[0]
    assert rec.truncated and rec.turns == 2 and rec.tool_calls == 1
    assert rec.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"expression": "1+1"}  # the pending call


def test_an_observation_that_does_not_fit_ends_the_episode_truncated():
    tok = chatml_tokenizer()
    driver = _agent(tok, tools=["calculator"]).driver([PromptRow([{"role": "user", "content": "q"}])], 2)
    driver.begin(2, 2)
    call = _call("calculator", {"expression": "1+1"})
    expected = len(_agent(tok, tools=["calculator"]).bridge.tool_suffix(
        [{"type": "function", "id": "x", "function": {"name": "calculator", "arguments": {}}}],
        [{"role": "tool", "name": "calculator", "content": "2"}]))
    out = [driver.respond([TurnEnd(0, ids(tok, call), "eos", expected)])[0],
           driver.respond([TurnEnd(1, ids(tok, call), "eos", expected + 1)])[0]]
    assert out[0] is None and driver.episodes[0].record.truncated
    assert len(out[1]) == expected and not driver.episodes[1].record.truncated


def test_turns_cut_by_a_budget_or_ended_by_another_eos_end_the_episode():
    tok = chatml_tokenizer()
    driver = _agent(tok, tools=["calculator"]).driver([PromptRow([{"role": "user", "content": "q"}])], 3)
    driver.begin(3, 3)
    half = '<tool_call>\n{"name": "calculator", "argum'
    full = _call("calculator", {"expression": "2"}).replace("<|im_end|>", "<|endoftext|>")
    out = driver.respond([TurnEnd(0, ids(tok, half), "length", 50), TurnEnd(1, ids(tok, half), "budget", 0),
                          TurnEnd(2, ids(tok, full), "eos", 500)])
    assert out == [None, None, None]
    recs = driver.finish()
    assert [r.truncated for r in recs] == [True, True, False] and [r.tool_calls for r in recs] == [0, 0, 0]
    with pytest.raises(ValueError, match="already ended"):
        driver.respond([TurnEnd(0, ids(tok, "x<|im_end|>"), "eos", 5)])
    with pytest.raises(ValueError, match="made for 1 prompts x 3"):
        driver.begin(4, 2)


# ---------------------------------------------------------------------------------------------- raw protocol


def test_raw_protocol_with_a_base_model_tokenizer(gpt2_tokenizer):
    tok = gpt2_tokenizer
    agent = _agent(tok, tools=["calculator"])
    assert agent.bridge is None  # no chat template: raw prompts only
    prompt = 'Q: 2*3?\nA: <call>calculator(expression="2*3")</call><result>6</result> 6.\n\nQ: What is 12*34?\nA: '
    driver = agent.driver([PromptRow(prompt), PromptRow("Q: hi\nA: ")], 1)
    driver.begin(2, 1)
    assert driver.turn_stops == ["</call>"] and driver.turn_end_ids == []
    assert driver.prompt_ids[0] == tok(prompt)["input_ids"]
    out = _run(driver, tok, ['<call>calculator(expression="12*34")</call>', "<call>calculator(12, 34)</call>"],
               ended="stop")
    assert tok.decode(out[0]) == "<result>408</result>" and out[0] == ids(tok, "<result>408</result>")
    assert tok.decode(out[1]).startswith("<result>Error: calculator() takes 1 argument(s), got 2")
    assert _run(driver, tok, [" 408.<|endoftext|>", " ok<|endoftext|>"]) == [None, None]
    recs = driver.finish()
    assert recs[0].messages == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "000000000", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]},
        {"role": "tool", "name": "calculator", "content": "408", "tool_call_id": "000000000"},
        {"role": "assistant", "content": "408."}]
    assert (recs[1].tool_calls, recs[1].tool_errors) == (1, 1)


def test_raw_calls_continue_only_when_call_ended_the_turn():
    tok = byte_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")
    driver = _agent(tok, tools=["calculator"]).driver([PromptRow("Q: ")], 3)
    driver.begin(3, 3)
    out = driver.respond([TurnEnd(0, ids(tok, '<call>calculator(expression="1+1")'), "eos", 99),
                          TurnEnd(1, ids(tok, "<call>calculator(expression="), "length", 99),
                          TurnEnd(2, ids(tok, "<call>calculator(1+)</call>"), "stop", 9999)])
    assert out[:2] == [None, None] and tok.decode(out[2]).startswith("<result>Error: cannot read the call")
    recs = [e.record for e in driver.episodes]
    assert [r.truncated for r in recs] == [False, True, False] and [r.tool_calls for r in recs] == [0, 0, 1]


def test_raw_environment_appends_observations_as_text():
    tok = byte_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")
    agent = _agent(tok, environment="tests.test_agents_driver:CountDown", env_options={"start": 2})
    driver = agent.driver([PromptRow("Count: ")], 1)
    driver.begin(1, 1)
    assert tok.decode(driver.prompt_ids[0]) == "Count: Start at 2."
    assert driver.turn_stops == []
    assert tok.decode(_run(driver, tok, ["2\n"], ended="stop")[0]) == "Now 1."
    assert _run(driver, tok, ["1<|endoftext|>"]) == [None]
    assert driver.finish()[0].reward == 2.5


# ---------------------------------------------------------------------------------------------- environments


class NoStep:
    def reset(self, row):
        return None


class BadTools(Vault):
    tools = ["peak"]


class UndocumentedTool(Vault):
    def peek(self, digit):  # no hints, no docstring
        return "?"


class Random:
    def __init__(self) -> None:
        import random

        self.first = str(random.random())

    def reset(self, row):
        return self.first

    def step(self, text):
        return None, None, True


class BadStep(CountDown):
    def step(self, text):
        return "only an observation"


class RaisingStep(CountDown):
    def step(self, text):
        raise KeyError("broken")


class HangingStep(CountDown):
    def step(self, text):
        HANG.wait(60)
        return None, None, True


class Quiet(CountDown):
    def step(self, text):
        return None, None, True

    def reward(self):
        return None

    def close(self):
        self.closed = True


def test_environment_tools_act_on_each_episode_own_instance():
    tok = chatml_tokenizer()
    agent = _agent(tok, environment="tests.test_agents_driver:Vault")
    assert list(agent.tools) == ["peek"]
    rows = [PromptRow([{"role": "user", "content": "Find it."}], {"secret": 5}),
            PromptRow([{"role": "user", "content": "Find it."}], {"secret": 2})]
    driver = agent.driver(rows, 2)
    driver.begin(4, 2)
    out = _run(driver, tok, [_call("peek", {"digit": 4})] * 4)
    assert all(o is not None for o in out)
    assert [_tool_text(driver, r) for r in range(4)] == ["above", "above", "not above", "not above"]
    assert [e.env.peeks for e in driver.episodes] == [1, 1, 1, 1]
    assert _run(driver, tok, ["5<|im_end|>", "4<|im_end|>", "2<|im_end|>", "2<|im_end|>"]) == [None] * 4
    assert [r.reward for r in driver.finish()] == [1.0, 0.0, 1.0, 1.0]


def test_group_episodes_must_start_from_one_observation():
    with pytest.raises(ValueError, match="different first observations.*seed any randomness"):
        _agent(environment="tests.test_agents_driver:Random").driver([PromptRow([{"role": "user", "content": "x"}])], 2)


def test_environment_contract_violations_raise_and_its_failures_end_the_episode():
    tok = chatml_tokenizer()
    rows = [PromptRow([{"role": "user", "content": "x"}])]
    driver = _agent(tok, environment="tests.test_agents_driver:BadStep").driver(rows, 1)
    driver.begin(1, 1)
    with pytest.raises(TypeError, match=r"BadStep.step\(\) must return \(observation"):
        _run(driver, tok, ["3<|im_end|>"])
    for env, why in [("RaisingStep", "raised KeyError"), ("HangingStep", "did not return within 0.3 s")]:
        driver = _agent(tok, environment=f"tests.test_agents_driver:{env}", tool_timeout_s=0.3).driver(rows, 2)
        driver.begin(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _run(driver, tok, ["3<|im_end|>", "3<|im_end|>"]) == [None, None]
        assert len(caught) == 1 and why in str(caught[0].message)
        recs = driver.finish()
        assert [r.metrics["env_errors"] for r in recs] == [1.0, 1.0] and recs[0].reward == 0.5


def test_rewards_are_none_when_the_environment_gives_none_and_close_is_called():
    tok = chatml_tokenizer()
    driver = _agent(tok, environment="tests.test_agents_driver:Quiet").driver(
        [PromptRow([{"role": "user", "content": "x"}])], 1)
    driver.begin(1, 1)
    env = driver.episodes[0].env
    assert _run(driver, tok, ["3<|im_end|>"]) == [None]
    rec = driver.finish()[0]
    assert rec.reward is None and env.closed and rec.messages == [{"role": "assistant", "content": "3"}]


def test_max_turns_truncates_an_environment_that_goes_on():
    tok = chatml_tokenizer()
    driver = _agent(tok, environment="tests.test_agents_driver:CountDown", env_options={"start": 5},
                    max_turns=2).driver([PromptRow([{"role": "user", "content": "x"}])], 1)
    driver.begin(1, 1)
    assert _run(driver, tok, ["5<|im_end|>"])[0] is not None
    assert _run(driver, tok, ["4<|im_end|>"]) == [None]
    rec = driver.finish()[0]
    assert rec.truncated and rec.reward == 2.5 and rec.turns == 2


# ---------------------------------------------------------------------------------------------- python tool


def test_python_tool_runs_code_in_the_sandbox():
    from logitless.rewards.sandbox import SandboxPool

    if not callable(getattr(SandboxPool, "execute", None)):
        pytest.skip("SandboxPool.execute (logitless.rewards.sandbox) is not in this tree yet")
    tok = chatml_tokenizer()
    agent = _agent(tok, tools=["python"], tool_options={"python": {"timeout_seconds": 2, "num_workers": 2}})
    driver = agent.driver([PromptRow([{"role": "user", "content": "q"}])], 4)
    driver.begin(4, 4)
    programs = ["print(sum(i * i for i in range(10)))", "x = 1", "raise ValueError('bad input')",
                "while True: pass"]
    out = _run(driver, tok, [_call("python", {"code": p}) for p in programs])
    assert all(o is not None for o in out)
    texts = [_tool_text(driver, r) for r in range(4)]
    assert texts[0] == "285\n" or texts[0] == "285"
    assert "printed nothing" in texts[1]
    assert "Error: " in texts[2] and "ValueError" in texts[2]
    assert "Error: the program ran longer than 2 s" in texts[3]
    recs = [e.record for e in driver.episodes]
    assert [r.tool_errors for r in recs] == [0, 0, 1, 1] and recs[3].metrics["tool_timeouts"] == 1
