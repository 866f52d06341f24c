"""Packed vision-language rows: the real tokens of every row in one sequence, each row with its own M-RoPE
positions (transformers' 4-row form: text positions restarting per row, then the row's `get_rope_index`), give the
padded forward's logprobs and gradients (fp32), with transformers' sdpa and with the logitless_varlen attention
(tiny random Qwen2.5-VL and Qwen3-VL on CPU; Gemma 3, whose image tokens attend both ways, is refused)."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.varlen import NAME as VARLEN
from logitless.models.varlen import register as register_varlen
from logitless.rollout import SamplingOptions, make_engine
from vlm_fixtures import shape_image, tiny_processor, tiny_vlm_config


def chat(text, images=()):
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


PROMPTS = [chat("How many red shapes?", [shape_image(3, 1)]),
           [{"role": "user", "content": "No image here."}],
           chat("Compare the two.", [shape_image(1, 2, size=112), shape_image(2)])]


def tiny(tokenizer_dir, family):
    from transformers import AutoModelForImageTextToText

    processor = tiny_processor(tokenizer_dir, family)
    tok = processor.tokenizer
    ids = {"boi": tok.convert_tokens_to_ids("<start_of_image>"), "eoi": tok.convert_tokens_to_ids("<end_of_image>"),
           "image": tok.convert_tokens_to_ids("<image_soft_token>")}
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(len(tok), family=family, image_ids=ids))
    model.generation_config.pad_token_id = 151643
    return model, processor


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, qwen_tokenizer_dir):
    model, processor = tiny(qwen_tokenizer_dir, request.param)
    options = SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=5, seed=2)
    batch = make_engine("hf", model, processor).generate(PROMPTS, options)
    batch.completion_mask[1, 2:] = 0  # ragged completions, and a row without any (left out of the packing)
    batch.completion_mask[3] = 0
    return model, batch


def logprobs_and_grads(model, b, **kw):
    model.zero_grad()
    weights = torch.linspace(-1, 1, b.completion_ids.numel()).view_as(b.completion_ids)
    logp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                  images=b.images, **kw)
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["sdpa", VARLEN])
def test_packed_rows_give_the_padded_logprobs_and_gradients(vlm, attention):
    model, b = vlm
    model.set_attn_implementation("sdpa")
    padded, grads = logprobs_and_grads(model, b)
    if attention == VARLEN:
        register_varlen()
    model.set_attn_implementation(attention)
    try:
        packed, packed_grads = logprobs_and_grads(model, b, packed=True)
    finally:
        model.set_attn_implementation("sdpa")
    assert padded.abs().sum() > 0 and torch.allclose(packed, padded, atol=1e-5, rtol=0), (packed - padded).abs().max()
    assert packed_grads.keys() == grads.keys() and any(".visual." in n for n in grads)
    for n, g in grads.items():
        scale = float(g.abs().max().clamp(min=1e-12))
        assert torch.allclose(packed_grads[n], g, atol=1e-5 * scale, rtol=0), (n, (packed_grads[n] - g).abs().max())


def test_each_packed_row_has_its_own_m_rope_positions(vlm):
    """The rotary embedding sees, over each packed row, the positions of the model's own get_rope_index of that row
    alone (restarting at 0; image rows really 3-D), and the text row restarts at 0 per row."""
    model, b = vlm
    base = model.model
    seen = []
    hooks = [base.language_model.rotary_emb.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())),
             base.language_model.register_forward_pre_hook(
                 lambda m, a, kw: seen.append(kw["position_ids"].clone()), with_kwargs=True)]
    try:
        with torch.no_grad():
            completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                images=b.images, packed=True)
    finally:
        for h in hooks:
            h.remove()
    four, rope = seen  # [4, 1, S] given to the text model, [3, 1, S] reaching the rotary embedding
    assert four.shape[0] == 4 and torch.equal(four[1:], rope)
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1).bool()
    start = 0
    for r in range(ids.shape[0]):
        if not b.completion_mask[r].any():
            continue  # left out of the packing
        row = ids[r][mask[r]][None]
        grid = b.images.rows[r]["image_grid_thw"] if b.images.rows[r] else None
        own, _ = base.get_rope_index(row, mm_token_type_ids=(row == base.config.image_token_id).long(),
                                     image_grid_thw=grid)
        end = start + row.shape[1]
        assert torch.equal(rope[:, 0, start:end], own[:, 0]), r
        assert torch.equal(four[0, 0, start:end], torch.arange(row.shape[1])), r
        assert grid is None or not torch.equal(own[0, 0], own[1, 0])
        start = end
    assert start == rope.shape[-1]


def test_gemma3_packing_is_refused_naming_the_setting(qwen_tokenizer_dir):
    model, processor = tiny(qwen_tokenizer_dir, "gemma3")
    b = make_engine("hf", model, processor).generate(PROMPTS[:1], SamplingOptions(max_new_tokens=2, seed=0))
    with pytest.raises(ValueError, match="set train.packed=false"):
        completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                            images=b.images, packed=True)
