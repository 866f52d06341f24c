"""Vision-language rollout and training passes on a tiny random Qwen2.5-VL (fp32, CPU): the `hf` engine samples with
the rows' images and the trainer's micro-batched forwards reproduce its logprobs; image tokens get no gradient; the
M-RoPE positions are the model's own; a micro-batch split equals one batch; the continuous engine is refused (the
static engine's image rows: `test_vlm_static.py`)."""

from __future__ import annotations

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.models.vision import ImageInputs, placeholder_ids
from logitless.rollout import SamplingOptions, make_engine
from logitless.trainer.batching import make_micro_batches
from vlm_fixtures import FAMILIES, backward_through, lora_vlm, shape_image


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, qwen_tokenizer_dir, tmp_path_factory):
    model, tok, processor = lora_vlm(qwen_tokenizer_dir, tmp_path_factory.mktemp("vlm") / "model", request.param)
    return model, tok, processor


def chat(text, images=()):
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


PROMPTS = [chat("How many red shapes?", [shape_image(3, 1)]),
           chat("Compare the two.", [shape_image(1, 2, size=112), shape_image(2)]),
           [{"role": "user", "content": "No image here."}]]


@pytest.fixture(scope="module")
def rollout(vlm):
    model, _, processor = vlm
    engine = make_engine("hf", model, processor)
    options = SamplingOptions(num_generations=2, temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True)
    return engine.generate(PROMPTS, options)


def test_hf_rollout_carries_each_rows_images_and_never_samples_a_placeholder(vlm, rollout):
    model = vlm[0]
    b = rollout
    assert b.images is not None and len(b.images) == 6
    assert [r is not None for r in b.images.rows] == [True, True, True, True, False, False]
    assert b.images.rows[0] is b.images.rows[1]  # a prompt's G rows share its tensors
    assert b.images.rows[2]["pixel_values"].shape[0] > b.images.rows[0]["pixel_values"].shape[0]  # two images
    config = model.get_base_model().config
    placeholders = torch.tensor(list(placeholder_ids(config)))
    assert not torch.isin(b.completion_ids, placeholders).any()
    n_image = (b.prompt_ids == config.image_token_id).sum(1)
    assert n_image.tolist() == [image_tokens(config, r) for r in b.images.rows]  # as the processor expanded them


def image_tokens(config, row) -> int:
    """How many placeholder tokens the images of one row expand to: Qwen-VL one per merged patch (2x2), Gemma 3
    `mm_tokens_per_image` per image."""
    if row is None:
        return 0
    if "image_grid_thw" in row:
        return int(row["image_grid_thw"].prod(-1).sum()) // 4
    return row["pixel_values"].shape[0] * config.mm_tokens_per_image


def test_trainer_micro_batches_reproduce_the_samplers_logprobs(vlm, rollout):
    """The key acceptance test: the trainer's micro-batched forwards, with each row's images, give the sampler's
    logprobs at 1e-5 (fp32), whatever the micro-batch split; without images the image rows fail loudly."""
    model = vlm[0]
    b = rollout
    adv = torch.zeros(6)
    args = (b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, b.sampler_logp, b.truncated, adv)
    with torch.no_grad():
        for size in (1, 4, 6):
            got = torch.zeros_like(b.sampler_logp)
            for m in make_micro_batches(*args, size, images=b.images):
                logp, _ = completion_logprobs(model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                              **m.inputs)
                got[m.rows, : logp.shape[1]] = logp
            assert torch.allclose(got, b.sampler_logp, atol=1e-5, rtol=0), (size, (got - b.sampler_logp).abs().max())
        with pytest.raises(ValueError, match="image placeholder tokens but no images"):
            completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask)


def test_a_micro_batch_split_gives_the_gradient_of_one_batch(vlm, rollout):
    model = vlm[0]
    b = rollout
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    args = (b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, b.sampler_logp, b.truncated, adv)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(size):
        model.zero_grad()
        for m in make_micro_batches(*args, size, images=b.images):
            logp, _ = completion_logprobs(model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask,
                                          **m.inputs)
            (logp * m.advantages[:, None]).sum().backward()
        return torch.cat([p.grad.flatten() for p in params])

    whole, split = grads(6), grads(2)
    assert whole.abs().max() > 0
    scale = float(whole.abs().max())  # fp32 sums in another order: differences at 1e-5 of the largest gradient
    assert float((whole - split).abs().max()) <= 1e-5 * scale, ((whole - split).abs().max(), scale)


def test_image_tokens_get_no_gradient_and_positions_are_the_models_own(vlm, rollout):
    """The final hidden states at image placeholders get exactly zero gradient (they predict prompt tokens, outside
    the loss), those predicting completion tokens do not; the rotary embedding sees, on every row, the positions of
    the model's own get_rope_index of that row alone (3 rows, not a 1-D fallback)."""
    model = vlm[0]
    base = model.get_base_model()
    b = rollout
    positions, hidden = backward_through(model, b)  # [3, B, L] (M-RoPE) or [B, L]
    grad = hidden.grad  # [B, L, H]
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    image = ids == base.config.image_token_id
    assert image.sum() > 0 and grad[image].abs().max() == 0
    P = b.prompt_ids.shape[1]
    assert (grad[:, P - 1:-1].abs().sum(-1) > 0).all()  # each completion token's predictor gets gradient
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1).bool()
    if not hasattr(base.model, "get_rope_index"):  # Gemma 3: 1-D positions counting each row's real tokens
        assert torch.equal(positions[mask], (mask.long().cumsum(1) - 1)[mask])
        return
    assert positions.shape[0] == 3
    for r in range(ids.shape[0]):
        row = ids[r][mask[r]][None]
        grid = b.images.rows[r]["image_grid_thw"] if b.images.rows[r] else None
        types = (row == base.config.image_token_id).long()
        own, _ = base.model.get_rope_index(row, mm_token_type_ids=types, image_grid_thw=grid)
        assert torch.equal(positions[:, r][:, mask[r]], own[:, 0]), r
        if grid is not None:
            assert not torch.equal(own[0, 0], own[1, 0])  # image rows really use M-RoPE


def test_continuous_engine_refuses_a_vision_language_model(vlm):
    from logitless.models import UnsupportedModelError

    model, _, processor = vlm
    with pytest.raises(UnsupportedModelError, match="rollout.backend=continuous cannot decode a vision-language"):
        make_engine("continuous", model, processor)


def test_image_inputs_select_and_batch():
    a = {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    c = {"pixel_values": torch.zeros(8, 3), "image_grid_thw": torch.tensor([[1, 2, 4]])}
    images = ImageInputs([a, None, c])
    picked = images.select(torch.tensor([2, 1, 0])).batched()
    assert picked["pixel_values"].shape == (12, 3) and picked["pixel_values"][0, 0] == 0
    assert picked["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2]]
