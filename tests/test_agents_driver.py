"""AgentDriver end to end with scripted model turns (token ids, no model): tools, the raw protocol, budgets,
and every failure case answered to the model instead of crashing (environments: test_agents_environments.py)."""

from __future__ import annotations

import threading

import pytest

from logitless.agents import AgentOptions
from logitless.data.prompts import PromptRow
from logitless.rollout.episodes import EpisodeDriver, TurnEnd
from tests.agent_fixtures import (boom, byte_tokenizer, call_text, chatml_tokenizer, huge, ids, make_agent, run_turns,
                                  slow, tool_text)


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
        ({"tools": ["calculator", "tests.test_agents_tools:add", "tests.agent_fixtures:huge"],
          "environment": "tests.agent_fixtures:Vault", "tool_options": {"huge": {"m": 1}}}, "not a parameter"),
        ({"environment": "tests.agent_fixtures:Nope"}, "has no class 'Nope'"),
        ({"environment": "tests.agent_fixtures:slow"}, "not a class"),
        ({"environment": "tests.agent_fixtures:NoStep"}, r"NoStep has no method step\(\)"),
        ({"environment": "tests.agent_fixtures:CountDown", "env_options": {"begin": 3}},
         r"agent.env_options: CountDown\(begin=...\) cannot be called"),
        ({"environment": "tests.agent_fixtures:BadTools"}, "names 'peak'.*did you mean 'peek'"),
        ({"environment": "tests.agent_fixtures:UndocumentedTool"}, "cannot describe the tool 'peek'"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            make_agent(**kw)


def test_two_tools_with_one_name_are_refused():
    def calculator(expression: str) -> str:
        """Mine.

        Args:
            expression: Text.
        """
        return expression

    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        make_agent(tools=["calculator", calculator])


def test_prompt_kinds_must_match_the_format():
    chat, raw = [PromptRow([{"role": "user", "content": "hi"}])], [PromptRow("hi")]
    with pytest.raises(ValueError, match="agent.format=hermes needs chat prompts"):
        make_agent(tools=["calculator"], format="hermes").driver(raw, 2)
    with pytest.raises(ValueError, match="agent.format=raw"):
        make_agent(tools=["calculator"], format="raw").driver(chat, 2)
    with pytest.raises(ValueError, match="mix raw text and chat"):
        make_agent(tools=["calculator"]).driver(chat + raw, 2)
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        make_agent(byte_tokenizer(["<|endoftext|>"]), tools=["calculator"]).driver(chat, 2)
    assert isinstance(make_agent(tools=["calculator"]).driver(raw, 2), EpisodeDriver)


# ---------------------------------------------------------------------------------------------- failure cases


def test_every_bad_call_is_answered_with_an_error_and_counted():
    tok = chatml_tokenizer()
    agent = make_agent(tok, tools=["calculator", "tests.test_agents_tools:add", boom])
    rows = [PromptRow([{"role": "user", "content": "q"}])]
    cases = [
        (call_text(None, raw='{"name": "add", "arguments": {"a": 1}'), "Error: the tool call is not valid JSON"),
        (call_text("calc", {"expression": "1"}), "Error: unknown tool 'calc'; the tools are: calculator, add, boom"),
        (call_text("add", {"b": 1}), "Error: add() is missing the required argument 'a'"),
        (call_text("add", {"a": "one"}), "Error: add(): argument 'a' must be integer, got \"one\""),
        (call_text("add", {"a": 1, "c": 2}), "Error: add() got an unexpected argument 'c'"),
        (call_text("boom", {"x": 3}), "Error: boom raised RuntimeError: no 3"),
        (call_text("calculator", {"expression": "1/0"}), "Error: division by zero"),
        ("<tool_call>\n{\"name\": \"add\"<|im_end|>", "Error: the <tool_call> is not closed with </tool_call>"),
    ]
    driver = agent.driver(rows, len(cases))
    driver.begin(len(cases), len(cases))
    out = run_turns(driver, tok, [t for t, _ in cases])
    for row, (_, want) in enumerate(cases):
        assert out[row] is not None, row
        assert tool_text(driver, row).startswith(want), (row, tool_text(driver, row))
        assert tok.decode(out[row]).startswith("\n<|im_start|>user\n<tool_response>\nError: ")
        rec = driver.episodes[row].record
        assert (rec.tool_calls, rec.tool_errors) == (1, 1)
        said, answer = rec.messages[-2], rec.messages[-1]  # every result answers a call of the turn (D4)
        assert answer["tool_call_id"] in [c["id"] for c in said["tool_calls"]]
        if row in (0, len(cases) - 1):  # malformed: the turn's text is kept as the model wrote it
            assert said["content"] == cases[row][0].removesuffix("<|im_end|>").strip()
            assert said["tool_calls"][0]["function"] == {"name": "invalid_call", "arguments": {}}
    ok = run_turns(driver, tok, ["Fine.<|im_end|>"] * len(cases))
    assert ok == [None] * len(cases)
    assert not any(r.truncated for r in driver.finish())


def test_a_hanging_tool_times_out_and_a_huge_result_is_cut():
    tok = chatml_tokenizer()
    agent = make_agent(tok, tools=[slow, huge], tool_timeout_s=0.3, max_tool_output_chars=200)
    driver = agent.driver([PromptRow([{"role": "user", "content": "q"}])], 2)
    driver.begin(2, 2)
    out = run_turns(driver, tok, [call_text("slow", {"seconds": 60}), call_text("huge", {"n": 5_000_000})])
    assert all(o is not None for o in out)
    assert tool_text(driver, 0).startswith("Error: slow did not finish within")
    cut = tool_text(driver, 1)
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
    driver = make_agent(tok, tools=[meet], max_parallel_tools=4).driver([PromptRow([{"role": "user", "content": "q"}])], 4)
    driver.begin(4, 4)
    run_turns(driver, tok, [call_text("meet", {"n": r}) for r in range(4)])
    assert [tool_text(driver, r) for r in range(4)] == ["0", "1", "2", "3"]


def test_a_batch_tool_gets_all_its_calls_of_a_respond_at_once_and_its_failure_raises():
    from logitless.agents.tools import Tool, ToolResult, function_schema

    sizes = []

    def double(n: int) -> str:
        """Double a number.

        Args:
            n: The number.
        """
        raise AssertionError("runs through batch")

    def batch(calls: list) -> list:
        sizes.append(len(calls))
        if any(c["n"] < 0 for c in calls):
            raise OSError("the workers did not start")
        return [ToolResult(str(2 * c["n"])) for c in calls]

    tok = chatml_tokenizer()
    agent = make_agent(tok, tools=["calculator"])
    agent.toolset.add(Tool("double", function_schema(double, "test"), batch=batch, timeout_s=5.0), "test")
    driver = agent.driver([PromptRow([{"role": "user", "content": "q"}])], 3)
    driver.begin(3, 3)
    run_turns(driver, tok, [call_text("double", {"n": 1}), call_text("double", {"n": "x"}), call_text("double", {"n": 3})])
    assert sizes == [2] and [tool_text(driver, r) for r in (0, 2)] == ["2", "6"]
    assert tool_text(driver, 1).startswith("Error: double(): argument 'n' must be integer")
    with pytest.raises(RuntimeError, match="the double tool failed .OSError: the workers did not start"):
        run_turns(driver, tok, [call_text("double", {"n": -1}), None, None])


# ---------------------------------------------------------------------------------------------- budgets


def test_max_turns_truncates_an_episode_still_calling():
    tok = chatml_tokenizer()
    driver = make_agent(tok, tools=["calculator"], max_turns=2).driver([PromptRow([{"role": "user", "content": "q"}])], 1)
    driver.begin(1, 1)
    call = call_text("calculator", {"expression": "1+1"})
    assert run_turns(driver, tok, [call])[0] is not None
    assert run_turns(driver, tok, [call]) == [None]
    rec = driver.finish()[0]
    assert rec.truncated and rec.turns == 2 and rec.tool_calls == 1
    assert rec.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"expression": "1+1"}  # the pending call


def test_an_observation_that_does_not_fit_ends_the_episode_truncated():
    tok = chatml_tokenizer()
    driver = make_agent(tok, tools=["calculator"]).driver([PromptRow([{"role": "user", "content": "q"}])], 2)
    driver.begin(2, 2)
    call = call_text("calculator", {"expression": "1+1"})
    expected = len(make_agent(tok, tools=["calculator"]).bridge.tool_suffix(
        [{"type": "function", "id": "x", "function": {"name": "calculator", "arguments": {}}}],
        [{"role": "tool", "name": "calculator", "content": "2"}]))
    out = [driver.respond([TurnEnd(0, ids(tok, call), "eos", expected)])[0],
           driver.respond([TurnEnd(1, ids(tok, call), "eos", expected + 1)])[0]]
    assert out[0] is None and driver.episodes[0].record.truncated
    assert len(out[1]) == expected and not driver.episodes[1].record.truncated


def test_turns_cut_by_a_budget_or_ended_by_another_eos_end_the_episode():
    tok = chatml_tokenizer()
    driver = make_agent(tok, tools=["calculator"]).driver([PromptRow([{"role": "user", "content": "q"}])], 3)
    driver.begin(3, 3)
    half = '<tool_call>\n{"name": "calculator", "argum'
    full = call_text("calculator", {"expression": "2"}).replace("<|im_end|>", "<|endoftext|>")
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
    agent = make_agent(tok, tools=["calculator"])
    assert agent.bridge is None  # no chat template: raw prompts only
    prompt = 'Q: 2*3?\nA: <call>calculator(expression="2*3")</call><result>6</result> 6.\n\nQ: What is 12*34?\nA: '
    driver = agent.driver([PromptRow(prompt), PromptRow("Q: hi\nA: ")], 1)
    driver.begin(2, 1)
    assert driver.turn_stops == ["</call>"] and driver.turn_end_ids == []
    assert driver.prompt_ids[0] == tok(prompt)["input_ids"]
    out = run_turns(driver, tok, ['<call>calculator(expression="12*34")</call>', "<call>calculator(12, 34)</call>"],
               ended="stop")
    assert tok.decode(out[0]) == "<result>408</result>" and out[0] == ids(tok, "<result>408</result>")
    assert tok.decode(out[1]).startswith("<result>Error: calculator() takes 1 argument(s), got 2")
    assert run_turns(driver, tok, [" 408.<|endoftext|>", " ok<|endoftext|>"]) == [None, None]
    recs = driver.finish()
    assert recs[0].messages == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "000000000", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]},
        {"role": "tool", "name": "calculator", "content": "408", "tool_call_id": "000000000"},
        {"role": "assistant", "content": "408."}]
    assert (recs[1].tool_calls, recs[1].tool_errors) == (1, 1)


def test_raw_calls_continue_only_when_call_ended_the_turn():
    tok = byte_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")
    driver = make_agent(tok, tools=["calculator"]).driver([PromptRow("Q: ")], 3)
    driver.begin(3, 3)
    out = driver.respond([TurnEnd(0, ids(tok, '<call>calculator(expression="1+1")'), "eos", 99),
                          TurnEnd(1, ids(tok, "<call>calculator(expression="), "length", 99),
                          TurnEnd(2, ids(tok, "<call>calculator(1+)</call>"), "stop", 9999)])
    assert out[:2] == [None, None] and tok.decode(out[2]).startswith("<result>Error: cannot read the call")
    recs = [e.record for e in driver.episodes]
    assert [r.truncated for r in recs] == [False, True, False] and [r.tool_calls for r in recs] == [0, 0, 1]


def test_raw_environment_appends_observations_as_text():
    tok = byte_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")
    agent = make_agent(tok, environment="tests.agent_fixtures:CountDown", env_options={"start": 2})
    driver = agent.driver([PromptRow("Count: ")], 1)
    driver.begin(1, 1)
    assert tok.decode(driver.prompt_ids[0]) == "Count: Start at 2."
    assert driver.turn_stops == []
    assert tok.decode(run_turns(driver, tok, ["2\n"], ended="stop")[0]) == "Now 1."
    assert run_turns(driver, tok, ["1<|endoftext|>"]) == [None]
    assert driver.finish()[0].reward == 2.5


# ---------------------------------------------------------------------------------------------- python tool


def test_python_tool_runs_code_in_the_sandbox():
    from logitless.rewards.sandbox import SandboxPool

    if not callable(getattr(SandboxPool, "execute", None)):
        pytest.skip("SandboxPool.execute (logitless.rewards.sandbox) is not in this tree yet")
    tok = chatml_tokenizer()
    agent = make_agent(tok, tools=["python"], tool_options={"python": {"timeout_seconds": 2, "num_workers": 2}})
    driver = agent.driver([PromptRow([{"role": "user", "content": "q"}])], 4)
    driver.begin(4, 4)
    programs = ["print(sum(i * i for i in range(10)))", "x = 1", "raise ValueError('bad input')",
                "while True: pass"]
    out = run_turns(driver, tok, [call_text("python", {"code": p}) for p in programs])
    assert all(o is not None for o in out)
    texts = [tool_text(driver, r) for r in range(4)]
    assert texts[0] == "285\n" or texts[0] == "285"
    assert "printed nothing" in texts[1]
    assert "Error: " in texts[2] and "ValueError" in texts[2]
    assert "Error: the program ran longer than 2 s" in texts[3]
    recs = [e.record for e in driver.episodes]
    assert [r.tool_errors for r in recs] == [0, 0, 1, 1] and recs[3].metrics["tool_timeouts"] == 1


def test_what_the_model_reads_of_each_program_outcome():
    from types import SimpleNamespace

    from logitless.agents.python_tool import program_result
    from logitless.rewards.sandbox import SandboxOptions

    limits = SandboxOptions(timeout_seconds=2, memory_mb=256, output_kb=8)
    cases = {
        ("ok", "285\n", ""): ("285\n", False),
        ("ok", "", ""): ("(the program printed nothing; use print() to show a value)", False),
        ("error", "partial\n", "ZeroDivisionError: division by zero"): (
            "partial\nError: ZeroDivisionError: division by zero", True),
        ("timeout", "", ""): ("Error: the program ran longer than 2 s and was stopped", True),
        ("memory", "", ""): ("Error: the program used more than 256 MB of memory and was stopped", True),
        ("output_limit", "xxx", ""): ("xxx\nError: the program printed more than 8 KB and was stopped", True),
        ("crashed", "", ""): ("Error: the sandbox running the program crashed", True),
    }
    for (status, stdout, error), (text, is_error) in cases.items():
        r = program_result(SimpleNamespace(status=status, stdout=stdout, error=error), limits)
        assert (r.text, r.error, r.timed_out) == (text, is_error, status == "timeout")
