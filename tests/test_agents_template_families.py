"""Chat-template conformance of the families docs/agents.md lists, with their real templates
(tests/fixtures/chat_templates, NOTICE.md there) and byte-level tokenizers carrying each family's special tokens.

For each family a multi-turn episode (prompt, sampled turns with and without tool calls, tool results or
environment observations) goes through the agent's driver and is assembled as an engine assembles it
(`EpisodeStream`). Checked against ground truth: the trained ids (env mask 0) are exactly the sampled ids; each
observation is the literal text the template writes for those messages after the model's latest turn (read off
the template source); and the whole sequence relates to the template's rendering of the whole conversation as
docs/agents.md says: equal for append-only templates, equal after the documented rewrite for the others (Qwen3
drops earlier reasoning, Hermes 3 adds a newline in earlier tool turns, GPT-OSS drops earlier analysis).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from logitless.agents import Agent, AgentOptions
from logitless.data.prompts import PromptRow
from logitless.rollout.episodes import EpisodeStream, TurnEnd
from tests.agent_fixtures import CHATML_SPECIALS, LLAMA_SPECIALS, MISTRAL_SPECIALS, byte_tokenizer, ids

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                    "<|endoftext|>"]
GEMMA_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
FAMILIES = {  # name: (special tokens, template file, bos, eos)
    "qwen2.5": (CHATML_SPECIALS, "Qwen-Qwen2.5-7B-Instruct", None, "<|im_end|>"),
    "qwen3": (CHATML_SPECIALS, "Qwen-Qwen3-0.6B", None, "<|im_end|>"),
    "llama3.1": (LLAMA_SPECIALS, "meta-llama-Llama-3.1-8B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": (LLAMA_SPECIALS, "meta-llama-Llama-3.2-3B-Instruct", "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL_SPECIALS, "mistralai-Mistral-Nemo-Instruct-2407", "<s>", "</s>"),
    "gpt-oss": (HARMONY_SPECIALS, "openai-gpt-oss-120b", None, "<|return|>"),
    "hermes3": (CHATML_SPECIALS + ["<|begin_of_text|>"], "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
                "<|begin_of_text|>", "<|im_end|>"),
    "gemma3": (GEMMA_SPECIALS, "google-gemma-3-it", "<bos>", "<eos>"),
}
PROMPT = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12*34+1?"}]


def tokenizer(family):
    specials, name, bos, eos = FAMILIES[family]
    return byte_tokenizer(specials, (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), bos=bos, eos=eos)


def hermes_call(expr):
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expr + '"}}\n</tool_call>'


def play(tok, agent, prompt, texts):
    """Drive one episode: each sampled turn's text is encoded as the model's ids and handed to the driver; returns
    the prompt ids, the assembled stream, the sampled ids, the observation texts and the episode record."""
    driver = agent.driver([PromptRow(prompt)], 1)
    driver.begin(1, 1)
    stream, sampled, observations = EpisodeStream(), [], []
    for text in texts:
        turn = ids(tok, text)
        sampled += turn
        stream.add(turn, [-1.0] * len(turn), env=False)
        obs = driver.respond([TurnEnd(0, turn, "eos", 100_000)])[0]
        if obs is not None:
            stream.add(obs, None, env=True)
            observations.append(tok.decode(obs))
    record = driver.finish()[0]
    assert [i for i, env in zip(stream.ids, stream.env) if not env] == sampled  # trained ids = sampled ids
    return driver.prompt_ids[0], stream, sampled, observations, record


def render(tok, agent, messages, gen=False):
    return tok.apply_chat_template(messages, tools=agent.bridge.tools, chat_template=agent.bridge.template,
                                   tokenize=False, add_generation_prompt=gen, **agent.bridge.template_kwargs)


def tool_episode(family, texts, history="as_sampled", **template_kwargs):
    tok = tokenizer(family)
    agent = Agent(tok, AgentOptions(tools=["calculator"], history=history), template_kwargs)
    prompt = PROMPT[1:] if family.startswith("llama") else PROMPT
    prompt_ids, stream, sampled, observations, record = play(tok, agent, prompt, texts)
    assert prompt_ids == ids(tok, render(tok, agent, prompt, gen=True))
    whole = render(tok, agent, prompt + record.messages)
    return tok, agent, tok.decode(prompt_ids + stream.ids), whole, observations, record


# ---------------------------------------------------------------------------------------------- append-only families


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "hermes3"])
def test_hermes_families_tool_episode(family, recwarn):
    think = "<think>\nMultiply first.\n</think>\n\n" if family == "qwen3" else ""
    texts = [think + hermes_call("12*34") + "\n" + hermes_call("2**70") + "<|im_end|>",
             think + "Now add one.\n" + hermes_call("408+1") + "<|im_end|>", think + "The answer is 409.<|im_end|>"]
    tok, agent, stream, whole, observations, record = tool_episode(family, texts)
    assert agent.chat_format == "hermes" and agent.bridge.turn_end_texts == ["<|im_end|>"]
    gen = "<|im_start|>assistant\n"
    if family == "hermes3":  # tool role, no newline after its <|im_end|>; a non-last result ends "\n</tool_response>\n"
        assert observations == [
            "\n<|im_start|>tool\n<tool_response>\n408\n</tool_response>\n<tool_response>\n1180591620717411303424\n"
            "</tool_response><|im_end|>" + gen, "\n<|im_start|>tool\n<tool_response>\n409\n</tool_response><|im_end|>" + gen]
        # re-rendered, each earlier tool turn gains a newline before <|im_end|> and a call's turn loses its text:
        # trained as the model was given it and wrote it
        given = stream.replace("</tool_response><|im_end|>", "</tool_response>\n<|im_end|>")
        assert whole == given.replace("Now add one.\n", "") + "\n"
        assert "given '<|im_end|><|im_start|>assistant" in agent.bridge.rewrites
        return
    assert observations == [
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n1180591620717411303424\n"
        "</tool_response><|im_end|>\n" + gen, "\n<|im_start|>user\n<tool_response>\n409\n</tool_response><|im_end|>\n" + gen]
    # one user query: Qwen3 keeps the reasoning of every turn after it, so the episode is its whole rendering
    assert whole == stream + "\n" and (record.turns, record.tool_calls, record.tool_errors) == (3, 3, 0)


def test_qwen3_without_thinking_trains_the_empty_think_block_it_was_given(recwarn):
    texts = [hermes_call("12*34") + "<|im_end|>", "The answer is 409.<|im_end|>"]
    tok, agent, stream, whole, observations, record = tool_episode("qwen3", texts, enable_thinking=False)
    empty = "<think>\n\n</think>\n\n"
    assert stream.count("<|im_start|>assistant\n" + empty) == 2  # the prompt and the observation pre-fill it
    assert observations == ["\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n" + empty]
    # re-rendered, the call's turn (no longer the last) loses its empty think block; the last keeps it
    first = stream.index(empty)
    assert whole == stream[:first] + stream[first + len(empty):] + "\n"
    assert "enable_thinking" in agent.bridge.template_kwargs and agent.bridge.rewrites


@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])
def test_llama_tool_episode(family):
    texts = ['{"name": "calculator", "parameters": {"expression": "12*34"}}<|eot_id|>',
             '<|python_tag|>{"name": "calculator", "parameters": {"expression": "408+1"}}<|eom_id|>',
             "The answer is 409.<|eot_id|>"]
    tok, agent, stream, whole, observations, record = tool_episode(family, texts)
    assert agent.chat_format == "llama3_json" and agent.bridge.turn_end_texts == ["<|eot_id|>", "<|eom_id|>"]
    gen = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    # a string result is written with tojson (a string "is iterable" in jinja): "408" with its quotes
    assert observations == [f'<|start_header_id|>ipython<|end_header_id|>\n\n"{r}"<|eot_id|>{gen}' for r in (408, 409)]
    assert (record.turns, record.tool_calls, record.tool_errors) == (3, 2, 0)
    # the template writes every call as {"name", "parameters"}<|eot_id|>; the model's <|python_tag|>/<|eom_id|> turn
    # is trained as sampled, everything else is the whole rendering
    sampled_second = texts[1]
    rendered_second = '{"name": "calculator", "parameters": {"expression": "408+1"}}<|eot_id|>'
    assert whole == stream.replace(sampled_second, rendered_second)


@pytest.mark.parametrize("family", ["llama3.1", "llama3.2"])
def test_llama_two_calls_in_one_turn_are_answered_as_an_invalid_call(family):
    """Llama 3.x templates render one call per assistant turn (they raise on two): a turn that writes two is
    answered with an error the model reads, not a crash of the rollout; the turn's text stays in the record."""
    two = ('{"name": "calculator", "parameters": {"expression": "12*34"}}; '
           '{"name": "calculator", "parameters": {"expression": "1+1"}}<|eot_id|>')
    texts = [two, '{"name": "calculator", "parameters": {"expression": "12*34"}}<|eot_id|>', "409.<|eot_id|>"]
    tok, agent, stream, whole, observations, record = tool_episode(family, texts)
    assert not agent.bridge.renders_several_calls()
    assert "one tool call per turn, and the turn wrote 2" in observations[0] and '"408"' in observations[1]
    assert (record.turns, record.tool_calls, record.tool_errors) == (3, 2, 1)
    assert record.messages[0]["content"] == two[: -len("<|eot_id|>")]  # what the model wrote, for rewards and traces
    assert record.messages[0]["tool_calls"][0]["function"]["name"] == "invalid_call"


def test_templates_that_render_several_calls_keep_them():
    tok = tokenizer("qwen2.5")
    assert Agent(tok, AgentOptions(tools=["calculator"])).bridge.renders_several_calls()


def test_mistral_tool_episode():
    call = '{"name": "calculator", "arguments": {"expression": "%s"}, "id": "%s"}'
    texts = ["[TOOL_CALLS][" + call % ("12*34", "a00000001") + ", " + call % ("2**70", "a00000002") + "]</s>",
             "[TOOL_CALLS][" + call % ("408+1", "a00000003") + "]</s>", "The answer is 409.</s>"]
    with pytest.warns(UserWarning, match="re-renders a system message.*a tool message follow, a re-render of the "
                      "conversation drops it"):
        tok, agent, stream, whole, observations, record = tool_episode("mistral", texts)
    assert agent.chat_format == "mistral" and agent.bridge.turn_end_texts == ["</s>"]
    assert observations == ['[TOOL_RESULTS]{"content": 408, "call_id": "a00000001"}[/TOOL_RESULTS]'
                            '[TOOL_RESULTS]{"content": 1180591620717411303424, "call_id": "a00000002"}[/TOOL_RESULTS]',
                            '[TOOL_RESULTS]{"content": 409, "call_id": "a00000003"}[/TOOL_RESULTS]']
    # Mistral Nemo writes the system message into the last user message only: a re-render drops it from history
    assert whole == stream.replace("Use the calculator.\n\n", "") and record.tool_calls == 3


# ---------------------------------------------------------------------------------------------- GPT-OSS (harmony)


def test_gpt_oss_tool_episode_keeps_the_analysis_it_sampled(recwarn):
    call = ("<|channel|>analysis<|message|>Multiply first.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.calculator <|constrain|>json<|message|>{"expression": "%s"}<|call|>')
    texts = [call % "12*34", call % "408+1",
             "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>The answer is "
             "409.<|return|>"]
    tok, agent, stream, whole, observations, record = tool_episode("gpt-oss", texts)
    assert agent.chat_format == "harmony" and agent.bridge.turn_end_texts == ["<|return|>", "<|call|>"]
    assert observations == [f'<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"{r}"<|end|>'
                            "<|start|>assistant" for r in (408, 409)]
    assert [m.get("tool_calls", [{}])[0].get("function", {}).get("arguments") for m in record.messages
            if m["role"] == "assistant"] == [{"expression": "12*34"}, {"expression": "408+1"}, None]
    assert record.messages[-1]["content"] == "The answer is 409." and record.tool_errors == 0
    # the template re-renders without the analysis and with its own call header; the trained turns are the sampled
    # ones, every observation and the prompt are the template's own text
    assert "Multiply first." not in whole and stream.count("Multiply first.") == 2
    assert whole.startswith(stream[:stream.index("<|channel|>analysis")])


def test_harmony_parser_reads_calls_content_and_errors():
    from logitless.agents.parsing import parse_harmony

    turn = parse_harmony('<|channel|>analysis<|message|>think<|end|><|start|>assistant to=functions.f<|channel|>'
                         'commentary json<|message|>{"x": 1}')
    assert turn.content == "" and [(c.name, c.arguments, c.error) for c in turn.calls] == [("f", {"x": 1}, None)]
    bad = parse_harmony("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{x: 1}")
    assert bad.calls[0].name is None and "not valid JSON" in bad.calls[0].error and "to=functions." in bad.calls[0].error
    assert parse_harmony("<|channel|>final<|message|>42").content == "42" and parse_harmony("42").content == "42"


# ---------------------------------------------------------------------------------------------- environments


def env_episode(family, texts, **template_kwargs):
    tok = tokenizer(family)
    agent = Agent(tok, AgentOptions(environment="tests.agent_fixtures:CountDown", env_options={"start": 2}),
                  template_kwargs)
    prompt_ids, stream, sampled, observations, record = play(tok, agent, [{"role": "user", "content": "Count down."}],
                                                             texts)
    assert record.reward == 2.5 and record.turns == 2
    return agent, tok.decode(prompt_ids + stream.ids), observations, record


@pytest.mark.parametrize("family", ["gemma3", "llama3.2", "mistral", "hermes3"])
def test_environment_episode_of_append_only_families(family):
    """(hermes3: its tool_use template iterates `tools` even when there are none; the bridge gives it [])"""
    end = {"gemma3": "<end_of_turn>", "llama3.2": "<|eot_id|>", "mistral": "</s>", "hermes3": "<|im_end|>"}[family]
    agent, stream, observations, record = env_episode(family, ["2" + end, "1" + end])
    expected = {"gemma3": "\n<start_of_turn>user\nNow 1.<end_of_turn>\n<start_of_turn>model\n",
                "llama3.2": "<|start_header_id|>user<|end_header_id|>\n\nNow 1.<|eot_id|>"
                            "<|start_header_id|>assistant<|end_header_id|>\n\n",
                "mistral": "[INST]Now 1.[/INST]",
                "hermes3": "\n<|im_start|>user\nNow 1.<|im_end|>\n<|im_start|>assistant\n"}[family]
    assert observations == [expected] and agent.bridge.rewrites is None
    tok = agent.tokenizer
    whole = render(tok, agent, agent.driver([PromptRow([{"role": "user", "content": "Count down."}])], 1).prompts[0]
                   + record.messages)
    assert whole.rstrip("\n") == stream


def test_qwen3_environment_episode_keeps_the_reasoning_a_rerender_drops(recwarn):
    tok = tokenizer("qwen3")
    agent = Agent(tok, AgentOptions(environment="tests.agent_fixtures:Turns", env_options={"turns": 2}))
    prompt = [{"role": "user", "content": "Count down."}]
    _, stream, _, observations, record = play(tok, agent, prompt, [
        "<think>\nStart at 2.\n</think>\n\n2<|im_end|>", "<think>\nNext.\n</think>\n\n1<|im_end|>"])
    stream = tok.decode(ids(tok, render(tok, agent, [{"role": "user", "content": "Count down. (2 turns)"}], True))
                        + stream.ids)
    assert observations == ["\n<|im_start|>user\n [1 left]<|im_end|>\n<|im_start|>assistant\n"]
    # the environment's step reads the turn as sampled, reasoning included
    assert record.messages[0]["content"] == "<think>\nStart at 2.\n</think>\n\n2"
    whole = render(tok, agent, [{"role": "user", "content": "Count down. (2 turns)"}] + record.messages)
    # the earlier turn's reasoning is gone from a re-render (it precedes the last user message); it is trained
    assert whole == stream.replace("<think>\nStart at 2.\n</think>\n\n", "") + "\n"
    with pytest.raises(ValueError, match="not append-only.*agent.history=as_sampled"):
        Agent(agent.tokenizer, AgentOptions(environment="tests.agent_fixtures:CountDown", history="append_only"))


def test_gpt_oss_environment_episode():
    agent, stream, observations, record = env_episode("gpt-oss", [
        "<|channel|>final<|message|>2<|return|>", "<|channel|>analysis<|message|>Next.<|end|><|start|>assistant"
        "<|channel|>final<|message|>1<|return|>"])
    # the environment reads the final channel's text ("2", "1": reward 2.5); the observation follows <|return|>
    assert observations == ["<|start|>user<|message|>Now 1.<|end|><|start|>assistant"]
    assert [m["content"] for m in record.messages] == ["2", "Now 1.", "1"]
    assert "'return|>'" in agent.bridge.rewrites and "'end|>'" in agent.bridge.rewrites


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3.1", "llama3.2", "gpt-oss", "hermes3"])
def test_templates_that_keep_the_system_message_do_not_warn_about_it(family, recwarn):
    agent = Agent(tokenizer(family), AgentOptions(tools=["calculator"]))
    assert agent.bridge.system_rewrite is None
    assert not [w for w in recwarn if "system message" in str(w.message)]


def test_mistral_system_message_a_rerender_drops_is_reported_with_an_environment_too():
    with pytest.warns(UserWarning, match="a user message follow, a re-render of the conversation drops it"):
        agent = Agent(tokenizer("mistral"), AgentOptions(environment="tests.agent_fixtures:CountDown"))
    # ground truth: the template itself writes the system message into the prompt and not into the conversation
    given = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count down."}]
    later = given + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "Now 1."},
                     {"role": "assistant", "content": "1"}]
    assert "Be brief." in render(agent.tokenizer, agent, given, gen=True)
    assert "Be brief." not in render(agent.tokenizer, agent, later)


def test_gemma3_tools_are_refused_naming_the_fix():
    # the first error names both settings, in the order they are needed
    with pytest.raises(ValueError, match=re.escape("cannot render tools") + ".*set, in order: agent.chat_template"
                       + ".*then.*agent.format"):
        Agent(tokenizer("gemma3"), AgentOptions(tools=["calculator"]))
    with pytest.raises(ValueError, match=re.escape("the tokenizer's chat template cannot render tools") +
                       ".*agent.chat_template"):
        Agent(tokenizer("gemma3"), AgentOptions(tools=["calculator"], format="hermes"))
