"""What one long row's update needs besides the tiled MLP (tests/test_tiled_mlp.py): its attention gets no [S, S]
mask (sdpa's causal kernels, memory linear in S), the memory plan predicts none for it, and the tiled MLP composes
with activation offload (the checkpointed layer inputs in host memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from logitless.models import completion_logprobs
from logitless.trainer.memory import plan as mp
from logitless.trainer.batching import make_micro_batches
from logitless.trainer.config.schema import ModelConfig
from logitless.trainer.policy.modeling import prepare_for_training, trainable_parameters
from logitless.trainer.policy.offload import ActivationOffload
from tests.test_packing import batch, tiny


@pytest.fixture
def sdpa_masks(monkeypatch):
    """The attn_mask (None, or its shape) and is_causal of every sdpa call."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    return calls


def test_a_one_row_micro_batch_attends_without_a_mask(one_thread, sdpa_masks):
    """The trainer's micro-batches of one row keep only that row's columns, so transformers' sdpa path runs the
    causal kernel with no mask; a micro-batch of two rows of different lengths materializes [S, S] masks."""
    model = tiny("qwen2")
    assert model.config._attn_implementation == "sdpa"
    pi, pm, ci, cm = batch(B=3, seed=1)
    zeros = torch.zeros(3)
    for size, masked in ((1, False), (3, True)):
        sdpa_masks.clear()
        micro = make_micro_batches(pi, pm, ci, cm, torch.zeros(ci.shape), zeros.bool(), zeros, size)
        m = micro[0]
        completion_logprobs(model, m.prompt_ids, m.prompt_mask, m.completion_ids, m.completion_mask)
        L = m.prompt_ids.shape[1] + m.completion_ids.shape[1]
        assert len(sdpa_masks) == 2  # one per layer
        if masked:
            assert all(shape is not None and shape[-2:] == (L, L) for shape, _ in sdpa_masks)
        else:
            assert bool(m.prompt_mask.all()) and sdpa_masks == [(None, True)] * 2


def test_the_plan_predicts_no_mask_for_micro_batches_of_one_row():
    step = mp.StepShape(prompts=1, rows=2, prompt_len=256, completion_len=130_816)
    one = mp.Knobs(by_rows=True, micro_batch_size=1)
    assert mp.mask_bytes(step, one, step.longest_row) == 0
    assert mp.mask_bytes(dataclasses.replace(step, rows=1), dataclasses.replace(one, micro_batch_size=8),
                         step.longest_row) == 0  # a step of one row
    two = dataclasses.replace(one, micro_batch_size=2)
    assert mp.mask_bytes(step, two, 2 * step.longest_row) == mp.MASK_BYTES * 2 * step.longest_row**2
    assert mp.mask_bytes(step, dataclasses.replace(two, packed=True), 2 * step.longest_row) == 0


def test_tiled_mlp_with_activation_offload_gives_the_untiled_gradients(one_thread):
    """model.activation_offload (the checkpointed layer inputs through the offload hooks) with the tiled MLP."""
    cfg = dict(lora_r=4, lora_alpha=8, gradient_checkpointing=True)
    grads = []
    for chunk in (None, 5):
        model = prepare_for_training(tiny("llama"), ModelConfig(**cfg, mlp_chunk_tokens=chunk)).train()
        with torch.no_grad():
            for p in trainable_parameters(model):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
        inputs = batch(B=4, seed=2)
        offload = ActivationOffload(model, min_bytes=0)
        with offload:
            logp, _ = completion_logprobs(model, *inputs)
        logp.sum().backward()
        assert offload.packed_bytes > 0
        grads.append([p.grad for p in trainable_parameters(model)])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
