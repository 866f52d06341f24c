"""Vision-language models: loading (class, processor, frozen vision tower, LoRA on the language model only) and the
fused op's logprobs against the model's own logits with images (tiny random Qwen2.5-VL, Qwen3-VL and Gemma 3, fp32
on CPU)."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.vision import ImageInputs, vision_module_names
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import load_model_and_tokenizer
from logitless.trainer.policy.vision import load_processor
from vlm_fixtures import FAMILIES, build_tiny_vlm, shape_image


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_dir(request, qwen_tokenizer_dir, tmp_path_factory):
    return build_tiny_vlm(qwen_tokenizer_dir, tmp_path_factory.mktemp("vlm") / "model", family=request.param)


def model_cfg(path, **kw) -> ModelConfig:
    return ModelConfig(name_or_path=str(path), device="cpu", dtype="float32", **kw)


def encode(processor, prompts):
    """Each (text, images) prompt through the chat template and processor: ids, the image tensors of each, and the
    token types the processor returns (`mm_token_type_ids`, Gemma 3's `token_type_ids`) with their name."""
    ids, rows, types = [], [], []
    for text, images in prompts:
        content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
        rendered = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        out = processor(text=[rendered], images=images or None, return_tensors="pt")
        ids.append(out["input_ids"][0].tolist())
        rows.append({k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out} or None)
        name = "token_type_ids" if "token_type_ids" in out else "mm_token_type_ids"
        types.append(out[name][0].tolist())
    return ids, ImageInputs(rows), (name, types)


def left_pad(seqs, pad):
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), 1
    return ids, mask


def test_load_freezes_the_vision_tower_and_keeps_lora_out_of_it(vlm_dir):
    from transformers import AutoModelForImageTextToText

    model, tok, _ = load_model_and_tokenizer(model_cfg(vlm_dir, lora=True, lora_target_modules=["q_proj", "gate_proj",
                                                                                                 "down_proj"]))
    base = model.get_base_model()
    assert type(base) is AutoModelForImageTextToText._model_mapping[type(base.config)]
    towers = vision_module_names(base)
    assert towers and all(n.startswith("model.") for n in towers)

    def in_tower(name):  # a parameter name of the PEFT model (base_model.model.<base name>)
        return any(f".{t}." in name for t in towers)

    lora = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert lora and not [n for n in lora if in_tower(n)]
    assert any("language_model" in n and "q_proj" in n for n in lora)  # the names the tower shares: LM only
    assert all(not p.requires_grad for n, p in model.named_parameters() if in_tower(n))

    trained, _, _ = load_model_and_tokenizer(model_cfg(vlm_dir, lora=True, train_vision=True))
    assert any(in_tower(n) and "lora_" in n for n, _ in trained.named_parameters())

    full, _, _ = load_model_and_tokenizer(model_cfg(vlm_dir, lora=False))
    grads = {n: p.requires_grad for n, p in full.named_parameters()}
    assert not any(v for n, v in grads.items() if in_tower("." + n))
    assert all(v for n, v in grads.items() if not in_tower("." + n))
    assert vision_module_names(full) == towers


def test_fused_logprobs_equal_the_models_logits_with_images(vlm_dir):
    """completion_logprobs through the fused op, the rows' images and the model's M-RoPE positions equal
    log_softmax of the model's own forward (which builds its positions from mm_token_type_ids) on every row: an
    image row, a two-image row and a text-only row, left-padded to one batch. The oracle's token types are the
    processor's own (Gemma 3: `token_type_ids`, which make each image's block attend bidirectionally)."""
    cfg = model_cfg(vlm_dir, lora=False)
    model, tok, _ = load_model_and_tokenizer(cfg, trainable=False)
    model.eval()
    processor = load_processor(cfg, tok)
    prompts = [("How many red shapes?", [shape_image(3, 1)]),
               ("Compare them.", [shape_image(1, 2, size=112), shape_image(2)]),
               ("No picture here.", [])]
    seqs, images, (name, types) = encode(processor, prompts)
    ids, mask = left_pad(seqs, tok.pad_token_id)
    g = torch.Generator().manual_seed(1)
    comp = torch.randint(0, 1000, (3, 5), generator=g)
    cmask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    comp = torch.where(cmask.bool(), comp, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ids, mask, comp, cmask, images=images, temperature=0.7)
        full_ids, full_mask = torch.cat([ids, comp], 1), torch.cat([mask, cmask], 1)
        kw = {k: v.double() if v.is_floating_point() else v for k, v in images.batched().items()}
        types, _ = left_pad(types, 0)
        types = torch.cat([types, torch.zeros_like(comp)], 1)  # the completion: text
        # the oracle in fp64 (an fp32 forward of the padded batch is itself up to 3e-5 off it on Gemma 3)
        logits = model.double()(input_ids=full_ids, attention_mask=full_mask, **{name: types}, **kw).logits
        model.float()
        P = ids.shape[1]
        ref = torch.log_softmax(logits[:, P - 1:-1] / 0.7, -1).gather(-1, comp[..., None])[..., 0] * cmask
    assert torch.allclose(logp.double(), ref, atol=1e-5, rtol=0), (logp - ref).abs().max()
    with pytest.raises(ValueError, match="row 0 has image placeholder tokens but no images"):
        completion_logprobs(model, ids, mask, comp, cmask)
    if hasattr(model.model, "get_rope_index"):  # M-RoPE rows pack, each with its own positions
        with torch.no_grad():
            packed, _ = completion_logprobs(model, ids, mask, comp, cmask, images=images, temperature=0.7,
                                            packed=True)
        assert torch.allclose(packed.double(), ref, atol=1e-5, rtol=0)
    else:  # Gemma 3's image tokens attend both ways: refused
        with pytest.raises(ValueError, match="set train.packed=false"):
            completion_logprobs(model, ids, mask, comp, cmask, images=images, packed=True)
