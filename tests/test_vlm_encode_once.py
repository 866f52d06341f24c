"""The vision encoder runs once per prompt: the `hf` engine's prefill and the trainer's forwards encode the images of
rows that share them (a prompt's G samples) once, and everything they compute is what encoding every row gives
(tiny random Qwen2.5-VL, Qwen3-VL with its deepstack features, Gemma 3; fp32 on CPU, the vision tower trainable so
its gradient is checked too)."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.vision import ImageInputs, vision_modules
from logitless.rollout import SamplingOptions, make_engine
from vlm_fixtures import FAMILIES, tiny_processor, tiny_vlm_config
from tests.test_vlm_rollout import PROMPTS




@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, qwen_tokenizer_dir):
    from transformers import AutoModelForImageTextToText

    processor = tiny_processor(qwen_tokenizer_dir, request.param)
    tok = processor.tokenizer
    ids = {"boi": tok.convert_tokens_to_ids("<start_of_image>"), "eoi": tok.convert_tokens_to_ids("<end_of_image>"),
           "image": tok.convert_tokens_to_ids("<image_soft_token>")}
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_vlm_config(len(tok), family=request.param, image_ids=ids))
    model.generation_config.pad_token_id = 151643
    return model, processor


class TowerCalls:
    """Counts the vision tower's forwards and the pixel rows (patches or images) they read."""

    def __init__(self, model):
        self.calls, self.rows = 0, 0
        self.handle = vision_modules(model)[0].register_forward_pre_hook(self.seen, with_kwargs=True)

    def seen(self, module, args, kwargs):
        pixels = args[0] if args else kwargs["pixel_values"]
        self.calls += 1
        self.rows += pixels.shape[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_the_engine_encodes_each_prompts_images_once(vlm):
    """G = 2 samples of 3 prompts encode the 2 image prompts' pixels once; the same 6 rows given as 6 prompts (each
    encoded on its own) read twice the pixels and sample the same tokens with the same logprobs."""
    model, processor = vlm
    engine = make_engine("hf", model, processor)
    options = dict(temperature=1.0, max_new_tokens=5, seed=3, ignore_eos=True)
    with TowerCalls(model) as shared:
        a = engine.generate(PROMPTS, SamplingOptions(num_generations=2, **options))
    with TowerCalls(model) as each:
        b = engine.generate([p for p in PROMPTS for _ in range(2)], SamplingOptions(num_generations=1, **options))
    one_each = sum(r["pixel_values"].shape[0] for r in a.images.rows[::2] if r)
    assert shared.calls == 1 and shared.rows == one_each
    assert each.calls == 1 and each.rows == 2 * one_each
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.allclose(a.sampler_logp, b.sampler_logp, atol=1e-6, rtol=0)


def test_the_trainers_forward_encodes_shared_rows_once_with_the_same_logprobs_and_gradients(vlm):
    """A micro-batch whose rows share a prompt's image tensors encodes them once; the logprobs and every gradient
    (the vision tower's included, accumulated over the rows that share its features) equal those of the same rows
    with their own copies (each row encoded)."""
    model, processor = vlm
    engine = make_engine("hf", model, processor)
    b = engine.generate(PROMPTS, SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=4, seed=1))
    copies = ImageInputs([None if r is None else dict(r) for r in b.images.rows])  # no two rows share a dict
    weights = torch.linspace(-1, 1, b.completion_ids.numel()).view_as(b.completion_ids)
    tower = [p for m in vision_modules(model) for p in m.parameters()]
    params = [p for p in model.parameters() if p.requires_grad]

    def run(images):
        model.zero_grad()
        with TowerCalls(model) as calls:
            logp, _ = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                                          images=images)
        (logp * weights).sum().backward()
        return logp.detach(), [None if p.grad is None else p.grad.clone() for p in params], calls.rows

    logp_shared, grads_shared, rows_shared = run(b.images)
    logp_each, grads_each, rows_each = run(copies)
    assert rows_each == 2 * rows_shared
    assert torch.allclose(logp_shared, logp_each, atol=1e-6, rtol=0)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in tower)  # the tower trains here
    for s, e in zip(grads_shared, grads_each):
        assert (s is None) == (e is None)  # parameters no forward reads (Gemma 3's SigLIP head) have none
        if e is not None:
            assert torch.allclose(s, e, atol=1e-5 * float(e.abs().max().clamp(min=1e-12)), rtol=0)
