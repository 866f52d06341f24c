"""The system message of agent prompts: the shipped qwen2.5 template, put in for a ChatML template that cannot render
tools (or named), writes the model's own default system message (Qwen's only for a model whose template says it),
else a neutral one; agent.system_prompt sets it for prompts without one."""

from __future__ import annotations

import pytest

from logitless.agents import Agent, AgentOptions
from logitless.agents.templates import chatml_default_system, load_template
from logitless.data.prompts import PromptRow
from tests.agent_fixtures import CHATML_SPECIALS, byte_tokenizer, chatml_tokenizer

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# ChatML without tools whose default system message is SYSTEM (Qwen2.5's and SmolLM2's own templates, minus their
# tool support); "" writes no system turn at all (plain ChatML)
OWN_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' and SYSTEM %}{{- '<|im_start|>"
    "system\\n' + SYSTEM + '<|im_end|>\\n' }}{%- endif %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
    "'<|im_start|>assistant\\n' }}{%- endif %}"
)


def own_tokenizer(system: str):
    """A byte-level ChatML tokenizer whose own template (no tools) writes `system` as its default."""
    return byte_tokenizer(CHATML_SPECIALS, OWN_TEMPLATE.replace("SYSTEM", repr(system)), eos="<|endoftext|>")


def _chat(text: str) -> PromptRow:
    return PromptRow([{"role": "user", "content": text}], {})


@pytest.mark.parametrize("own, want", [(QWEN_SYSTEM, QWEN_SYSTEM), (SMOL_SYSTEM, SMOL_SYSTEM),
                                       ("", "You are a helpful assistant.")], ids=["qwen", "smollm2", "plain-chatml"])
def test_the_substituted_template_keeps_the_models_own_default_system_message(own, want):
    """Qwen's identity only for a model whose own template says it; a plain ChatML model gets a neutral one. The
    same when the template is named (agent.chat_template=qwen2.5) rather than substituted."""
    tok = own_tokenizer(own)
    assert chatml_default_system(tok, tok.chat_template) == (own or None)
    agent = Agent(tok, AgentOptions(tools=["calculator"]))
    assert agent.bridge.template == load_template("qwen2.5")  # substituted: the own template renders no tools
    prompt = tok.decode(agent.driver([_chat("q")], 1).prompt_ids[0])
    assert prompt.startswith(f"<|im_start|>system\n{want}\n\n# Tools\n")
    assert ("Qwen" in prompt) == (own == QWEN_SYSTEM)
    named = Agent(tok, AgentOptions(environment="tests.agent_fixtures:CountDown", chat_template="qwen2.5"))
    assert tok.decode(named.driver([_chat("q")], 1).prompt_ids[0]).startswith(f"<|im_start|>system\n{want}<|im_end|>")


def test_agent_system_prompt_is_the_system_message_of_prompts_without_one():
    for tok in (own_tokenizer(QWEN_SYSTEM), own_tokenizer("")):
        agent = Agent(tok, AgentOptions(tools=["calculator"], system_prompt="You solve arithmetic."))
        own = PromptRow([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], {})
        driver = agent.driver([_chat("q"), own], 1)
        first, second = (tok.decode(p) for p in driver.prompt_ids)
        assert first.startswith("<|im_start|>system\nYou solve arithmetic.\n\n# Tools\n") and "Qwen" not in first
        assert second.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")  # a prompt's own one stays
        assert driver.prompts[0][0] == {"role": "system", "content": "You solve arithmetic."}
    agent = Agent(chatml_tokenizer(), AgentOptions(tools=["calculator"], system_prompt="S"))
    with pytest.raises(ValueError, match="agent.system_prompt is the system message of chat prompts, but the "
                                         "prompts are raw text"):
        agent.driver([PromptRow("Q: 1+1?\nA:", {})], 1)
    with pytest.raises(ValueError, match="agent.system_prompt=3 is invalid"):
        AgentOptions(tools=["calculator"], system_prompt=3)
