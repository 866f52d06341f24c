"""data.chat_template_kwargs reaches the tokenizer's apply_chat_template for chat prompts: in the rollouts a run
trains on and in its eval (e.g. Qwen3's enable_thinking=false)."""

from __future__ import annotations

import copy

import pytest

from logitless.trainer.config.schema import load_train_config
from logitless.trainer.context import build_context
from logitless.trainer.evaluate import eval_options
from logitless.trainer.distributed.parallel import World
from logitless.trainer.stages import rollout_stage
from tests.conftest import TINY_LORA_QUIET, tiny_qwen2

# a Qwen3-like switch: an empty thinking block when enable_thinking is false
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")


@pytest.fixture
def tok(gpt2_tokenizer):
    t = copy.deepcopy(gpt2_tokenizer)
    t.pad_token, t.padding_side, t.chat_template = t.eos_token, "left", TEMPLATE
    return t


@pytest.mark.parametrize("kwargs, passed, thinking", [
    ("{}", None, False), ("{enable_thinking: false}", {"enable_thinking": False}, True),
    ("{enable_thinking: true}", {"enable_thinking": True}, False),
])
def test_rollout_prompts_are_rendered_with_the_kwargs(tmp_path, tok, kwargs, passed, thinking, one_thread):
    cfg = load_train_config(None, [
        f"train.output_dir={tmp_path / 'run'}", "train.prompts_per_step=2", "rollout.num_generations=2",
        "rollout.max_completion_length=2", "data.options={difficulty: 1, n: 10, chat: true}",
        f"data.chat_template_kwargs={kwargs}", *TINY_LORA_QUIET,
    ])
    ctx = build_context(cfg, World(), model=tiny_qwen2(vocab_size=50_257, hidden=32, layers=1), tokenizer=tok)
    try:
        ro = rollout_stage(ctx, 1)
    finally:
        ctx.logger.close()
    texts = tok.batch_decode(ro.batch.prompt_ids, skip_special_tokens=True)
    assert all(t.endswith("<|assistant|><think></think>" if thinking else "<|assistant|>") for t in texts)
    assert all(f"<|user|>{r.prompt[-1]['content']}" in t for r, t in zip(ro.sample_rows, texts))
    assert ro.options.chat_template_kwargs == passed and eval_options(cfg).chat_template_kwargs == passed
