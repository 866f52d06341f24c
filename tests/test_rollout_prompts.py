"""What every rollout backend shares before sampling (`rollout/engine.py`), on its own: where the EOS ids come
from, how chat prompts are told from bad ones and encoded, the context window (of a model whose text settings
sit in a sub-config; it caps the static cache), the model under a compile wrapper, and the warnings. Cases that
mutation testing (docs/testing.md) showed the engine tests leave open."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import transformers as tf

from logitless.rollout import SamplingOptions
from logitless.rollout.engine import (
    context_window,
    encode_prompts,
    resolve_special_tokens,
    unwrap_model,
    warn_greedy_duplicates,
)
from logitless.rollout.static import StaticEngine
from tests.test_rollout_families import TOK, make_model


def test_eos_ids_come_from_the_options_then_the_generation_config_then_the_tokenizer():
    model = make_model("llama")
    model.generation_config.eos_token_id = [5, 7]
    assert resolve_special_tokens(model, TOK, SamplingOptions()) == (TOK.pad_token_id, [5, 7])
    assert resolve_special_tokens(model, TOK, SamplingOptions(eos_token_ids=[9])) == (TOK.pad_token_id, [9])
    model.generation_config.eos_token_id = 6
    assert resolve_special_tokens(model, TOK, SamplingOptions()) == (TOK.pad_token_id, [6])
    model.generation_config.eos_token_id = None
    assert resolve_special_tokens(model, TOK, SamplingOptions()) == (TOK.pad_token_id, [TOK.eos_token_id])
    no_config = types.SimpleNamespace()  # a model without a generation config
    assert resolve_special_tokens(no_config, TOK, SamplingOptions()) == (TOK.pad_token_id, [TOK.eos_token_id])


def test_context_window_of_a_model_with_a_text_sub_config():
    cfg = tf.Gemma3Config(text_config={"max_position_embeddings": 77})
    assert not hasattr(cfg, "max_position_embeddings")  # only the text config has it
    assert context_window(types.SimpleNamespace(config=cfg)) == 77
    assert context_window(make_model("llama")) == 128


def test_a_tokenizer_without_pad_token_is_warned_about_once_each():
    model = make_model("llama")
    first, second = copy.deepcopy(TOK), copy.deepcopy(TOK)
    first.pad_token = second.pad_token = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for tok in (first, first, second):
            assert resolve_special_tokens(model, tok, SamplingOptions()) == (TOK.eos_token_id, [TOK.eos_token_id])
    texts = [str(w.message) for w in seen]
    assert texts == [f"tokenizer has no pad token; padding with the EOS id {TOK.eos_token_id}"] * 2


def test_greedy_warning_only_with_several_samples():
    with pytest.warns(UserWarning) as seen:
        warn_greedy_duplicates(SamplingOptions(temperature=0.0, num_generations=4))
    assert [str(w.message) for w in seen] == [
        "temperature=0 (greedy) with num_generations=4: every sample of a prompt is identical, so group "
        "advantages are all zero; use temperature > 0 for GRPO"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_greedy_duplicates(SamplingOptions(temperature=0.0, num_generations=1))
        warn_greedy_duplicates(SamplingOptions(temperature=1.0, num_generations=4))


def test_chat_prompts_get_the_generation_prompt_and_bad_ones_are_refused_by_their_text():
    chat = copy.deepcopy(TOK)
    chat.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    opts = SamplingOptions()
    messages = [{"role": "user", "content": "hi"}]
    [ids] = encode_prompts(chat, [messages], opts, None)
    assert chat.decode(ids) == "<user>hi<assistant>"
    for bad in (["plain", "strings"], ["role play"], [{"content": "no role"}]):
        with pytest.raises(TypeError) as info:
            encode_prompts(chat, ["ok", bad], opts, None)
        why = (f"prompts[1] must be a string, a list of {{'role', 'content'}} dicts or a list of token ids, got "
               f"{bad!r:.80}")
        assert str(info.value) == why
    with pytest.raises(ValueError) as info:
        encode_prompts(TOK, [messages], opts, None)
    assert str(info.value) == (
        "prompts[0] is a chat-message list but the tokenizer has no chat_template: set tokenizer.chat_template "
        "(e.g. copy it from the instruct model's tokenizer) or pass raw text"
    )


def test_the_static_cache_stays_within_the_context_window():
    model = make_model("llama")  # a context window of 128 positions
    eng = StaticEngine(model, TOK, cache_multiple=96)
    b = eng.generate(["a" * 90], SamplingOptions(num_generations=1, max_new_tokens=10, seed=0, ignore_eos=True))
    assert b.completion_mask.sum() == 10
    assert eng._max_len == 128  # 100 positions rounded up to 192, capped at the window


def test_a_compiled_model_is_unwrapped():
    model = make_model("llama")
    assert unwrap_model(torch.compile(model)) is model  # compiles nothing until called
