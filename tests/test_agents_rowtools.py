"""Per-row tool sets (agent.tools_field): a row's tool set decides which tool schemas its prompt shows (token for
token the template's rendering with exactly those tools) and which calls run: a call outside the set reads the
unknown-tool error. A row naming a tool that is not configured fails before the weights load, naming the row and the
field.
"""

from __future__ import annotations

import json

import pytest

from logitless.agents import Agent, AgentOptions
from logitless.agents.templates import load_template
from logitless.data.prompts import PromptRow
from tests.agent_fixtures import call_text, chatml_tokenizer, ids, run_turns, tool_text
from tests.test_agent_dry_run import _args, model_dir  # noqa: F401 (fixture)
from tests.test_rundir import _cli, no_model_load  # noqa: F401 (fixture)


def lookup(city: str) -> str:
    """Current temperature of a city.

    Args:
        city: The city's name.
    """
    return f"21 C in {city}"


def _chat(text: str, tools: list[str] | None = None) -> PromptRow:
    return PromptRow([{"role": "user", "content": text}], {"answer": "1"} | ({} if tools is None else {"tools": tools}))


# ---------------------------------------------------------------------------------------------- per-row tool sets


def test_rows_see_and_may_call_only_their_own_tools():
    tok = chatml_tokenizer()
    agent = Agent(tok, AgentOptions(tools=["calculator", "tests.test_agents_rowtools:lookup"], tools_field="tools"))
    schemas = {name: t.schema for name, t in agent.tools.items()}
    rows = [_chat("q0", ["calculator"]), _chat("q1", ["lookup"]), _chat("q2", []), _chat("q3", ["lookup", "calculator"])]
    driver = agent.driver(rows, 2)
    tpl, default = load_template("qwen2.5"), {"default_system_prompt": "You are a helpful assistant."}
    for i, names in enumerate([["calculator"], ["lookup"], [], ["calculator", "lookup"]]):  # the configured order
        want = tok.apply_chat_template(rows[i].prompt, tools=[schemas[n] for n in names] or None, chat_template=tpl,
                                       tokenize=False, add_generation_prompt=True, **default)
        assert driver.prompt_ids[i] == ids(tok, want)
    text = [tok.decode(p) for p in driver.prompt_ids]
    assert '"name": "calculator"' in text[0] and '"name": "lookup"' not in text[0]
    assert '"name": "lookup"' in text[1] and '"name": "calculator"' not in text[1]
    assert "# Tools" not in text[2] and "<tools>" not in text[2]
    assert len(set(map(tuple, driver.prompt_ids))) == 4

    driver.begin(8, 2)
    turns = [call_text("lookup", {"city": "Oslo"}), call_text("nope", {}),  # prompt 0: lookup is not its tool
             call_text("lookup", {"city": "Oslo"}), call_text("calculator", {"expression": "1+1"}),  # prompt 1
             call_text("calculator", {"expression": "1+1"}), None,  # prompt 2: no tools at all
             call_text("lookup", {"city": "Oslo"}), call_text("calculator", {"expression": "2*3"})]  # prompt 3: both
    out = run_turns(driver, tok, turns)
    assert tool_text(driver, 0) == "Error: unknown tool 'lookup'; the tools are: calculator"
    assert tool_text(driver, 1) == "Error: unknown tool 'nope'; the tools are: calculator"  # the same answer
    assert tool_text(driver, 2) == "21 C in Oslo"
    assert tool_text(driver, 3) == "Error: unknown tool 'calculator'; the tools are: lookup"
    assert tool_text(driver, 4) == "Error: unknown tool 'calculator'; this conversation has no tools"
    assert (tool_text(driver, 6), tool_text(driver, 7)) == ("21 C in Oslo", "6")
    assert [driver.episodes[r].record.tool_errors for r in (0, 1, 2, 3, 4, 6, 7)] == [1, 1, 0, 1, 1, 0, 0]
    # token in, token out: the prompt, the turn and the observation are the template's rendering of the whole
    # conversation with the row's own tools
    conv = rows[1].prompt + driver.episodes[2].record.messages
    whole = tok.apply_chat_template(conv, tools=[schemas["lookup"]], chat_template=tpl, tokenize=False,
                                    add_generation_prompt=True, **default)
    assert driver.prompt_ids[1] + ids(tok, turns[2]) + out[2] == ids(tok, whole)


def test_rows_without_a_valid_tool_set_are_refused_naming_the_row_and_the_field():
    agent = Agent(chatml_tokenizer(), AgentOptions(tools=["calculator", "tests.test_agents_rowtools:lookup"],
                                                   tools_field="tools"))
    where = "data.task='jsonl' split 'train'"
    assert agent.row_tools.check_rows([_chat("a", ["lookup"]), _chat("b", []), _chat("c", ["lookup"])], where) == 2
    cases = [
        (_chat("b", ["calculator", "lookpu"]), "agent.tools_field='tools': row 1 of data.task='jsonl' split 'train' "
         "names the tool 'lookpu', which is not configured (did you mean 'lookup'?); the tools are: calculator, "
         "lookup. Configure it"),
        (_chat("b"), "agent.tools_field='tools': row 1 of data.task='jsonl' split 'train' has no field 'tools' (its "
                     "fields: answer); give every row a list of tool names ([] for none)"),
        (_chat("b", "calculator"), "row 1 of data.task='jsonl' split 'train' has tools='calculator'; give a list of "
                                   "tool names"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError) as e:
            agent.row_tools.check_rows([_chat("a", ["lookup"]), bad], where)
        assert message in str(e.value)
        with pytest.raises(ValueError, match="prompt 1 of this rollout"):  # the rollout refuses it too
            agent.driver([_chat("a", ["lookup"]), bad], 2)
    with pytest.raises(ValueError, match="agent.tools_field='tools' chooses each row's tools among the configured "
                                         "ones, but no tool is configured"):
        Agent(chatml_tokenizer(), AgentOptions(environment="tests.agent_fixtures:CountDown", tools_field="tools"))
    with pytest.raises(ValueError, match="agent.tools_field='tools' is invalid: per-row tool sets"):
        AgentOptions(driver="tests.episode_driver:Echo", tools_field="tools")


def test_a_bad_row_far_into_the_data_fails_before_the_weights_load(tmp_path, model_dir, capsys,  # noqa: F811
                                                                   no_model_load):  # noqa: F811
    """`train` reads every row of the split for the check (row 70 is past the first rows the data checks read),
    without loading the weights or claiming the run folder; --dry-run says what it checked."""
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1), "tools": ["search"] if i % 2 else []}
            for i in range(80)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*_args(model_dir, tmp_path / "run")[:1], f"train.output_dir={tmp_path / 'run'}", "data.task=jsonl",
            f"data.options={{path: {data}, chat: false, answer_field: answer}}", "agent.tools=[dry_tools:search]",
            "agent.tools_field=tools"]
    code, err = _cli(capsys, "train", "--dry-run", *args)
    assert code == 0 and "checked: agent.tools_field='tools': every row names configured tools: 80 rows of split " \
                         "'train' (2 distinct tool sets)" in err, err
    rows[70]["tools"] = ["serch"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = _cli(capsys, "train", *args)
    assert code == 1 and "agent.tools_field='tools': row 70 of data.task='jsonl' split 'train' names the tool " \
                         "'serch', which is not configured (did you mean 'search'?)" in err, err
    assert "the model was loaded" not in err and not (tmp_path / "run").exists()
