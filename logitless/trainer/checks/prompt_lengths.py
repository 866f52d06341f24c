"""Every prompt of a dataset against the run's prompt limit, before training, without tokenizing most of them.

The limit is the one the rollout enforces (`rollout.engine.encode_prompts`): rollout.max_prompt_length, and at most
the model's positions less the completion length. A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, SmolLM, ...)
makes at most one token per byte of the normalized text: its pre-tokenizer maps each byte to one symbol and every
token merges one or more of them (an added token such as `<|im_start|>` is one token for several bytes). So a
prompt whose rendered text (the chat template applied) has at most `limit` bytes, less the special tokens the
tokenizer adds, fits without being tokenized; only longer ones are tokenized exactly. On a million GSM8K-sized
prompts this takes seconds instead of minutes, and no token ids are kept. Other tokenizers are tokenized exactly.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

from logitless.data import PromptRow
from logitless.rollout import SamplingOptions
from logitless.rollout.engine import context_window, encode_prompts
from logitless.rollout.vision import has_blocks, text_tokenizer

CHUNK = 4096  # prompts rendered per chat-template call


def _state(component: Any) -> dict[str, Any]:
    """The JSON description of a tokenizers component (pre-tokenizer, normalizer); {} for none."""
    if component is None:
        return {}
    try:
        return json.loads(component.__getstate__())
    except (ValueError, TypeError, AttributeError):
        return {"type": "unknown"}


def _byte_level(tokenizer: Any) -> tuple[bool, bool, Any] | None:
    """(add_prefix_space, normalizes, normalizer) of a fast byte-level BPE tokenizer, else None. Reads the small
    pre-tokenizer and normalizer descriptions only (serializing the whole tokenizer takes seconds)."""
    from tokenizers import models

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, models.BPE):
        return None
    pre = _state(backend.pre_tokenizer)
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in parts if p.get("type") == "ByteLevel"]
    if not byte_level:
        return None
    norm = _state(backend.normalizer)
    normalizes = bool(norm) and not (norm.get("type") == "Sequence" and not norm.get("normalizers"))
    return any(p.get("add_prefix_space") for p in byte_level), normalizes, backend.normalizer


def token_bound(tokenizer: Any) -> Callable[[str, bool], int] | None:
    """bound(text, special) >= the number of tokens `tokenizer` makes of `text` (with its special tokens when
    `special`), computed without tokenizing; None for a tokenizer this bound is not known for (not byte-level BPE).
    One token per byte of the text, raw or normalized (whichever is longer); twice that plus one where the
    tokenizer adds a space before words (add_prefix_space)."""
    info = _byte_level(tokenizer)
    if info is None:
        return None
    prefix_space, normalizes, normalizer = info
    specials = tokenizer.num_special_tokens_to_add()

    def bound(text: str, special: bool) -> int:
        n = len(text.encode("utf-8"))
        if normalizes:
            n = max(n, len(normalizer.normalize_str(text).encode("utf-8")))
        return (2 * n + 1 if prefix_space else n) + (specials if special else 0)

    return bound


def _texts(tokenizer: Any, prompts: Sequence[Any]) -> list[str | None]:
    """The text each prompt is tokenized from (chat messages through the chat template, as the rollout renders
    them), or None for a prompt given as token ids or of a kind the rollout refuses (checked exactly)."""
    out: list[str | None] = [p if isinstance(p, str) else None for p in prompts]
    chats = [i for i, p in enumerate(prompts)  # content blocks (images): counted exactly, through the processor
             if isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m for m in p) and not has_blocks(p)]
    if chats and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([prompts[i] for i in chats], tokenize=False, add_generation_prompt=True)
        for i, text in zip(chats, rendered):
            out[i] = text
    return out


def check_prompt_lengths(rows: list[PromptRow], tokenizer: Any, model: Any, options: SamplingOptions, what: str) -> None:
    """Refuse, before any training, a prompt that does not fit the prompt limit or the context window (`what`
    names the data in the message; row i is row i of the dataset). `tokenizer` may be a vision-language model's
    processor: prompts with images are then encoded by it (each image's tokens counted)."""
    ctx, completion = context_window(model), options.max_new_tokens
    limit = options.max_prompt_length
    if ctx is not None:
        if ctx - completion < 1:
            raise ValueError(f"{what}: rollout.max_completion_length={completion} leaves no room for a prompt in the "
                             f"model's {ctx} positions; lower rollout.max_completion_length below {ctx}")
        limit = ctx - completion if limit is None else min(limit, ctx - completion)
    bound = token_bound(text_tokenizer(tokenizer))
    unlimited = dataclasses.replace(options, max_prompt_length=None)
    for start in range(0, len(rows), CHUNK):
        prompts = [r.prompt for r in rows[start:start + CHUNK]]
        for j, (prompt, text) in enumerate(zip(prompts, _texts(text_tokenizer(tokenizer), prompts))):
            if text and bound is not None and limit is not None and bound(text, isinstance(prompt, str)) <= limit:
                continue  # fits: at most one token per byte
            i = start + j
            try:
                n = len(encode_prompts(tokenizer, [prompt], unlimited, None)[0])
            except (ValueError, TypeError) as e:
                raise type(e)(f"{what}: row {i}: {str(e).replace('prompts[0]', 'its prompt')}") from None
            if limit is not None and n > limit:
                why = [f"rollout.max_prompt_length={options.max_prompt_length}"] if options.max_prompt_length else []
                if ctx is not None:
                    why.append(f"the model's {ctx} positions less rollout.max_completion_length={completion}")
                raise ValueError(
                    f"{what}: row {i} has {n} prompt tokens, over the limit of {limit} ({'; '.join(why)}); raise "
                    "rollout.max_prompt_length, lower rollout.max_completion_length, or filter the data"
                )
