"""The chat-template bridge: the shipped Qwen2.5 tool template, and token exactness of prompt + sampled turns +
observations against the template rendering the whole conversation at once (ChatML/Qwen, Llama 3, Mistral)."""

from __future__ import annotations

import json

import pytest

from logitless.agents import Agent, AgentOptions
from logitless.agents.templates import ChatBridge, detect_format, load_template, renders_tools
from logitless.data.prompts import PromptRow
from logitless.rollout.episodes import TurnEnd
from tests.agent_fixtures import (COUNTING_TEMPLATE, DROPS_REASONING_TEMPLATE, chatml_tokenizer, ids, llama_tokenizer,
                                  mistral_tokenizer)

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call><|im_end|>\n")
SCHEMA = {"type": "function", "function": {"name": "f", "description": "F.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "description": "X."}}, "required": ["x"]}}}


def _render(tok, template, messages, tools=None, gen=False, **kw):
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=gen, **kw)


# ---------------------------------------------------------------------------------------------- shipped template


def test_shipped_qwen25_template_writes_the_official_format():
    """With Qwen's default system message (what the agent passes for a Qwen model) the shipped template writes Qwen2.5's
    official text; without one it writes a neutral default, not Qwen's."""
    tok, tpl = chatml_tokenizer(), load_template("qwen2.5")
    user = [{"role": "user", "content": "U"}]
    assert _render(tok, tpl, user, gen=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert _render(tok, tpl, user, gen=True, default_system_prompt=QWEN_DEFAULT_SYSTEM) == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert _render(tok, tpl, user, tools=[SCHEMA], default_system_prompt=QWEN_DEFAULT_SYSTEM) == (
        f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}{TOOLS_HEADER}\n{json.dumps(SCHEMA)}{TOOLS_FOOTER}"
        "<|im_start|>user\nU<|im_end|>\n")
    conv = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"type": "function", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "name": "f", "content": "r1"}, {"role": "tool", "name": "g", "content": "r2"},
        {"role": "assistant", "content": "Thinking.", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 2}}}]},
        {"role": "tool", "name": "f", "content": "r3"},
        {"role": "assistant", "content": "A"},
        {"role": "system", "content": "S2"},
    ]
    assert _render(tok, tpl, conv, tools=[SCHEMA, SCHEMA], gen=True) == (
        f"<|im_start|>system\nS{TOOLS_HEADER}\n{json.dumps(SCHEMA)}\n{json.dumps(SCHEMA)}{TOOLS_FOOTER}"
        "<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThinking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nr3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>system\nS2<|im_end|>\n<|im_start|>assistant\n")


def test_format_detection_and_tool_rendering_probe():
    assert detect_format(load_template("qwen2.5"), chatml_tokenizer()) == "hermes"
    assert detect_format(chatml_tokenizer().chat_template, chatml_tokenizer()) == "hermes"
    assert detect_format(llama_tokenizer().chat_template, llama_tokenizer()) == "llama3_json"
    assert detect_format(mistral_tokenizer().chat_template, mistral_tokenizer()) == "mistral"
    assert detect_format(None, chatml_tokenizer()) is None
    tok = chatml_tokenizer()
    assert "drops the tool schemas" in renders_tools(tok, tok.chat_template)
    assert renders_tools(tok, load_template("qwen2.5")) is None
    assert renders_tools(llama_tokenizer(), llama_tokenizer().chat_template) is None


def test_the_plain_chatml_template_is_replaced_by_the_shipped_one_only_when_tools_need_it():
    tok = chatml_tokenizer()
    assert Agent(tok, AgentOptions(tools=["calculator"])).bridge.template == load_template("qwen2.5")
    env_only = Agent(tok, AgentOptions(environment="tests.agent_fixtures:CountDown"))
    assert env_only.bridge.template == tok.chat_template and env_only.bridge.turn_end_texts == ["<|im_end|>"]


def test_turn_end_ids_per_family():
    tok = llama_tokenizer()
    bridge = Agent(tok, AgentOptions(tools=["calculator"])).bridge
    assert bridge.turn_end_texts == ["<|eot_id|>", "<|eom_id|>"]
    assert bridge.turn_end_ids == tok.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    assert Agent(mistral_tokenizer(), AgentOptions(tools=["calculator"])).bridge.turn_end_texts == ["</s>"]


# ---------------------------------------------------------------------------------------------- refusals


def test_templates_that_are_not_append_only_are_refused_with_append_only_and_named_with_as_sampled():
    env = "tests.agent_fixtures:CountDown"
    with pytest.raises(ValueError, match="agent.chat_template: the chat template is not append-only.*agent.history"):
        Agent(chatml_tokenizer(COUNTING_TEMPLATE), AgentOptions(environment=env, history="append_only"))
    # dropping earlier reasoning matters once a user message (an environment observation) follows
    with pytest.raises(ValueError, match="not append-only"):
        Agent(chatml_tokenizer(DROPS_REASONING_TEMPLATE), AgentOptions(environment=env, history="append_only"))
    # as_sampled (the default): accepted, and the warning says what a re-render changes
    with pytest.warns(UserWarning, match="re-renders earlier turns.*'<think>.*agent.history=append_only"):
        agent = Agent(chatml_tokenizer(DROPS_REASONING_TEMPLATE), AgentOptions(environment=env))
    assert "<think>" in agent.bridge.rewrites
    with pytest.warns(UserWarning, match="the model was given '1<|im_end|>"):
        Agent(chatml_tokenizer(COUNTING_TEMPLATE), AgentOptions(environment=env))
    with pytest.raises(ValueError, match="agent.history='strict' is invalid: use as_sampled"):
        AgentOptions(environment=env, history="strict")


def test_templates_that_cannot_render_tools_or_turn_ends_are_refused(tmp_path):
    tok = llama_tokenizer()
    tok.chat_template = chatml_tokenizer().chat_template.replace("<|im_start|>", "").replace("<|im_end|>", "")
    with pytest.raises(ValueError, match="the tokenizer's chat template cannot render tools.*agent.chat_template"):
        Agent(tok, AgentOptions(tools=["calculator"], format="llama3_json"))
    path = tmp_path / "no_tools.jinja"
    path.write_text(chatml_tokenizer().chat_template)
    with pytest.raises(ValueError, match="agent.chat_template cannot render tools"):
        Agent(chatml_tokenizer(), AgentOptions(tools=["calculator"], chat_template=str(path)))
    with pytest.raises(ValueError, match="neither a shipped template"):
        Agent(chatml_tokenizer(), AgentOptions(tools=["calculator"], chat_template="qwen9"))
    tok = chatml_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="holds no special token"):
        Agent(tok, AgentOptions(environment="tests.agent_fixtures:CountDown", format="hermes"))


# ---------------------------------------------------------------------------------------------- token exactness


CALL = '{{"name": "calculator", "{key}": {{"expression": "{expr}"}}}}'


def _turns(family):
    """Sampled assistant texts (as the template writes them) for: two calls, one call, a final answer."""
    if family == "hermes":
        c = lambda e: "<tool_call>\n" + CALL.format(key="arguments", expr=e) + "\n</tool_call>"  # noqa: E731
        return [c("12*34") + "\n" + c("2**70"), "Next: 408 + 1.\n" + c("408+1"), "The answer is 409."], "<|im_end|>"
    if family == "llama3_json":
        c = lambda e: CALL.format(key="parameters", expr=e)  # noqa: E731
        return [c("12*34"), c("408+1"), "The answer is 409."], "<|eot_id|>"
    c = lambda e, i: '{"name": "calculator", "arguments": {"expression": "' + e + '"}, "id": "' + i + '"}'  # noqa: E731
    return (["[TOOL_CALLS][" + c("12*34", "a00000001") + ", " + c("2**70", "a00000002") + "]",
             "[TOOL_CALLS][" + c("408+1", "a00000003") + "]", "The answer is 409."], "</s>")


@pytest.mark.parametrize("family", ["qwen", "chatml", "llama3_json", "mistral"])
def test_prompt_turns_and_observations_equal_the_whole_conversation_rendered(family, request):
    tok = {"chatml": chatml_tokenizer, "llama3_json": llama_tokenizer, "mistral": mistral_tokenizer,
           "qwen": lambda: request.getfixturevalue("qwen_tokenizer")}[family]()
    fmt = {"qwen": "hermes", "chatml": "hermes"}.get(family, family)
    agent = Agent(tok, AgentOptions(tools=["calculator"]))
    assert agent.chat_format == fmt
    prompt = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12*34+1?"}]
    if fmt == "llama3_json":
        prompt = prompt[1:]
    driver = agent.driver([PromptRow(prompt)], 1)
    driver.begin(1, 1)
    texts, end = _turns(fmt)
    stream = list(driver.prompt_ids[0])
    template, schemas = agent.bridge.template, agent.toolset.schemas
    for k, text in enumerate(texts):
        sampled = ids(tok, text + end)
        stream += sampled
        obs = driver.respond([TurnEnd(0, sampled, "eos", 10_000)])[0]
        messages = prompt + driver.episodes[0].record.messages
        if k < len(texts) - 1:
            assert obs is not None
            stream += obs
            assert ids(tok, _render(tok, template, messages, tools=schemas, gen=True)) == stream
        else:
            assert obs is None
    record = driver.finish()[0]
    assert (record.turns, record.tool_calls, record.tool_errors, record.truncated) == (3, 2 + (fmt != "llama3_json"),
                                                                                       0, False)
    whole = ids(tok, _render(tok, template, prompt + record.messages, tools=schemas))
    assert whole[: len(stream)] == stream and tok.decode(whole[len(stream):]).strip() == ""
    results = [m["content"] for m in record.messages if m["role"] == "tool"]
    assert results[:1] == ["408"] and results[-1] == "409"


@pytest.mark.parametrize("family", ["chatml", "llama3_json"])
def test_environment_observations_are_exact_user_turns(family):
    tok = chatml_tokenizer() if family == "chatml" else llama_tokenizer()
    end = "<|im_end|>" if family == "chatml" else "<|eot_id|>"
    agent = Agent(tok, AgentOptions(environment="tests.agent_fixtures:CountDown", env_options={"start": 2}))
    prompt = [{"role": "user", "content": "Count down."}]
    driver = agent.driver([PromptRow(prompt, {"id": 1})], 1)
    driver.begin(1, 1)
    assert driver.prompts[0][-1]["content"] == "Count down.\n\nStart at 2."
    stream = list(driver.prompt_ids[0])
    for text in ["2", "1"]:
        sampled = ids(tok, text + end)
        obs = driver.respond([TurnEnd(0, sampled, "eos", 10_000)])[0]
        stream += sampled
        if obs is not None:
            stream += obs
            messages = driver.prompts[0] + driver.episodes[0].record.messages
            assert ids(tok, _render(tok, agent.bridge.template, messages, gen=True)) == stream
    record = driver.finish()[0]
    assert record.reward == 2.5 and record.turns == 2 and not record.truncated


def test_bridge_suffix_keeps_the_chatml_seam_in_the_observation():
    tok = chatml_tokenizer()
    bridge = ChatBridge(tok, load_template("qwen2.5"), [SCHEMA], "hermes")
    call = [{"type": "function", "id": "c", "function": {"name": "f", "arguments": {"x": 1}}}]
    suffix = tok.decode(bridge.tool_suffix(call, [{"role": "tool", "name": "f", "content": "7"}]))
    assert suffix == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(bridge.user_suffix("go")) == "\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
