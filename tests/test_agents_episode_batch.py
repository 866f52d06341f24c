"""The driver through the episode protocol as an engine runs it (begin, respond per turn, finish) into
`episode_batch`: the rollout batch holds exactly the conversation the template renders, with the driver's
tokens (and only those) under env_mask."""

from __future__ import annotations

import time

import torch

from logitless.agents import Agent, AgentOptions
from logitless.data.prompts import PromptRow
from logitless.rollout.engine import PreparedPrompts, left_pad
from logitless.rollout.episodes import EpisodeStream, TurnEnd, episode_batch
from logitless.rollout.types import SamplingOptions
from tests.agent_fixtures import call_text, chatml_tokenizer, ids


def scripted_rollout(tok, driver, scripts, max_new_tokens):
    """An engine without a model: row b samples the texts scripts[b] in order, one per turn (log-prob -1 per
    token), until the driver ends its episode."""
    G = driver.num_generations
    B = len(driver.prompt_ids) * G
    options = SamplingOptions(num_generations=G, max_new_tokens=max_new_tokens)
    prompt_ids, prompt_mask = left_pad(driver.prompt_ids, tok.pad_token_id or 0, torch.device("cpu"))
    prep = PreparedPrompts(options, tok.pad_token_id or 0, [], torch.device("cpu"), driver.prompt_ids, prompt_ids,
                           prompt_mask, None, time.perf_counter())
    streams = [EpisodeStream() for _ in range(B)]
    driver.begin(B, G)
    turn = 0
    while not all(s.done for s in streams):
        live = [b for b in range(B) if not streams[b].done]
        ends = []
        for b in live:
            sampled = ids(tok, scripts[b][turn])
            streams[b].add(sampled, [-1.0] * len(sampled), env=False)
            ends.append(TurnEnd(b, sampled, "eos", max_new_tokens - len(streams[b].ids)))
        for b, obs in zip(live, driver.respond(ends)):
            if obs is None:
                streams[b].done = True
            else:
                streams[b].add(obs, None, env=True)
        turn += 1
    return episode_batch(tok, prep, streams, driver.finish(), 0.0)


def test_batch_rows_are_the_rendered_conversations_and_env_mask_marks_the_driver_tokens():
    tok = chatml_tokenizer()
    tok.pad_token = "<|endoftext|>"
    agent = Agent(tok, AgentOptions(tools=["calculator"]))
    prompts = [[{"role": "user", "content": "What is 6*7?"}], [{"role": "user", "content": "And 2**10?"}]]
    driver = agent.driver([PromptRow(p) for p in prompts], 2)
    scripts = [
        [call_text("calculator", {"expression": "6*7"}), "42<|im_end|>"],
        ["42<|im_end|>"],
        [call_text("calculator", {"expression": "2**10"}), call_text("calculator", {"expression": "1024+0"}),
         "1024<|im_end|>"],
        [call_text("calc", {"expression": "2**10"}), "1024<|im_end|>"],
    ]
    batch = scripted_rollout(tok, driver, scripts, max_new_tokens=4096)
    for b in range(4):
        n = int(batch.completion_mask[b].sum())
        prompt = [int(i) for i, m in zip(batch.prompt_ids[b], batch.prompt_mask[b]) if m]
        completion = batch.completion_ids[b, :n].tolist()
        conversation = prompts[b // 2] + batch.episodes[b].messages
        rendered = ids(tok, tok.apply_chat_template(conversation, tools=agent.toolset.schemas,
                                                    chat_template=agent.bridge.template, tokenize=False))
        assert rendered[: len(prompt) + n] == prompt + completion
        assert tok.decode(rendered[len(prompt) + n:]) == "\n"
        model = [t for t, e in zip(completion, batch.env_mask[b, :n].tolist()) if not e]
        assert model == [t for s in scripts[b] for t in ids(tok, s)]  # the sampled ids, untouched
        assert torch.equal(batch.loss_mask()[b, :n], 1 - batch.env_mask[b, :n])
        assert (batch.sampler_logp[b, :n] == torch.where(batch.env_mask[b, :n].bool(), 0.0, -1.0)).all()
    assert [e.turns for e in batch.episodes] == [2, 1, 3, 2]
    assert [e.tool_errors for e in batch.episodes] == [0, 0, 0, 1]
    assert not batch.truncated.any()
