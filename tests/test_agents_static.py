"""An agent on the static engine, end to end on CPU: a tiny model that learned one worked example calls the
calculator in the raw protocol, the engine ends its turn at `</call>`, prefills the driver's `<result>` and the model
finishes its answer; the batch marks the result as the driver's and the sampler's logprobs of the model's tokens
equal the trainer's."""

from __future__ import annotations

import torch

from logitless.agents import Agent, AgentOptions
from logitless.data.prompts import PromptRow
from logitless.models import completion_logprobs
from logitless.rollout import SamplingOptions, make_engine
from tests.agent_fixtures import byte_tokenizer, ids

PROMPT = "Q: 12*34?\nA: "
CALL = '<call>calculator(expression="12*34")</call>'
ANSWER = " 408.<|endoftext|>"


def _memorizing_model(tok, text: str):
    """A 2-layer Llama that reproduces `text` greedily (trained on it alone)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    seq = torch.tensor([ids(tok, text)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        model(seq, labels=seq).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_a_model_calls_the_calculator_through_the_static_engine(one_thread):
    tok = byte_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")
    tok.pad_token = "<|endoftext|>"
    model = _memorizing_model(tok, PROMPT + CALL + "<result>408</result>" + ANSWER)
    agent = Agent(tok, AgentOptions(tools=["calculator"]))
    driver = agent.driver([PromptRow(PROMPT)], 1)
    engine = make_engine("static", model, tok)
    b = engine.generate(driver.prompt_ids, SamplingOptions(num_generations=1, temperature=0.0, max_new_tokens=80),
                        episodes=driver)
    n = int(b.completion_mask[0].sum())
    completion, env = b.completion_ids[0, :n].tolist(), b.env_mask[0, :n].tolist()
    assert completion == ids(tok, CALL + "<result>408</result>" + ANSWER)  # the result came from the calculator
    assert env == [0] * len(ids(tok, CALL)) + [1] * len(ids(tok, "<result>408</result>")) + [0] * len(ids(tok, ANSWER))
    rec = b.episodes[0]
    assert (rec.turns, rec.tool_calls, rec.tool_errors, rec.truncated) == (2, 1, 0, False)
    assert rec.messages[1] == {"role": "tool", "name": "calculator", "content": "408", "tool_call_id": "000000000"}
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)
    model_tokens = b.loss_mask().bool()
    assert (lp - b.sampler_logp)[model_tokens].abs().max() < 1e-5
    assert (b.sampler_logp[b.env_mask.bool()] == 0).all()
