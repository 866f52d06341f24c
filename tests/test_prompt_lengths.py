"""The check of every prompt's length before training: the same verdict as tokenizing each prompt, without
tokenizing the prompts that cannot be too long.

Oracle: `rollout.engine.encode_prompts` (what the rollout enforces) on every prompt. The byte bound is checked
against the real token counts of the Qwen2.5 and GPT-2 tokenizers on text that stresses it (multi-byte characters,
characters NFC normalization expands, combining marks, special tokens, whitespace runs, random code points).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from transformers import Qwen2Config

from logitless.data import PromptRow
from logitless.rollout import SamplingOptions
from logitless.rollout.engine import encode_prompts
from logitless.trainer.checks.prompt_lengths import check_prompt_lengths, token_bound

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(params=["qwen", "gpt2"])
def tokenizer(request, qwen_tokenizer, gpt2_tokenizer):
    return qwen_tokenizer if request.param == "qwen" else gpt2_tokenizer


def _texts(n: int = 300) -> list[str]:
    rng = random.Random(0)
    fixed = ["", " ", "a", "Hello, world!", "\u0958\u0959\u095a" * 5, "\u2126\u212b" * 7, "e\u0301" * 9,
             "\ufdfa" * 4, "\U0001f600\U0001f680" * 6, "\u4e2d\u6587" * 11, "<|im_start|>user\nhi<|im_end|>\n" * 3,
             "<|endoftext|>" * 4, "   \n\n\t  " * 5, "x" * 300]
    pools = [(0x20, 0x7e), (0xa0, 0x2fff), (0x3000, 0x9fff), (0x1f300, 0x1faff), (0x900, 0x97f)]
    randoms = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        randoms.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 40))))
    return fixed + randoms


def test_the_byte_bound_is_never_below_the_token_count(tokenizer):
    bound = token_bound(tokenizer)
    assert bound is not None  # both are byte-level BPE
    for text in _texts():
        for special in (True, False):
            n = len(tokenizer(text, add_special_tokens=special)["input_ids"])
            assert bound(text, special) >= n, (text, special, n)


def _model(positions: int):
    return SimpleNamespace(config=Qwen2Config(max_position_embeddings=positions))


def _exact_fits(tokenizer, prompt, options, positions) -> bool:
    try:
        encode_prompts(tokenizer, [prompt], options, positions)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("chat", [False, True])
def test_same_verdict_as_tokenizing_every_prompt(tokenizer, chat, monkeypatch):
    if chat:
        monkeypatch.setattr(tokenizer, "chat_template", CHAT_TEMPLATE)
    texts = [t for t in _texts(60) if t.strip()]
    for limit in (4, 9, 16, 40):
        options = SamplingOptions(max_new_tokens=8, max_prompt_length=limit)
        for text in texts:
            prompt = [{"role": "user", "content": text}] if chat else text
            expected = _exact_fits(tokenizer, prompt, options, 512)
            try:
                check_prompt_lengths([PromptRow(prompt=prompt)], tokenizer, _model(512), options, "data")
                got = True
            except ValueError as e:
                assert "row 0" in str(e) and f"over the limit of {limit}" in str(e), e
                got = False
            assert got == expected, (text, limit, chat)


def test_the_context_window_limits_prompts_too(tokenizer):
    options = SamplingOptions(max_new_tokens=500, max_prompt_length=None)
    rows = [PromptRow(prompt="word " * 5), PromptRow(prompt="word " * 20)]
    with pytest.raises(ValueError, match=r"data: row 1 has \d+ prompt tokens, over the limit of 12 \(the model's 512 "
                                         r"positions less rollout.max_completion_length=500\)"):
        check_prompt_lengths(rows, tokenizer, _model(512), options, "data")
    with pytest.raises(ValueError, match=r"rollout.max_completion_length=600 leaves no room for a prompt"):
        check_prompt_lengths(rows, tokenizer, _model(512), SamplingOptions(max_new_tokens=600), "data")


def test_short_prompts_are_not_tokenized(tokenizer, monkeypatch):
    calls = []
    real = type(tokenizer).__call__

    def counting(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("text"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    rows = [PromptRow(prompt=f"What is {i} + {i}?") for i in range(500)] + [PromptRow(prompt="many words " * 10)]
    check_prompt_lengths(rows, tokenizer, _model(512), SamplingOptions(max_new_tokens=8, max_prompt_length=64), "data")
    assert calls == ["many words " * 10]  # only the row whose bytes exceed the limit (110 bytes, 20 tokens)


def test_a_tokenizer_without_a_known_bound_is_checked_exactly():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="b")
    assert token_bound(tok) is None
    options = SamplingOptions(max_new_tokens=2, max_prompt_length=3)
    check_prompt_lengths([PromptRow(prompt="a b a")], tok, _model(64), options, "data")
    with pytest.raises(ValueError, match="row 1 has 4 prompt tokens, over the limit of 3"):
        check_prompt_lengths([PromptRow(prompt="a"), PromptRow(prompt="a b a b")], tok, _model(64), options, "data")
